"""Reading and validating a large JSONL input, beside the same rows as parquet.

Generates N conversation rows (~`--row-bytes` each: the seed team's 914K prompts were 1.5 GB, ~1.6 KB a row) as
one `.jsonl`, one `.jsonl.zst` (and `.jsonl.gz` with --gz) and one parquet file, then for each runs what a run's
first start does before any engine: 1. list + scan (row count, checkpoints), 2. validate ids (parse every line),
3. cut the rows into work units, 4. read one unit near the end of the file (what an engine actor does). Each step
runs in a fresh process so its peak RSS is its own. Prints a markdown table.

    .venv/bin/python bench/bench_inputs.py [--rows 1000000] [--row-bytes 1600] [--gz] [--dir /tmp/bench-inputs]
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import random
import time


def write_inputs(directory: str, rows: int, row_bytes: int, gz: bool) -> dict[str, str]:
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    paths = {"jsonl": os.path.join(directory, "rows.jsonl"), "jsonl.zst": os.path.join(directory, "rows.jsonl.zst"),
             "parquet": os.path.join(directory, "parquet", "rows.parquet")}
    if gz:
        paths["jsonl.gz"] = os.path.join(directory, "rows.jsonl.gz")
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    import numpy as np

    rng = random.Random(0)
    # Text that compresses like text (~3-4x), not like one repeated sentence: slices of a 64 MB pool of random
    # words, larger than zstd's and gzip's windows.
    words = np.array(("the of and to in is was for on that with as by at from this be are it an or model data "
                      "turn token answer question speculative decoding drafter target layer hidden state "
                      "gradient batch sequence attention").split() + [f"w{i}" for i in range(2000)])
    filler = " ".join(words[np.random.default_rng(0).integers(0, len(words), 64 << 20 >> 3)].tolist())
    os.makedirs(os.path.dirname(paths["parquet"]), exist_ok=True)
    zst = pa.CompressedOutputStream(paths["jsonl.zst"], "zstd")
    gzf = gzip.open(paths["jsonl.gz"], "wb", compresslevel=1) if gz else None
    writer = None
    with open(paths["jsonl"], "wb") as plain:
        for lo in range(0, rows, 50_000):
            batch = []
            for i in range(lo, min(rows, lo + 50_000)):
                k = rng.randrange(len(filler) - row_bytes)
                batch.append({"id": f"sample-{i:010d}", "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": filler[k:k + row_bytes // 2]},
                    {"role": "assistant", "content": filler[k + 7:k + 7 + row_bytes // 3]}], "source": "bench"})
            data = "".join(json.dumps(r) + "\n" for r in batch).encode()
            plain.write(data)
            zst.write(data)
            if gzf:
                gzf.write(data)
            table = pa.Table.from_pylist(batch)
            writer = writer or pq.ParquetWriter(paths["parquet"], table.schema)
            writer.write_table(table, row_group_size=4096)
    zst.close()
    writer.close()
    if gzf:
        gzf.close()
    return paths


def _step(uri: str, step: str, rows_per_shard: int, queue) -> None:
    from job.generate import inputs, jsonl_input
    from job.generate.units import pending_units
    from job.storage import StorageConfig

    importlib.import_module("pandas")  # imported lazily by id hashing: not part of any step's time

    sc = StorageConfig()
    files = inputs.list_input_files(uri, sc)
    carried = jsonl_input.table_schema(["id", "messages", "source"])  # what validation finds (JSONL only)
    inputs.read_unit(pending_units(files, [], None, 16)[0], sc, carried)  # warm: first-call set-up costs
    base = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (peak RSS) to the current RSS (Linux)
        f.write("5")
    t0 = time.perf_counter()
    if step == "scan":
        inputs.list_input_files(uri, sc)
    elif step == "validate":
        inputs.validate_input(files, sc)
    elif step == "units":
        pending_units(files, [], None, rows_per_shard)
    elif step == "read_unit":
        unit = pending_units(files, [], None, rows_per_shard)[-2]  # near the end
        assert inputs.read_unit(unit, sc, carried).num_rows == rows_per_shard
    seconds = time.perf_counter() - t0
    peak = _status_mib("VmHWM")
    queue.put((seconds, peak, peak - base))


def _status_mib(key: str) -> float:
    """VmRSS / VmHWM of this process in MiB. (ru_maxrss would carry the parent's peak across fork and exec.)"""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def measure(uri: str, step: str, rows_per_shard: int) -> tuple[float, float, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_step, args=(uri, step, rows_per_shard, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--row-bytes", type=int, default=1600)
    ap.add_argument("--rows-per-shard", type=int, default=256)
    ap.add_argument("--gz", action="store_true", help="also .jsonl.gz (slow to write)")
    ap.add_argument("--dir", default="/tmp/bench-inputs")
    args = ap.parse_args()
    t0 = time.perf_counter()
    paths = write_inputs(args.dir, args.rows, args.row_bytes, args.gz)
    print(f"inputs ready in {time.perf_counter() - t0:.0f} s: " +
          ", ".join(f"{k} {os.path.getsize(p) / 2**20:,.0f} MiB" for k, p in paths.items()), flush=True)
    print(f"\n| {args.rows:,} rows | step | seconds | peak RSS MiB | RSS growth in the step MiB |\n"
          "|---|---|---|---|---|")
    for form, path in paths.items():
        for step in ("scan", "validate", "units", "read_unit"):
            seconds, peak, growth = measure(path, step, args.rows_per_shard)
            print(f"| {form} | {step} | {seconds:.2f} | {peak:.0f} | {growth:.0f} |", flush=True)


if __name__ == "__main__":
    main()
