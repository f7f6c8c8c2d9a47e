"""The project's tiny model: deterministic build, loads in transformers and in vLLM (CPU build), renders the
Qwen3 thinking prompt, and answers in the target's format often enough to stand in for it.

The default model comes from the session fixture `tiny_model_dir` (tests/conftest.py, ~85 s to build once per
checkout, then cached in .cache/tiny-model); everything else here builds 2-5-step models in a few seconds each.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from job.builtin.tiny_model import build_tiny_model, ensure_tiny_model

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
NUM_SAMPLES = 32


# ---------------------------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------------------------
def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.slow  # three builds of the tiny model
def test_build_is_deterministic(tmp_path):
    first = _files(Path(build_tiny_model(str(tmp_path / "a"), train_steps=5)))
    second = _files(Path(build_tiny_model(str(tmp_path / "b"), train_steps=5)))
    assert sorted(first) == [
        "build_info.json", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]
    for name in first:
        assert first[name] == second[name], f"{name} differs between two identical builds"
    # A different seed is a different model (the comparison above is not vacuous).
    third = _files(Path(build_tiny_model(str(tmp_path / "c"), train_steps=5, seed=1)))
    assert third["model.safetensors"] != first["model.safetensors"]


def test_ensure_builds_once_and_replaces_incomplete_models(tmp_path):
    model_dir = tmp_path / "cache" / "tiny"
    ensure_tiny_model(str(model_dir), train_steps=2)
    config_mtime = (model_dir / "config.json").stat().st_mtime_ns
    ensure_tiny_model(str(model_dir), train_steps=2)  # complete: reused as is
    assert (model_dir / "config.json").stat().st_mtime_ns == config_mtime

    # What a build killed half way leaves (config.json is written last, so it is missing): rebuilt.
    (model_dir / "config.json").unlink()
    (model_dir / "model.safetensors").write_bytes(b"truncated")
    ensure_tiny_model(str(model_dir), train_steps=2)
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen3"
    assert (model_dir / "model.safetensors").stat().st_size > 1_000_000
    # An older recipe or another step count is rebuilt too.
    info = json.loads((model_dir / "build_info.json").read_text())
    (model_dir / "build_info.json").write_text(json.dumps({**info, "recipe_version": 0}))
    ensure_tiny_model(str(model_dir), train_steps=2)
    assert json.loads((model_dir / "build_info.json").read_text()) == info
    # No temp dirs left beside it, and the directory is readable by others (mkdtemp makes 0700).
    assert sorted(p.name for p in model_dir.parent.iterdir() if not p.name.endswith(".lock")) == ["tiny"]
    assert model_dir.stat().st_mode & 0o777 == 0o755


# ---------------------------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------------------------
def test_config_matches_qwen3_shape(tiny_model_dir, tokenizer):
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["head_dim"] == 64  # vLLM's CPU attention rejects 16
    assert config["vocab_size"] >= len(tokenizer) and config["vocab_size"] % 64 == 0
    assert 2000 <= len(tokenizer) <= 4096
    generation = json.loads((Path(tiny_model_dir) / "generation_config.json").read_text())
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert generation == {
        "bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95,
    }


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    for token in SPECIAL_TOKENS:
        ids = tokenizer.encode(f"a {token} b", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids(token) in ids, token
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    # Like Qwen3: <think> and </think> survive skip_special_tokens (vLLM's default), the chat markers do not.
    ids = tokenizer.encode("<|im_start|>x<think>r</think>a<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "x<think>r</think>a"
    # Byte-level BPE: text the corpus never saw still round-trips.
    text = "naïve café — 東京 🙂 x²\ttab"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_the_thinking_prompt(tiny_model_dir, tokenizer):
    shipped = (Path(__file__).resolve().parents[1] / "job" / "builtin" / "data" / "chat_template.jinja").read_text()
    assert tokenizer.chat_template == shipped
    assert (Path(tiny_model_dir) / "chat_template.jinja").read_text() == shipped

    def render(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    user = [{"role": "user", "content": "Hi"}]
    assert render(user) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert render(user, enable_thinking=True) == render(user)
    assert render(user, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]) == render(user)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "some reasoning\n</think>\n\nA1"},  # history keeps the answer only
        {"role": "user", "content": "Q2"},
        {"role": "tool", "content": "42"},
    ]
    assert render(history) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    assert tokenizer.apply_chat_template(user, tokenize=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_loads_in_transformers(tiny_model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}], tokenize=False,
                                         add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
    assert out.logits.shape == (1, input_ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(out.logits).all()
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    # Trained, not random: after the thinking prompt the likeliest next tokens are words, not markers.
    top = tokenizer.convert_ids_to_tokens(out.logits[0, -1].topk(5).indices.tolist())
    assert not set(top) & set(SPECIAL_TOKENS), top


# ---------------------------------------------------------------------------------------------------------------
# The hybrid (the target's architecture)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # the hybrid model
def test_hybrid_has_the_targets_layout(tiny_hybrid_dir, tokenizer):
    from safetensors import safe_open

    config = json.loads((Path(tiny_hybrid_dir) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["attn_output_gate"] is True and text["mtp_num_hidden_layers"] == 1
    assert text["head_dim"] == 64 and text["linear_key_head_dim"] == text["linear_value_head_dim"] == 64
    assert text["linear_num_value_heads"] % text["linear_num_key_heads"] == 0
    assert text["vocab_size"] >= len(tokenizer)
    with safe_open(str(Path(tiny_hybrid_dir) / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        dtypes = {str(f.get_tensor(k).dtype) for k in keys}
    assert dtypes == {"torch.bfloat16"}  # vLLM's CPU GDN kernels need bf16 weights
    assert any(k.startswith("model.language_model.layers.0.linear_attn.conv1d") for k in keys)
    assert any(k.startswith("model.language_model.layers.3.self_attn.q_proj") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(keys)


@pytest.mark.slow  # the hybrid model
def test_hybrid_loads_in_transformers_with_the_checkpoints_weights(tiny_hybrid_dir, tokenizer):
    """The text model transformers builds for stage 2 (Qwen3_5ForCausalLM) holds exactly the checkpoint's
    `model.language_model.*` tensors, and is trained: it answers in the thinking format's vocabulary."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hybrid_dir, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    stored = load_file(str(Path(tiny_hybrid_dir) / "model.safetensors"))
    state = model.model.state_dict()
    language = {k.removeprefix("model.language_model."): v for k, v in stored.items()
                if k.startswith("model.language_model.")}
    assert set(language) == set(state)
    for name, tensor in language.items():
        assert torch.equal(state[name], tensor), name
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}], tokenize=False,
                                         add_generation_prompt=True)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokenizer.encode(text, add_special_tokens=False)]))
    top = tokenizer.convert_ids_to_tokens(out.logits[0, -1].float().topk(5).indices.tolist())
    assert not set(top) & set(SPECIAL_TOKENS), top


# ---------------------------------------------------------------------------------------------------------------
# vLLM (CPU build)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_samples(tiny_model_dir):
    """NUM_SAMPLES chats sampled by a real vLLM engine with the model's own defaults (generation_config.json)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; must be set before the engine starts
    from vllm import LLM

    from job.builtin.demo import demo_questions

    # The engine in this process, as configs/demo.yaml runs it (VLLM_ENABLE_V1_MULTIPROCESSING "0"): the CPU build
    # otherwise starts an EngineCore and a worker process, each importing torch and vLLM again (54 s of this test's
    # setup in the last fresh-clone run). vLLM reads the variable when the engine starts; put back after.
    was = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(model=tiny_model_dir, max_model_len=1024, enforce_eager=True)
    finally:
        if was is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = was
    params = llm.get_default_sampling_params()  # no per-request seed: it kills the CPU engine
    params.max_tokens = 768
    questions = demo_questions()
    chats = [[{"role": "user", "content": questions[i * 7 % len(questions)]}] for i in range(NUM_SAMPLES)]
    outputs = llm.chat(chats, params, use_tqdm=False)
    # Stopped before the tests run (they need only the outputs): `del llm` would leave the engine processes to the
    # garbage collector, and the engine guard (conftest) fails a test after which an engine still runs.
    llm.llm_engine.engine_core.shutdown()
    yield params, outputs


@pytest.mark.slow  # a vLLM engine of its own (~40 s), the model served as vLLM serves it (its own chat rendering)
def test_vllm_uses_the_generation_config(vllm_samples, tokenizer):
    params, outputs = vllm_samples
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 20, 0.95)
    assert set(params.stop_token_ids or []) | {tokenizer.eos_token_id} >= {
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    }
    for output in outputs:
        # vLLM renders the same prompt, to the token, as transformers.
        assert output.prompt.endswith("<|im_start|>assistant\n<think>\n")
        assert output.prompt_token_ids == tokenizer.encode(output.prompt, add_special_tokens=False)


@pytest.mark.slow  # a vLLM engine of its own (~40 s)
def test_vllm_outputs_follow_the_thinking_format(vllm_samples, tokenizer):
    """Most samples are `reasoning\\n</think>\\n\\nanswer<|im_end|>`, and output lengths have a long tail.
    Measured on the default model: ~90% of samples well-formed (threshold 60%), median ~110 tokens, longest
    several hundred."""
    _, outputs = vllm_samples
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    well_formed, lengths = 0, []
    for output in outputs:
        completion = output.outputs[0]
        lengths.append(len(completion.token_ids))
        reasoning, closed, answer = completion.text.partition("</think>")
        if closed and answer.strip() and reasoning.strip() and completion.finish_reason == "stop":
            assert think_end in completion.token_ids  # one token, also in the ids
            well_formed += 1
    assert well_formed >= 0.6 * NUM_SAMPLES, f"only {well_formed}/{NUM_SAMPLES} well-formed"
    assert max(lengths) >= 200 and max(lengths) >= 2 * statistics.median(lengths), lengths


@pytest.mark.slow  # the hybrid model
def test_the_hybrids_mtp_head_is_trained_to_predict_the_targets_own_token_two_ahead(tiny_hybrid_dir):
    """The MTP head `worth` compares a trained draft against is a real baseline: read back from the checkpoint as
    vLLM's qwen3_5_mtp loads it, on chats the build never used, its top token is the target's own greedy token two
    ahead at most completion slots (67 % when first built; a random head: 0.1 %). ~10 s."""
    import random

    from job.builtin.corpus import CORPUS_PATH, load_corpus
    from job.builtin.mtp_head import greedy_agreement
    from job.builtin.tokenizer import CHAT_TEMPLATE_PATH, ENDOFTEXT, train_tokenizer
    from job.builtin.training import training_examples

    tok = train_tokenizer(CORPUS_PATH)
    chats = training_examples(tok, CHAT_TEMPLATE_PATH.read_text(), load_corpus(), 20_000, random.Random(12345))
    assert len(chats) >= 50
    assert greedy_agreement(tiny_hybrid_dir, chats, tok.token_to_id(ENDOFTEXT)) > 0.4
