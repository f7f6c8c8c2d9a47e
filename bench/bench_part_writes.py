"""Stage 2's writer on its own: a part serialized into a fresh buffer and written (table_to_ipc +
write_bytes_atomic, the writer before 2026-12-07) against the part streamed into its file (write_ipc_atomic).

    .venv/bin/python bench/bench_part_writes.py [--dir /dev/shm/part-writes] [--parts 8]

The part is what bench/gpu_stage2_cli.sh's job writes: 8 rows of ~1,780 tokens, one layer of 5,120 in bf16 (146 MB).
Each writer writes --parts parts into --dir (tmpfs by default: the disk's own speed left out), one after another, as
stage 2's writer thread does; MB/s of parts written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm/part-writes")
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1780)
    args = parser.parse_args()

    import numpy as np

    from job import schema, storage
    from job.hidden_states.samples import Sample
    from job.hidden_states.shards import part_table, table_to_ipc

    hidden = 5120
    part_schema = schema.hidden_states_schema(model="m", layer_ids=[7], hidden_size=hidden, dtype="bfloat16",
                                              num_model_layers=8, last_layer_before_norm=True)
    rng = np.random.default_rng(0)
    samples = [Sample(id=f"s{i}", input_ids=rng.integers(0, 3000, args.tokens).astype(np.int32),
                      num_prompt_tokens=args.tokens - 30, original_num_tokens=args.tokens, row=i)
               for i in range(args.rows)]
    features = rng.integers(0, 255, args.rows * args.tokens * hidden * 2, dtype=np.uint8)

    def through_a_buffer(uri, table):
        buf = table_to_ipc(table)
        storage.write_bytes_atomic(uri, buf)
        return buf.size

    for name, write in (("fresh buffer a part", through_a_buffer), ("streamed", storage.write_ipc_atomic)):
        os.makedirs(args.dir, exist_ok=True)
        started, size = time.perf_counter(), 0
        for i in range(args.parts):
            size += write(os.path.join(args.dir, f"p{i:04d}.arrow"), part_table(samples, features, part_schema))
        seconds = time.perf_counter() - started
        print(f"{name}: {args.parts} parts of {size / args.parts / 1e6:.0f} MB, {seconds / args.parts:.3f} s a part, "
              f"{size / seconds / 1e6:,.0f} MB/s", flush=True)
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
