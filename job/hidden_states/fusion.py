"""Fused elementwise work for the transformers backend on Qwen3.5/3.6.

Eager transformers spends about a quarter of stage 2's GPU time on the 27B hybrid (docs/BENCHMARKS.md)
outside the matmuls: every RMSNorm is ~9 kernels over float32 copies of the activations, the gated norm of each Gated
DeltaNet layer ~10, SiLU-and-multiply 2 over the 17,408-wide MLP, rotary embedding ~8, the attention's sigmoid gate
2, each a full pass over memory. Here each of those becomes one kernel, from maintained code only:

- 'compile': `torch.compile` (Inductor) of the same arithmetic as transformers' modules, written out below, with the
  token dimension marked dynamic, so packed batches of any length share one compiled kernel per function (no
  recompiles; nothing to bucket).
- 'fla': flash-linear-attention's fused Triton norms (`rms_norm` with the residual add folded in, `rms_norm_gated`)
  and `swiglu`; the attention's q/k norm + rotary and gates are compiled as in 'compile' (fla has no kernel for
  Qwen3.5's zero-centred, partially rotary q/k path).
- 'reference': the written-out functions run eagerly: the same arithmetic op for op as transformers (bit-identical
  on CPU), for tests of the rewritten layer on machines without a GPU compiler.

The rewrites are instance `forward`s that run only inside the extractor's own forward (`active()`): the exactness
self-check's plain reference forward still runs transformers' own modules. Only the Qwen3.5/3.6 decoder layer is
rewritten (`fusion_problem` says why any other is not): its RMSNorm is zero-centred (`x * (1 + w)`), unlike Qwen3's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FUSIONS = ("auto", "off", "compile", "fla", "reference")

# The classes whose arithmetic the functions below write out (transformers 5.17-5.19, models/qwen3_5).
_LAYER, _NORM, _GATED_NORM, _ATTENTION = ("Qwen3_5DecoderLayer", "Qwen3_5RMSNorm", "Qwen3_5RMSNormGated",
                                          "Qwen3_5Attention")


# ---------------------------------------------------------------------------------------------------------------
# transformers' Qwen3.5 arithmetic, written out as functions of tensors (what 'compile' compiles)
# ---------------------------------------------------------------------------------------------------------------


def rms_norm(x, weight, eps: float):
    """Qwen3_5RMSNorm: float32 math, zero-centred weight, one rounding at the end."""
    import torch

    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def add_rms_norm(residual, delta, weight, eps: float):
    """The decoder layer's `residual + mixer_out` followed by post_attention_layernorm: (sum, normed sum)."""
    hidden = residual + delta
    return hidden, rms_norm(hidden, weight, eps)


def swiglu(gate, up):
    """Qwen3_5MLP's `act_fn(gate_proj(x)) * up_proj(x)` with act_fn SiLU."""
    import torch.nn.functional as F

    return F.silu(gate) * up


def gated_rms_norm(x, gate, weight, eps: float):
    """Qwen3_5RMSNormGated: norm in float32, rounded, times the weight, times SiLU(gate) in float32, rounded."""
    import torch
    import torch.nn.functional as F

    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def _rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb for one tensor [B, T, heads, d], cos/sin [B, T, rotary] (partial rotary:
    the first `rotary` dims turn, the rest pass)."""
    import torch

    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rotary = cos.shape[-1]
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat([turned * cos + _rotate_half(turned) * sin, kept], dim=-1)


def qk_norm_rope(query, key, q_weight, k_weight, eps: float, cos, sin):
    """Qwen3_5Attention's q_norm/k_norm over the head dim, then rotary: [B, T, heads, d] in and out (the caller
    transposes views, as transformers does)."""
    return _rope(rms_norm(query, q_weight, eps), cos, sin), _rope(rms_norm(key, k_weight, eps), cos, sin)


def sigmoid_gate(x, gate):
    """Qwen3_5Attention's output gate, `x * sigmoid(gate)`; `gate` may be the strided half of q_proj's output."""
    import torch

    return x * torch.sigmoid(gate.reshape(x.shape))


def gdn_gates(a, b, A_log, dt_bias):
    """Qwen3_5GatedDeltaNet's decay and write strength: g = -exp(A_log) * softplus(a + dt_bias) (float32), beta =
    sigmoid(b)."""
    import torch.nn.functional as F

    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


@dataclass
class Kernels:
    """The fused functions one extractor uses; same signatures as the written-out functions above."""
    kind: str
    rms_norm: Callable
    add_rms_norm: Callable
    swiglu: Callable
    gated_rms_norm: Callable
    qk_norm_rope: Callable
    sigmoid_gate: Callable
    gdn_gates: Callable


def _token_dim_dynamic(fn):
    """Compile `fn` once for every batch shape: the leading dimensions of its activations (rows and tokens: [B, T, H],
    [B, T, heads, d]; the rows of a [N, d] tensor) are marked dynamic, while the last dims (hidden size, heads, head
    dim) stay static, so the reductions over the hidden size keep fixed-size kernels. Size-1 dims (a packed batch's
    one row) are left alone: torch specializes them anyway."""
    import torch

    # emulate_precision_casts: round to bf16 wherever transformers' eager code rounds (Inductor otherwise keeps
    # float32 between fused steps). Measured on CPU, small Qwen3.5 shape: without it the features moved 1.9 % from a
    # plain forward instead of 0.9 %; with it, the same 0.9 % as unfused.
    import torch._inductor.config as inductor  # heavy: imported on use

    options = {"emulate_precision_casts": True} if hasattr(inductor, "emulate_precision_casts") else {}
    compiled = torch.compile(fn, dynamic=False, fullgraph=True, options=options)

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 2:
                for dim in range(min(2, a.dim() - 1)):
                    if a.shape[dim] > 1:
                        torch._dynamo.maybe_mark_dynamic(a, dim)
        return compiled(*args)

    return call


def _fla_kernels(compiled: dict) -> dict:
    """flash-linear-attention's fused norms and SwiGLU. Its RMSNorm weight multiplies, so Qwen3.5's zero-centred
    weight goes in as float32 (1 + w), which is transformers' own product; the residual add is folded into the
    norm's kernel (`prenorm`). Its kernels keep float32 between steps where transformers rounds to bf16 once or twice
    more: differences are bf16 rounding, which the exactness self-check bounds."""
    import torch
    from fla.modules.activations import swiglu as fla_swiglu  # heavy: imported on use
    from fla.modules.norm.fused_norm_gate import rms_norm_gated  # heavy: imported on use
    from fla.modules.norm.layernorm import rms_norm as fla_rms_norm  # heavy: imported on use

    centred: dict[int, torch.Tensor] = {}

    def weight_of(w):
        if id(w) not in centred:
            centred[id(w)] = 1.0 + w.detach().float()
        return centred[id(w)]

    def norm(x, weight, eps):
        return fla_rms_norm(x, weight_of(weight), None, eps=eps)

    def add_norm(residual, delta, weight, eps):
        y, hidden = fla_rms_norm(delta, weight_of(weight), None, residual=residual, prenorm=True, eps=eps)
        return hidden, y

    def gated(x, gate, weight, eps):
        return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)

    return dict(rms_norm=norm, add_rms_norm=add_norm, swiglu=fla_swiglu, gated_rms_norm=gated,
                qk_norm_rope=compiled["qk_norm_rope"], sigmoid_gate=compiled["sigmoid_gate"],
                gdn_gates=compiled["gdn_gates"])


def kernels(kind: str) -> Kernels:
    written = dict(rms_norm=rms_norm, add_rms_norm=add_rms_norm, swiglu=swiglu, gated_rms_norm=gated_rms_norm,
                   qk_norm_rope=qk_norm_rope, sigmoid_gate=sigmoid_gate, gdn_gates=gdn_gates)
    if kind == "reference":
        return Kernels(kind, **written)
    compiled = {name: _token_dim_dynamic(fn) for name, fn in written.items()}
    if kind == "compile":
        return Kernels(kind, **compiled)
    if kind == "fla":
        return Kernels(kind, **_fla_kernels(compiled))
    raise ValueError(f"fuse must be one of {', '.join(FUSIONS)}, got {kind!r}")


# ---------------------------------------------------------------------------------------------------------------
# Which models, and the rewritten forwards
# ---------------------------------------------------------------------------------------------------------------


def fusion_problem(stack) -> str | None:
    """None when every decoder layer of `stack` is the Qwen3.5/3.6 layer whose arithmetic `kernels` writes out."""
    config = stack.config
    if getattr(config, "hidden_act", None) != "silu":
        return f"the MLP's activation is {getattr(config, 'hidden_act', None)!r}, not silu"
    for i, layer in enumerate(stack.layers):
        if type(layer).__name__ != _LAYER:
            return f"decoder layer {i} is {type(layer).__name__}, not {_LAYER}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if getattr(layer, "self_attn", None) is not None:
            if type(layer.self_attn).__name__ != _ATTENTION:
                return f"decoder layer {i}'s attention is {type(layer.self_attn).__name__}, not {_ATTENTION}"
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None and type(mixer.norm).__name__ != _GATED_NORM:
            return f"decoder layer {i}'s gated norm is {type(mixer.norm).__name__}, not {_GATED_NORM}"
        for norm in norms:
            if type(norm).__name__ != _NORM:
                return f"decoder layer {i} has a {type(norm).__name__}, not the zero-centred {_NORM}"
    return None


def fused_layer_forward(layer, k: Kernels, active: Callable[[], bool]):
    """Qwen3_5DecoderLayer.forward (no cache) with the input norm, the residual add + post norm, and SwiGLU fused.
    The mixers are called as modules, so their own rewrites (varlen GDN, fused attention) and hooks still run."""
    original = layer.forward
    mlp = layer.mlp

    def forward(hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                past_key_values=None, **kwargs):
        if not active() or past_key_values is not None:
            return original(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                            position_ids=position_ids, past_key_values=past_key_values, **kwargs)
        kwargs.pop("use_cache", None)
        normed = k.rms_norm(hidden_states, layer.input_layernorm.weight, layer.input_layernorm.eps)
        if layer.block_type == "linear_attention":
            mixed = layer.linear_attn(hidden_states=normed, cache_params=None, attention_mask=attention_mask, **kwargs)
        else:
            mixed, _ = layer.self_attn(hidden_states=normed, attention_mask=attention_mask, position_ids=position_ids,
                                       past_key_values=None, position_embeddings=position_embeddings, **kwargs)
        hidden, normed = k.add_rms_norm(hidden_states, mixed, layer.post_attention_layernorm.weight,
                                        layer.post_attention_layernorm.eps)
        return hidden + mlp.down_proj(k.swiglu(mlp.gate_proj(normed), mlp.up_proj(normed)))

    return forward


def fused_attention_forward(attn, k: Kernels, active: Callable[[], bool]):
    """Qwen3_5Attention.forward (no cache) with q/k norm + rotary, and the output gate, fused."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # heavy: imported on use
    from transformers.models.qwen3_5.modeling_qwen3_5 import eager_attention_forward  # heavy: imported on use

    original = attn.forward
    eps = attn.q_norm.eps
    assert attn.k_norm.eps == eps

    def forward(hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        if not active() or past_key_values is not None:
            return original(hidden_states, position_embeddings, attention_mask, past_key_values=past_key_values,
                            **kwargs)
        shape = hidden_states.shape[:-1]
        query, gate = attn.q_proj(hidden_states).view(*shape, -1, attn.head_dim * 2).chunk(2, dim=-1)
        key = attn.k_proj(hidden_states).view(*shape, -1, attn.head_dim)
        value = attn.v_proj(hidden_states).view(*shape, -1, attn.head_dim).transpose(1, 2)
        query, key = k.qk_norm_rope(query, key, attn.q_norm.weight, attn.k_norm.weight, eps, *position_embeddings)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
        out, _ = interface(attn, query.transpose(1, 2), key.transpose(1, 2), value, attention_mask, dropout=0.0,
                           scaling=attn.scaling, **kwargs)
        return attn.o_proj(k.sigmoid_gate(out.reshape(*shape, -1), gate)), None

    return forward
