"""The tiny models' shapes: the dimension constants, config.json of the dense model (Qwen3ForCausalLM) and of the
hybrid (Qwen3_5ForConditionalGeneration), the torch models that training starts from, and the hybrid saved whole
(trained language model, seeded vision tower, MTP head).
"""

from __future__ import annotations

from pathlib import Path

from job.builtin.tokenizer import ENDOFTEXT, IM_END

# ---------------------------------------------------------------------------------------------------------------
# Model shape
# ---------------------------------------------------------------------------------------------------------------
# head_dim must be 64: vLLM's CPU attention kernels reject 16. 4 layers x hidden 256 is 2.4M parameters plus
# 1.0M of (tied) embeddings: large enough to learn the answer format in ~80 s on 2 CPU cores, small enough that
# vLLM CPU generates ~4K tokens/s over 64 requests and a test loads it in a second.
HIDDEN_SIZE = 256
NUM_LAYERS = 4
NUM_ATTENTION_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE_SIZE = 512
MAX_POSITION_EMBEDDINGS = 4096
ROPE_THETA = 10000.0
# The hybrid (Qwen3.5/3.6 layout at the same text sizes): per 4 layers, 3 Gated DeltaNet ("linear_attention")
# layers, then one gated full-attention layer. vLLM's CPU GDN kernels need bf16 weights (the checkpoint is bf16)
# and, like its attention, head dims of 64. The real 27B has 16 key / 48 value heads of 128; 2 / 4 keeps the
# value-heads-per-key-head repeat (here 2, there 3) that a kernel must get right.
HYBRID_LAYER_TYPES = ("linear_attention",) * 3 + ("full_attention",)
LINEAR_NUM_KEY_HEADS = 2
LINEAR_NUM_VALUE_HEADS = 4
LINEAR_HEAD_DIM = 64
LINEAR_CONV_KERNEL = 4
MTP_NUM_LAYERS = 1
# Qwen3.5 rotates a quarter of each head (partial_rotary_factor 0.25: 16 of 64 dims), split over the text,
# height and width positions as mrope sections summing to 16 / 2 (the 27B: [11, 11, 10] of 64 / 2).
PARTIAL_ROTARY_FACTOR = 0.25
MROPE_SECTION = (4, 2, 2)
# A vision tower as small as vLLM and transformers accept: one block, head dim 64. Text-only runs never use it
# (`language_model_only`), but it is what makes the checkpoint look like the real one.
VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 1, "patch_size": 16,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
          "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "initializer_range": 0.02}
ARCHITECTURES = ("dense", "hybrid")
# The embedding table: the tokenizer's vocabulary rounded up to a multiple of this.
VOCAB_PAD_MULTIPLE = 64


# ---------------------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------------------
def model_config(vocab_size: int, ids: dict[str, int]) -> dict:
    # Written by hand, not by Qwen3Config.save_pretrained: the file is then the same under every transformers
    # version (5.x writes rope_parameters, 4.x rope_theta; both read rope_theta) and holds no version string.
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "max_window_layers": NUM_LAYERS,
        "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def hybrid_config(vocab_size: int, ids: dict[str, int]) -> dict:
    """config.json of the hybrid, in the layout of the public Qwen3.5/3.6 configs (`text_config` with
    `layer_types`, `attn_output_gate`, `mamba_ssm_dtype`, `mtp_num_hidden_layers`; a `vision_config`), written by
    hand for the same reason as the dense one. The vision token ids point at unused ids of the padded vocabulary:
    the tokenizer has no image tokens, and text-only runs never emit them."""
    text = {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "full_attention_interval": 4,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE_SIZE,
        "layer_types": list(HYBRID_LAYER_TYPES),
        "linear_conv_kernel_dim": LINEAR_CONV_KERNEL,
        "linear_key_head_dim": LINEAR_HEAD_DIM,
        "linear_num_key_heads": LINEAR_NUM_KEY_HEADS,
        "linear_num_value_heads": LINEAR_NUM_VALUE_HEADS,
        "linear_value_head_dim": LINEAR_HEAD_DIM,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "mtp_num_hidden_layers": MTP_NUM_LAYERS,
        "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_hidden_layers": len(HYBRID_LAYER_TYPES),
        "num_key_value_heads": NUM_KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor":
                            PARTIAL_ROTARY_FACTOR, "mrope_section": list(MROPE_SECTION), "mrope_interleaved": True},
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": vocab_size - 1,
        "video_token_id": vocab_size - 2,
        "vision_start_token_id": vocab_size - 3,
        "vision_end_token_id": vocab_size - 4,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {**VISION, "model_type": "qwen3_5_vision", "out_hidden_size": HIDDEN_SIZE},
    }


# Keys of the public configs that transformers' Qwen3_5TextConfig does not take as arguments (vLLM reads them).
_VLLM_ONLY_TEXT_KEYS = ("model_type", "attn_output_gate", "mamba_ssm_dtype", "mtp_num_hidden_layers",
                        "full_attention_interval")


def _transformers_text_kwargs(text: dict) -> dict:
    return {k: v for k, v in text.items() if k not in _VLLM_ONLY_TEXT_KEYS}


# ---------------------------------------------------------------------------------------------------------------
# Torch models
# ---------------------------------------------------------------------------------------------------------------
def dense_model(config: dict):
    # heavy: keeps python -m job --help fast
    from transformers import Qwen3Config, Qwen3ForCausalLM  # heavy: imported on use

    return Qwen3ForCausalLM(Qwen3Config(**config, attn_implementation="sdpa"))


def hybrid_text_model(config: dict):
    """The hybrid's language model alone (Qwen3_5ForCausalLM), trained like the dense one; its weights then go
    into the full Qwen3_5ForConditionalGeneration. Packed rows let the GDN state run on from one chat into the
    next during training (only attention gets a per-chat mask); inference never packs, so the model only sees
    slightly noisier training data."""
    # heavy: keeps python -m job --help fast
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # heavy: imported on use

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_transformers_text_kwargs(config["text_config"]),
                                                attn_implementation="sdpa"))


def save_hybrid(out: Path, config: dict, text_tensors: dict, mtp_tensors: dict, seed: int) -> None:
    """Qwen3_5ForConditionalGeneration with the trained language model and a seeded random vision tower, saved
    with save_pretrained (the real checkpoint layout: `model.language_model.*`, `model.visual.*`), plus the MTP
    head (`mtp.*`, trained by job/builtin/mtp_head.py) as vLLM's qwen3_5_mtp loads it: `fc` over [embedding; hidden],
    one full-attention decoder layer, three norms."""
    # heavy: keeps python -m job --help fast
    import torch  # heavy: imported on use
    from safetensors.torch import load_file, save_file  # heavy: imported on use
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration  # heavy: imported on use

    text = _transformers_text_kwargs(config["text_config"])
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=config["vision_config"],
                                                          tie_word_embeddings=True))
    language_model = model.model.language_model
    language_model.load_state_dict({k.removeprefix("model."): v for k, v in text_tensors.items()}, strict=True)
    model.to(torch.bfloat16).save_pretrained(str(out))

    tensors = load_file(str(out / "model.safetensors"))
    tensors.update(mtp_tensors)
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
