"""Stage 1 throughput of `generate.regenerate: conversation` against single-turn regeneration of the same turns, in
ONE run (this machine is shared and noisy: only ratios between rows of the same run mean anything).

    flock /tmp/heavy.lock nice -n 5 .venv/bin/python bench/bench_conversation.py --conversations 384 --max-tokens 128

The same multi-turn chats (the tiny corpus's question/answer pairs, 2-4 turns each, as the demo composes them) go
through stage 1 (job.generate.run_generate, configs/demo.yaml, the tiny model) three times, each in its own
subprocess, one after another:
  every_turn    `every_assistant_turn`: every assistant turn generated on the data's history, all turns at once
                (single-turn regeneration of exactly the turns `conversation` generates)
  conversation  `conversation`: the same turns, each on the model's own earlier answers, so a conversation's turns
                run one after the other (many conversations at once)
  last_turn     `last_turn`: one turn per conversation (for scale)
Reported: rows (turns generated), output tokens, the generation window, output tokens/s over it, and the ratio of
`conversation` to `every_turn`. The engine is only full in conversation mode when many more conversations are in
flight than it runs sequences (max_num_seqs 128 here): --conversations sets how many.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = {"every_turn": "every_assistant_turn", "conversation": "conversation", "last_turn": "last_turn"}


def write_chats(directory: str, num_conversations: int, seed: int = 0) -> str:
    """`num_conversations` chats of 2-4 question/answer turns from the tiny corpus, in 4 parquet files."""
    from job.builtin.demo import demo_pairs

    pairs, rng = demo_pairs(), random.Random(seed)
    rows = []
    for i in range(num_conversations):
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        for q, a in rng.sample(pairs, 2 + i % 3):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append({"id": f"chat-{i:05d}", "messages": json.dumps(messages)})
    os.makedirs(directory, exist_ok=True)
    per = -(-num_conversations // 4)
    for s in range(4):
        pq.write_table(pa.Table.from_pylist(rows[s * per:(s + 1) * per]), os.path.join(directory, f"c{s}.parquet"))
    return directory


def run_one(mode: str, inp: str, out: str, max_tokens: int) -> dict:
    from job.builtin.demo import TINY_MODEL_DIR
    from job.config import load_config
    from job.generate import run_generate

    config = load_config(str(REPO / "configs/demo.yaml"), model=str(REPO / TINY_MODEL_DIR), input=inp, output=out,
                         **{"generate.regenerate": MODES[mode], "generate.sampling": {"max_tokens": max_tokens},
                            "quality.canary_rows": 0})
    from job import scan

    summary = run_generate(config)
    rows = scan.read_columns(out, ["id", "error"])
    return {"mode": mode, "rows": rows.num_rows, "errors": rows.num_rows - int(scan.ok_rows(rows).sum()),
            "input_rows": summary.num_rows, "output_tokens": summary.num_output_tokens,
            "generation_s": summary.generation_seconds,
            "tokens_per_s": summary.num_output_tokens / summary.generation_seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--modes", default="every_turn,conversation,last_turn")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this mode, print its JSON line
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, os.path.join(args.workdir, "chats"),
                                             os.path.join(args.workdir, f"run-{args.one}"), args.max_tokens)),
              flush=True)
        return
    work = tempfile.mkdtemp(prefix="bench-conversation-")
    write_chats(os.path.join(work, "chats"), args.conversations)
    results = []
    for mode in args.modes.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--workdir", work,
                              "--max-tokens", str(args.max_tokens)], capture_output=True, text=True, cwd=REPO)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            sys.exit(f"{mode} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        results.append(json.loads(line[0][7:]))
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{args.conversations} conversations, max_tokens {args.max_tokens} (tiny model, CPU, configs/demo.yaml)")
    print(f"{'mode':<14} {'turns':>6} {'output tokens':>14} {'generation s':>13} {'tokens/s':>9}")
    for r in results:
        print(f"{r['mode']:<14} {r['rows']:>6} {r['output_tokens']:>14,} {r['generation_s']:>13.1f} "
              f"{r['tokens_per_s']:>9,.0f}")
    by = {r["mode"]: r for r in results}
    if "every_turn" in by and "conversation" in by:
        print(f"conversation / every_turn output tokens/s: "
              f"{by['conversation']['tokens_per_s'] / by['every_turn']['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
