"""Where one footer read's time goes on S3 (moto on loopback): its latency, the driver's CPU for it, and what of that
CPU is botocore's, pyarrow's and the job's own.

    .venv/bin/python bench/bench_s3_requests.py [--shards 1000] [--threads 32]

Writes N small completion shards (as bench_control_plane.py does) to a counting moto server, then reads every
footer (`scan.check_completion_shard`, what every command does for every shard without the trust cache) one at a
time under cProfile, then N at `--threads` in flight, then lists them with their ETags and reads them through the
trust cache. Prints seconds, CPU seconds and requests of each, and the profile's top entries grouped by library.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import sys
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_control_plane import requests_made, start_server  # noqa: E402


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=32)
    args = parser.parse_args()
    server, endpoint = start_server()
    try:
        import json

        import pyarrow as pa

        from job import layout, scan, schema, storage, trust_cache

        run = f"s3://bench/req-{uuid.uuid4().hex[:6]}"
        n = 128
        table = pa.table({schema.ID: [f"r{i}" for i in range(n)], schema.ERROR: pa.nulls(n, pa.string()),
                          schema.NUM_OUTPUT_TOKENS: pa.array([2] * n, pa.int32()),
                          schema.NUM_PROMPT_TOKENS: pa.array([2] * n, pa.int32())})
        names = [layout.completion_shard_name(0, i * n, (i + 1) * n) for i in range(args.shards)]

        def put(name: str) -> None:
            t = table.replace_schema_metadata({schema.META_SHARD_ID: uuid.uuid4().hex,
                                               schema.META_COUNTS: json.dumps(scan.shard_counts(table))})
            storage.write_bytes_atomic(storage.join(run, layout.COMPLETIONS_DIR, name), storage.table_to_ipc_bytes(t))

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, names))
        shards = scan.list_completion_shards(run)
        scan.check_completion_shard(shards[0])  # the client made, the connection pool warm

        def measure(what: str, fn) -> None:
            requests_made(endpoint, reset=True)
            c0, t0 = cpu(), time.perf_counter()
            fn()
            seconds, cpu_s = time.perf_counter() - t0, cpu() - c0
            r = requests_made(endpoint)
            total = sum(r.values())
            print(f"{what}: {seconds:.2f} s, driver CPU {cpu_s:.2f} s, {total:,} requests {dict(r)}; per request "
                  f"{1000 * seconds / max(1, total):.2f} ms wall, {1000 * cpu_s / max(1, total):.2f} ms CPU",
                  flush=True)

        profile = cProfile.Profile()
        measure("footers one at a time (cProfile on)",
                lambda: (profile.enable(), [scan.check_completion_shard(s) for s in shards], profile.disable()))
        measure("footers one at a time", lambda: [scan.check_completion_shard(s) for s in shards])
        measure(f"footers, {args.threads} in flight",
                lambda: scan.check_completion_shards(shards, num_threads=args.threads))
        measure("listing with ETags", lambda: scan.list_completion_shards(run))
        cache = trust_cache.Entries()
        scan.check_completion_shards(shards, cache=cache)
        measure("footers through a warm trust cache (listing + cache lookups)",
                lambda: scan.check_completion_shards(scan.list_completion_shards(run), cache=cache))

        by_lib: dict[str, float] = defaultdict(float)
        stats = pstats.Stats(profile)
        for (path, _, func), (_, _, tottime, _, _) in stats.stats.items():
            lib = next((k for k in ("botocore", "urllib3", "boto3", "pyarrow", "dateutil", "/job/", "http/", "ssl",
                                    "socket", "json", "xml") if k in path), None)
            by_lib[lib or (func if path == "~" else os.path.basename(path))] += tottime
        total = sum(by_lib.values())
        print(f"\nown time by library, footers one at a time ({total:.2f} s in all):")
        for lib, t in sorted(by_lib.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {lib:<40} {t:6.2f} s  {100 * t / total:4.1f}%")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
