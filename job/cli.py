"""Command line: thin subcommands over the stages. Errors a user can cause end in one `error:` line, exit 2.

    python -m job generate --config configs/demo.yaml --input PROMPTS --output RUN [--limit N]
    python -m job hidden-states --config configs/demo.yaml --output RUN
    python -m job report RUN
    python -m job export RUN --to {specforge,speculators} --format {dflash,eagle3,conversations} --output DIR
    python -m job status RUN
    python -m job plan --prompts N --tokens-per-prompt T --gpus G --tokens-per-s-per-gpu R --usd-per-gpu-hour P
    python -m job tiny-model --output DIR
    python -m job demo
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from job.config import ConfigError, RunConfig, load_config

from job.demo import DEMO_CONFIG


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEMO_CONFIG, help="run config YAML (default: %(default)s)")
    p.add_argument("--output", help="run directory, local path or s3:// URI (overrides the config)")
    p.add_argument("--model", help="model directory or name (overrides the config)")
    p.add_argument("--limit", type=int, help="process only the first N rows")
    p.add_argument("--allow-drift", action="store_true",
                   help="resume although the run's settings changed (stage 1: the output mixes two settings; stage 2: "
                        "every shard's hidden states are redone). Changed input is refused regardless")
    p.add_argument("--take-lock", action="store_true",
                   help="take over another job's writer lock: only when that job is dead (its lock goes stale by "
                        "itself after 2 minutes)")
    p.add_argument("--force", action="store_true", help=argparse.SUPPRESS)  # split: says so


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m job", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stage 1: prompts → completion shards")
    _common(g)
    g.add_argument("--input", help="folder or prefix of prompt parquet shards (overrides the config)")
    g.add_argument("--chat-template", help="Jinja chat template file that replaces the model's own")
    g.add_argument("--no-canary", action="store_true", help="skip the quality check on the first rows")

    h = sub.add_parser("hidden-states", help="stage 2: completions → hidden-state shards")
    _common(h)
    h.add_argument("--check", action="store_true",
                   help="check a finished run's shards against a plain transformers forward instead of extracting")
    h.add_argument("--check-samples", type=int, default=8, help="samples --check compares (default %(default)s)")

    r = sub.add_parser("report", help="quality and length report of a run (finished or still running)")
    r.add_argument("run", help="run directory (local or s3://)")

    e = sub.add_parser("export", help="a run in SpecForge's or vLLM speculators' training format (job/export/)")
    e.add_argument("run", help="run directory (local or s3://)")
    e.add_argument("--to", required=True, choices=("specforge", "speculators"))
    e.add_argument("--format", required=True, choices=("dflash", "eagle3", "conversations"),
                   help="dflash / eagle3: hidden-state features; conversations (specforge): the completions as "
                        "its training conversations JSONL")
    e.add_argument("--output", required=True, help="export directory (local or s3://)")
    e.add_argument("--layers", type=int, nargs="+",
                   help="aux/context layers in our (= SpecForge's) ids, in the trainer's order (default: the run's "
                        "layers but the model's last)")
    e.add_argument("--draft-vocab-size", type=int, help="specforge eagle3: d2t/t2d size (default 32000, at most "
                                                         "the target's vocabulary)")
    e.add_argument("--target-vocab-size", type=int, help="specforge eagle3: default from the model's config")

    t = sub.add_parser("tiny-model", help="build one of the project's tiny models (dense Qwen3, or hybrid Qwen3.5)")
    t.add_argument("--output", required=True)
    t.add_argument("--architecture", choices=("dense", "hybrid"), default="dense",
                   help="dense: Qwen3-style; hybrid: the target's Qwen3.5/3.6 architecture (Gated DeltaNet, MTP)")
    t.add_argument("--train-steps", type=int)

    sub.add_parser("status", help="progress of a run from its run directory alone (see --help)", add_help=False)
    sub.add_parser("plan", help="time, cost and storage before renting GPUs (see --help)", add_help=False)

    d = sub.add_parser("demo", help="both stages end to end on the embedded demo (what `make demo` runs)")
    d.add_argument("--output", default="demo-run")
    return parser


def _config(args) -> RunConfig:
    overrides = {"output": args.output, "model": args.model, "limit": args.limit}
    if getattr(args, "input", None):
        overrides["input"] = args.input
    if getattr(args, "chat_template", None):
        overrides["generate.chat_template"] = args.chat_template
    return load_config(args.config, **overrides)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["plan"], ["status"]):  # these two own their argument parsing (job/plan.py, job/status.py)
        return importlib.import_module(f"job.{argv[0]}").main(argv[1:])
    args = build_parser().parse_args(argv)
    from job.generate.engine import EngineStartError
    from job.generate import CanaryFailed
    from job.hidden_states import HiddenStateCheckError
    from job.generate.inputs import InputError
    from job.runs import RunError
    from job.storage import StorageError

    try:
        return _dispatch(args)
    except (CanaryFailed, HiddenStateCheckError) as e:
        print(f"\nerror: {e}", file=sys.stderr, flush=True)
        return 3
    except (ConfigError, InputError, RunError, StorageError, EngineStartError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


def _dispatch(args) -> int:
    if getattr(args, "force", False):
        raise ConfigError("--force was split in two: --allow-drift (resume although settings changed) and "
                          "--take-lock (take over a dead job's writer lock); changed input is never resumed")
    if args.command == "generate":
        from job.generate import run_generate
        from job.report import print_summary

        config = _config(args)
        summary = run_generate(config, allow_drift=args.allow_drift, take_lock=args.take_lock,
                               canary=not args.no_canary)
        print_summary(config, summary)
        return 0
    if args.command == "hidden-states":
        from job.hidden_states import run_hidden_states

        config = _config(args)
        if args.check:
            from job.hidden_states import check_run

            result = check_run(config, args.check_samples)
            print(f"exactness check passed: {result['num_samples']} stored samples differ from a plain transformers "
                  f"forward by at most {result['max_difference']:.2e} (tolerance {result['tolerance']:.0e}); "
                  "by layer: " + ", ".join(f"{k}: {v:.1e}" for k, v in result["max_difference_by_layer"].items()))
            return 0
        run_hidden_states(config, allow_drift=args.allow_drift, take_lock=args.take_lock)
        return 0
    if args.command == "export":
        from job.export import export

        summary = export(args.run, to=args.to, format=args.format, output=args.output, layers=args.layers,
                         draft_vocab_size=args.draft_vocab_size, target_vocab_size=args.target_vocab_size)
        reasons = "; ".join(f"{n} {r}" for r, n in summary["dropped_by_reason"].items())
        print(f"export: {summary['num_samples']:,} samples → {args.output} ({args.to} {args.format}); "
              f"dropped {summary['num_dropped']:,}" + (f": {reasons}" if reasons else "") +
              f"; details in {args.output.rstrip('/')}/export.json")
        return 0
    if args.command == "report":
        from job.report import build_report, format_report

        print(format_report(build_report(args.run)))
        return 0
    if args.command == "tiny-model":
        from job.tiny_model import build_tiny_model

        kwargs = {"train_steps": args.train_steps} if args.train_steps else {}
        print(build_tiny_model(args.output, architecture=args.architecture, **kwargs))
        return 0
    if args.command == "demo":
        from job.demo import run_demo

        return run_demo(args.output)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
