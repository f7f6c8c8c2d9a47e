"""FP8 feature storage (`hidden_states.dtype: float8_e4m3fn`): features are computed in bfloat16 and stored as
float8 e4m3 with one float32 scale per token and layer, about half the bytes of bf16.

A token's layer vector x (hidden values) is stored as q = fp8(x / s) with s = max|x| / 448 (e4m3's largest finite
value), so the largest entry uses the whole range and nothing overflows; reading gives q * s. A scale per layer, not
only per token: the layers of one token differ in scale by orders of magnitude (the last layer before the final norm
is ~10-100x the first), and one scale for all of them would push the small layers into e4m3's subnormals. It costs
4 bytes per layer a token beside hidden bytes (0.08 % at hidden 5,120). docs/BENCHMARKS.md has the error measured.

e4m3 keeps 3 mantissa bits: a value's rounding error is at most 2^-4 of it (6.25 %), and values below 2^-6 of the
vector's max land among the subnormals (absolute error up to s * 2^-10). `ROUND_TRIP_TOLERANCE` bounds the relative
L2 error of a whole layer vector, which is what the self-check holds a run to.
"""

from __future__ import annotations

import numpy as np

from job.schema import FP8
from job.schema import FP8_SCALE_BYTES as SCALE_BYTES  # float32, per token and layer

E4M3_MAX = 448.0
# Relative L2 error of one dequantized layer vector: uniform rounding error of 3 mantissa bits is ~2^-4 / sqrt(3)
# = 3.6 % of each value at most and ~2.2 % on Gaussian-like activations; 5 % leaves room for heavy tails.
ROUND_TRIP_TOLERANCE = 0.05


def is_fp8(dtype: str) -> bool:
    return dtype == FP8


def quantize(x):
    """x: torch tensor [..., hidden] (any float dtype) -> (fp8 tensor [..., hidden], float32 scales [...])."""
    import torch  # heavy: imported on use

    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1)


def dequantize(q, scale, dtype=None):
    """The inverse of `quantize`: q [..., hidden] fp8, scale [...] float32 -> [..., hidden] in `dtype` (bfloat16)."""
    import torch  # heavy: imported on use

    return (q.float() * scale.float().unsqueeze(-1)).to(dtype or torch.bfloat16)


def record_width(num_layers: int, hidden: int) -> int:
    """Bytes of one token's FP8 record: its values, then its scales."""
    return num_layers * (hidden + SCALE_BYTES)


def records(x):
    """x: [tokens, layers, hidden] on any device -> uint8 [tokens, record_width]: each token's fp8 values followed
    by its float32 scales, so that one device-to-host copy moves both (the transformers backend, on the GPU)."""
    import torch  # heavy: imported on use

    q, scale = quantize(x)
    tokens = x.shape[0]
    scales = scale.contiguous().view(torch.uint8).reshape(tokens, -1)
    return torch.cat([q.view(torch.uint8).reshape(tokens, -1), scales], dim=1)


def split_records(features: np.ndarray, tokens: int, num_layers: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """A part's FP8 records (uint8, `records` back to back, slack after the last) -> (fp8 bytes [tokens * layers *
    hidden], float32 scales [tokens, layers]): the two columns of a shard. One copy of each, at memory speed."""
    rec = features[:tokens * record_width(num_layers, hidden)].reshape(tokens, -1)
    values = np.ascontiguousarray(rec[:, :num_layers * hidden]).reshape(-1)
    scales = np.ascontiguousarray(rec[:, num_layers * hidden:]).view(np.float32).reshape(tokens, num_layers)
    return values, scales


def relative_l2(x, y) -> np.ndarray:
    """Per layer: ||x - y|| / ||x|| over every token, x and y [tokens, layers, hidden]."""
    x32, y32 = x.float(), y.float()
    return ((x32 - y32).norm(dim=(0, 2)) / x32.norm(dim=(0, 2)).clamp_min(1e-30)).numpy()
