"""What one work unit holds when its input file is a single row group (pq.write_table's and pandas' default for
files up to ~1M rows): the old read (whole group, then a zero-copy slice) against job.generate.inputs.read_rows (stream
the
group in batches, copy out the unit's rows). Prints one JSON line.

    .venv/bin/python bench/bench_row_groups.py [--rows 200000] [--unit 128]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

from job.generate.inputs import read_rows
from job.storage import StorageConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--unit", type=int, default=128)
    args = ap.parse_args()
    n, k = args.rows, args.unit
    table = pa.table({"id": [f"id-{i:07d}" for i in range(n)],
                      "prompt": [f"{i:07d} " + "lorem ipsum " * 40 for i in range(n)]})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "one-group.parquet")
        pq.write_table(table, path, row_group_size=n)
        start = n // 2
        t0 = time.perf_counter()
        old = pq.ParquetFile(path).read_row_groups([0]).slice(start, k)
        t_old = time.perf_counter() - t0
        t0 = time.perf_counter()
        new = read_rows(path, StorageConfig(), start=start, stop=start + k)
        t_new = time.perf_counter() - t0
        assert new.equals(old)
        print(json.dumps({"rows_in_group": n, "unit_rows": k, "file_bytes": os.path.getsize(path),
                          "unit_data_bytes": new.nbytes, "held_bytes_old": old.get_total_buffer_size(),
                          "held_bytes_new": new.get_total_buffer_size(), "seconds_old": round(t_old, 3),
                          "seconds_new": round(t_new, 3)}))


if __name__ == "__main__":
    main()
