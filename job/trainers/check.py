"""Prove an export trains: N optimizer steps of the trainer's OWN training code on one repeated batch of the export,
with a tiny draft model, on CPU.

    make trainers                                   # .venv-trainers: SpecForge 0.2.0, speculators 0.9.0 (once, ~1 min)
    python -m job train-check EXPORT_DIR [--steps 5]   # runs this module in .venv-trainers

Runs in the trainers' environment, not the job's (their pins do not fit it: SpecForge pins torch 2.11 and sglang),
so nothing here imports the rest of the `job` package. Per step it prints the trainer's loss, the gradient norm and
the trainer's accuracy, and fails (exit 1) when a loss is not finite and positive, a gradient norm is zero, or the
loss does not fall over the steps of a repeated batch. Those three catch what "a step ran" does not: with every
loss mask zero, SpecForge's EAGLE-3 step runs with loss 0 and gradient 0.

The trainer-specific code (and each CPU workaround, with the error it avoids) is in specforge.py and
speculators_train.py.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import time

MANIFEST = "export.json"


class TrainCheckFailed(Exception):
    """The export did not train: the message says which step and which rule."""


# The module with each trainer's `train(export_dir, manifest, config, steps, workdir)` and `draft_config(manifest)`.
TRAINER_MODULES = {"specforge": "job.trainers.specforge", "speculators": "job.trainers.speculators_train"}


def trainer_module(to: str):
    if to not in TRAINER_MODULES:
        raise TrainCheckFailed(f"train-check: unknown trainer {to!r} in {MANIFEST}")
    return importlib.import_module(TRAINER_MODULES[to])


def judge(steps: list[dict]) -> list[str]:
    """What is wrong with these steps (empty: they trained)."""
    problems = []
    for s in steps:
        if not (math.isfinite(s["loss"]) and s["loss"] > 0):
            problems.append(f"step {s['step']}: loss {s['loss']} is not finite and positive")
        if not (math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0):
            problems.append(f"step {s['step']}: gradient norm {s['grad_norm']} (nothing would be learned)")
    if len(steps) >= 2 and not steps[-1]["loss"] < steps[0]["loss"]:
        problems.append(f"the loss did not fall on a repeated batch ({steps[0]['loss']:.4f} → {steps[-1]['loss']:.4f})")
    return problems


def run(export_dir: str, steps: int = 5, workdir: str | None = None) -> dict:
    manifest = json.load(open(os.path.join(export_dir, MANIFEST)))
    if manifest.get("format") == "conversations":
        raise TrainCheckFailed("train-check: a conversations export holds no hidden states; SpecForge trains on it "
                               "online, with the target loaded (not a CPU check)")
    module = trainer_module(manifest["to"])
    config = manifest.get("draft_config") or module.draft_config(manifest)
    workdir = workdir or tempfile.mkdtemp(prefix="train-check-")
    started = time.monotonic()
    results = module.train(export_dir, manifest, config, steps, workdir)
    return {"export": export_dir, "to": manifest["to"], "format": manifest["format"], "steps": results,
            "problems": judge(results), "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m job.trainers", description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", help="export directories (python -m job export ... --output DIR)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps on one repeated batch (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON line per export instead of the table")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the loss must be seen to fall)")
    failed = 0
    for export_dir in args.exports:
        try:
            result = run(export_dir, args.steps)
        except TrainCheckFailed as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(f"{result['to']} {result['format']} ({export_dir}), {result['seconds']} s:")
            for s in result["steps"]:
                print(f"  step {s['step']}: loss {s['loss']:.4f}  grad norm {s['grad_norm']:.4f}  "
                      f"accuracy {s['accuracy']:.3f}")
            print("  " + ("; ".join(result["problems"]) if result["problems"] else "trains: loss finite, positive "
                          "and falling; gradients non-zero"), flush=True)
        failed += bool(result["problems"])
    return 1 if failed else 0
