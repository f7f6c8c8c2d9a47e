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

Training the draft (`python -m job train`, speculators' EAGLE-3 or DFlash):
    training GPU-hours = (prompt + output tokens) × epochs / training tokens/s per GPU / 3600

Three ways to get the hidden states to the trainer, each with its GPU-hours, bytes and money:
    stage 2 GPU-hours  = (prompt + output tokens) / stage-2 tokens/s per GPU / 3600
    stored bf16        = stage 2 once + hidden states × $ per GB-month × months kept
    stored FP8         = stage 2 once + (hidden bytes / 2 + 4 B of scale per token and layer) × $ × months
    streamed           = stage 2 once per training epoch beside the trainer, nothing stored

`--from RUN` and `--from-bench FILE` (what a run or a benchmark measured instead of the guesses):
job/runview/plan_inputs.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from job import schema
from job.config import ConfigError
from job.drafters import dflash_layers, every_trainer_layers
from job.formatting import format_bytes

# S3 Standard, first 50 TB/month, us-east-1 (check your region's price): only used for the monthly storage line.
DEFAULT_USD_PER_GB_MONTH = 0.023
# S3 Standard requests, us-east-1 / us-west-2, per 1,000 (for the requests line): PUT, COPY, POST, LIST; GET, HEAD.
USD_PER_1000_PUTS = 0.005
USD_PER_1000_GETS = 0.0004
# Requests to write one object, at most: a multipart upload (create, one part, complete: 3 PUT-class) and the HEAD
# that checks it (storage.write_*; counted by bench/s3_counting_server.py). A small object goes as one PutObject.
PUT_CLASS_PER_OBJECT, HEADS_PER_OBJECT = 3, 1
# What an export moves per node per second when nobody measured it (--export-gb-per-s-per-node): 1 GB/s, a node's S3
# bandwidth at best. Measured here (bench/bench_export.py, docs/BENCHMARKS.md): 0.25 GB/s on a 2-core machine's disk.
DEFAULT_EXPORT_GB_PER_S_PER_NODE = 1.0
# A completion shard stores each output token as an int32 id (4 B) and as text (~4 B of UTF-8 per token for
# English), zstd-compressed to roughly 5 B together; `--from` measures the real figure from shard sizes.
DEFAULT_COMPLETION_BYTES_PER_TOKEN = 5.0
PROMPT_ID_BYTES = 4  # prompt_token_ids: int32 per prompt token
# Stage 2 on one H200, Qwen3.6-27B hybrid shape, transformers backend with varlen GDN kernels and the fused
# elementwise kernels (`fuse: auto` = compile; docs/BENCHMARKS.md): prompt + completion tokens per second
# per GPU. 10,136 before the fusion.
DEFAULT_STAGE2_TOKENS_PER_S_PER_GPU = 12_318
# `python -m job train` on one H100, Qwen3.6-27B's shape (bench/bench_train_step.py, docs/BENCHMARKS.md): EAGLE-3 with
# speculators' 32,000-id draft vocabulary, one step of 8,192 tokens (speculators' total_seq_len) in 0.36 s, 26 GB
# of GPU memory at its peak: trained tokens (prompt + completion) per second per GPU. The target's whole vocabulary
# (248,320 ids) takes 0.64 s and 66 GB.
DEFAULT_TRAIN_TOKENS_PER_S_PER_GPU = 22_700
TRAIN_PEAK_GB = 26.0


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
    train_tokens_per_s_per_gpu: float = DEFAULT_TRAIN_TOKENS_PER_S_PER_GPU
    """What `python -m job train` trains per second per GPU (prompt + completion tokens)."""
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
    export_gb_per_s_per_node: float = DEFAULT_EXPORT_GB_PER_S_PER_NODE
    """What `python -m job export` reads (and writes) per second per node, for the export line."""
    """Rows per completion shard and per hidden-state shard (the production config's), for the S3 requests line."""

    def __post_init__(self):
        if self.hidden_bytes_per_token is None:
            self.hidden_bytes_per_token = self.layout.bytes_per_token
        for name in ("num_prompts", "output_tokens_per_prompt", "num_gpus", "output_tokens_per_s_per_gpu",
                     "stage2_tokens_per_s_per_gpu", "train_tokens_per_s_per_gpu", "epochs", "gpus_per_engine",
                     "rows_per_shard", "hidden_rows_per_shard"):
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
    # The objects a run writes: its completion shards, stage 2's parts, and one stage-2 marker per completion shard.
    completion_shards = -(-p.num_prompts // p.rows_per_shard)
    stage2_parts = -(-p.num_prompts // p.hidden_rows_per_shard)
    objects = completion_shards + stage2_parts + completion_shards
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
        # The draft trains on every token of every sample, each epoch.
        "train_gpu_hours": (output_tokens + prompt_tokens) * p.epochs / p.train_tokens_per_s_per_gpu / 3600,
        "completion_shards": completion_shards,
        "stage2_parts": stage2_parts,
        "objects_written": objects,
        "write_requests": objects * (PUT_CLASS_PER_OBJECT + HEADS_PER_OBJECT),
        "write_requests_usd": objects * (PUT_CLASS_PER_OBJECT * USD_PER_1000_PUTS
                                         + HEADS_PER_OBJECT * USD_PER_1000_GETS) / 1000,
        # An export reads the stored bytes and writes the trainer's layers of them again: twice the bytes move.
        "export_hours_per_node": 2 * hidden_bytes / (p.export_gb_per_s_per_node * 1e9) / 3600,
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


def engine_units(n: float, device: str) -> str:
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
    engines = (f" ({engine_units(n // p['gpus_per_engine'], 'engine')} of tensor_parallel_size {p['gpus_per_engine']})"
               if p["gpus_per_engine"] > 1 else "")
    lines += [
        _layout_line(p),
        f"work     {p['num_prompts']:,} prompts × {p['output_tokens_per_prompt']:,.0f} output tokens = "
        f"{_count(e['output_tokens'])} output tokens",
        f"speed    {engine_units(n, gpu)}{engines} × {p['output_tokens_per_s_per_gpu']:,.0f} tok/s per {gpu} = "
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
    lines += _train_lines(e, p)
    lines += _worth_lines((measured or {}).get("worth") or {})
    export_h = e["export_hours_per_node"]
    idle_units = engine_units(p["num_gpus"], p["device"])
    idle_cost = _usd(export_h * p["num_gpus"] * p["usd_per_gpu_hour"])
    lines += [
        f"export   only for another launcher (`python -m job train` reads the stored parts where they are): reads and "
        f"writes up to {format_bytes(e['hidden_state_bytes'])} per trainer format, {_hours(export_h, short=True)} "
        f"on one node at {p['export_gb_per_s_per_node']:g} GB/s (assumed: a node's S3 bandwidth; "
        f"--export-gb-per-s-per-node, bench/bench_export.py); on the engines' node, its {idle_units} idle, "
        f"{idle_cost}: take it down first and export on cheaper workers",
        f"         (not included: engine start-up, ~5-15 min per (re)start; the canary; an idle head node; S3 "
        f"requests: writing {_count(e['completion_shards'])} completion shards, {_count(e['stage2_parts'])} stage-2 "
        f"parts and their markers takes up to ~{_count(e['write_requests'])} requests, "
        f"{_usd(e['write_requests_usd'])})",
    ]
    return "\n".join(lines)


def _train_lines(e: dict, p: dict) -> list[str]:
    gpu, hours = p["device"], e["train_gpu_hours"]
    rate = p["train_tokens_per_s_per_gpu"]
    measured = rate == DEFAULT_TRAIN_TOKENS_PER_S_PER_GPU
    source = (f"one H100 on the 27B shape, EAGLE-3, 8,192 tokens a step, {TRAIN_PEAK_GB:g} GB at its peak"
              if measured else "as given")
    lines = [f"train    the draft (`python -m job train`, {rate:,.0f} tok/s per {gpu}: {source}; "
             f"{p['epochs']} epoch{'s' * (p['epochs'] != 1)}): {_num(hours)} {gpu}-hours "
             f"({_hours(hours / p['num_gpus'], short=True)} on {engine_units(p['num_gpus'], gpu)}), "
             f"{_usd(hours * p['usd_per_gpu_hour'])}"]
    if gpu != "GPU" and measured:
        lines.append(f"         (training's rate is one H100's, not a {gpu}'s: pass --train-tokens-per-s-per-gpu)")
    return lines


def _worth_lines(worth: dict) -> list[str]:
    """What `python -m job worth` said of the run's data, per format: the verdict, and the decode speed-up it
    measured serving the trained draft (on the hardware it ran on: a CPU's says little of a GPU's)."""
    lines = []
    for _fmt, w in sorted(worth.items()):
        speedup = w.get("drafters", {}).get("trained", {}).get("speedup_sampled")
        lines.append(f"{'worth' if not lines else '':<8} {w['verdict']}"
                     + (f"; decode ×{speedup:.2f} against the target alone where `worth` ran" if speedup else ""))
    return lines


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
                     f"({_hours(w['stage2_gpu_hours'] / p['num_gpus'], short=True)} on "
                     f"{engine_units(p['num_gpus'], gpu)}) "
                     f"{_usd(w['compute_usd'])}"
                     + (f" + storage {_usd(w['storage_usd'])}" if w["bytes"] else "")
                     + f" = {_usd(w['total_usd'])}")
    if gpu != "GPU" and p["stage2_tokens_per_s_per_gpu"] == DEFAULT_STAGE2_TOKENS_PER_S_PER_GPU:
        lines.append(f"         (stage 2's rate is one H200's, not a {gpu}'s: pass --stage2-tokens-per-s-per-gpu)")
    lines.append("         (FP8: float8 e4m3 + a float32 scale per token and layer, ~2.6 % relative L2 per layer; "
                 f"streaming pays stage 2 per epoch and needs the extracting {gpu}s up while training)")
    return lines
