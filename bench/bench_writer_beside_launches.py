"""Does stage 2's writer thread slow the thread that launches the forward? Small torch ops a second, on one thread,
alone and beside a thread streaming 146 MB parts through `storage.write_ipc_atomic` (as stage 2's BackgroundWriter
does), then alone again. A writer that held the GIL would show as fewer ops beside it.

    .venv/bin/python bench/bench_writer_beside_launches.py [--dir /dev/shm/writer-bench] [--seconds 6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ops_per_s(x, seconds: float) -> float:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            x.add_(1.0).mul_(0.5)
        n += 100
    return n / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/dev/shm/writer-bench")
    p.add_argument("--seconds", type=float, default=6.0)
    args = p.parse_args()
    import numpy as np
    import pyarrow as pa
    import torch

    from job import storage

    torch.set_num_threads(1)
    x = torch.ones(8)
    part = pa.table({"f": pa.FixedSizeListArray.from_arrays(
        pa.array(np.random.default_rng(0).integers(0, 255, 146_000_000, dtype=np.uint8)), 1_000_000)})
    os.makedirs(args.dir, exist_ok=True)
    stop, written = threading.Event(), [0]

    def writer():
        while not stop.is_set():
            storage.write_ipc_atomic(os.path.join(args.dir, f"p{written[0] % 3}.arrow"), part)
            written[0] += 1

    alone = ops_per_s(x, args.seconds / 2)
    thread = threading.Thread(target=writer)
    thread.start()
    started = time.perf_counter()
    beside = ops_per_s(x, args.seconds)
    gb_per_s = written[0] * part.nbytes / (time.perf_counter() - started) / 1e9
    stop.set()
    thread.join()
    again = ops_per_s(x, args.seconds / 2)
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"ops/s alone {alone:,.0f}, beside the writer {beside:,.0f} ({gb_per_s:.1f} GB/s written), "
          f"alone again {again:,.0f}")


if __name__ == "__main__":
    main()
