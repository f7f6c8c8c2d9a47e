"""Time, cost and storage of a run before renting any GPU.

    python -m job plan --prompts 914000 --tokens-per-prompt 2500 --gpus 7 \
        --tokens-per-s-per-gpu 2000 --usd-per-gpu-hour 3.81
    # → ~45.3 h, ~$1,209, $0.53 per million output tokens, ~11 GB of completions, ~164 TB of hidden states (every trainer's layers)

    # measure first (a canary-sized run on the real cluster), then plan the full run from it:
    python -m job plan --from s3://my-bucket/runs/canary --prompts 914000 --gpus 8 --usd-per-gpu-hour 3.81

    # or take tokens/s per GPU from a benchmark result (bench/results/*.json):
    python -m job plan --from-bench bench/results/h200_stage1_27b.json --prompts 914000 --tokens-per-prompt 2500 \
        --gpus 8 --usd-per-gpu-hour 3.81

The arithmetic, all of it:
    output tokens      = prompts × tokens per prompt
    hours              = output tokens / (GPUs × tokens/s per GPU) / 3600
    cost               = hours × GPUs × $ per GPU-hour
    $ per M tokens     = $ per GPU-hour / (tokens/s per GPU × 3600) × 1e6      (independent of the GPU count)
    completions        = output tokens × completion bytes per token (+ prompt tokens × 4 B of prompt ids),
                         or prompts × measured shard bytes per row with --from
    hidden states      = (prompt + output tokens) × hidden bytes per token (layers × hidden size × 2 B for bf16)

Three ways to get the hidden states to the trainer (issue 32), each with its GPU-hours, bytes and money:
    stage 2 GPU-hours  = (prompt + output tokens) / stage-2 tokens/s per GPU / 3600
    stored bf16        = stage 2 once + hidden states × $ per GB-month × months kept
    stored FP8         = stage 2 once + (hidden bytes / 2 + 4 B of scale per token and layer) × $ × months
    streamed           = stage 2 once per training epoch beside the trainer, nothing stored

`--from RUN` replaces the guesses with what a run measured: output tokens per prompt (mean over its shards,
error rows included since they happen in the full run too), prompt tokens per prompt, shard bytes per row,
and tokens/s per GPU: `generate.output_tokens_per_s` of run.json (written when the job completes) over its GPUs
(`generate.num_engines` × tensor_parallel_size, or --from-gpus), else the rate of the shard timestamps (see
job/runview/status.py).

`--from-bench FILE` takes tokens/s per GPU from a benchmark result, a JSON object with one of
    "tokens_per_s_per_gpu": 3562                   the figure itself (what bench/results/*.json hold), or
    "tok_per_s_window": 3562                       a bench/bench_generate.py result line (`RESULT {...}`), or
    "output_tokens": N, "generation_s": S          the same, from its two raw fields;
the last two are divided by "num_gpus" (default 1: bench_generate.py drives one GPU). Anything else in the
object ("gpu", "what", "date", ...) is shown beside the figure. A benchmark's tokens per prompt are its
max_tokens, not the data's, so only its rate is used. It wins over --from's rate; flags given explicitly always
win over measured values. The format is checked by tests/test_plan.py on bench/results/h200_stage1_27b.json.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from job import scan
from job.config import ConfigError
from job.formatting import format_bytes
from job.schema import FP8_SCALE_BYTES
from job.runview.status import measure_rate, scan_completions
from job.storage import StorageConfig


# Qwen3.6-27B with the default layer set, every trainer's layers (job/drafters.py): [1, 16, 31, 46, 60, 61, 63],
# 7 layers × hidden 5120 × 2 bytes (bf16). DFlash's own 5 layers alone would be 51,200 B per token.
QWEN36_27B_HIDDEN_SIZE = 5120
DEFAULT_HIDDEN_BYTES_PER_TOKEN = 7 * QWEN36_27B_HIDDEN_SIZE * 2
DFLASH_ONLY_BYTES_PER_TOKEN = 5 * QWEN36_27B_HIDDEN_SIZE * 2
# A completion shard stores each output token as an int32 id (4 B) and as text (~4 B of UTF-8 per token for
# English), zstd-compressed to roughly 5 B together; `--from` measures the real figure from shard sizes.
DEFAULT_COMPLETION_BYTES_PER_TOKEN = 5.0
PROMPT_ID_BYTES = 4  # prompt_token_ids: int32 per prompt token
# S3 Standard, first 50 TB/month, us-east-1 (check your region's price): only used for the monthly storage line.
DEFAULT_USD_PER_GB_MONTH = 0.023
# Stage 2 on one H200, Qwen3.6-27B hybrid shape, transformers backend with varlen GDN kernels and the fused
# elementwise kernels (`fuse: auto` = compile; docs/BENCHMARKS.md, issue 35): prompt + completion tokens per second
# per GPU. 10,136 before the fusion.
DEFAULT_STAGE2_TOKENS_PER_S_PER_GPU = 12_318


class PlanError(ConfigError):
    """Missing or impossible inputs; the message names the flag to pass."""


@dataclass(kw_only=True)
class PlanInputs:
    num_prompts: int
    output_tokens_per_prompt: float
    num_gpus: int
    output_tokens_per_s_per_gpu: float
    usd_per_gpu_hour: float
    prompt_tokens_per_prompt: float = 0.0
    hidden_bytes_per_token: float = DEFAULT_HIDDEN_BYTES_PER_TOKEN
    completion_bytes_per_token: float = DEFAULT_COMPLETION_BYTES_PER_TOKEN
    completion_bytes_per_prompt: float | None = None
    """Measured shard bytes per row (`--from`): replaces the per-token estimate, prompts and carried columns
    included."""
    usd_per_gb_month: float = DEFAULT_USD_PER_GB_MONTH
    stage2_tokens_per_s_per_gpu: float = DEFAULT_STAGE2_TOKENS_PER_S_PER_GPU
    epochs: int = 1
    """Training epochs over the data: a streamed run extracts once per epoch."""
    months_stored: float = 1.0
    """How long stored hidden states are kept (the training and its reruns)."""

    def __post_init__(self):
        for name in ("num_prompts", "output_tokens_per_prompt", "num_gpus", "output_tokens_per_s_per_gpu",
                     "stage2_tokens_per_s_per_gpu", "epochs"):
            if not getattr(self, name) > 0:
                raise PlanError(f"plan: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("usd_per_gpu_hour", "prompt_tokens_per_prompt", "hidden_bytes_per_token",
                     "completion_bytes_per_token", "usd_per_gb_month", "months_stored"):
            if getattr(self, name) < 0:
                raise PlanError(f"plan: {name} must be >= 0, got {getattr(self, name)!r}")


def estimate(p: PlanInputs) -> dict:
    output_tokens = p.num_prompts * p.output_tokens_per_prompt
    prompt_tokens = p.num_prompts * p.prompt_tokens_per_prompt
    tokens_per_s = p.num_gpus * p.output_tokens_per_s_per_gpu
    hours = output_tokens / tokens_per_s / 3600
    gpu_hours = hours * p.num_gpus
    cost = gpu_hours * p.usd_per_gpu_hour
    if p.completion_bytes_per_prompt is not None:
        completion_bytes = p.num_prompts * p.completion_bytes_per_prompt
    else:
        completion_bytes = output_tokens * p.completion_bytes_per_token + prompt_tokens * PROMPT_ID_BYTES
    hidden_bytes = (output_tokens + prompt_tokens) * p.hidden_bytes_per_token
    every_trainer = p.hidden_bytes_per_token == DEFAULT_HIDDEN_BYTES_PER_TOKEN
    return {
        # What serving every trainer from one run costs over DFlash's layers alone (the default layer set only).
        "every_trainer_extra_bytes": (output_tokens + prompt_tokens) *
        (DEFAULT_HIDDEN_BYTES_PER_TOKEN - DFLASH_ONLY_BYTES_PER_TOKEN) if every_trainer else None,
        "inputs": asdict(p),
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "cluster_output_tokens_per_s": tokens_per_s,
        "hours": hours,
        "gpu_hours": gpu_hours,
        "cost_usd": cost,
        "usd_per_million_output_tokens": cost / output_tokens * 1e6,
        "completion_bytes": completion_bytes,
        "hidden_state_bytes": hidden_bytes,
        "hidden_state_usd_per_month": hidden_bytes / 1e9 * p.usd_per_gb_month,
        "hidden_state_ways": hidden_state_ways(p, output_tokens + prompt_tokens),
    }


def hidden_state_ways(p: PlanInputs, tokens: float) -> dict:
    """Stored bf16, stored FP8, streamed: stage-2 GPU-hours, bytes and dollars of each (module docstring). FP8's
    bytes assume hidden size 5,120 for the scales (Qwen3.6-27B; 0.08 % of the bytes)."""
    stage2_gpu_hours = tokens / p.stage2_tokens_per_s_per_gpu / 3600
    layers = p.hidden_bytes_per_token / (2 * QWEN36_27B_HIDDEN_SIZE)
    fp8_per_token = p.hidden_bytes_per_token / 2 + FP8_SCALE_BYTES * layers

    def way(gpu_hours: float, stored_bytes: float) -> dict:
        compute, storage = gpu_hours * p.usd_per_gpu_hour, stored_bytes / 1e9 * p.usd_per_gb_month * p.months_stored
        return {"stage2_gpu_hours": gpu_hours, "bytes": stored_bytes, "compute_usd": compute, "storage_usd": storage,
                "total_usd": compute + storage}

    return {"stored_bf16": way(stage2_gpu_hours, tokens * p.hidden_bytes_per_token),
            "stored_fp8": {**way(stage2_gpu_hours, tokens * fp8_per_token), "bytes_per_token": fp8_per_token},
            "streamed": way(stage2_gpu_hours * p.epochs, 0.0)}


def format_plan(e: dict, measured: dict | None = None) -> str:
    p = e["inputs"]
    lines = []
    for m in (measured, (measured or {}).get("bench")):  # --from's run, --from-bench's file
        if m and m.get("notes"):
            lines.append(f"{m['source']}: " + ", ".join(m["notes"]))
    lines += [
        f"work     {p['num_prompts']:,} prompts × {p['output_tokens_per_prompt']:,.0f} output tokens = "
        f"{e['output_tokens'] / 1e9:,.3f}B output tokens",
        f"speed    {p['num_gpus']} GPUs × {p['output_tokens_per_s_per_gpu']:,.0f} tok/s per GPU = "
        f"{e['cluster_output_tokens_per_s']:,.0f} tok/s",
        f"time     {e['hours']:,.1f} hours ({e['hours'] / 24:,.1f} days), {e['gpu_hours']:,.0f} GPU-hours",
        f"cost     ${e['cost_usd']:,.0f} at ${p['usd_per_gpu_hour']:,.2f} per GPU-hour "
        f"(${e['usd_per_million_output_tokens']:,.3f} per million output tokens)",
        f"storage  completions {format_bytes(e['completion_bytes'])} ("
        + (f"{p['completion_bytes_per_prompt'] / 1e3:,.1f} KB per prompt, measured"
           if p["completion_bytes_per_prompt"] is not None else
           f"~{p['completion_bytes_per_token']:.1f} B per output token"
           + (f" + {PROMPT_ID_BYTES} B per prompt token" if p["prompt_tokens_per_prompt"] else ""))
        + ")",
        f"         hidden states {format_bytes(e['hidden_state_bytes'])} "
        f"({p['hidden_bytes_per_token']:,.0f} B per token over "
        + ("prompt + completion" if p["prompt_tokens_per_prompt"] else "the completion only; add "
           "--prompt-tokens-per-prompt to include the prompt")
        + f"), ~${e['hidden_state_usd_per_month']:,.0f}/month at ${p['usd_per_gb_month']}/GB-month "
        "if stored rather than streamed",
    ]
    if e.get("every_trainer_extra_bytes"):
        extra = e["every_trainer_extra_bytes"]
        lines.append(
            f"         of which {format_bytes(extra)} (~${extra / 1e9 * p['usd_per_gb_month']:,.0f}/month) are the "
            f"layers that serve EAGLE-3 too (60 and the last, 63: "
            f"+{DEFAULT_HIDDEN_BYTES_PER_TOKEN - DFLASH_ONLY_BYTES_PER_TOKEN:,} B per token over DFlash's 5 layers, "
            f"{DFLASH_ONLY_BYTES_PER_TOKEN:,} B): one stage-2 run exports to every trainer")
    ways = e["hidden_state_ways"]
    months = f"{p['months_stored']:g} month{'s' * (p['months_stored'] != 1)}"
    lines += [
        f"feeding  the trainer its hidden states, three ways (stage 2 at {p['stage2_tokens_per_s_per_gpu']:,.0f} "
        f"tok/s per GPU, ${p['usd_per_gpu_hour']:,.2f} per GPU-hour; stored for {months}; "
        f"{p['epochs']} epoch{'s' * (p['epochs'] != 1)}):",
    ]
    for key, label, what in (
            ("stored_bf16", "stored bf16", "stage 2 once"),
            ("stored_fp8", "stored FP8 ", "stage 2 once"),
            ("streamed", "streamed   ", "stage 2 every epoch beside the trainer, nothing stored")):
        w = ways[key]
        stored = f"{format_bytes(w['bytes'])}" if w["bytes"] else "0 B"
        lines.append(f"         {label} {stored:>9}  {what}: {w['stage2_gpu_hours']:,.0f} GPU-hours "
                     f"({w['stage2_gpu_hours'] / p['num_gpus']:,.1f} h on {p['num_gpus']} GPUs) ${w['compute_usd']:,.0f}"
                     + (f" + storage ${w['storage_usd']:,.0f}" if w["bytes"] else "")
                     + f" = ${w['total_usd']:,.0f}")
    lines += [
        "         (FP8: float8 e4m3 + a float32 scale per token and layer, ~2.6 % relative L2 per layer; streaming "
        "pays stage 2 per epoch and needs the extracting GPUs up while training)",
        "         (not included: engine start-up, ~5-15 min per (re)start; the canary; idle head node)",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Measuring a run
# ---------------------------------------------------------------------------------------------------------------


def _gpus_of_run(run: dict) -> int | None:
    """GPUs a run's engines held, as far as run.json says: `generate.num_engines` (written when the job completes;
    else the config's `generate.num_engines`) × tensor_parallel_size. A CPU run's engine counts as one "GPU" here,
    which is what a CPU-sized rehearsal of the arithmetic wants."""
    cfg = run.get("config", {})
    tp = int(cfg.get("engine_kwargs", {}).get("tensor_parallel_size", 1))
    engines = run.get("generate", {}).get("num_engines") or cfg.get("generate", {}).get("num_engines")
    return int(engines) * tp if engines else None


def measure_run(run_uri: str, storage_config=None, *, num_gpus: int | None = None) -> dict:
    """What a run measured: tokens per prompt, bytes per token, tokens/s per GPU (None if it cannot be known)."""

    storage_config = storage_config or StorageConfig()
    run = scan.require_run(run_uri, storage_config, hint="`plan --from` takes the --output of a `generate` run")
    shards = scan_completions(run_uri, storage_config)
    rows = sum(s.num_rows for s in shards)
    if rows == 0:
        raise PlanError(f"--from {run_uri}: no completion rows yet; wait for the first shards (`python -m job status "
                        f"{run_uri}`)")
    out_tokens = sum(s.num_output_tokens for s in shards)
    prompt_tokens = sum(s.num_prompt_tokens for s in shards)
    measured = {
        "run": run_uri,
        "source": f"measured on {run_uri}",
        "rows": rows,
        "rows_total": run.get("generate", {}).get("input", {}).get("num_rows"),
        "output_tokens_per_prompt": out_tokens / rows,
        "prompt_tokens_per_prompt": prompt_tokens / rows,
        "completion_bytes_per_prompt": sum(s.size for s in shards) / rows,
        "output_tokens_per_s_per_gpu": None,
        "num_gpus": num_gpus or _gpus_of_run(run),
    }
    notes = [f"{rows:,} rows", f"{measured['output_tokens_per_prompt']:,.0f} output tokens per prompt"]

    recorded = run.get("generate", {}).get("output_tokens_per_s")
    cluster_tps, source = (float(recorded), "recorded by the job") if recorded else (None, "")
    if cluster_tps is None:
        rate = measure_rate(shards)
        if rate:
            cluster_tps, source = rate.output_tokens_per_s, f"from shard timestamps over {rate.seconds / 60:,.0f} min"
    if cluster_tps is not None and measured["num_gpus"]:
        measured["output_tokens_per_s_per_gpu"] = cluster_tps / measured["num_gpus"]
        notes.append(f"{measured['output_tokens_per_s_per_gpu']:,.0f} tok/s per GPU ({cluster_tps:,.0f} tok/s on "
                     f"{measured['num_gpus']} GPUs, {source})")
    elif cluster_tps is not None:
        measured["cluster_output_tokens_per_s"] = cluster_tps
    measured["notes"] = notes
    return measured


def read_bench(path: str) -> dict:
    """Tokens/s per GPU from a benchmark result file (the format is in this module's docstring)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PlanError(f"--from-bench {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"--from-bench {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise PlanError(f"--from-bench {path}: expected a JSON object, got {type(data).__name__}")
    gpus = data.get("num_gpus") or 1
    if data.get("tokens_per_s_per_gpu"):
        tps = float(data["tokens_per_s_per_gpu"])
    elif data.get("tok_per_s_window"):
        tps = float(data["tok_per_s_window"]) / gpus
    elif data.get("output_tokens") and data.get("generation_s"):
        tps = float(data["output_tokens"]) / float(data["generation_s"]) / gpus
    else:
        raise PlanError(f"--from-bench {path}: has none of tokens_per_s_per_gpu, tok_per_s_window, or "
                        "output_tokens with generation_s (see job/runview/plan.py)")
    notes = [f"{tps:,.0f} tok/s per GPU"] + [f"{data[k]}" for k in ("gpu", "what", "date") if data.get(k)]
    return {"bench": path, "source": f"benchmark {path}", "output_tokens_per_s_per_gpu": tps, "notes": notes}


def plan_from_flags(args, storage_config=None) -> tuple[dict, dict | None]:
    """`python -m job plan`'s flags (job/cli.py) → (estimate, what was measured or None). Raises PlanError naming
    the flag to pass when an input is missing."""
    run = measure_run(args.from_run, storage_config, num_gpus=args.from_gpus) if args.from_run else None
    bench = read_bench(args.from_bench) if args.from_bench else None
    m = {**(run or {}), **({"output_tokens_per_s_per_gpu": bench["output_tokens_per_s_per_gpu"]} if bench else {})}

    def pick(flag_value, measured_key, flag, default=None):
        if flag_value is not None:
            return flag_value
        if m.get(measured_key) is not None:
            return m[measured_key]
        if default is not None:
            return default
        hint = ""
        if run and run["num_gpus"] is None and measured_key in ("num_gpus", "output_tokens_per_s_per_gpu"):
            hint = (f" ({run['run']} does not record how many GPUs it ran on: pass --from-gpus G with "
                    "that number, and --gpus for the planned run)")
        raise PlanError(f"plan: pass {flag}{hint}")

    inputs = PlanInputs(
        num_prompts=pick(args.prompts, "rows_total", "--prompts N"),
        output_tokens_per_prompt=pick(args.tokens_per_prompt, "output_tokens_per_prompt", "--tokens-per-prompt T"),
        num_gpus=pick(args.gpus, "num_gpus", "--gpus G"),
        output_tokens_per_s_per_gpu=pick(args.tokens_per_s_per_gpu, "output_tokens_per_s_per_gpu",
                                         "--tokens-per-s-per-gpu R"),
        usd_per_gpu_hour=pick(args.usd_per_gpu_hour, "-", "--usd-per-gpu-hour P"),
        prompt_tokens_per_prompt=pick(args.prompt_tokens_per_prompt, "prompt_tokens_per_prompt", "", 0.0),
        hidden_bytes_per_token=pick(args.hidden_bytes_per_token, "-", "", DEFAULT_HIDDEN_BYTES_PER_TOKEN),
        completion_bytes_per_token=pick(args.completion_bytes_per_token, "-", "", DEFAULT_COMPLETION_BYTES_PER_TOKEN),
        # Measured bytes per prompt, while tokens per prompt is the measured one too.
        completion_bytes_per_prompt=None if args.completion_bytes_per_token is not None
        or args.tokens_per_prompt is not None else m.get("completion_bytes_per_prompt"),
        usd_per_gb_month=args.usd_per_gb_month,
        stage2_tokens_per_s_per_gpu=args.stage2_tokens_per_s_per_gpu, epochs=args.epochs,
        months_stored=args.months_stored,
    )
    measured = {**(run or {}), "bench": bench} if run or bench else None
    return estimate(inputs), measured
