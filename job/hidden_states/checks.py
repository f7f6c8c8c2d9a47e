"""Checks on features: the sanity checks every batch gets (NaN/inf, all zero, RMS in a plausible range) and the
exactness self-check (batched against a plain forward of each sample alone)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from job.errors import Verdict
from job.hidden_states.samples import Sample
from job.target_weights import decoder_stack, torch_dtype


class HiddenStateCheckError(Verdict, RuntimeError):
    """Features failed a sanity check (NaN/inf, all zero, implausible norm). The message names layer and sample."""


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
# The exactness self-check
# The exactness self-check: stage 2's batched features against a plain transformers forward of each sample alone.
#
# Silent corruption is the failure that costs most in this field: features that are finite, non-zero and of a
# plausible size, but wrong (another sequence's state leaking in through a packed batch, vLLM returning other
# requests' states, a layer off by one). The sanity checks above cannot see it. This check can: before
# a stage-2 worker writes anything, a few of the run's own samples go through the worker's batched path *together*
# (so that all but the first share a batch with another sequence) and through `model(input_ids,
# output_hidden_states=True)` one by one; beyond the tolerance the job stops and names the layer and the sample.
#
#     python -m job hidden-states --check --output RUN     # the same comparison over a finished run's shards
#
# The measure is the relative L2 difference per (sample, layer), over the whole sample and over its first
# FIRST_TOKENS tokens, where leaked state shows most (packed Qwen3.5 on an H200: 5-10 % over whole sequences,
# 39-69 % over their first 16 tokens; bf16 rounding of a correct batch: <= 0.5 %).
# ---------------------------------------------------------------------------------------------------------------

FIRST_TOKENS = 16
# Relative L2 difference allowed between a batched and a lone forward. float32: a different GEMM blocking moves the
# last bits (measured <= 1e-6 on the tiny models). bf16/fp16: rounding differs between batch shapes and kernels
# (measured <= 0.3 % on the tiny hybrid, 1.8 % on a random 8-layer hidden-2048 Qwen3.5 shape on CPU); 5 % leaves
# room for 64 layers and for vLLM's own kernels, and is still far below what a leak does (73-78 % on that shape).
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.05,
                     # Stored FP8 against a plain forward: bf16's 5 % plus FP8's rounding (2.6 % relative L2 per
                     # layer measured on the tiny target; fp8.ROUND_TRIP_TOLERANCE bounds it at 5 % in every run).
                     "float8_e4m3fn": 0.10}


def tolerance_for(dtype: str, configured: float | None) -> float:
    return configured if configured is not None else DEFAULT_TOLERANCE[dtype]


def pick_samples(samples: list[Sample], num: int, batch_tokens: int) -> list[Sample]:
    """`num` samples of typical length that fit one batch together, longest first (plan order). Taken around the
    median length, so the check costs about as much as `num` ordinary samples."""
    if num <= 0 or not samples:
        return []
    ordered = sorted(samples, key=lambda s: (s.num_tokens, s.row))
    mid = len(ordered) // 2
    picked = ordered[max(0, mid - num // 2):][:num]
    # One padded batch holds rows x longest tokens: drop the longest until they fit (packed needs less).
    while len(picked) > 1 and len(picked) * max(s.num_tokens for s in picked) > batch_tokens:
        picked = picked[:-1]
    return sorted(picked, key=lambda s: (-s.num_tokens, s.row))


def reference_features(model, samples: list[Sample], layer_ids: list[int],
                       last_layer_before_norm: bool = False) -> list:
    """float32 CPU tensors [num_tokens, num_layers, hidden], one per sample: `output_hidden_states[k + 1]` of a plain
    transformers forward of the sample alone (no padding, no packing, no hooks of ours). With
    `last_layer_before_norm`, the last layer is instead the output of the final decoder layer itself (before the
    final norm), which output_hidden_states does not return: a forward hook on that layer reads it."""
    import torch  # heavy: imported on use

    stack = decoder_stack(model)
    device = stack.embed_tokens.weight.device
    last = len(stack.layers) - 1
    pre_norm = []
    hook = stack.layers[last].register_forward_hook(
        lambda module, args, output: pre_norm.append(output[0] if isinstance(output, tuple) else output)) \
        if last_layer_before_norm and last in layer_ids else None
    out = []
    try:
        with torch.inference_mode():
            for s in samples:
                pre_norm.clear()
                ids = torch.as_tensor(s.input_ids, dtype=torch.long, device=device)[None]
                hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False,
                               logits_to_keep=1).hidden_states
                layers = [pre_norm[0][0] if hook is not None and k == last else hidden[k + 1][0] for k in layer_ids]
                out.append(torch.stack(layers, dim=1).float().cpu())
    finally:
        if hook is not None:
            hook.remove()
    return out


@dataclass
class Difference:
    sample: str
    layer: int
    whole: float
    first: float
    """Relative L2 difference over the whole sample and over its first FIRST_TOKENS tokens."""


def compare(samples: list[Sample], batched: list, reference: list, layer_ids: list[int]) -> list[Difference]:
    """Relative differences of every (sample, layer). `batched` and `reference`: tensors [num_tokens, L, H]."""
    out = []
    for s, got, ref in zip(samples, batched, reference):
        got = got.float()
        if tuple(got.shape) != tuple(ref.shape):
            raise HiddenStateCheckError(f"exactness self-check: sample {s.id!r} came back with features of shape "
                                        f"{tuple(got.shape)}; a plain forward gives {tuple(ref.shape)}")
        for j, k in enumerate(layer_ids):
            diff, base = got[:, j] - ref[:, j], ref[:, j]
            first = slice(0, FIRST_TOKENS)
            out.append(Difference(sample=s.id, layer=k, whole=_relative(diff, base), first=_relative(diff[first],
                                                                                                      base[first])))
    return out


def _relative(diff, base) -> float:
    norm = float(base.norm())
    return float(diff.norm()) / norm if norm > 0 else float(diff.norm() > 0)


def verdict(differences: list[Difference], tolerance: float, where: str) -> dict:
    """Raise HiddenStateCheckError on the worst (sample, layer) beyond `tolerance`; else a summary for the report."""
    worst = max(differences, key=lambda d: max(d.whole, d.first))
    if max(worst.whole, worst.first) > tolerance:
        raise HiddenStateCheckError(
            f"exactness self-check failed ({where}): layer {worst.layer} of sample {worst.sample!r} differs from a "
            f"plain transformers forward of that sample alone by {worst.whole:.2%} over the sample and "
            f"{worst.first:.2%} over its first {FIRST_TOKENS} tokens (tolerance {tolerance:.2%}). The batched "
            "path mixes sequences or reads the wrong layer: nothing was written. Try hidden_states.attention: "
            "padded, or the transformers backend; hidden_states.check_tolerance sets the tolerance.")
    return {"num_samples": len({d.sample for d in differences}), "max_difference": max(worst.whole, worst.first),
            "tolerance": tolerance,
            "max_difference_by_layer": {str(k): max(max(d.whole, d.first) for d in differences if d.layer == k)
                                        for k in sorted({d.layer for d in differences})}}


def split_features(samples: list[Sample], features: np.ndarray, num_layers: int, hidden: int, dtype: str) -> list:
    """A part's features (uint8, the samples' [n, L, H] blocks back to back) as one tensor per sample."""
    import torch  # heavy: imported on use

    flat = torch.from_numpy(features).view(torch_dtype(dtype))
    out, pos = [], 0
    for s in samples:
        n = s.num_tokens * num_layers * hidden
        out.append(flat[pos:pos + n].view(s.num_tokens, num_layers, hidden))
        pos += n
    return out
