"""Ray Train v2 fault test: rank 0 raises once after a checkpoint; FailureConfig(max_failures=1) restarts the group.
Records, per attempt and rank, the checkpoint seen by get_checkpoint() and the ids iterated."""
import json
import os
import tempfile
import time

import ray
import ray.train
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def loop(config):
    out = config["out"]
    rank = ray.train.get_context().get_world_rank()
    ckpt = ray.train.get_checkpoint()
    resumed = None
    if ckpt:
        with ckpt.as_directory() as d:
            resumed = json.load(open(os.path.join(d, "state.json")))
    attempt = 2 if os.path.exists(os.path.join(out, "failed")) else 1
    ids = []
    for i, batch in enumerate(ray.train.get_dataset_shard("train").iter_batches(batch_size=8)):
        ids.extend(int(x) for x in batch["id"])
        if i == 1:  # after 2 batches: a checkpoint (rank 0 writes it, every rank reports)
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    json.dump({"batches_done": 2, "ids_done": ids}, open(os.path.join(d, "state.json"), "w"))
                ray.train.report({"step": 2}, checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
            json.dump({"resumed_from": resumed, "ids_before_fail": ids},
                      open(os.path.join(out, f"attempt{attempt}-rank{rank}-early.json"), "w"))
            if attempt == 1 and rank == 0:
                open(os.path.join(out, "failed"), "w").close()
                raise RuntimeError("injected failure on attempt 1")
    json.dump({"resumed_from": resumed, "ids": ids}, open(os.path.join(out, f"attempt{attempt}-rank{rank}.json"), "w"))
    ray.train.report({"step": "end", "n": len(ids)})


def main():
    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False)
    out = tempfile.mkdtemp(prefix="raytrain-fault-")
    trainer = TorchTrainer(
        loop, train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        datasets={"train": ray.data.range(64)},
        run_config=RunConfig(name="fault", storage_path=os.path.join(out, "storage"),
                             failure_config=FailureConfig(max_failures=1)),
    )
    result = trainer.fit()
    files = {f: json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.endswith(".json")}
    print("RESULT", json.dumps({"total_s": round(time.monotonic() - t0, 1), "error": repr(result.error),
                                "checkpoint": str(result.checkpoint), "files": files}))
    ray.shutdown()


if __name__ == "__main__":
    main()
