"""Packed batches kept exact: rows concatenated with no padding, each sequence mixer kept inside its own sequence
(varlen flash attention for attention layers; Gated DeltaNet layers once per sequence, or once per batch through
flash-linear-attention's varlen kernels)."""

from __future__ import annotations

import importlib.util
import inspect

PACKED_ATTENTION = "datagen_packed"


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                      max_length_q=None, **kwargs):
    """transformers attention function for sequences packed along one row: [1, heads, tokens, head_dim] in,
    [1, tokens, heads, head_dim] out, causal within each sequence (`cu_seq_lens_q` = cumulative lengths).
    CUDA: torch's varlen flash attention, no padding and no mask. Elsewhere: causal SDPA per sequence (exact)."""
    import torch  # heavy: imported on use

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
    from torch.nn.attention.varlen import varlen_attn  # heavy: imported on use

    return varlen_attn, inspect.signature(varlen_attn).parameters


def packed_attention_available() -> bool:
    try:
        import torch  # heavy: imported on use

        _varlen()
        return torch.cuda.is_available()
    except ImportError:
        return False


def register_packed_attention() -> None:
    from transformers import AttentionInterface  # heavy: imported on use
    from transformers.masking_utils import AttentionMaskInterface  # heavy: imported on use

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, lambda *args, **kwargs: None)  # no mask: cu_seq_lens say it


# Sequence mixers a packed batch keeps apart, by the model config's `layer_types` (Qwen3, Llama: every layer
# "full_attention"). Full attention runs through `_packed_attention` (causal within each sequence). A Gated DeltaNet
# layer (Qwen3.5/3.6 "linear_attention") carries a causal conv1d and a recurrent state along the sequence, and
# transformers passes it no sequence boundaries that both honour (its torch chunk rule drops `cu_seqlens`, its conv
# never gets them: measured 39-69 % error on the first tokens of every sequence but the first of a pack, H200, bf16),
# so a packed batch runs each such layer once per sequence (`per_sequence`). Any other mixer (sliding windows,
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

    if "linear_attention" not in (getattr(stack.config, "layer_types", None) or []):
        return []
    if importlib.util.find_spec("fla") is None:
        return ["stage 2 runs the Gated DeltaNet layers on transformers' torch reference path (>10x slower): "
                "flash-linear-attention is not installed on this worker (`pip install -e '.[gpu]'` brings it)"]
    return []


# The attributes of transformers' Qwen3.5/3.6 Gated DeltaNet layer (`Qwen3_5GatedDeltaNet`, transformers 5.17-5.19)
# that `varlen_gated_deltanet` computes with: its own forward's arithmetic, kernels told the sequence bounds.
_GDN_ATTRIBUTES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                   "out_proj", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "activation")


def varlen_gdn_problem(stack) -> str | None:
    """None when every Gated DeltaNet layer of `stack` can run once per packed batch through flash-linear-attention's
    varlen kernels; else why not (then a packed batch runs each such layer once per sequence)."""

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


def varlen_gated_deltanet(mixer, hidden_states, cu_seqlens, cu_seqlens_cpu, kernels=None):
    """transformers' Qwen3_5GatedDeltaNet.forward (no cache) over a packed batch [1, tokens, hidden] in one pass:
    the causal conv1d and the chunked gated delta rule are flash-linear-attention's varlen kernels, given the
    sequence bounds, so each sequence's conv window and recurrent state start from zero at its first token, exactly
    as when it runs alone. Grouped value heads (48 value : 16 key heads on the 27B) go to the kernel as they are
    (its GVA maps value head j to key head j // 3, which is transformers' `repeat_interleave`). Measured against
    once-per-sequence in docs/BENCHMARKS.md; every worker's self-check compares it with a plain forward."""
    import torch  # heavy: imported on use
    import torch.nn.functional as F  # heavy: imported on use
    from fla.modules.causal_conv1d.ops import causal_conv1d  # heavy: imported on use
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # heavy: imported on use

    _, tokens, _ = hidden_states.shape
    mixed, _ = causal_conv1d(mixer.in_proj_qkv(hidden_states), weight=mixer.conv1d.weight.squeeze(1),
                             bias=mixer.conv1d.bias, activation=mixer.activation, cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu)
    query, key, value = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    query = query.reshape(1, tokens, -1, mixer.head_k_dim)
    key = key.reshape(1, tokens, -1, mixer.head_k_dim)
    value = value.reshape(1, tokens, -1, mixer.head_v_dim)
    if kernels is None:
        beta = mixer.in_proj_b(hidden_states).sigmoid()
        g = -mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(hidden_states).float() + mixer.dt_bias)
    else:
        g, beta = kernels.gdn_gates(mixer.in_proj_a(hidden_states), mixer.in_proj_b(hidden_states), mixer.A_log,
                                    mixer.dt_bias)
    out, _ = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, output_final_state=False,
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    if kernels is None:
        z = mixer.in_proj_z(hidden_states).reshape(-1, mixer.head_v_dim)
        out = mixer.norm(out.reshape(-1, mixer.head_v_dim), z).reshape(1, tokens, -1)
    else:  # [1, tokens, heads, head_v_dim]: the norm is over head_v_dim either way
        z = mixer.in_proj_z(hidden_states).reshape(out.shape)
        out = kernels.gated_rms_norm(out, z, mixer.norm.weight, mixer.norm.variance_epsilon).reshape(1, tokens, -1)
    return mixer.out_proj(out)
