"""Stage 2's core, without Ray: completion rows → samples → length-sorted batches → target-model forward with
hooks on the chosen layers → features on the host → Arrow tables (and back, zero-copy, for the loader).

Importable where only torch + transformers + pyarrow exist (the GPU bench machine has no Ray, no vLLM); torch and
transformers themselves are imported inside the functions that need them, so `import job.extractor` is fast.

    from job.extractor import TransformersExtractor, load_model, samples_from_completions, plan_parts
    extractor = TransformersExtractor(load_model(path, dtype="bfloat16", device="cuda"), layer_ids=[1, 17, 32])
    for part in extractor.run(list(enumerate(plan_parts(samples, 32)))):
        table = part_table(part.samples, part.features, schema)

Layer convention (DESIGN.md): layer k is transformers' `output_hidden_states[k + 1]`, the output of decoder layer
k. One wrinkle, measured on transformers 5.19 Qwen3: for the LAST decoder layer transformers returns the output
*after* the model's final norm (`hidden_states[-1] == norm(layer_out)`), so that is what layer N-1 stores here too.
vLLM's aux hidden states (`eagle_aux_hidden_state_layer_ids`) count differently: vLLM id j is the residual stream
after j layers, before any final norm, so our layer k is vLLM id k + 1 and our last layer has no vLLM equivalent.

Throughput decisions (numbers from bench/bench_hidden_states.py, docs/BENCHMARKS.md):
- Rows are sorted by length (longest first) and cut into batches of at most `batch_tokens` padded tokens, so
  padding stays at a few percent and the longest (most memory-hungry) batch runs first.
- A forward hook on each captured layer gathers the non-pad tokens straight into one [tokens, layers, hidden]
  buffer; the hook of the last captured layer raises `_StopForward`, so later layers, the final norm and the LM
  head never run, and all layers are never materialized.
- Feature checks reduce on the GPU to a [rows, layers] table (sum of squared per-token norms, non-finite count);
  only that small table and the features cross to the host.
- Device→host copies run on a side stream into two pinned staging buffers, so batch i+1's forward is queued
  before the host waits for batch i: the GPU never idles while the host sorts features into parts.
- Host memory is first-touched at ~0.3 GB/s on small VMs: part buffers are reused from a pool, and Arrow IPC is
  written into one pre-sized buffer (one copy, ~9 GB/s) instead of a growing stream (several copies).
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from job import schema

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


class HiddenStateCheckError(RuntimeError):
    """Features failed a sanity check (NaN/inf, all zero, implausible norm). The message names layer and sample."""


class _StopForward(Exception):
    """Raised by the hook of the last captured layer: nothing after it is needed."""


# ---------------------------------------------------------------------------------------------------------------
# Samples: completion rows → token ids, loss mask, clipping
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    id: str
    input_ids: np.ndarray
    """int32 prompt_token_ids + output_token_ids, clipped to max_length."""
    num_prompt_tokens: int
    """Prompt tokens inside input_ids (loss_mask is 0 over them)."""
    original_num_tokens: int
    row: int
    """Row index in its completion shard (ties in the length sort break on it: the plan is deterministic)."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def clipped(self) -> bool:
        return self.original_num_tokens > self.num_tokens

    def loss_mask(self) -> np.ndarray:
        mask = np.ones(self.num_tokens, dtype=np.uint8)
        mask[: self.num_prompt_tokens] = 0
        return mask


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list<int> column, as numpy, for slicing rows without Python lists."""
    arr = table.column(name).combine_chunks()
    if isinstance(arr, pa.ChunkedArray):  # an empty table
        arr = pa.array([], type=arr.type)
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    return offsets, values


def samples_from_completions(table: pa.Table, *, max_length: int, keep_flagged: bool,
                             row_limit: int | None = None) -> tuple[list[Sample], dict[str, int]]:
    """Samples of one completion shard, and counts of the rows skipped (error, flagged, empty).

    No re-templating: input_ids = prompt_token_ids + output_token_ids exactly as stage 1 stored them.
    """
    missing = [c for c in (schema.ID, schema.PROMPT_TOKEN_IDS, schema.OUTPUT_TOKEN_IDS, schema.ERROR)
               if c not in table.column_names]
    if missing:
        raise ValueError(f"completion shard lacks column(s) {missing}: stage 2 needs the exact token ids of "
                         "stage 1 (prompt_token_ids, output_token_ids) and its error column")
    if row_limit is not None:
        table = table.slice(0, row_limit)
    ids = table.column(schema.ID).to_pylist()
    errors = table.column(schema.ERROR).is_valid().to_numpy(zero_copy_only=False)
    flagged = np.zeros(table.num_rows, dtype=bool)
    for flag in schema.QUALITY_FLAGS:
        if flag in table.column_names:
            flagged |= table.column(flag).fill_null(False).to_numpy(zero_copy_only=False)
    p_off, p_val = _list_column(table, schema.PROMPT_TOKEN_IDS)
    o_off, o_val = _list_column(table, schema.OUTPUT_TOKEN_IDS)
    p_valid = table.column(schema.PROMPT_TOKEN_IDS).is_valid().to_numpy(zero_copy_only=False)
    o_valid = table.column(schema.OUTPUT_TOKEN_IDS).is_valid().to_numpy(zero_copy_only=False)

    samples, skipped = [], {"error": 0, "flagged": 0, "empty": 0}
    for i in range(table.num_rows):
        if errors[i]:
            skipped["error"] += 1
            continue
        if flagged[i] and not keep_flagged:
            skipped["flagged"] += 1
            continue
        prompt = p_val[p_off[i]:p_off[i + 1]] if p_valid[i] else p_val[:0]
        output = o_val[o_off[i]:o_off[i + 1]] if o_valid[i] else o_val[:0]
        n = len(prompt) + len(output)
        if n == 0:
            skipped["empty"] += 1
            continue
        input_ids = np.concatenate([prompt, output])[:max_length].astype(np.int32)
        samples.append(Sample(id=ids[i], input_ids=input_ids, num_prompt_tokens=min(len(prompt), max_length),
                              original_num_tokens=n, row=i))
    return samples, skipped


def plan_parts(samples: list[Sample], rows_per_part: int) -> list[list[Sample]]:
    """Sort longest first (ties by row) and cut into parts of `rows_per_part` rows: one output shard each.

    Deterministic for the same shard and settings, so a rerun names and skips the same parts. Rows of similar
    length share a part, which is what lets batches stay nearly free of padding.
    """
    ordered = sorted(samples, key=lambda s: (-s.num_tokens, s.row))
    return [ordered[i:i + rows_per_part] for i in range(0, len(ordered), rows_per_part)]


def plan_batches(lengths: list[int], batch_tokens: int, packed: bool = False) -> list[tuple[int, int]]:
    """[start, stop) ranges over longest-first `lengths`. Padded: each batch's rows × its longest ≤ batch_tokens;
    packed (sequences concatenated, no padding): the sum of lengths ≤ batch_tokens. Either way one batch's memory
    is bounded whatever the lengths (a single longer sequence gets a batch of its own)."""
    batches, start = [], 0
    while start < len(lengths):
        stop, total = start + 1, lengths[start]
        while stop < len(lengths):
            cost = total + lengths[stop] if packed else (stop - start + 1) * lengths[start]
            if cost > batch_tokens:
                break
            total, stop = total + lengths[stop], stop + 1
        batches.append((start, stop))
        start = stop
    return batches


def resolve_layer_ids(layer_ids: Iterable[int], num_layers: int) -> list[int]:
    """Negative ids count from the end (-1 = last layer); the result is checked against the model."""
    resolved = []
    for k in layer_ids:
        r = k + num_layers if k < 0 else k
        if not 0 <= r < num_layers:
            raise ValueError(f"hidden_states.layer_ids: layer {k} is out of range for a model with {num_layers} "
                             f"decoder layers (valid: 0..{num_layers - 1}, or -1 for the last)")
        resolved.append(r)
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"hidden_states.layer_ids {list(layer_ids)} name the same layer twice ({resolved})")
    return resolved


# ---------------------------------------------------------------------------------------------------------------
# Arrow: the hidden-state shard schema, features → table → IPC bytes, and back (zero-copy)
# ---------------------------------------------------------------------------------------------------------------


def hidden_states_schema(*, model: str, layer_ids: list[int], hidden_size: int, dtype: str,
                         num_model_layers: int | None = None, last_layer_before_norm: bool = False) -> pa.Schema:
    """One row per sample. `hidden_states` is list<fixed_size_binary(num_layers × hidden × itemsize)>: one
    fixed-size value per token holding that token's [num_layers, hidden] features as raw `dtype` bits, so a
    sample's features are one contiguous, uncompressed [num_tokens, num_layers, hidden] block in the file.

    Metadata records both layer-id conventions: ours (`layer_ids`) and vLLM's (`vllm_layer_ids`, ours + 1), and
    whether the model's last layer, when captured, is stored after the final norm or before it."""
    width = len(layer_ids) * hidden_size * ITEMSIZE[dtype]
    metadata = {
        schema.META_MODEL: model,
        schema.META_LAYER_IDS: json.dumps(layer_ids),
        schema.META_VLLM_LAYER_IDS: json.dumps([k + 1 for k in layer_ids]),
        schema.META_LAYER_CONVENTION: (schema.LAYER_CONVENTION_BEFORE_NORM if last_layer_before_norm
                                       else schema.LAYER_CONVENTION),
        schema.META_LAST_LAYER_NORM: schema.LAST_BEFORE_NORM if last_layer_before_norm else schema.LAST_AFTER_NORM,
        schema.META_DTYPE: dtype,
        schema.META_HIDDEN_SIZE: str(hidden_size),
    }
    if num_model_layers is not None:
        metadata[schema.META_NUM_MODEL_LAYERS] = str(num_model_layers)
    return pa.schema([
        pa.field(schema.ID, pa.string(), nullable=False),
        pa.field(schema.INPUT_IDS, pa.list_(pa.int32())),
        pa.field(schema.LOSS_MASK, pa.list_(pa.uint8())),
        pa.field(schema.NUM_TOKENS, pa.int32()),
        pa.field(schema.ORIGINAL_NUM_TOKENS, pa.int32()),
        pa.field(schema.CLIPPED, pa.bool_()),
        pa.field(schema.HIDDEN_STATES, pa.list_(pa.binary(width))),
    ], metadata=metadata)


def part_table(samples: list[Sample], features: np.ndarray, hs_schema: pa.Schema) -> pa.Table:
    """Arrow table of one part. `features` (uint8, the samples' [n, L, H] blocks back to back) is wrapped, not
    copied: keep it alive and unchanged until the table is serialized."""
    counts = np.array([s.num_tokens for s in samples], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    total = int(counts.sum())
    hs_type = hs_schema.field(schema.HIDDEN_STATES).type
    width = hs_type.value_type.byte_width
    assert features.nbytes >= total * width, (features.nbytes, total, width)
    child = pa.FixedSizeBinaryArray.from_buffers(hs_type.value_type, total,
                                                 [None, pa.py_buffer(features[:total * width])])
    columns = [
        pa.array([s.id for s in samples], pa.string()),
        pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([s.input_ids for s in samples]), pa.int32())),
        pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([s.loss_mask() for s in samples]), pa.uint8())),
        pa.array(counts.astype(np.int32)),
        pa.array(np.array([s.original_num_tokens for s in samples], dtype=np.int32)),
        pa.array([s.clipped for s in samples], pa.bool_()),
        pa.ListArray.from_arrays(offsets, child, type=hs_type),
    ]
    return pa.Table.from_arrays(columns, schema=hs_schema)


def table_to_ipc(table: pa.Table) -> pa.Buffer:
    """Uncompressed Arrow IPC file bytes (memory-mappable), written into one buffer sized up front: one copy of
    the features instead of the 2-3 a growing BytesIO makes (1.2 → 9 GB/s measured)."""
    sizer = pa.MockOutputStream()
    with ipc.new_file(sizer, table.schema) as w:
        w.write_table(table)
    buf = pa.allocate_buffer(sizer.size())
    with ipc.new_file(pa.FixedSizeBufferWriter(buf), table.schema) as w:
        w.write_table(table)
    return buf


def _DTYPES() -> dict:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _torch_dtype(name: str):
    return _DTYPES()[name]


def iter_records(table: pa.Table) -> Iterator[dict]:
    """One dict per sample; `hidden_states` is a torch tensor [num_tokens, num_layers, hidden] that views the
    table's buffer (no copy: with a memory-mapped file nothing is read until used). Treat the tensors as
    read-only (`.clone()` to modify): they share memory with the file mapping."""
    import torch

    meta = table.schema.metadata
    layer_ids = json.loads(meta[schema.META_LAYER_IDS])
    dtype = meta[schema.META_DTYPE].decode()
    hidden = int(meta[schema.META_HIDDEN_SIZE])
    tdtype = _torch_dtype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": a read-only mapping, documented above
        for batch in table.to_batches():
            hs = batch.column(schema.HIDDEN_STATES)
            child = hs.values
            data = np.frombuffer(child.buffers()[1], dtype=np.uint8)
            width = child.type.byte_width
            hs_off = hs.offsets.to_numpy()
            ids = batch.column(schema.ID).to_pylist()
            in_ids, mask = batch.column(schema.INPUT_IDS), batch.column(schema.LOSS_MASK)
            in_off, in_val = in_ids.offsets.to_numpy(), in_ids.values.to_numpy()
            m_off, m_val = mask.offsets.to_numpy(), mask.values.to_numpy()
            clipped = batch.column(schema.CLIPPED).to_pylist()
            original = batch.column(schema.ORIGINAL_NUM_TOKENS).to_pylist()
            for i in range(batch.num_rows):
                n = int(hs_off[i + 1] - hs_off[i])
                start = (child.offset + int(hs_off[i])) * width
                features = torch.from_numpy(data[start:start + n * width]).view(tdtype).view(n, len(layer_ids),
                                                                                              hidden)
                yield {
                    schema.ID: ids[i],
                    schema.INPUT_IDS: torch.from_numpy(in_val[in_off[i]:in_off[i + 1]]),
                    schema.LOSS_MASK: torch.from_numpy(m_val[m_off[i]:m_off[i + 1]]),
                    "layer_ids": layer_ids,
                    schema.HIDDEN_STATES: features,
                    schema.CLIPPED: clipped[i],
                    schema.ORIGINAL_NUM_TOKENS: original[i],
                }


# ---------------------------------------------------------------------------------------------------------------
# Feature checks: NaN/inf, all zero, RMS in a plausible range
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class FeatureStats:
    """Token-weighted per-layer RMS over everything extracted so far (for the report)."""
    layer_ids: list[int]
    hidden_size: int
    sumsq: np.ndarray = None
    num_tokens: int = 0
    min_rms: np.ndarray = None
    max_rms: np.ndarray = None

    def __post_init__(self):
        n = len(self.layer_ids)
        self.sumsq, self.min_rms, self.max_rms = np.zeros(n), np.full(n, np.inf), np.zeros(n)

    def update(self, sumsq: np.ndarray, rms: np.ndarray, counts: np.ndarray) -> None:
        self.sumsq += sumsq.sum(axis=0)
        self.num_tokens += int(counts.sum())
        self.min_rms = np.minimum(self.min_rms, rms.min(axis=0))
        self.max_rms = np.maximum(self.max_rms, rms.max(axis=0))

    def to_dict(self) -> dict:
        rms = np.sqrt(self.sumsq / max(1, self.num_tokens * self.hidden_size))
        return {str(k): {"rms": float(rms[j]), "min_sample_rms": float(self.min_rms[j]),
                         "max_sample_rms": float(self.max_rms[j])} for j, k in enumerate(self.layer_ids)}


def check_features(samples: list[Sample], sumsq: np.ndarray, nonfinite: np.ndarray, *, layer_ids: list[int],
                   hidden_size: int, min_rms: float, max_rms: float) -> np.ndarray:
    """Raise HiddenStateCheckError on the first bad (sample, layer); return the per-sample RMS [rows, layers].

    `sumsq[r, j]` is the sum over sample r's tokens of the squared L2 norm of layer j's feature, `nonfinite[r, j]`
    the number of its tokens whose norm is NaN/inf (any NaN/inf element makes the norm non-finite).
    """
    counts = np.array([s.num_tokens for s in samples], dtype=np.float64)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        rms = np.sqrt(sumsq / (counts * hidden_size))
    for r, s in enumerate(samples):
        for j, k in enumerate(layer_ids):
            where = f"layer {k} of sample {s.id!r} ({s.num_tokens} tokens)"
            if nonfinite[r, j] or not np.isfinite(sumsq[r, j]):
                raise HiddenStateCheckError(f"{where}: {int(nonfinite[r, j])} token(s) hold NaN/inf features; "
                                            "the model or its dtype is broken (try dtype float32 to compare)")
            if sumsq[r, j] == 0:
                raise HiddenStateCheckError(f"{where}: features are all zero (a known failure of hidden-state "
                                            "extraction that trains drafters to 0% acceptance)")
            if not min_rms <= rms[r, j] <= max_rms:
                raise HiddenStateCheckError(f"{where}: RMS {rms[r, j]:.3g} is outside the plausible range "
                                            f"[{min_rms:g}, {max_rms:g}] (hidden_states.min_rms / max_rms)")
    return rms


# ---------------------------------------------------------------------------------------------------------------
# The transformers backend
# ---------------------------------------------------------------------------------------------------------------


def load_model(path: str, *, dtype: str = "bfloat16", device: str | None = None):
    """The target model for a forward over token ids, in `dtype` on `device` (default: cuda if present)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per actor adds nothing to a run's log
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # No device_map: that needs `accelerate`, which the CPU install does not have; .to() does the same here.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(dtype), attn_implementation="sdpa")
    return model.to(device).eval()


PACKED_ATTENTION = "datagen_packed"


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                      max_length_q=None, **kwargs):
    """transformers attention function for sequences packed along one row: [1, heads, tokens, head_dim] in,
    [1, tokens, heads, head_dim] out, causal within each sequence (`cu_seq_lens_q` = cumulative lengths).
    CUDA: torch's varlen flash attention, no padding and no mask. Elsewhere: causal SDPA per sequence (exact)."""
    import torch

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    if q.is_cuda:
        varlen_attn, params = _varlen()
        kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                          **kwargs)
    else:
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, scale=scaling,
            enable_gqa=k.shape[1] != q.shape[1]).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])])
    return out.unsqueeze(0), None


def _varlen():
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, inspect.signature(varlen_attn).parameters


def packed_attention_available() -> bool:
    try:
        import torch

        _varlen()
        return torch.cuda.is_available()
    except ImportError:
        return False


def _register_packed_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, lambda *args, **kwargs: None)  # no mask: cu_seq_lens say it


def decoder_stack(model):
    """The module holding `embed_tokens`, `layers` and `norm` (Qwen3Model inside Qwen3ForCausalLM, a
    multimodal model's language model, ...): calling it runs embeddings + decoder layers, never the LM head."""
    import torch

    for _, module in model.named_modules():
        if (isinstance(getattr(module, "layers", None), torch.nn.ModuleList) and hasattr(module, "norm")
                and hasattr(module, "embed_tokens")):
            return module
    raise ValueError(f"{type(model).__name__}: no decoder stack (a module with embed_tokens, layers, norm) found; "
                     "the transformers backend supports Llama/Qwen-style decoder models")


# Sequence mixers a packed batch keeps apart, by the model config's `layer_types` (Qwen3, Llama: every layer
# "full_attention"). Full attention runs through `_packed_attention` (causal within each sequence). A Gated DeltaNet
# layer (Qwen3.5/3.6 "linear_attention") carries a causal conv1d and a recurrent state along the sequence, and
# transformers passes it no sequence boundaries that both honour (its torch chunk rule drops `cu_seqlens`, its conv
# never gets them: measured 39-69 % error on the first tokens of every sequence but the first of a pack, H200, bf16),
# so a packed batch runs each such layer once per sequence (`_per_sequence`). Any other mixer (sliding windows,
# Mamba, ...) has no boundary-safe packed path here: such a model is never packed.
PACKABLE_LAYERS = {"full_attention": "self_attn", "linear_attention": "linear_attn"}


def packing_problem(stack) -> str | None:
    """None when packed batches keep every sequence of this decoder stack apart; else what stands in the way."""
    types = getattr(stack.config, "layer_types", None) or ["full_attention"] * len(stack.layers)
    for i, (kind, layer) in enumerate(zip(types, stack.layers)):
        if kind not in PACKABLE_LAYERS:
            return f"decoder layer {i} is {kind!r}, a sequence mixer packed batches cannot keep apart"
        if not hasattr(layer, PACKABLE_LAYERS[kind]):
            return f"decoder layer {i} ({kind}) has no `{PACKABLE_LAYERS[kind]}` module, so it cannot be packed safely"
    return None


def slow_path_warnings(stack) -> list[str]:
    """The fast kernels a model with Gated DeltaNet layers lacks on a GPU. Without flash-linear-attention,
    transformers runs its torch reference of the chunked gated delta rule, over 10x slower on an H100 (transformers'
    own warning, which one line among a worker's start-up logs hides)."""
    import importlib.util

    if "linear_attention" not in (getattr(stack.config, "layer_types", None) or []):
        return []
    if importlib.util.find_spec("fla") is None:
        return ["stage 2 runs the Gated DeltaNet layers on transformers' torch reference path (>10x slower): "
                "flash-linear-attention is not installed on this worker (`pip install -e '.[gpu]'` brings it)"]
    return []


# The attributes of transformers' Qwen3.5/3.6 Gated DeltaNet layer (`Qwen3_5GatedDeltaNet`, transformers 5.17-5.19)
# that `_varlen_gated_deltanet` computes with: its own forward's arithmetic, kernels told the sequence bounds.
_GDN_ATTRIBUTES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                   "out_proj", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "activation")


def varlen_gdn_problem(stack) -> str | None:
    """None when every Gated DeltaNet layer of `stack` can run once per packed batch through flash-linear-attention's
    varlen kernels; else why not (then a packed batch runs each such layer once per sequence)."""
    import importlib.util

    types = getattr(stack.config, "layer_types", None) or []
    if "linear_attention" not in types:
        return "the model has no Gated DeltaNet layers"
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed"
    for i, (kind, layer) in enumerate(zip(types, stack.layers)):
        mixer = getattr(layer, "linear_attn", None)
        if kind == "linear_attention" and (mixer is None or not all(hasattr(mixer, a) for a in _GDN_ATTRIBUTES)):
            return f"decoder layer {i}'s linear_attn is not the Qwen3.5 Gated DeltaNet this code knows"
    return None


def _varlen_gated_deltanet(mixer, hidden_states, cu_seqlens, cu_seqlens_cpu):
    """transformers' Qwen3_5GatedDeltaNet.forward (no cache) over a packed batch [1, tokens, hidden] in one pass:
    the causal conv1d and the chunked gated delta rule are flash-linear-attention's varlen kernels, given the
    sequence bounds, so each sequence's conv window and recurrent state start from zero at its first token, exactly
    as when it runs alone. Grouped value heads (48 value : 16 key heads on the 27B) go to the kernel as they are
    (its GVA maps value head j to key head j // 3, which is transformers' `repeat_interleave`). Measured against
    once-per-sequence in docs/BENCHMARKS.md; every worker's self-check compares it with a plain forward."""
    import torch
    import torch.nn.functional as F
    from fla.modules.causal_conv1d.ops import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    _, tokens, _ = hidden_states.shape
    mixed, _ = causal_conv1d(mixer.in_proj_qkv(hidden_states), weight=mixer.conv1d.weight.squeeze(1),
                             bias=mixer.conv1d.bias, activation=mixer.activation, cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu)
    query, key, value = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    query = query.reshape(1, tokens, -1, mixer.head_k_dim)
    key = key.reshape(1, tokens, -1, mixer.head_k_dim)
    value = value.reshape(1, tokens, -1, mixer.head_v_dim)
    beta = mixer.in_proj_b(hidden_states).sigmoid()
    g = -mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(hidden_states).float() + mixer.dt_bias)
    out, _ = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, output_final_state=False,
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    z = mixer.in_proj_z(hidden_states).reshape(-1, mixer.head_v_dim)
    out = mixer.norm(out.reshape(-1, mixer.head_v_dim), z).reshape(1, tokens, -1)
    return mixer.out_proj(out)


@dataclass
class PartFeatures:
    """One finished part: its samples (part order) and their features back to back, uint8 [total × width]."""
    index: int
    samples: list[Sample]
    features: np.ndarray
    release: Callable[[], None] = lambda: None
    """Return `features` to the extractor's buffer pool once the table is serialized (never for streaming)."""


@dataclass
class RunStats:
    num_tokens: int = 0
    num_padded_tokens: int = 0
    num_batches: int = 0
    seconds: float = 0.0
    feature_bytes: int = 0
    wait_gpu_s: float = 0.0
    """Host time spent waiting for the GPU (high = GPU-bound, as it should be)."""
    host_copy_s: float = 0.0
    """Host time spent sorting features into part buffers."""

    @property
    def padding_waste(self) -> float:
        return 1 - self.num_tokens / self.num_padded_tokens if self.num_padded_tokens else 0.0

    def to_dict(self) -> dict:
        return {"num_tokens": self.num_tokens, "num_padded_tokens": self.num_padded_tokens,
                "num_batches": self.num_batches, "padding_waste": self.padding_waste,
                "feature_bytes": self.feature_bytes, "seconds": self.seconds, "wait_gpu_s": self.wait_gpu_s,
                "host_copy_s": self.host_copy_s}


class _BufferPool:
    """Reused host buffers: fresh memory costs a page fault per 4 KB (~0.3 GB/s first touch on a small VM)."""

    def __init__(self, max_free: int = 4):
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()
        self.max_free = max_free

    def get(self, nbytes: int) -> np.ndarray:
        with self.lock:
            fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
            if fits:
                return self.free.pop(min(fits, key=lambda i: self.free[i].nbytes))[:nbytes]
        return np.empty(int(nbytes * 1.25) + 1, dtype=np.uint8)[:nbytes]

    def put(self, buf: np.ndarray) -> None:
        with self.lock:
            self.free.append(buf.base if buf.base is not None else buf)
            if len(self.free) > self.max_free:  # keep the largest buffers
                self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].nbytes))


class TransformersExtractor:
    """Forward passes over length-sorted batches, capturing exactly `layer_ids` (resolved) with hooks."""

    def __init__(self, model, *, layer_ids: list[int], batch_tokens: int = 16384, min_rms: float = 1e-5,
                 max_rms: float = 1e4, check: bool = True, attention: str = "auto", gdn: str = "auto",
                 last_layer_before_norm: bool = False):
        """`attention`: 'padded' (transformers' SDPA over right-padded rows with a mask), 'packed' (rows
        concatenated with no padding: varlen flash attention, see _packed_attention; recurrent layers once per
        sequence, see PACKABLE_LAYERS) or 'auto' (packed where torch has varlen attention, a GPU, and every
        sequence mixer of the model can be kept exact; else padded). `gdn`, for the Gated DeltaNet layers of a
        packed batch: 'varlen' (one flash-linear-attention call per layer over the whole batch, told the sequence
        bounds: see _varlen_gated_deltanet), 'per_sequence' (transformers' own layer once per sequence) or 'auto'
        (varlen on a GPU with flash-linear-attention). `last_layer_before_norm`: the last layer is the final
        decoder layer's output before the final norm (vLLM's convention) instead of after it."""
        import torch

        self.torch = torch
        self.stack = decoder_stack(model)
        # Features are stored in the dtype the model computes in (load_model's `dtype`).
        dtype = {v: k for k, v in _DTYPES().items()}[self.stack.embed_tokens.weight.dtype]
        num_layers = len(self.stack.layers)
        self.num_model_layers = num_layers
        self.layer_ids = resolve_layer_ids(layer_ids, num_layers)
        self.last_layer_before_norm = last_layer_before_norm
        self.hidden_size = int(self.stack.embed_tokens.weight.shape[1])
        self.dtype, self.batch_tokens = dtype, batch_tokens
        self.min_rms, self.max_rms, self.check = min_rms, max_rms, check
        self.device = self.stack.embed_tokens.weight.device
        self.cuda = self.device.type == "cuda"
        problem = packing_problem(self.stack)
        if attention == "auto":  # packing saves padding and takes the varlen flash kernel; only where it is exact
            attention = "packed" if self.cuda and packed_attention_available() and problem is None else "padded"
        if attention not in ("padded", "packed"):
            raise ValueError(f"hidden_states.attention must be auto, packed or padded, got {attention!r}")
        if attention == "packed" and problem:
            raise ValueError(f"hidden_states.attention 'packed' is not exact for this model: {problem}. Use "
                             "'padded' (or 'auto', which packs only models it can keep exact).")
        self.attention = attention
        self.packed = attention == "packed"
        self._segments: list[tuple[int, int]] | None = None  # host [start, stop) of each sequence of a packed batch
        self._cu_seqlens = None  # (device int64, host int64) sequence bounds of a packed batch, for varlen GDN kernels
        if gdn not in ("auto", "varlen", "per_sequence"):
            raise ValueError(f"gdn must be auto, varlen or per_sequence, got {gdn!r}")
        if gdn == "auto":
            gdn = "varlen" if self.packed and self.cuda and varlen_gdn_problem(self.stack) is None else "per_sequence"
        elif gdn == "varlen" and self.packed and varlen_gdn_problem(self.stack):
            raise ValueError(f"gdn 'varlen' is not available: {varlen_gdn_problem(self.stack)}")
        self.gdn = gdn
        self._wrapped = []
        if self.packed:
            _register_packed_attention()
            for layer in self.stack.layers:
                mixer = getattr(layer, PACKABLE_LAYERS["linear_attention"], None)
                if mixer is not None:
                    mixer.forward = self._per_sequence(mixer, mixer.forward)
                    self._wrapped.append(mixer)
        self.width = len(self.layer_ids) * self.hidden_size * ITEMSIZE[dtype]
        self.stats = RunStats()
        self.feature_stats = FeatureStats(self.layer_ids, self.hidden_size)
        self.pool = _BufferPool()
        self.warnings = slow_path_warnings(self.stack) if self.cuda else []
        for warning in self.warnings:
            warnings.warn(warning, stacklevel=2)

        # Hooks: layer k < N-1 → output of decoder layer k; k = N-1 → output of the final norm (transformers'
        # hidden_states[N]), or of decoder layer N-1 itself with last_layer_before_norm. The hook of the deepest
        # captured layer stops the forward.
        self._out = self._gather = None
        last = max(self.layer_ids)
        self._hooks = []
        for slot, k in enumerate(self.layer_ids):
            after_norm = k == num_layers - 1 and not last_layer_before_norm
            module = self.stack.norm if after_norm else self.stack.layers[k]
            self._hooks.append(module.register_forward_hook(self._make_hook(slot, stop=(k == last))))
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            per_buffer = batch_tokens * self.width
            self.staging = [torch.empty(per_buffer, dtype=torch.uint8).pin_memory() for _ in range(2)]

    def _make_hook(self, slot: int, stop: bool):
        def hook(module, args, output):
            if self._out is None:  # a forward not started by this extractor (e.g. a reference run)
                return
            hidden = output[0] if isinstance(output, tuple) else output
            flat = hidden.reshape(-1, hidden.shape[-1])
            self._out[:, slot].copy_(flat if self._gather is None else flat.index_select(0, self._gather))
            if stop:
                raise _StopForward
        return hook

    def _per_sequence(self, mixer, forward):
        """A packed batch's recurrent mixer runs once per sequence, each alone as in an unbatched forward (no cache,
        no mask, no packing arguments), so its conv and recurrent state start from zero at every sequence. The
        boundaries come from the host (`_segments`): reading them off a device tensor would stall the GPU at
        every such layer. Token-wise work around it (projections, MLPs, norms) stays packed. With `gdn` 'varlen'
        the layer runs once over the whole batch, its kernels told the bounds (`_varlen_gated_deltanet`)."""
        torch = self.torch

        def per_sequence(hidden_states, *args, **kwargs):
            if self._segments is None:  # a forward this extractor did not start (e.g. a reference forward)
                return forward(hidden_states, *args, **kwargs)
            if self.gdn == "varlen":
                return _varlen_gated_deltanet(mixer, hidden_states, *self._cu_seqlens)
            return torch.cat([forward(hidden_states[:, a:b]) for a, b in self._segments], dim=1)

        return per_sequence

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        for mixer in self._wrapped:
            del mixer.forward  # the class's forward again
        self._wrapped = []

    # -- one batch ------------------------------------------------------------------------------------------------

    def _launch(self, samples: list[Sample], slot: int) -> dict:
        """Queue batch forward + feature reductions + device→host copy; return without waiting for the GPU."""
        torch = self.torch
        counts = np.array([s.num_tokens for s in samples])
        rows, longest, total = len(samples), int(counts.max()), int(counts.sum())
        token_row = np.repeat(np.arange(rows), counts)

        def dev(a):
            t = torch.from_numpy(a)
            return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t

        config = self.stack.config
        if self.packed:  # one row of concatenated sequences; positions restart at each sequence
            cu = dev(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
            kwargs = dict(input_ids=dev(np.concatenate([s.input_ids for s in samples]).astype(np.int64)[None]),
                          position_ids=dev(np.concatenate([np.arange(n) for n in counts])[None]),
                          cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
            gather, padded_tokens = None, total
            bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
            self._segments = list(zip(bounds[:-1], bounds[1:]))
            if self.gdn == "varlen":
                cpu = torch.tensor(bounds, dtype=torch.int64)
                self._cu_seqlens = (cpu.pin_memory().to(self.device, non_blocking=True), cpu)
        else:
            ids = np.zeros((rows, longest), dtype=np.int64)
            mask = np.zeros((rows, longest), dtype=np.int64)
            for r, s in enumerate(samples):
                ids[r, :s.num_tokens] = s.input_ids
                mask[r, :s.num_tokens] = 1
            # No mask when no row is padded: SDPA then takes its causal fast path.
            kwargs = dict(input_ids=dev(ids), attention_mask=dev(mask) if total < rows * longest else None)
            gather = dev(np.concatenate([r * longest + np.arange(n) for r, n in enumerate(counts)]))
            padded_tokens = rows * longest

        L, H = len(self.layer_ids), self.hidden_size
        self._out = torch.empty((total, L, H), dtype=_torch_dtype(self.dtype), device=self.device)
        self._gather = gather
        out = self._out
        implementation = config._attn_implementation
        try:
            with torch.inference_mode():
                try:
                    if self.packed:
                        config._attn_implementation = PACKED_ATTENTION
                    self.stack(use_cache=False, **kwargs)
                except _StopForward:
                    pass
                finally:
                    config._attn_implementation = implementation
                norms = torch.linalg.vector_norm(out, dim=-1, dtype=torch.float32)  # [tokens, L]
                reduced = torch.zeros((2, rows, L), dtype=torch.float32, device=self.device)
                tr = dev(token_row)
                reduced[0].index_add_(0, tr, norms.square())
                reduced[1].index_add_(0, tr, (~torch.isfinite(norms)).float())
        finally:
            self._out = self._gather = self._segments = self._cu_seqlens = None

        self.stats.num_tokens += total
        self.stats.num_padded_tokens += padded_tokens
        self.stats.num_batches += 1
        pending = {"samples": samples, "counts": counts, "total": total}
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(done)
                host = self.staging[slot][:total * self.width]
                host.copy_(out.view(-1).view(torch.uint8), non_blocking=True)
                reduced_host = reduced.to("cpu", non_blocking=True)
                out.record_stream(self.copy_stream)
                reduced.record_stream(self.copy_stream)
                copied = torch.cuda.Event()
                copied.record(self.copy_stream)
            pending.update(host=host, reduced=reduced_host, event=copied)
        else:
            pending.update(host=out.view(-1).view(torch.uint8), reduced=reduced, event=None)
        return pending

    def _finish(self, pending: dict) -> tuple[list[Sample], np.ndarray]:
        """Wait for one batch's copy, check it, return its samples and host features (uint8, back to back)."""
        if pending["event"] is not None:
            waited = time.perf_counter()
            pending["event"].synchronize()
            self.stats.wait_gpu_s += time.perf_counter() - waited
        reduced = pending["reduced"].numpy()
        samples = pending["samples"]
        if self.check:
            rms = check_features(samples, reduced[0], reduced[1], layer_ids=self.layer_ids,
                                 hidden_size=self.hidden_size, min_rms=self.min_rms, max_rms=self.max_rms)
            self.feature_stats.update(reduced[0], rms, pending["counts"])
        return samples, pending["host"].numpy()

    # -- a list of parts ------------------------------------------------------------------------------------------

    def run(self, parts: list[tuple[int, list[Sample]]], *, pooled: bool = True) -> Iterator[PartFeatures]:
        """Extract the given (index, samples) parts; yield each as soon as its last row is done.

        Parts must be in plan order (longest first): batches are cut over their concatenation, so short parts
        share batches instead of running tiny ones. `pooled=False` gives every part its own memory (streaming
        hands it to Ray; the pool would reuse it too early).
        """
        order = [(p, s) for p, (_, samples) in enumerate(parts) for s in samples]
        if not order:
            return
        part_tokens = [sum(s.num_tokens for s in samples) for _, samples in parts]
        part_rows_left = [len(samples) for _, samples in parts]
        buffers: dict[int, np.ndarray] = {}
        filled = [0] * len(parts)  # bytes written into each part's buffer (rows arrive in part order)
        batches = plan_batches([s.num_tokens for _, s in order], self.batch_tokens, packed=self.packed)
        started = time.perf_counter()
        in_flight: deque = deque()

        def absorb(pending_batch, first: int):
            samples, host = self._finish(pending_batch)
            copy_started, pos = time.perf_counter(), 0
            for i, s in enumerate(samples):
                p = order[first + i][0]
                if p not in buffers:
                    nbytes = part_tokens[p] * self.width
                    buffers[p] = self.pool.get(nbytes) if pooled else np.empty(nbytes, dtype=np.uint8)
                n = s.num_tokens * self.width
                buffers[p][filled[p]:filled[p] + n] = host[pos:pos + n]
                filled[p] += n
                pos += n
                part_rows_left[p] -= 1
                if part_rows_left[p] == 0:
                    self.stats.host_copy_s += time.perf_counter() - copy_started
                    buf = buffers.pop(p)
                    self.stats.feature_bytes += buf.nbytes
                    yield PartFeatures(index=parts[p][0], samples=parts[p][1], features=buf,
                                       release=(lambda b=buf: self.pool.put(b)) if pooled else (lambda: None))
                    copy_started = time.perf_counter()
            self.stats.host_copy_s += time.perf_counter() - copy_started

        for b, (start, stop) in enumerate(batches):
            in_flight.append((self._launch([s for _, s in order[start:stop]], slot=b % 2), start))
            if len(in_flight) == 2:  # batch b is queued on the GPU: now finish batch b-1 on the host
                yield from absorb(*in_flight.popleft())
        while in_flight:
            yield from absorb(*in_flight.popleft())
        self.stats.seconds += time.perf_counter() - started


# ---------------------------------------------------------------------------------------------------------------
# The vLLM backend (CUDA only)
# ---------------------------------------------------------------------------------------------------------------


class VllmExtractor:
    """Hidden states from vLLM's prefill: speculative method `extract_hidden_states` stores the chosen layers of
    every prompt token in a cache-only layer, and its `ExampleHiddenStatesConnector` writes each finished request's
    [tokens, layers, hidden] to a safetensors file (under `shm_dir`), which this reads back and deletes. Each
    sample is one request of `max_tokens=1`; a part's requests go to the engine together, so it batches them.

    vLLM's aux layer id j is the residual stream after j decoder layers (before the final norm), so our layer k is
    vLLM id k + 1; the last layer (after the final norm in transformers' convention) has no vLLM equivalent and is
    refused. Needs CUDA: the connector pins host memory, which the CPU build of vLLM cannot do.
    """

    def __init__(self, model: str, *, layer_ids: list[int], dtype: str = "bfloat16", max_length: int = 4096,
                 engine_kwargs: dict | None = None, shm_dir: str = "/dev/shm/datagen-hidden-states",
                 min_rms: float = 1e-5, max_rms: float = 1e4, check: bool = True,
                 last_layer_before_norm: bool = False):
        from transformers import AutoConfig
        from vllm import LLM

        text = AutoConfig.from_pretrained(model).get_text_config()
        num_layers = int(text.num_hidden_layers)
        self.num_model_layers = num_layers
        self.layer_ids = resolve_layer_ids(layer_ids, num_layers)
        self.last_layer_before_norm = last_layer_before_norm
        if num_layers - 1 in self.layer_ids and not last_layer_before_norm:
            raise ValueError(f"hidden_states.backend 'vllm' cannot capture the last layer ({num_layers - 1}): in "
                             "the transformers convention it is taken after the final norm, and vLLM exposes only "
                             "the residual stream before it. Use the transformers backend, a lower layer, or "
                             "hidden_states.last_layer_before_norm: true (vLLM id N, what speculators stores).")
        self.hidden_size, self.dtype = int(text.hidden_size), dtype
        self.width = len(self.layer_ids) * self.hidden_size * ITEMSIZE[dtype]
        self.min_rms, self.max_rms, self.check = min_rms, max_rms, check
        self.stats, self.feature_stats, self.pool = RunStats(), FeatureStats(self.layer_ids, self.hidden_size), \
            _BufferPool()
        args = dict(model=model, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
                    max_model_len=max_length + 8, enable_chunked_prefill=False,
                    max_num_batched_tokens=max(16384, max_length + 8))
        args.update(engine_kwargs or {})
        self.llm = LLM(**args, speculative_config={
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [k + 1 for k in self.layer_ids]}},
        }, kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": shm_dir},
        })

    def close(self) -> None:
        pass

    def run(self, parts: list[tuple[int, list[Sample]]], *, pooled: bool = True) -> Iterator[PartFeatures]:
        import torch
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states, load_hidden_states)

        params = SamplingParams(max_tokens=1, detokenize=False)
        for index, samples in parts:
            started = time.perf_counter()
            outputs = self.llm.generate([{"prompt_token_ids": s.input_ids.tolist()} for s in samples], params,
                                        use_tqdm=False)
            nbytes = sum(s.num_tokens for s in samples) * self.width
            buf = self.pool.get(nbytes) if pooled else np.empty(nbytes, dtype=np.uint8)
            sumsq = np.zeros((len(samples), len(self.layer_ids)))
            nonfinite = np.zeros_like(sumsq)
            pos = 0
            for r, (s, out) in enumerate(zip(samples, outputs)):
                path = out.kv_transfer_params["hidden_states_path"]
                data = load_hidden_states(path)
                cleanup_hidden_states(path)
                hidden, token_ids = data["hidden_states"], data["token_ids"]
                if token_ids.tolist() != s.input_ids.tolist() or tuple(hidden.shape[1:]) != (len(self.layer_ids),
                                                                                             self.hidden_size):
                    raise RuntimeError(f"vllm backend: sample {s.id!r} came back with {len(token_ids)} tokens and "
                                       f"features {tuple(hidden.shape)}; expected {s.num_tokens} tokens")
                norms = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32)
                sumsq[r] = norms.square().sum(0).numpy()
                nonfinite[r] = (~torch.isfinite(norms)).sum(0).numpy()
                n = s.num_tokens * self.width
                buf[pos:pos + n] = hidden.contiguous().view(-1).view(torch.uint8).numpy()
                pos += n
            if self.check:
                rms = check_features(samples, sumsq, nonfinite, layer_ids=self.layer_ids,
                                     hidden_size=self.hidden_size, min_rms=self.min_rms, max_rms=self.max_rms)
                self.feature_stats.update(sumsq, rms, np.array([s.num_tokens for s in samples]))
            tokens = sum(s.num_tokens for s in samples)
            self.stats.num_tokens += tokens
            self.stats.num_padded_tokens += tokens
            self.stats.feature_bytes += nbytes
            self.stats.seconds += time.perf_counter() - started
            yield PartFeatures(index=index, samples=samples, features=buf,
                               release=(lambda b=buf: self.pool.put(b)) if pooled else (lambda: None))


# ---------------------------------------------------------------------------------------------------------------
# Writing parts in the background
# ---------------------------------------------------------------------------------------------------------------


class BackgroundWriter:
    """Serialize + write parts on one thread while the GPU works on the next batches. At most `max_pending`
    parts wait (bounded memory); the first failure is re-raised in the caller at the next submit or close."""

    def __init__(self, max_pending: int = 2):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hs-writer")
        self.pending: deque[Future] = deque()
        self.results: list = []
        self.max_pending = max_pending
        self.blocked_s = 0.0
        """Caller time spent waiting for the writer (high = writing is the bottleneck)."""

    def submit(self, fn, *args) -> None:
        while len(self.pending) >= self.max_pending:
            started = time.perf_counter()
            self.results.append(self.pending.popleft().result())
            self.blocked_s += time.perf_counter() - started
        self.pending.append(self.pool.submit(fn, *args))

    def close(self) -> list:
        """Wait for every write; return their results in submission order."""
        try:
            while self.pending:
                self.results.append(self.pending.popleft().result())
            return self.results
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
