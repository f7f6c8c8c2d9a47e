"""Cost of resume bookkeeping for a 10M-row input: what a rerun does before it starts any engine.

    .venv/bin/python bench/bench_resume.py [--rows 10000000] [--files 1000] [--rows-per-shard 256]

Builds a real input (parquet files of `id` + a short `prompt`) and a run directory that is half done (real,
empty shard files with the names stage 1 gives them), then times and measures peak Python memory (tracemalloc)
of each step of a rerun:
  1. list the input and read every footer          (every run)
  2. validate ids: no nulls, unique                 (first run only; run.json records it)
  3. list the output shards                         (every run)
  4. cut the rows left into work units              (every run)
The resume state is the list of shard names: O(shards), never O(ids).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from job import layout, scan, storage  # noqa: E402
from job.generate import inputs
from job.generate.units import count_done_rows, pending_units
from job.storage import StorageConfig  # noqa: E402


def measure(label: str, fn):
    tracemalloc.start()
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    arrow_peak = pa.default_memory_pool().max_memory() / 2**20  # Arrow buffers are invisible to tracemalloc
    print(f"| {label} | {seconds:.2f} | {peak / 2**20:.1f} | {arrow_peak:.0f} |", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--rows-per-shard", type=int, default=256)
    parser.add_argument("--string-ids", action="store_true", help="ids like 'sample-0000012345' instead of ints")
    args = parser.parse_args()
    per_file = args.rows // args.files
    sc = StorageConfig()
    with tempfile.TemporaryDirectory() as d:
        inp, out = Path(d, "in"), Path(d, "run", layout.COMPLETIONS_DIR)
        inp.mkdir()
        out.mkdir(parents=True)
        t0 = time.perf_counter()
        for f in range(args.files):
            ids = pa.array(range(f * per_file, (f + 1) * per_file), pa.int64())
            if args.string_ids:
                ids = pa.array([f"sample-{i:010d}" for i in ids.to_pylist()])
            pq.write_table(pa.table({"id": ids, "prompt": pa.array(["hello"] * per_file)}),
                           inp / f"part-{f:05d}.parquet")
        files = inputs.list_input_files(str(inp), sc)
        # Half the run done: every unit of the first half of the files has its shard.
        done_units = pending_units(files[: args.files // 2], [], None, args.rows_per_shard)
        # Real (small) shard files: a resume reads every shard's footer before it trusts it.
        shard = storage.table_to_ipc_bytes(pa.table({"id": pa.array([str(i) for i in range(args.rows_per_shard)]),
                                                     "error": pa.nulls(args.rows_per_shard, pa.string())}))
        for u in done_units:
            (out / u.shard_name).write_bytes(shard)
        print(f"setup: {args.rows:,} rows in {args.files} files, {len(done_units):,} shards done "
              f"({time.perf_counter() - t0:.0f} s)\n")
        print("| step (10M-row input, half done) | seconds | peak Python MiB | Arrow pool high-water MiB |")
        print("|---|---|---|---|")
        files = measure("1. list input + read footers", lambda: inputs.list_input_files(str(inp), sc))
        measure("2. validate ids (first run only)", lambda: inputs.validate_input(files, sc))
        names = measure("3. list output shards", lambda: [u.rsplit("/", 1)[-1] for u in
                                                           storage.list_files(str(out), ".arrow", sc)])
        listed = scan.list_completion_shards(str(out.parent), sc)
        checks = measure("3b. read every shard's footer (resume trusts content)",
                         lambda: scan.check_completion_shards(listed, sc))
        assert not scan.unreadable(checks)
        units = measure("4. rows left → work units", lambda: pending_units(
            files, names, None, args.rows_per_shard))
        recorded = inputs.describe_files(files, str(inp), {}, inputs.content_digests(files, sc))
        measure("5. input unchanged? (SHA-256 of every file, every resume)",
                lambda: inputs.check_unchanged(recorded, files, str(inp), sc))
        done = count_done_rows(files, names, None)
        print(f"\n{len(names):,} shards done = {done:,} rows; {len(units):,} units left = "
              f"{sum(u.num_rows for u in units):,} rows; process max RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
        assert done + sum(u.num_rows for u in units) == args.rows


if __name__ == "__main__":
    main()
