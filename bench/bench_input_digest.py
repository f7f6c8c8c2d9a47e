"""What identifying the input by content costs: job/generate/inputs.py `content_digests` and
`_same_content`, per GB.

A local file is hashed whole on every resume (SHA-256, streamed in 4 MB reads); an S3 object is hashed once, on
the run's first start (a download), and on a resume identified by its ETag (one HEAD, whatever its size) unless
that changed. Writes a `--gb` GB file of incompressible bytes once, hashes it `--repeats` times (the first read
after `sync` may come from the page cache anyway: this machine has the RAM), then uploads it to moto on loopback
and times the S3 hash and the HEAD.

    .venv/bin/python bench/bench_input_digest.py [--gb 2] [--repeats 3] [--dir /tmp/bench-digest] [--no-s3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/bench-digest")
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()

    from job import storage

    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "input.bin")
    size = int(args.gb * (1 << 30))
    if not os.path.exists(path) or os.path.getsize(path) != size:
        with open(path, "wb") as f:
            for _ in range(size >> 24):
                f.write(os.urandom(1 << 24))
    subprocess.run(["sync"], check=False)
    gb = size / (1 << 30)
    print("| what | file | seconds | seconds per GB |\n|---|---|---|---|")
    for i in range(args.repeats):
        t = time.perf_counter()
        storage.sha256(path)
        dt = time.perf_counter() - t
        print(f"| local SHA-256, run {i + 1}{' (first read)' if i == 0 else ' (page cache warm)'} | {gb:.1f} GB | "
              f"{dt:.2f} | {dt / gb:.2f} |", flush=True)
    if args.no_s3:
        return
    sys.path.insert(0, str(REPO / "tests"))
    import boto3
    from conftest import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_ENDPOINT_URL=endpoint)
        for _ in range(600):  # moto's server takes a few seconds to start
            try:
                boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench-digest")
                break
            except Exception:
                time.sleep(0.1)
        else:
            raise RuntimeError("moto did not start within 60 s")
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.upload_file(path, "bench-digest", "input.bin")
        t = time.perf_counter()
        storage.sha256("s3://bench-digest/input.bin")
        dt = time.perf_counter() - t
        print(f"| S3 SHA-256 (first start: a download, moto on loopback) | {gb:.1f} GB | {dt:.2f} | {dt / gb:.2f} |")
        t = time.perf_counter()
        for _ in range(10):
            storage.etag("s3://bench-digest/input.bin")
        dt = (time.perf_counter() - t) / 10
        print(f"| S3 ETag (resume: one HEAD, moto on loopback) | {gb:.1f} GB | {dt:.3f} | {dt / gb:.3f} |")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
