"""The drafts `python -m job train` left in a run, each served by vLLM beside its target on the held-out prompts
(job/train/serve.py: τ from vLLM's own spec-decode counters, greedy and at the target's sampling), and the target
alone for its decode tokens/s: one engine per process (vLLM's metrics are process-wide). bench/gpu_train.sh runs it.

    python bench/gpu_serve_drafts.py --run RUN --heldout HELDOUT_RUN --config C.yaml --out DIR [--k 3] [--limit 64]
                                     [--drafts DRAFT_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def held_out_prompts(run: str, limit: int) -> list[dict]:
    from job.runview.notebook import read_rows  # the notebook's reader

    rows = [r for r in read_rows(run, ["id", "prompt_token_ids", "output_token_ids", "error"]).to_pylist()
            if r["error"] is None]
    rows.sort(key=lambda r: r["id"])
    return [{"prompt_token_ids": list(r["prompt_token_ids"])} for r in rows[:limit]]


def one(args) -> int:
    from job.train.serve import serve_one, target_sampling

    prompts = json.load(open(args.prompts))
    result = serve_one(args.model, args.draft or None, args.k, prompts, target_sampling(args.model), args.max_tokens,
                       config_path=args.config)
    for name in ("greedy", "sampled"):
        result.get(name, {}).pop("greedy_outputs", None)
    print("RESULT " + json.dumps({"draft": args.draft, **result}), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run")
    p.add_argument("--heldout")
    p.add_argument("--config", required=True)
    p.add_argument("--out", default=".")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--drafts", nargs="+", help="draft directories to serve (default: the run's drafts/*/draft)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--draft", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(args)
    from job.config import load_config

    model = load_config(args.config).model
    prompts = os.path.join(args.out, "heldout_prompts.json")
    with open(prompts, "w") as f:
        json.dump(held_out_prompts(args.heldout, args.limit), f)
    drafts = [""] + (args.drafts or [os.path.join(args.run, "drafts", fmt, "draft") for fmt in ("eagle3", "dflash")
                                     if os.path.isdir(os.path.join(args.run, "drafts", fmt, "draft"))])
    for draft in drafts:
        subprocess.run([sys.executable, __file__, "--one", "--model", model, "--draft", draft, "--prompts", prompts,
                        "--config", args.config, "--k", str(args.k), "--max-tokens", str(args.max_tokens)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
