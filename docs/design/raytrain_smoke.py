"""Ray Train v2 + Ray Data smoke test: 2 CPU workers, each iterating its streaming_split shard of range(64)."""
import collections
import json
import os
import sys
import tempfile
import time

import ray
import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def loop(config):
    ctx = ray.train.get_context()
    shard = ray.train.get_dataset_shard("train")
    ids = []
    for batch in shard.iter_batches(batch_size=8):
        ids.extend(int(x) for x in batch["id"])
    # every rank writes its ids (reports need a checkpoint to carry files; metrics carry rank 0's only)
    with open(os.path.join(config["out"], f"rank{ctx.get_world_rank()}.json"), "w") as f:
        json.dump(ids, f)
    ray.train.report({"rank": ctx.get_world_rank(), "n": len(ids)})


def main():
    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False)
    t_init = time.monotonic() - t0
    out = tempfile.mkdtemp(prefix="raytrain-smoke-")
    ds = ray.data.range(64)
    trainer = TorchTrainer(
        loop,
        train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                     resources_per_worker={"CPU": float(os.environ.get("WORKER_CPU", "1"))}),
        datasets={"train": ds},
        run_config=RunConfig(name="smoke", storage_path=os.path.join(out, "storage")),
    )
    t1 = time.monotonic()
    result = trainer.fit()
    t_fit = time.monotonic() - t1
    seen = {}
    for r in range(2):
        seen[r] = json.load(open(os.path.join(out, f"rank{r}.json")))
    counts = collections.Counter(seen[0] + seen[1])
    exactly_once = sorted(counts) == list(range(64)) and all(c == 1 for c in counts.values())
    print("RESULT", json.dumps({
        "ray": ray.__version__, "train_v2": os.environ.get("RAY_TRAIN_V2_ENABLED", "default"),
        "worker_cpu": os.environ.get("WORKER_CPU", "1"),
        "init_s": round(t_init, 1), "fit_s": round(t_fit, 1), "total_s": round(time.monotonic() - t0, 1),
        "rank0_n": len(seen[0]), "rank1_n": len(seen[1]), "rank0_ids": seen[0], "rank1_ids": seen[1],
        "exactly_once": exactly_once, "metrics": result.metrics, "error": repr(result.error),
    }))
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
