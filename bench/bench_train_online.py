"""Bounded memory when training online, measured on CPU: stage 2's stream (job.export.stream, the tiny
target) into one Ray Train worker through job/train/data.py's DataConfig (split without dropping rows, object
store limit), with a consumer that sleeps per sample (slower than stage 2) or does not (faster than stage 2).

    PYTHONPATH=. .venv/bin/python bench/bench_train_online.py RUN_DIR [--limit 320] [--slow-s 0.1] \
        [--bound-mib 16] [--block-mib 2]

RUN_DIR: a run directory with stage-1 completions (e.g. `make demo`'s demo-run). Per case it prints the object
store's peak use (the raylet's plasma bytes in use, polled every 0.2 s by the driver) and Ray Data's own peak
accounting of the stream's blocks (its executor's progress lines, every 5 s), the producer's idle share
(1 − the extractor operator's summed task wall time / the span over which it produced blocks, from Ray Data's own
stats of the worker's shard), and samples/s at the consumer from its first sample on. Cases: fast and slow consumer
under the
bound, then both with Ray Data's default limit (half the object store) for contrast.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import threading
import time

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def consume(cfg: dict) -> None:
    """The Train worker: iterate the shard, `delay` seconds per sample, record what the consumer saw."""
    import ray.train

    shard = ray.train.get_dataset_shard("train")
    started, first, n, feature_bytes = time.monotonic(), None, 0, 0
    for batch in shard.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=1):
        first = first or time.monotonic()
        n += len(batch["id"])
        feature_bytes += sum(h.nbytes for h in batch["hidden_states"])
        time.sleep(cfg["delay"] * len(batch["id"]))
    ended = time.monotonic()
    with open(cfg["out"], "w") as f:
        json.dump({"samples": n, "seconds": ended - started, "seconds_after_first": ended - (first or ended),
                   "feature_bytes": feature_bytes, "stats": shard.stats()}, f)


class PlasmaPoller(threading.Thread):
    """Peak bytes in use in the object store, polled from the raylet every `interval` seconds."""

    def __init__(self, interval: float = 0.2):
        super().__init__(daemon=True)
        from ray._private.internal_api import get_state_from_address

        self.state = get_state_from_address(ray.get_runtime_context().gcs_address)
        self.interval, self.peak, self.stop = interval, 0, threading.Event()
        self.baseline = self._used()

    def _used(self) -> int:
        from ray._private.internal_api import get_memory_info_reply

        return get_memory_info_reply(self.state).store_stats.object_store_bytes_used

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self._used())
            time.sleep(self.interval)


def extractor_seconds(stats: str) -> tuple[float, float] | None:
    """(busy, span) of the extractor operator in Ray Data's stats text: its tasks' summed wall time (`Remote wall
    time: ... total`) and the span over which it produced blocks (`... blocks produced in N s`), or None."""
    section = stats.split("MapBatches(HiddenStateExtractor):", 1)
    if len(section) < 2:
        return None
    unit = {"s": 1, "ms": 1e-3, "us": 1e-6}
    span = re.search(r"blocks produced in ([\d.]+)(ms|s|us)", section[1])
    busy = re.search(r"Remote wall time: .*?([\d.]+)(ms|s|us) total", section[1])
    if not (span and busy):
        return None
    return float(busy.group(1)) * unit[busy.group(2)], float(span.group(1)) * unit[span.group(2)]


_USAGE = re.compile(r"Resources: [\d.]+ CPU, ([\d.]+)(B|KiB|MiB|GiB) object store")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def ray_data_peak_bytes(since: float) -> int | None:
    """Ray Data's own accounting: the largest sum over the stream's operators of their object-store use, from the
    executor's progress lines (every 5 s) in the ray-data logs of datasets that ran since `since` (epoch s)."""
    logs = glob.glob(os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs", "ray-data",
                                  "ray-data-*_*.log"))  # ray-data-dataset_<id>, or ray-data-train_<id> when
    # Ray Train's own DataConfig named the dataset
    peak = None
    for path in (p for p in logs if os.path.getmtime(p) >= since):
        tick = 0
        for line in open(path):
            if "Execution Progress:" in line:
                peak, tick = max(peak or 0, tick), 0
            m = _USAGE.search(line)
            if m:
                tick += float(m.group(1)) * _UNITS[m.group(2)]
        peak = max(peak or 0, tick)
    return int(peak) if peak is not None else None


def run_case(config, delay: float, bound: int | None) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from job.export.stream import stream
    from job.train.data import exactly_once_data_config

    out = tempfile.mktemp(suffix=".json")
    ds = stream(config, to="speculators", format="eagle3")
    data_config = exactly_once_data_config(bound) if bound else None
    trainer = TorchTrainer(consume, train_loop_config={"delay": delay, "out": out},
                           scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.25}),
                           datasets={"train": ds}, **({"dataset_config": data_config} if data_config else {}),
                           run_config=RunConfig(name=f"bench-{delay}-{bound}", storage_path=tempfile.mkdtemp()))
    since = time.time()
    poller = PlasmaPoller()
    poller.start()
    result = trainer.fit()
    poller.stop.set()
    poller.join()
    assert result.error is None, result.error
    seen = json.load(open(out))
    busy, span = extractor_seconds(seen["stats"]) or (None, None)
    return {"delay_s_per_sample": delay, "bound_mib": bound / 2**20 if bound else "default (1/2 of the store)",
            "samples": seen["samples"], "feature_mib": round(seen["feature_bytes"] / 2**20, 1),
            "object_store_peak_mib": round(poller.peak / 2**20, 1),
            "object_store_before_mib": round(poller.baseline / 2**20, 1),
            "ray_data_peak_mib": round((ray_data_peak_bytes(since) or 0) / 2**20, 1),
            "samples_per_s": round(seen["samples"] / seen["seconds_after_first"], 2),
            "stream_seconds": round(seen["seconds"], 1),
            # Idle: the share of the extractor's producing span (first to last block) it ran no task, i.e. was
            # held back; its start-up (model load, before the first block) is not counted.
            "producer_busy_s": round(busy, 1) if busy is not None else None,
            "producer_span_s": round(span, 1) if span is not None else None,
            "producer_idle_pct": round(100 * (1 - busy / span), 1) if busy is not None and span else None,
            "stats": seen["stats"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run")
    p.add_argument("--model", default=".cache/tiny-model")
    p.add_argument("--limit", type=int, default=320)
    p.add_argument("--slow-s", type=float, default=0.1, help="the slow consumer's sleep per sample")
    p.add_argument("--bound-mib", type=int, default=16)
    p.add_argument("--block-mib", type=float, default=2,
                   help="Ray Data's target_max_block_size: a unit's output is cut into blocks of this size (its "
                        "default, 128 MiB, is more than the tiny target's whole stream)")
    args = p.parse_args()
    from job.config import load_config

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=512 * 2**20,
             log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = load_config("configs/demo.yaml", model=args.model, output=args.run, limit=args.limit,
                         **{"hidden_states.check_samples": 0})
    # Before the trainers are built: each deep-copies the DataContext (ray/train/v2/_internal/callbacks/datasets.py).
    ray.data.DataContext.get_current().target_max_block_size = int(args.block_mib * 2**20)
    bound = args.bound_mib * 2**20
    for delay, limit in ((0.0, bound), (args.slow_s, bound), (0.0, None), (args.slow_s, None)):
        case = run_case(config, delay, limit)
        stats = case.pop("stats")
        print("CASE", json.dumps(case), flush=True)
        print(stats[:3000], flush=True)


if __name__ == "__main__":
    main()
