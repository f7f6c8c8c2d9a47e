"""Stage 2's fused elementwise work (job/hidden_states/fusion.py, issue 35) on CPU: the rewritten Qwen3.5 decoder
layer and attention, run with the written-out functions eagerly ('reference'), give the features of transformers' own
code bit for bit, and they are the code that ran; other models are refused by name. The fused kernels themselves
('compile', 'fla') are measured against a plain forward on the GPU (bench/gpu_hybrid_exactness.py --fused,
docs/BENCHMARKS.md): Inductor on CPU is a different compiler, and fla has no CPU kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from job.hidden_states import fusion
from job.hidden_states.samples import Sample, plan_parts
from job.hidden_states.transformers_backend import TransformersExtractor

# A small random Qwen3.5/3.6 text model: GDN x3 + gated attention, twice; partial rotary, grouped heads (~1 s to make).
SMALL_HYBRID = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
                    max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                     "mrope_section": [4, 2, 2], "mrope_interleaved": True})


@pytest.fixture(scope="module")
def small_hybrid():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL_HYBRID, attn_implementation="sdpa"))
    with torch.no_grad():  # transformers initialises the zero-centred norms at 0: give them weights that matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
    return model.to(torch.bfloat16).eval()


def samples(lengths, vocab=512):
    rng = np.random.default_rng(1)
    return [Sample(id=f"s{i}", input_ids=rng.integers(0, vocab, size=n).astype(np.int32), num_prompt_tokens=4,
                   original_num_tokens=n, row=i) for i, n in enumerate(lengths)]


def features(model, batch, attention, fuse, calls=None):
    ex = TransformersExtractor(model, layer_ids=[1, 3, 6, 7], batch_tokens=4096, attention=attention, fuse=fuse)
    assert ex.fuse == fuse
    if calls is not None:  # count what the rewritten forwards call
        for name in ("rms_norm", "add_rms_norm", "swiglu", "qk_norm_rope", "sigmoid_gate"):
            inner = getattr(ex._kernels, name)
            setattr(ex._kernels, name, lambda *a, _f=inner, _n=name: calls.__setitem__(_n, calls.get(_n, 0) + 1)
                    or _f(*a))
    (part,) = list(ex.run([(0, plan_parts(batch, len(batch))[0])], pooled=False))
    ex.close()
    return part.features.copy()


@pytest.mark.parametrize("attention", ["padded", "packed"])
def test_rewritten_layers_give_transformers_features_bit_for_bit(small_hybrid, attention):
    batch = samples([37, 20, 9])
    calls: dict[str, int] = {}
    plain = features(small_hybrid, batch, attention, "off")
    rewritten = features(small_hybrid, batch, attention, "reference", calls)
    assert np.array_equal(plain, rewritten)
    # The rewrite ran, once per layer up to the deepest captured one (7 of 8 layers run before the stop; layer 7, an
    # attention layer, is the last): input norm and SwiGLU in each layer, q/k norm and gate in the 2 attention layers.
    assert calls == {"rms_norm": 8, "add_rms_norm": 8, "swiglu": 8, "qk_norm_rope": 2, "sigmoid_gate": 2}, calls
    # After close(), and in forwards the extractor did not start (the self-check's reference), transformers' own code.
    assert all("forward" not in vars(layer) for layer in small_hybrid.model.layers)


def test_a_changed_rewrite_is_seen(small_hybrid):
    """The bit-for-bit test can fail: a rewrite that rounds differently (float32 kept through SwiGLU) changes the
    features."""
    batch = samples([33, 17])
    plain = features(small_hybrid, batch, "padded", "off")
    ex = TransformersExtractor(small_hybrid, layer_ids=[1, 3, 6, 7], batch_tokens=4096, attention="padded",
                               fuse="reference")
    ex._kernels.swiglu = lambda gate, up: (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
    (part,) = list(ex.run([(0, plan_parts(batch, len(batch))[0])], pooled=False))
    ex.close()
    assert not np.array_equal(plain, part.features)


def test_other_models_are_not_fused(tiny_model_dir):
    from job.hidden_states.transformers_backend import describe_kernel_path, load_model

    dense = load_model(tiny_model_dir, dtype="bfloat16")  # Qwen3: its RMSNorm multiplies by w, not (1 + w)
    assert "Qwen3DecoderLayer, not Qwen3_5DecoderLayer" in fusion.fusion_problem(dense.model)
    chosen = TransformersExtractor(dense, layer_ids=[0], attention="auto", gdn="auto", fuse="auto")
    assert chosen.fuse == "off"
    # The worker's kernel-path line names the modes chosen, never the 'auto' it was given.
    assert chosen.kernel_path == "attention padded (SDPA over right-padded rows); elementwise ops eager (fuse off)"
    with pytest.raises(ValueError, match="attention, fuse still 'auto'"):
        describe_kernel_path(cuda=True, attention="auto", gdn="varlen", fuse="auto", hybrid=True, fla=True)
    with pytest.raises(ValueError, match="fuse 'compile' is not available for this model: decoder layer 0"):
        TransformersExtractor(dense, layer_ids=[0], fuse="compile")
    with pytest.raises(ValueError, match="hidden_states.fuse must be auto, off, compile, fla or reference, got 'fast'"):
        TransformersExtractor(dense, layer_ids=[0], fuse="fast")
