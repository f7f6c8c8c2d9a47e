"""Command line: every subcommand of `python -m job`, defined here. Errors a user can cause or must act on
(job/errors.py's JobError) end in one `error:` line, exit 2 (3: the data failed a check).

    python -m job generate --config configs/demo.yaml --input PROMPTS --output RUN [--limit N]
    python -m job hidden-states --config configs/demo.yaml --output RUN
    python -m job report RUN
    python -m job export RUN --to {specforge,speculators} --format {dflash,eagle3,conversations} --output DIR
    python -m job train-check EXPORT_DIR... [--steps 5]      # needs `make trainers`
    python -m job train RUN --format {eagle3,dflash} [--stream] [--gpus-per-worker 1]
    python -m job status RUN
    python -m job plan [--config C.yaml | --from RUN] --prompts N --tokens-per-prompt T --gpus G \
        --tokens-per-s-per-gpu R --usd-per-gpu-hour P
    python -m job tiny-model --output DIR
    python -m job demo

Commands that read a run directory share the storage flags (`--endpoint-url`, `--region`); for generate and
hidden-states they override the config's `storage` section.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from job.config import DEFAULT_CONFIG, ConfigError, RunConfig, load_config


def _storage_flags() -> argparse.ArgumentParser:
    """Parent parser of every subcommand that reads (or writes) a run directory."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("storage")
    g.add_argument("--endpoint-url", help="S3-compatible endpoint (default: the config's storage.endpoint_url, "
                                          "else AWS_ENDPOINT_URL, else AWS itself)")
    g.add_argument("--region", help="S3 region (default: the config's, else AWS_REGION, else us-east-1)")
    return p


def _storage(args):
    from job.storage import StorageConfig  # per command: --help stays fast

    return StorageConfig(endpoint_url=args.endpoint_url, region=args.region)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="run config YAML (default: %(default)s)")
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
    run_dir = [_storage_flags()]
    _add_stages(sub, run_dir)
    _add_export(sub, run_dir)
    _add_training(sub, run_dir)
    _add_worth(sub, run_dir)
    _add_read_side(sub, run_dir)
    _add_builtin(sub)
    return parser


def _add_stages(sub, run_dir: list) -> None:
    """generate (stage 1) and hidden-states (stage 2)."""
    g = sub.add_parser("generate", help="stage 1: prompts → completion shards", parents=run_dir)
    _common(g)
    g.add_argument("--input", help="the prompts: a folder, prefix or file of parquet, JSON Lines (.jsonl, .gz, .zst) "
                   "or Arrow (overrides the config)")
    g.add_argument("--chat-template", help="Jinja chat template file that replaces the model's own")
    g.add_argument("--no-canary", action="store_true", help="skip the quality check on the first rows")

    h = sub.add_parser("hidden-states", help="stage 2: completions → hidden-state shards", parents=run_dir)
    _common(h)
    h.add_argument("--check", action="store_true",
                   help="check a finished run's shards against a plain transformers forward instead of extracting")
    h.add_argument("--check-samples", type=int, default=8, help="samples --check compares (default %(default)s)")


def _add_export(sub, run_dir: list) -> None:
    e = sub.add_parser("export", help="a run in SpecForge's or vLLM speculators' training format (job/export/)",
                       parents=run_dir)
    e.add_argument("run", help="run directory (local or s3://)")
    e.add_argument("--to", required=True, choices=("specforge", "speculators"))
    e.add_argument("--format", required=True, choices=("dflash", "eagle3", "conversations"),
                   help="dflash / eagle3: hidden-state features; conversations (specforge): the completions as "
                        "its training conversations JSONL")
    e.add_argument("--output", required=True, help="export directory (local or s3://)")
    e.add_argument("--layers", type=int, nargs="+",
                   help="aux/context layers in our (= SpecForge's) ids, in the trainer's order (default: the "
                        "trainer's own default layers for this target, job/drafters.py)")
    e.add_argument("--loss-turns", choices=("last_turn", "every_assistant_turn"),
                   help="multi-turn samples: the loss on the generated turn only, or on every assistant turn of the "
                        "history too (default: what the trainer does itself: specforge every_assistant_turn, "
                        "speculators last_turn)")
    e.add_argument("--model", metavar="DIR",
                   help="the target model's directory on this machine (default: the path the run recorded); the "
                        "export reads its config, tokenizer and final norm weight")
    e.add_argument("--draft-config", metavar="JSON",
                   help="your draft-model config: refused if its layer ids disagree with the export's (default: "
                        "a ready one is written into export.json)")
    e.add_argument("--draft-vocab-size", type=int, help="specforge eagle3: d2t/t2d size (default 32000, at most "
                                                         "the target's vocabulary)")
    e.add_argument("--target-vocab-size", type=int, help="specforge eagle3: default from the model's config")
    e.add_argument("--limit", type=int, help="the first N samples the trainer keeps, in the run's order: a quick "
                                             "export to prove a launcher before the whole run")
    e.add_argument("--sample", type=float, metavar="FRACTION",
                   help="the samples whose id falls in this fraction (by a hash of the id: the same ones each time)")
    e.add_argument("--workers", type=int,
                   help="export tasks at once, one group of parts each (default: as many as the cluster runs)")
    e.add_argument("--take-lock", action="store_true", help="take over another export's writer lock into this output")


def _add_training(sub, run_dir: list) -> None:
    """train-check (an export trains, in .venv-trainers), train (a drafter on a run, job/train/) and train-online
    (its --stream, by its earlier name)."""
    t = sub.add_parser("train-check", help="prove exports train: N steps of the trainer's own code on CPU, in "
                                            ".venv-trainers (`make trainers`; job/trainers/)", parents=run_dir)
    t.add_argument("exports", nargs="+", help="export directories (local, or s3:// of at most 10 GB: an export made "
                                             "with --limit is copied here first)")
    t.add_argument("--steps", type=int, default=5, help="optimizer steps on one repeated batch (default 5)")
    t.add_argument("--json", action="store_true", help="one JSON line per export (steps, problems, seconds)")
    t.add_argument("--python", default=str(TRAINERS_PYTHON),
                   help="the trainers' Python (default: .venv-trainers/bin/python of this checkout)")

    tr = sub.add_parser("train", help="train a drafter on a run: speculators' draft model and loss on Ray Train "
                                       "workers (GPUs on a cluster); its result a directory vLLM serves (job/train/)",
                        parents=run_dir)
    tr.add_argument("run", help="the run directory (local or s3://): its stored hidden states, or with --stream its "
                                "completions")
    _training_flags(tr)
    tr.add_argument("--config", help="the run config (default: the run's own, from its run.json)")
    tr.add_argument("--stream", action="store_true",
                    help="train on stage 2's stream (nothing stored) instead of the run's stored hidden states")
    tr.add_argument("--holdout", type=float, metavar="FRACTION",
                    help="leave the samples whose id falls in this fraction (by a hash of the id) untrained: "
                         "`python -m job worth` serves on them")

    o = sub.add_parser("train-online", help="the same as `train RUN --stream` (its earlier name)", parents=run_dir)
    o.add_argument("--config", default=DEFAULT_CONFIG, help="run config YAML (default: %(default)s)")
    o.add_argument("--output", required=True, help="the run directory whose completions stage 2 reads")
    o.add_argument("--storage-path", dest="checkpoints", help="where Ray Train keeps checkpoints (default: "
                                                                 "RUN/drafts/NAME/checkpoints)")
    _training_flags(o)


def _add_worth(sub, run_dir: list) -> None:
    w = sub.add_parser("worth", help="what the run's data is worth on its target: a draft trained with a held-out "
                                      "slice left out, served by vLLM beside the untrained draft and the target's "
                                      "own MTP head, on that slice (job/worth/)", parents=run_dir)
    w.add_argument("run", help="the run directory (local or s3://), its stage 2 done")
    _training_flags(w)
    w.add_argument("--holdout", type=float, default=0.1,
                   help="the fraction of samples (by a hash of the id) left out of training and served on "
                        "(default %(default)s)")
    w.add_argument("--rows", type=int, default=32, help="held-out prompts served (default %(default)s)")
    w.add_argument("--k", type=int, help="draft length served (default: the draft's own, 3 for EAGLE-3)")
    w.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default %(default)s)")
    w.add_argument("--config", help="the run config (default: the run's own, from its run.json); its engine_kwargs "
                                    "serve the target")


def _training_flags(p: argparse.ArgumentParser) -> None:
    """What `train` and `train-online` share (job/train/options.py)."""
    from job.train.options import DEFAULT_OBJECT_STORE_BYTES  # per command: --help stays fast

    p.add_argument("--format", default="eagle3", choices=("eagle3", "dflash"), help="default %(default)s")
    p.add_argument("--name", help="the draft's name: RUN/drafts/NAME/ (default: the format); rerun the same name to "
                                  "resume")
    p.add_argument("--model", help="the target model's directory here (default: the path the run recorded)")
    p.add_argument("--limit", type=int, help="--stream: train on the first N completion rows only")
    p.add_argument("--to", default="speculators", choices=("speculators",), help="the trainer (default %(default)s)")
    p.add_argument("--layers", type=int, nargs="+", help="aux layers in our ids (default: the trainer's own)")
    p.add_argument("--checkpoints", help="where Ray Train keeps checkpoints (default RUN/drafts/NAME/checkpoints)")
    p.add_argument("--num-workers", type=int, default=1, help="training workers (default %(default)s)")
    p.add_argument("--gpus-per-worker", type=float, default=0.0,
                   help="GPUs each training worker holds (default %(default)s: CPU training); with --stream on one "
                        "GPU, a fraction shares it with the extractor (hidden_states.gpus_per_worker)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0,
                   help="CPUs each training worker holds (default %(default)s); leave some to the samples' reader")
    p.add_argument("--object-store-bytes", type=int, default=DEFAULT_OBJECT_STORE_BYTES,
                   help="Ray Data's object store limit for the samples (default 2 GiB)")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="optimizer steps between checkpoints (default %(default)s)")
    p.add_argument("--max-failures", type=int, default=1,
                   help="worker-group restarts from the last checkpoint (default %(default)s; -1: forever)")
    p.add_argument("--epochs", type=int, default=1, help="default %(default)s")
    p.add_argument("--steps", type=int, dest="max_steps",
                   help="stop after this many optimizer steps (default: every epoch whole): a short draft on a large "
                        "run; the samples trained are recorded, a rerun trains no more")
    p.add_argument("--lr", type=float, help="learning rate (default: speculators')")
    p.add_argument("--draft-vocab", type=int,
                   help="the draft predicts the N ids the run's completions use most (default: speculators' 32000, "
                        "or the target's whole vocabulary where it is smaller)")
    p.add_argument("--speculative-tokens", type=int, help="the served draft's draft length (default 3 for EAGLE-3)")
    p.add_argument("--take-lock", action="store_true", help="take over another job's writer lock of this draft")


def _add_read_side(sub, run_dir: list) -> None:
    """report, status and plan: they read a run (or nothing) and write nothing."""
    from job.runview import plan, status  # per command: --help stays fast

    r = sub.add_parser("report", help="quality and length report of a run (finished or still running)",
                       parents=run_dir)
    r.add_argument("run", help="run directory (local or s3://)")

    s = sub.add_parser("status", help="progress of a run from its run directory alone (job/runview/status.py)",
                       parents=run_dir, description=status.__doc__.split("\n\n")[0])
    s.add_argument("run", help="run directory (local path or s3:// URI)")
    s.add_argument("--window-min", type=float, default=30.0,
                   help="the 'recent' rate is measured over this many minutes (default %(default)s)")
    s.add_argument("--names-only", action="store_true",
                   help="count rows from shard names only, do not open shards (no tokens, no quality rates)")
    s.add_argument("--json", action="store_true", help="print the status as JSON")

    pl = sub.add_parser("plan", help="time, cost and storage before renting GPUs (job/runview/plan.py)",
                        parents=run_dir,
                        description=plan.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="example: python -m job plan --config configs/qwen3.6-27b.yaml --prompts 914000 "
                               "--tokens-per-prompt 2500 --gpus 8 --tokens-per-s-per-gpu 2000 "
                               "--usd-per-gpu-hour 3.81\n"
                               "the arithmetic and the benchmark file format: job/runview/plan.py")
    pl.add_argument("--prompts", type=int, help="prompts to complete (default with --from: the run's total rows)")
    pl.add_argument("--tokens-per-prompt", type=float, help="mean output tokens per prompt (reasoning + answer)")
    pl.add_argument("--gpus", type=int, help="GPUs generating (one engine per GPU, or per TP group)")
    pl.add_argument("--tokens-per-s-per-gpu", type=float, help="output tokens/s one GPU sustains at full batch")
    pl.add_argument("--usd-per-gpu-hour", type=float, help="price of one GPU-hour (node price / GPUs per node)")
    pl.add_argument("--prompt-tokens-per-prompt", type=float, help="mean prompt tokens (storage only; default 0)")
    pl.add_argument("--config", metavar="C.yaml",
                    help="the run config the run will use: the stored layers and their dtype "
                         "(hidden_states.layer_ids, .dtype), tensor_parallel_size, rows per shard and max_tokens "
                         "from it, the model's shape from its config.json (default: the --from run's own config)")
    pl.add_argument("--model", metavar="DIR",
                    help="a directory with the model's config.json, when the config's model path is not on this "
                         "machine (without one: Qwen3.6-27B's shape, and the plan says so)")
    pl.add_argument("--hidden-bytes-per-token", type=float,
                    help="stage-2 bytes per token, overriding the layers' (layers × hidden size × 2 + 5; default: "
                         "from --config or --from, else "
                         f"{plan.DEFAULT_HIDDEN_BYTES_PER_TOKEN:,} = Qwen3.6-27B's 7 layers × 5,120 × bf16 + 5)")
    pl.add_argument("--completion-bytes-per-token", type=float,
                    help=f"completion shard bytes per output token (default {plan.DEFAULT_COMPLETION_BYTES_PER_TOKEN})")
    pl.add_argument("--usd-per-gb-month", type=float, default=plan.DEFAULT_USD_PER_GB_MONTH,
                    help="object storage price, for the monthly hidden-state line (default %(default)s)")
    pl.add_argument("--stage2-tokens-per-s-per-gpu", type=float, default=plan.DEFAULT_STAGE2_TOKENS_PER_S_PER_GPU,
                    help="stage-2 tokens/s per GPU, prompt + completion (default %(default)s: one H200, the 27B "
                         "hybrid shape, docs/BENCHMARKS.md)")
    pl.add_argument("--train-tokens-per-s-per-gpu", type=float, default=plan.DEFAULT_TRAIN_TOKENS_PER_S_PER_GPU,
                    help="what `python -m job train` trains per second per GPU, prompt + completion tokens (default "
                         "%(default)s: one H100, EAGLE-3 on the 27B shape, docs/BENCHMARKS.md)")
    pl.add_argument("--epochs", type=int, default=1,
                    help="training epochs over the data: streaming extracts once per epoch (default %(default)s)")
    pl.add_argument("--export-gb-per-s-per-node", type=float, default=plan.DEFAULT_EXPORT_GB_PER_S_PER_NODE,
                    help="what an export reads and writes per second per node, for its line (default %(default)s, "
                         "assumed: measure yours with bench/bench_export.py)")
    pl.add_argument("--months-stored", type=float, default=1.0,
                    help="months stored hidden states are kept, for the three ways' totals (default %(default)s)")
    pl.add_argument("--from", dest="from_run", metavar="RUN_URI",
                    help="take tokens per prompt, tokens/s per GPU and bytes per token from a run (finished or "
                         "running)")
    pl.add_argument("--from-gpus", type=int, help="GPUs the --from run used, when its run.json does not record it")
    pl.add_argument("--from-bench", metavar="FILE",
                    help="take tokens/s per GPU from a benchmark result JSON (e.g. bench/results/*.json; the format "
                         "is in job/runview/plan.py); it wins over --from's rate")
    pl.add_argument("--json", action="store_true", help="print the estimate as JSON")


def _add_builtin(sub) -> None:
    """What the project builds to run without downloads: the tiny models and the demo."""
    t = sub.add_parser("tiny-model", help="build one of the project's tiny models (dense Qwen3, or hybrid Qwen3.5)")
    t.add_argument("--output", required=True, help="model directory to write")
    t.add_argument("--architecture", choices=("dense", "hybrid"), default="dense",
                   help="dense: Qwen3-style; hybrid: the target's Qwen3.5/3.6 architecture (Gated DeltaNet, MTP)")
    t.add_argument("--train-steps", type=int, help="optimizer steps (default: the recipe's, 400 dense, 200 hybrid)")
    t.add_argument("--seed", type=int, default=0)

    d = sub.add_parser("demo", help="both stages end to end on the embedded demo (what `make demo` runs)")
    d.add_argument("--output", default="demo-run")


def _config(args) -> RunConfig:
    overrides = {"output": args.output, "model": args.model, "limit": args.limit,
                 "storage.endpoint_url": args.endpoint_url, "storage.region": args.region}
    if getattr(args, "input", None):
        overrides["input"] = args.input
    if getattr(args, "chat_template", None):
        overrides["generate.chat_template"] = args.chat_template
    return load_config(args.config, **overrides)


TRAINERS_PYTHON = Path(__file__).resolve().parent.parent / ".venv-trainers" / "bin" / "python"


def _read_json_file(path: str, flag: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {path}: {e}") from None


def _train_check(args) -> int:
    """The check runs in the trainers' environment (their pins do not fit the job's): a child process."""

    if not os.path.exists(args.python):
        raise ConfigError(f"train-check: {args.python} does not exist: run `make trainers` first (it builds "
                          ".venv-trainers with SpecForge and speculators, ~1 min)")
    from job.export.local_copy import local_copies  # per command: --help stays fast

    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with local_copies(args.exports, _storage(args)) as exports:
        return subprocess.run([args.python, "-m", "job.trainers", *exports, "--steps", str(args.steps),
                               *(["--json"] if args.json else [])], env=env).returncode


def _worth(args) -> int:
    from job.train.run import run_config_of  # per command: --help stays fast
    from job.worth import WorthOptions, run_worth  # per command: --help stays fast

    train = _train_options(args, stream=False, name=args.name or f"worth-{args.format}")
    options = WorthOptions(format=args.format, holdout=args.holdout, rows=args.rows, k=args.k,
                           max_tokens=args.max_tokens, train=train)
    config = run_config_of(args.run, _storage(args), args.config, model=args.model)
    run_worth(config, options, take_lock=args.take_lock)
    return 0


def _train(args, stream: bool) -> int:
    from job.train.run import run_config_of, run_train  # per command: --help stays fast

    options = _train_options(args, stream)
    run = args.run if args.command == "train" else args.output
    config = run_config_of(run, _storage(args), args.config, model=args.model, limit=args.limit)
    run_train(config, options, take_lock=args.take_lock)
    return 0


def _train_options(args, stream: bool, **over):
    from job.train import TrainOptions  # per command: --help stays fast

    given = dict(format=args.format, name=args.name, stream=stream, to=args.to, layers=args.layers,
                 num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker,
                 gpus_per_worker=args.gpus_per_worker, object_store_bytes=args.object_store_bytes,
                 checkpoint_every=args.checkpoint_every, max_failures=args.max_failures, epochs=args.epochs,
                 max_steps=args.max_steps, draft_vocab=args.draft_vocab,
                 lr=args.lr, speculative_tokens=args.speculative_tokens, checkpoints=args.checkpoints,
                 holdout=getattr(args, "holdout", None))
    return TrainOptions(**{**given, **over})


def main(argv: list[str] | None = None) -> int:
    from job import redaction  # per command: --help stays fast

    redaction.install()  # everything this process prints or logs from here on passes job/redaction.py
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    from job.errors import JobError, Verdict  # per command: --help stays fast

    try:
        return _dispatch(args)
    except JobError as e:  # any stage, any actor: one form (job/errors.py); a verdict after a blank line
        print(f"{chr(10) if isinstance(e, Verdict) else ''}error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


def _dispatch(args) -> int:
    if getattr(args, "force", False):
        raise ConfigError("--force was split in two: --allow-drift (resume although settings changed) and "
                          "--take-lock (take over a dead job's writer lock); changed input is never resumed")
    if args.command == "generate":
        from job.generate import print_summary, run_generate  # per command: --help stays fast

        config = _config(args)
        summary = run_generate(config, allow_drift=args.allow_drift, take_lock=args.take_lock,
                               canary=not args.no_canary)
        print_summary(config, summary)
        return 0
    if args.command == "hidden-states":
        from job.hidden_states import run_hidden_states  # per command: --help stays fast

        config = _config(args)
        if args.check:
            from job.hidden_states import check_run  # per command: --help stays fast

            result = check_run(config, args.check_samples)
            print(f"exactness check passed: {result['num_samples']} stored samples differ from a plain transformers "
                  f"forward by at most {result['max_difference']:.2e} (tolerance {result['tolerance']:.0e}); "
                  "by layer: " + ", ".join(f"{k}: {v:.1e}" for k, v in result["max_difference_by_layer"].items()))
            return 0
        run_hidden_states(config, allow_drift=args.allow_drift, take_lock=args.take_lock)
        return 0
    if args.command == "export":
        from job.export import export  # per command: --help stays fast

        draft_config = _read_json_file(args.draft_config, "--draft-config") if args.draft_config else None
        summary = export(args.run, to=args.to, format=args.format, output=args.output, layers=args.layers,
                         draft_vocab_size=args.draft_vocab_size, target_vocab_size=args.target_vocab_size,
                         loss_turns=args.loss_turns, draft_config=draft_config, model=args.model,
                         storage_config=_storage(args), limit=args.limit, sample=args.sample, workers=args.workers,
                         take_lock=args.take_lock)
        reasons = "; ".join(f"{n} {r}" for r, n in summary["dropped_by_reason"].items())
        print(f"export: {summary['num_samples']:,} samples → {args.output} ({args.to} {args.format}); "
              f"dropped {summary['num_dropped']:,}" + (f": {reasons}" if reasons else "") +
              f"; details in {args.output.rstrip('/')}/export.json")
        return 0
    if args.command == "train-check":
        return _train_check(args)
    if args.command == "worth":
        return _worth(args)
    if args.command in ("train", "train-online"):
        return _train(args, stream=args.command == "train-online" or args.stream)
    if args.command == "report":
        from job.generate.report import build_report, format_report  # per command: --help stays fast

        print(format_report(build_report(args.run, _storage(args))))
        return 0
    if args.command == "status":
        from job.runview.status import build_status, format_status  # per command: --help stays fast

        st = build_status(args.run, _storage(args), window_s=args.window_min * 60, read_columns=not args.names_only)
        print(json.dumps(st, indent=2) if args.json else format_status(st))
        return 0
    if args.command == "plan":
        from job.runview.plan import format_plan  # per command: --help stays fast
        from job.runview.plan_inputs import plan_from_flags  # per command: --help stays fast

        estimate, measured = plan_from_flags(args, _storage(args))
        print(json.dumps({**estimate, "measured": measured}, indent=2, default=str) if args.json
              else format_plan(estimate, measured))
        return 0
    if args.command == "tiny-model":
        from job.builtin.tiny_model import build_tiny_model  # per command: --help stays fast

        print(build_tiny_model(args.output, architecture=args.architecture, train_steps=args.train_steps,
                               seed=args.seed))
        return 0
    if args.command == "demo":
        from job.builtin.demo import run_demo  # per command: --help stays fast

        return run_demo(args.output)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
