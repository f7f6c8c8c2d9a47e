"""Typed run configuration: nested dataclasses loaded from YAML (configs/*.yaml), then CLI overrides.

vLLM engine arguments (`engine_kwargs`) and sampling parameters (`sampling`) are passed to vLLM untouched, so
every vLLM knob works without this file knowing about it. Sampling defaults come from the model's
generation_config.json; `sampling` in the config overrides them key by key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from job.drafters import EVERY_TRAINER, every_trainer_layers
from job.errors import JobError
from job.schema import FP8
from job.storage import StorageConfig

DEFAULT_CONFIG = "configs/demo.yaml"
"""The config every run command reads unless given --config (relative to the working directory)."""


class ConfigError(JobError, ValueError):
    """A config the user must fix; the CLI prints its message without a traceback."""


# ---------------------------------------------------------------------------------------------------------------
# Every value checked where the config is read: its type, then its range, with one line naming the key
# ---------------------------------------------------------------------------------------------------------------

# The range of every numeric setting: (lowest, highest), None = open. Numeric settings not named here must be >= 0.
# What 0 means is said in each field's docstring (a timeout of 0 = none, canary_rows 0 = no canary, ...).
LIMITS: dict[str, tuple[float | None, float | None]] = {
    "limit": (1, None),
    "quality.repetition_ngram": (1, None),
    "quality.repetition_tail_tokens": (1, None),
    "quality.repetition_min_coverage": (0, 1),
    "quality.canary_max_template_mismatch": (0, 1),
    "quality.canary_max_too_short": (0, 1),
    "quality.canary_max_unclosed_think": (0, 1),
    "quality.canary_max_error": (0, 1),
    "generate.rows_per_shard": (1, None),
    "generate.kv_tokens_per_seq": (1, None),
    "generate.output_tokens_mean": (1, None),
    "generate.output_tokens_p99": (1, None),
    "generate.units_in_flight_per_engine": (1, None),
    "generate.max_rows_in_flight": (1, None),
    "generate.num_engines": (1, None),
    "generate.max_engines": (1, None),
    "hidden_states.max_length": (1, None),
    "hidden_states.batch_tokens": (1, None),
    "hidden_states.rows_per_shard": (1, None),
    "hidden_states.num_workers": (1, None),
    "hidden_states.gpus_per_worker": (0.01, 1),
    "hidden_states.check_tolerance": (1e-12, None),
    "hidden_states.max_rms": (1e-12, None),
}

# Settings where null means "work it out" and 0 is no number of them: the refusal says so.
NULL_MEANS = {"generate.num_engines": "null = one per GPU", "generate.max_engines": "null = the start size",
              "generate.max_rows_in_flight": "null = 2 x max_num_seqs",
              "hidden_states.num_workers": "null = one per GPU", "limit": "null = every row"}


# Settings where 0 switches something off: the refusal of a negative value says so.
ZERO_MEANS = {"generate.hang_timeout_s": "0 = no watchdog", "generate.engine_start_timeout_s": "0 = wait for ever",
              "generate.max_unit_attempts": "0 = retry for ever", "quality.canary_rows": "0 = no canary",
              "hidden_states.check_samples": "0 = no self-check"}


def value_kinds(hint) -> tuple[set, bool]:
    """({int, float, bool, ...} the hint allows, whether None is allowed)."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return {a for a in args if a is not type(None)}, type(None) in args


def check_fields(obj, section: str) -> None:
    """Type and range of every bool, int and float field of a config section (dataclass), before anything uses
    them: a wrong value stops the load with one line naming the key, not a TypeError (or a job that dies later)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        kinds, optional = value_kinds(hints[f.name])
        value, key = getattr(obj, f.name), f"{section}.{f.name}".lstrip(".")
        if not kinds & {bool, int, float} or (value is None and optional):
            continue
        if bool in kinds:
            if not isinstance(value, bool):
                raise ConfigError(f"config: {key} must be true or false, got {value!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, int if float not in kinds else (int, float)):
            raise ConfigError(f"config: {key} must be {'an integer' if float not in kinds else 'a number'}"
                              f"{' or null' if optional else ''}, got {value!r}")
        low, high = LIMITS.get(key, (0, None))
        if (low is not None and value < low) or (high is not None and value > high):
            allowed = f"between {low} and {high}" if high is not None else \
                "> 0" if 0 < low < 1e-6 else f">= {low}"
            hint = ZERO_MEANS.get(key) or NULL_MEANS.get(key)
            zero = f" ({hint})" if hint else ""
            raise ConfigError(f"config: {key} must be {allowed}{zero}, got {value!r}")


@dataclass(kw_only=True)
class QualityConfig:
    min_content_tokens: int = 16
    """A completion with fewer output tokens than this (excluding think markers and the stop token) is `too_short`."""
    repetition_ngram: int = 8
    """n-gram size for the repetition check."""
    repetition_tail_tokens: int = 256
    """The repetition check looks at this many last output tokens."""
    repetition_min_coverage: float = 0.5
    """`repetition` when one repeated n-gram covers at least this fraction of the tail."""
    canary_rows: int = 64
    """The first N completed rows are checked before the run goes on (0 = no canary). 64 rows finish in a few
    minutes on a real cluster: engines answer the first rows of their first batches early."""
    canary_max_template_mismatch: float = 0.05
    canary_max_too_short: float = 0.5
    canary_max_unclosed_think: float = 0.5
    canary_max_error: float = 0.5

    def __post_init__(self):
        check_fields(self, "quality")


REGENERATE_MODES = ("last_turn", "every_assistant_turn", "conversation", "none")


@dataclass(kw_only=True)
class GenerateConfig:
    sampling: dict[str, Any] = field(default_factory=dict)
    """vllm.SamplingParams keyword arguments, over the model's generation_config.json defaults."""
    enable_thinking: bool = True
    """Rendered into the chat template (Qwen's `enable_thinking`)."""
    chat_template: str | None = None
    """Path of a Jinja chat template that replaces the model's own (flagged as `template_mismatch` if it
    renders a different generation prompt than the model's template would)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template."""
    regenerate: str = "last_turn"
    """Which assistant turns of a conversation are generated. `last_turn`: one output row per input row, the
    assistant turn after the last message (a trailing assistant message in the data is dropped and regenerated).
    `every_assistant_turn`: one output row per assistant turn of the data (plus one after a final user or tool
    message), each generated on the history before it as the data has it; ids become "{id}#{turn}". Both keep
    the turn index (`turn`) and the data's own length of that turn (`original_turn_tokens`).
    `conversation`: the rows of every_assistant_turn (same ids and turns), but each conversation is regenerated
    turn by turn: turn k is generated after the user turns, system prompt and tool calls/results of the data and
    the model's OWN answers to turns < k (rendered through the chat template, which keeps or drops their reasoning
    as it does when the model is served): what the served target sees at every turn. A conversation's turns run one
    after the other; many conversations run at once. A turn that fails (e.g. its prompt, grown by the earlier
    answers, too long for max_model_len) is a row error and the turns after it are row errors naming it. Why a row
    per turn and not one per conversation: job/generate/prompts.py ("each turn on the model's own earlier answers").
    `none`: nothing is generated and no engine is started: each row's completion is the data's OWN last assistant
    turn, tokenized as the chat template renders the whole conversation (prompts.data_turn_ids), with
    finish_reason "data" and the usual quality flags. The baseline most teams train on, made into a run stage 2
    reads like any other (bench/bench_acceptance.py compares drafters trained on it and on regenerated data). A row
    that does not end with an assistant turn is a row error."""
    sampling_variants: list[dict[str, Any]] = field(default_factory=list)
    """Diversity: per-prompt variation of the sampling settings. Each entry is a set of vllm.SamplingParams keys over
    `sampling` and may set `enable_thinking` (true/false) over the run's, e.g. [{temperature: 0.6}, {temperature:
    1.0}, {temperature: 1.0, enable_thinking: false}]. Each input row (a conversation: all its turns) takes one
    entry, drawn from (seed, id) (prompts.variant_index): the same on every rerun whatever the batching, about
    evenly mixed. Its index is recorded per row (`variant`); `report` and the notebook show the mix. Empty (the
    default): every row is sampled with `sampling` and `enable_thinking`."""
    seed: int = 0
    """Run seed. Each row's seed is derived from (seed, id) and stored in the `seed` column."""
    per_request_seed: bool = False
    """Pass each row's seed to vLLM, so that a rerun samples each row as before whatever it is batched with (the seed
    column holds it). Off by default: on a GPU any seeded request moves vLLM's sampler off FlashInfer for the whole
    batch onto its PyTorch top-k/top-p path with one noise draw per seeded row per step (vLLM 0.26 and 0.32,
    v1/sample/ops/topk_topp_sampler.py). On one H200, 27B hybrid shape, 128 sequences, that cost 7.6 % of stage 1's
    steady-state throughput (docs/BENCHMARKS.md): ~3.4 hours of a 45-hour run. Without it a row's sample
    depends on the engine seed and on what it was batched with, so a regenerated shard has other (equally
    distributed) samples; the `seed` column is null. The CPU build crashes on per-request seeds: keep it off there."""
    output_tokens_mean: int = 2500
    """The run's completion lengths, which `engine_kwargs.max_num_seqs: auto` sizes the engines for: mean, p99 (a
    lognormal through both, capped at sampling.max_tokens) and mean prompt tokens (job/generate/length_mix.py). Once
    the run has rows (run.json `generate.lengths`), a later job's engines size for the measured lengths instead;
    `kv_tokens_per_seq` pins the tokens (prompt + completion) each sequence is sized for in place of either."""
    output_tokens_p99: int = 16000
    prompt_tokens_mean: int = 256
    kv_tokens_per_seq: int | None = None
    rows_per_shard: int = 256
    """Rows per work unit and per output shard. A crash redoes at most the units in flight."""
    units_in_flight_per_engine: int = 16
    """Work units Ray Data hands one engine actor at once. Their rows queue at the actor's admission gate
    (`max_rows_in_flight`), so a unit waiting for its slowest row never starves the engine: measured on the demo,
    4 units of 64 rows let the engine drain to 12 running requests before the next units arrived (0.85× plain
    vLLM throughput); the gate fixes it (docs/BENCHMARKS.md)."""
    max_rows_in_flight: int | None = None
    """Requests an engine holds at once (running + waiting). None = 2 × the engine's max_num_seqs: a full batch
    plus a full queue behind it. Rows past it wait at the gate in unit order, so older units finish first."""
    num_engines: int | None = None
    """Engine actors. None = cluster GPUs // tensor_parallel_size when the job starts, or 1 on a CPU-only cluster.
    It is also the pool's minimum: the job waits for that many engines (a lost node's engine waits for a node)."""
    max_engines: int | None = None
    """The engine pool's maximum, for an autoscaling cluster (cluster.yaml's max_workers): while units wait and every
    engine is full, Ray Data adds engines as GPU nodes join, up to this many. None = the pool keeps its start size."""
    max_unit_attempts: int = 3
    """A work unit whose engine actor dies or hangs this many times in one job (an out-of-memory row, a prompt that
    crashes the engine, a hang) is written as error rows ("unit failed N times") instead of being retried for
    ever; the rest of the run goes on. 0 = retry for ever. Delete such a shard to retry it in a later job."""
    engine_start_timeout_s: float = 1800
    """An engine that has not started after this long (load, compile, CUDA graphs) ends the run with an error
    naming the host; 0 = wait for ever. The 27B on a B200 starts in ~5-7 min."""
    hang_timeout_s: float = 900
    """An engine with requests in flight that finishes none for this long is declared hung and replaced; 0 = no
    watchdog (as engine_start_timeout_s: 0 waits for ever). Keep it well above the slowest single request's time:
    a request that runs longer than this with nothing else finishing counts as a hang."""

    def __post_init__(self):
        check_fields(self, "generate")
        if self.max_engines is not None and (self.max_engines < 1 or self.max_engines < (self.num_engines or 1)):
            raise ConfigError(f"config: generate.max_engines ({self.max_engines}) must be >= 1 and >= "
                              f"generate.num_engines ({self.num_engines})")
        if self.regenerate not in REGENERATE_MODES:
            raise ConfigError(f"config: generate.regenerate must be one of {', '.join(REGENERATE_MODES)}, "
                              f"got {self.regenerate!r}")
        check_sampling_variants(self.sampling_variants, self.regenerate)


def check_sampling_variants(variants, regenerate: str) -> None:
    """generate.sampling_variants: a list of non-empty mappings; `enable_thinking` true or false; no `n` (one
    completion per row) or `seed` (rows' seeds are the job's); nothing to vary under `regenerate: none`. The
    sampling keys themselves are vLLM's: the engine refuses an unknown one when it starts."""
    key = "generate.sampling_variants"
    if not isinstance(variants, list):
        raise ConfigError(f"config: {key} must be a list of sampling settings, got {variants!r}")
    for i, v in enumerate(variants):
        if not isinstance(v, dict) or not v:
            raise ConfigError(f"config: {key}[{i}] must be a non-empty mapping of sampling settings, got {v!r}")
        if "enable_thinking" in v and not isinstance(v["enable_thinking"], bool):
            raise ConfigError(f"config: {key}[{i}].enable_thinking must be true or false, got {v['enable_thinking']!r}")
        for fixed in ("n", "seed"):
            if fixed in v:
                raise ConfigError(f"config: {key}[{i}] may not set {fixed!r} (one completion per row, each row's seed "
                                  "drawn from generate.seed and its id)")
    if variants and regenerate == "none":
        raise ConfigError(f"config: {key} varies sampling, and generate.regenerate: none samples nothing")


ATTENTION_MODES = ("auto", "packed", "padded")
"""hidden_states.attention: checked here for a config and by the transformers backend for a direct caller."""
FUSE_MODES = ("auto", "off", "compile", "fla")
"""hidden_states.fuse. The backend also takes 'reference' (job/hidden_states/fusion.py: the fused rewrite run eager,
for tests), which a config does not offer."""


def check_choice(what: str, value, allowed: tuple) -> None:
    """The one refusal of a setting outside its allowed values (config and backend alike)."""
    if value not in allowed:
        raise ConfigError(f"config: {what} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}")


@dataclass(kw_only=True)
class HiddenStatesConfig:
    # Owned by the stage-2 module (job/hidden_states/).
    layer_ids: list[int] | str = "every_trainer"
    """Decoder layers to capture; layer k = output of decoder layer k = transformers hidden_states[k + 1]. Negative
    ids count from the end (-1 = last layer). Default "every_trainer": the layers every drafter trainer reads
    (SpecForge's DFlash layers, the EAGLE-3 low/middle/high layers of both trainers, and the last layer; see
    job/drafters.py), so one stage-2 run exports to all four (SpecForge and speculators, DFlash and EAGLE-3). For
    Qwen3.6-27B that is [1, 16, 31, 46, 60, 61, 63]."""
    last_layer_before_norm: bool = True
    """Store the model's last layer (when in layer_ids) as the final decoder layer's own output, BEFORE the final
    norm: what vLLM's aux hidden states and vLLM speculators' last slot hold. The export applies the target's final
    norm where a trainer wants the layer after it (SpecForge's EAGLE-3 `hidden_state`), exactly as the model does;
    the other way round is impossible (a norm cannot be undone). false: store it after the norm, as transformers'
    output_hidden_states returns it (such a run exports to SpecForge only). Shard metadata records which
    (`last_layer_norm`)."""
    max_length: int = 4096
    """Sequences longer than this are clipped (recorded per sample)."""
    backend: str = "transformers"
    """'transformers' (reference) or 'vllm' (fast prefill path; needs a CUDA GPU)."""
    dtype: str = "bfloat16"
    """Storage dtype of the features: bfloat16, float16 or float32 (also the compute dtype), or float8_e4m3fn:
    computed in bfloat16, stored as float8 e4m3 with a float32 scale per token and layer (job/hidden_states/fp8.py,
    quantized on the device before the copy; the transformers backend only), ~half the bytes of bf16 at ~2.6 %
    relative L2 error per layer (docs/BENCHMARKS.md). Readers (`load`, the exports, the notebook) get bfloat16 back;
    streaming (`export.stream`) streams the bfloat16 features as computed."""
    keep_flagged: bool = True
    """Keep rows with quality flags (error rows are always skipped)."""
    batch_tokens: int = 16384
    """Padded tokens per forward batch (rows are length-sorted, so padding stays small). At least max_length."""
    attention: str = "auto"
    """How the transformers backend batches sequences: 'padded' (right-padded rows and a mask), 'packed' (rows
    concatenated without padding: varlen attention; Gated DeltaNet layers once per batch through
    flash-linear-attention's varlen kernels, or once per sequence without them, so their conv and recurrent state
    never cross a boundary) or 'auto' (packed on a CUDA GPU when every sequence mixer of the model can be kept
    exact that way, else padded). Both are exact; a model packing cannot keep exact is refused."""
    fuse: str = "auto"
    """The transformers backend's elementwise work on Qwen3.5/3.6 layers (norms, SwiGLU, gates, rotary) as fused
    kernels (job/hidden_states/fusion.py): 'compile' (torch.compile), 'fla' (flash-linear-attention's fused norms),
    'off' (transformers' eager code), or 'auto' (FUSE_AUTO in job/hidden_states/transformers_backend.py on a CUDA GPU:
    'compile', measured faster there with the same exactness; off elsewhere and for other models). The exactness
    self-check compares the result with
    transformers' own code either way."""
    check_samples: int = 4
    """Exactness self-check: before writing anything, each worker runs this many of the run's own samples through
    its batched path together and through a plain transformers forward one by one; beyond `check_tolerance` the
    job stops and names the layer and sample. 0 turns it off."""
    check_tolerance: float | None = None
    """Largest relative L2 difference per (sample, layer) the self-check accepts, over the sample and over its first
    16 tokens. None: 1e-3 for float32, 0.05 for bfloat16/float16 (job/hidden_states/checks.py says why)."""
    rows_per_shard: int = 32
    """Rows per hidden-state shard. Features are big (every trainer's 7 layers x 5120 x 2 B = 72 KB per token): 32
    rows of ~2.5K tokens is ~5.7 GB per shard for Qwen3.6-27B, all of which an extractor holds in memory while
    writing (configs/qwen3.6-27b.yaml keeps 8)."""
    num_workers: int | None = None
    """Extractor actors. None = cluster GPUs, or 1 on CPU."""
    gpus_per_worker: float = 1.0
    """GPUs each extractor holds on a GPU cluster: 1 (its own GPU), or a fraction that lets a training worker share
    it (`python -m job train --stream --gpus-per-worker 0.4` beside an extractor of 0.6)."""
    min_rms: float = 1e-5
    max_rms: float = 1e4
    """Per-sample, per-layer RMS of the features must lie in [min_rms, max_rms]; outside it the job stops and
    names the layer and sample (NaN/inf and all-zero features always stop it)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """vllm.LLM keyword arguments for the vllm backend, passed through untouched."""

    @property
    def compute_dtype(self) -> str:
        """The dtype the model runs in and features are computed in: `dtype`, or bfloat16 for FP8 storage."""
        return "bfloat16" if self.dtype == FP8 else self.dtype

    def __post_init__(self):
        check_fields(self, "hidden_states")
        if self.layer_ids != EVERY_TRAINER and (
                isinstance(self.layer_ids, str) or not self.layer_ids
                or not all(isinstance(k, int) and not isinstance(k, bool) for k in self.layer_ids)):
            raise ConfigError(f"config: hidden_states.layer_ids must be {EVERY_TRAINER!r} or a non-empty list of "
                              f"ints, got {self.layer_ids!r}")
        if self.backend not in ("transformers", "vllm"):
            raise ConfigError(f"config: hidden_states.backend must be 'transformers' or 'vllm', "
                              f"got {self.backend!r}")
        if self.dtype not in ("bfloat16", "float16", "float32", FP8):
            raise ConfigError(f"config: hidden_states.dtype must be bfloat16, float16, float32 or float8_e4m3fn, "
                              f"got {self.dtype!r}")
        if self.dtype == FP8 and self.backend != "transformers":
            raise ConfigError("config: hidden_states.dtype float8_e4m3fn needs hidden_states.backend: transformers "
                              "(it quantizes on the device before the copy; the vllm backend stores bf16 only)")
        if self.batch_tokens < self.max_length:
            raise ConfigError(f"config: hidden_states.batch_tokens ({self.batch_tokens}) must be at least "
                              f"max_length ({self.max_length}): one full-length sequence must fit in a batch")
        check_choice("hidden_states.attention", self.attention, ATTENTION_MODES)
        check_choice("hidden_states.fuse", self.fuse, FUSE_MODES)
        if self.min_rms >= self.max_rms:
            raise ConfigError(f"config: hidden_states.min_rms ({self.min_rms}) must be below max_rms ({self.max_rms})")

    def resolved_layer_ids(self, num_layers: int) -> list[int]:
        """`layer_ids` on a model of `num_layers` decoder layers: negative ids counted from the end, checked."""
        return resolve_layer_ids(self.layer_ids, num_layers)


def resolve_layer_ids(layer_ids: Iterable[int] | str, num_layers: int) -> list[int]:
    """The one place layer ids are resolved: "every_trainer" becomes the union of the trainers' layers for this
    model (job/drafters.py); negative ids count from the end (-1 = last layer = num_layers - 1); every id must name a
    decoder layer of the model, each at most once. Raises ConfigError (a ValueError)."""
    if layer_ids == EVERY_TRAINER:
        return every_trainer_layers(num_layers)
    if isinstance(layer_ids, str):
        raise ConfigError(f"hidden_states.layer_ids must be {EVERY_TRAINER!r} or a list of ints, got {layer_ids!r}")
    layer_ids = list(layer_ids)
    resolved = []
    for k in layer_ids:
        r = k + num_layers if k < 0 else k
        if not 0 <= r < num_layers:
            raise ConfigError(f"hidden_states.layer_ids: layer {k} is out of range for a model with {num_layers} "
                              f"decoder layers (valid: 0..{num_layers - 1}, or -1 for the last)")
        resolved.append(r)
    if len(set(resolved)) != len(resolved):
        raise ConfigError(f"hidden_states.layer_ids {layer_ids} name the same layer twice ({resolved})")
    return resolved


@dataclass(kw_only=True)
class RunConfig:
    model: str
    """Local path, s3:// URI staged to local disk, or a hub name (clusters only)."""
    input: str | None = None
    """Folder, file or s3:// prefix of prompts: parquet, JSONL (.jsonl/.jsonl.gz/.jsonl.zst) or Arrow
    (a `datasets.save_to_disk` directory or .arrow files)."""
    output: str
    """Run directory (local or s3://)."""
    limit: int | None = None
    """Process only the first N input rows (in input order)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """vllm.LLM / AsyncEngineArgs keyword arguments, passed through untouched."""
    env_vars: dict[str, str] = field(default_factory=dict)
    """Environment for the engine actors: cluster workers do not inherit the driver's. A value `${NAME}` is taken
    from the driver's environment when the config is loaded (so a config file holds no secret). Variables that
    are secrets (job/redaction.py: by name or by value) are handed to each actor at construction and set in its
    process only; the others go through Ray's runtime_env, which Ray writes to its logs."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    hidden_states: HiddenStatesConfig = field(default_factory=HiddenStatesConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self):
        # Each section checked itself when it was built (its __post_init__); here only the top level's own keys.
        check_fields(self, "")
        check_fields(self.storage, "storage")  # StorageConfig lives in storage.py, below this module
        if not self.model:
            raise ConfigError("config: `model` is required (a model directory or name)")
        seqs = self.engine_kwargs.get("max_num_seqs")
        if seqs is not None and seqs != "auto" and (not isinstance(seqs, int) or isinstance(seqs, bool) or seqs < 1):
            raise ConfigError(f"config: engine_kwargs.max_num_seqs must be a positive int or 'auto' (sized from the "
                              f"device's memory: job/generate/engine_sizing.py), got {seqs!r}")
        tp = self.engine_kwargs.get("tensor_parallel_size", 1)
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"config: engine_kwargs.tensor_parallel_size must be a positive int, got {tp!r}")

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_kwargs.get("tensor_parallel_size", 1))


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"config: `{where}` must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"config: unknown key(s) {unknown} in `{where or 'top level'}`; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        ftype = fields[name].type
        sub = _NESTED.get(ftype)
        kwargs[name] = _build(sub, value or {}, f"{where}.{name}".strip(".")) if sub else value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise ConfigError(f"config: {where or 'top level'}: {e}") from None


_NESTED = {
    "GenerateConfig": GenerateConfig,
    "QualityConfig": QualityConfig,
    "HiddenStatesConfig": HiddenStatesConfig,
    "StorageConfig": StorageConfig,
}


def load_config(path: str, **overrides) -> RunConfig:
    """Read a YAML config and apply non-None overrides (dotted keys allowed: `generate.seed=3`)."""
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    for key, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    # Paths in a config file are relative to the working directory (where `make`/`ray job submit` runs).
    config = _build(RunConfig, data, "")
    config.env_vars = {k: _from_environment(k, v) for k, v in config.env_vars.items()}
    return config


_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _from_environment(name: str, value) -> str:
    """`${NAME}` in an env_vars value, from this process's environment: a secret stays out of the config file."""
    def sub(m: re.Match) -> str:
        if m[1] not in os.environ:
            raise ConfigError(f"config: env_vars.{name} refers to ${{{m[1]}}}, which is not set in this environment "
                              "(set it where the driver runs: your shell, or the head node for `ray job submit`)")
        return os.environ[m[1]]

    return _REFERENCE.sub(sub, str(value))


def to_dict(config: RunConfig) -> dict:
    return dataclasses.asdict(config)


def from_dict(data: dict) -> RunConfig:
    return _build(RunConfig, data, "")
