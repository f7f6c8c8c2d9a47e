"""Export throughput by writers: `python -m job export` of a run at 1, 2 and 4 concurrent writer tasks, the run and the
export both local, then both on S3 (a moto server on loopback), on this machine's Ray.

    .venv/bin/python bench/bench_export.py demo-run [--workers 1 2 4] [--parts-per-group 2] [--where local s3]

GB/s = the hidden-state bytes the export read (the run's done parts) / the export's wall time (its listing, the
count pass, the writers and the small files), Ray already started and its worker processes warm (one untimed export
first: a new worker's imports, ~4 s, are not the export's). Every export is into a fresh output (nothing to resume);
each row is the median of --repeats. One Ray for every row: a local one of --cpus CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_REGION": "us-east-1"})
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
    return proc, endpoint


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--parts-per-group", type=int, default=2)
    p.add_argument("--where", nargs="+", default=["local", "s3"])
    p.add_argument("--to", default="speculators")
    p.add_argument("--format", default="eagle3")
    p.add_argument("--cpus", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    server = None
    if "s3" in args.where:
        server, _ = moto()  # before Ray starts: its workers inherit the endpoint and credentials
    import ray

    from job import scan, storage
    from job.export import export
    from job.storage import StorageConfig

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    results, work = [], tempfile.mkdtemp(prefix="bench-export-")
    try:
        for where in args.where:
            run = os.path.abspath(args.run)
            if where == "s3":
                run = "s3://bench/run"
                for root, _, names in os.walk(os.path.abspath(args.run)):
                    for name in names:
                        path = os.path.join(root, name)
                        with open(path, "rb") as f:
                            storage.write_bytes_atomic(f"{run}/{os.path.relpath(path, args.run)}", f.read())
            read = sum(size for _, size in scan.done_hidden_state_parts(run, StorageConfig()))
            export(run, to=args.to, format=args.format, output=f"{run}-warm", workers=max(args.workers),
                   parts_per_group=args.parts_per_group, storage_config=StorageConfig())
            for workers in args.workers:
                times = []
                for k in range(args.repeats):
                    out = f"s3://bench/out-{workers}-{k}" if where == "s3" else os.path.join(work, f"out-{workers}-{k}")
                    started = time.monotonic()
                    manifest = export(run, to=args.to, format=args.format, output=out, workers=workers,
                                      parts_per_group=args.parts_per_group, storage_config=StorageConfig())
                    times.append(time.monotonic() - started)
                seconds = sorted(times)[len(times) // 2]
                row = {"where": where, "workers": workers, "samples": manifest["num_samples"],
                       "bytes_read": read, "seconds": round(seconds, 2), "gb_per_s": round(read / seconds / 1e9, 4),
                       "all_seconds": [round(t, 2) for t in times]}
                results.append(row)
                print("RESULT " + json.dumps(row), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        if server is not None:
            server.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
