"""The project's own tiny models: tokenizer, chat template and weights, trained briefly on CPU. Two architectures:

- `dense`:  Qwen3ForCausalLM (the demo's model);
- `hybrid`: the target's own architecture, Qwen3.5/3.6 (`Qwen3_5ForConditionalGeneration`): 3 Gated DeltaNet
            layers (causal conv1d + gated delta rule) then 1 gated full-attention layer, a tiny vision tower, an MTP
            head, saved with `save_pretrained` so its keys carry the real `model.language_model.` prefixes.

Nothing can be downloaded in CI or on an offline laptop, yet the tests, the demo and the benchmarks need a real
model that real vLLM (CPU build) and real transformers load and that answers in the same shape as the target
model (Qwen3.6 in thinking mode): `reasoning\n</think>\n\nanswer<|im_end|>` after a generation prompt that
already opened `<think>\n`. This module builds one from `job/data/corpus.txt` (~35 KB of original text shipped
with the package), deterministically: the same arguments give byte-identical files on the same machine and
package versions.

    python -m job tiny-model --output .cache/tiny-model                  # default recipe, ~85 s on 2 cores
    python -m job tiny-model --output .cache/tiny-hybrid --architecture hybrid
    python -m job tiny-model --output /tmp/tiny --train-steps 5          # ~5 s: loadable, not trained

    from job.tiny_model import ensure_tiny_model
    model_dir = ensure_tiny_model(".cache/tiny-model")                   # builds once, then reuses

One file of ~740 lines on purpose: it is one recipe read top to bottom (corpus → synthetic chats → tokenizer →
config → brief training → files), and nothing else in the package uses its internals.

The directory is a normal Hugging Face model directory:

    config.json              Qwen3ForCausalLM, 4 layers, hidden 256, head_dim 64, vocab 3840 (3792 used); or
                             Qwen3_5ForConditionalGeneration: the same text sizes, layers GDN/GDN/GDN/attention
    model.safetensors        6.7 MB of bf16 weights (embeddings tied to the LM head, so no lm_head.weight); the
                             hybrid adds `model.visual.*` and `mtp.*` (8.6 MB)
    tokenizer.json           byte-level BPE trained on the corpus: any text encodes
    tokenizer_config.json    eos <|im_end|>, pad <|endoftext|>, the chat template
    chat_template.jinja      the same template (transformers 5 reads this file first)
    generation_config.json   Qwen3.6 thinking-mode sampling: temperature 1.0, top_k 20, top_p 0.95
    build_info.json          recipe version, train steps and seed (ensure_tiny_model rebuilds on a new recipe)

Sampled with the generation config after the thinking prompt, ~85-90% of outputs are
`reasoning\n</think>\n\nanswer<|im_end|>`; the rest wander into word salad and stop or run long. Output lengths
have a long tail: median ~100 tokens, a tenth over ~300, a few run to max_tokens. The text itself is word salad
stitched from corpus sentences: this model exercises the pipeline, it knows nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
CORPUS_PATH = DATA_DIR / "corpus.txt"
CHAT_TEMPLATE_PATH = DATA_DIR / "chat_template.jinja"

# Bump when anything below changes what gets built; ensure_tiny_model() then rebuilds stale cached models.
RECIPE_VERSION = 2

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
# BPE with min_frequency=1 on the ~37 KB corpus stops at ~3.8K tokens, by then nearly every corpus word is one
# token: the model learns word sequences instead of spelling (with 2K tokens it spent most of its training on
# word fragments). The cap is not reached; it keeps a bigger corpus from growing the embedding table.
TOKENIZER_MAX_VOCAB = 4096
VOCAB_PAD_MULTIPLE = 64

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END)

# ---------------------------------------------------------------------------------------------------------------
# Training recipe
# ---------------------------------------------------------------------------------------------------------------
# 400 steps of one 1024-token row (~5 chats) is 410K tokens: 0.2 s a step, ~80 s on 2 idle cores (several times
# longer when other processes keep the cores busy: the OpenMP threads then wait on each other). Learning is
# limited by the number of optimizer steps, not tokens: 60 steps of 4 rows stayed at loss 5 and word salad, 400
# of 1 row reach loss ~2 and the format. 300 steps gave as many well-formed outputs but almost no long ones.
# Tests that only need a loadable model use ~5 steps.
DEFAULT_TRAIN_STEPS = 400
# The hybrid trains ~3x slower per step on CPU (transformers' torch reference path for the conv and the gated delta
# rule), so it gets fewer steps: enough for the answer format most of the time, which keeps its completions short
# (an untrained model runs every completion to max_tokens).
DEFAULT_HYBRID_TRAIN_STEPS = 200
ROWS_PER_STEP = 1
# Chats are packed into rows of this many tokens; it is above nearly every chat the synthesizer makes (up to 40
# reasoning sentences), so chats are learned in full, including their <|im_end|>. 768-token rows (capping
# reasoning at 30 sentences) were 25% cheaper but closed the think block twice far more often.
ROW_TOKENS = 1024
# 1e-2 with 1-row steps; 5e-3 reached the same loss but closed the think block twice more often.
LEARNING_RATE = 1e-2
BOUNDARY_LOSS_WEIGHT = 3.0
WARMUP_STEPS = 10
# Threads are fixed during training: the reduction order of CPU kernels depends on the thread count, and two
# builds must be byte-identical.
TRAIN_THREADS = 2


# ---------------------------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Corpus:
    """The three kinds of line in corpus.txt (sections `# questions`, `# facts`, `# thoughts`)."""

    qa_pairs: list[tuple[str, str]]
    """(question, answer) from `Q:` / `A:` line pairs."""
    facts: list[str]
    """Plain sentences: filler for the reasoning."""
    thoughts: list[str]
    """Reasoning-style sentences ("Let me check whether the numbers add up.")."""


def load_corpus(path: Path = CORPUS_PATH) -> Corpus:
    qa_pairs: list[tuple[str, str]] = []
    sections: dict[str, list[str]] = {"facts": [], "thoughts": []}
    section = None
    question = None
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("# "):
            section = line[2:]
        elif line.startswith("Q: "):
            question = line[3:]
        elif line.startswith("A: "):
            assert question is not None, f"answer without a question in {path}: {line!r}"
            qa_pairs.append((question, line[3:]))
            question = None
        else:
            sections[section].append(line)
    return Corpus(qa_pairs=qa_pairs, facts=sections["facts"], thoughts=sections["thoughts"])


def _split_sentences(text: str) -> list[str]:
    sentences, start = [], 0
    for i, char in enumerate(text):
        if char in ".?!" and (i + 1 == len(text) or text[i + 1] == " "):
            sentences.append(text[start : i + 1].strip())
            start = i + 1
    return [s for s in sentences if s]


# ---------------------------------------------------------------------------------------------------------------
# Synthetic chats
# ---------------------------------------------------------------------------------------------------------------
# Each training example is a rendered prompt (system/user turns, sometimes history) plus a completion in the
# target's format. Output lengths must have a long tail (the benchmarks measure how an engine copes with it), so
# a chat is "long" with probability LONG_FRACTION or when the user asks for steps. A long chat opens its
# reasoning with one of LONG_OPENERS: the model picks the opener itself when sampling, and then keeps going for
# ~20 sentences instead of ~3, so the sampled lengths are a mixture: most 50-150 tokens, a tenth 300-800.
LONG_FRACTION = 0.15
LONG_OPENERS = (
    "Let me think about this step by step.",
    "There are two parts to this question, and I will take them one at a time.",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly tutor who explains things clearly.",
    "Answer the user's questions accurately and concisely.",
)


def _geometric(rng: random.Random, p: float) -> int:
    """Number of failures before the first success: mean (1 - p) / p, a long tail."""
    count = 0
    while rng.random() > p:
        count += 1
    return count


def _user_turn(rng: random.Random, question: str, corpus: Corpus) -> tuple[str, bool | None]:
    """A user message for `question`, and whether it asks for a long (True) / short (False) answer."""
    roll = rng.random()
    if roll < 0.10:
        return f"Explain step by step: {question}", True
    if roll < 0.20:
        return f"Briefly, {question[0].lower()}{question[1:]}", False
    if roll < 0.30:
        return f"{rng.choice(corpus.facts)} {question}", None
    return question, None


def _reasoning(rng: random.Random, corpus: Corpus, question: str, long: bool) -> str:
    """Thoughts and facts. Answers are made of other sentences (the corpus answers), so the sentence just written
    tells the model which side of </think> it is on; with facts on both sides a 4-layer model stopped inside
    the think block in ~1 of 3 samples."""
    thoughts = [t for t in corpus.thoughts if t not in LONG_OPENERS]
    # Short: 2 + Geometric(0.4) sentences (mean 3.5, ~50 tokens). Long: 10 + Geometric(0.1), capped at 40
    # (mean ~19, ~300 tokens).
    num_sentences = 10 + min(_geometric(rng, 0.1), 30) if long else 2 + _geometric(rng, 0.4)
    sentences = [rng.choice(LONG_OPENERS if long else thoughts)]
    if rng.random() < 0.3:
        sentences.append(f"The question is: {question}")
    while len(sentences) < num_sentences:
        candidate = rng.choice(thoughts) if rng.random() < 0.45 else rng.choice(corpus.facts)
        if candidate not in sentences:  # no repeated sentence: the quality checks flag repetition
            sentences.append(candidate)
    # Paragraph breaks now and then, as real reasoning has them.
    text = sentences[0]
    for sentence in sentences[1:]:
        text += ("\n\n" if rng.random() < 0.2 else " ") + sentence
    return text


def _answer(rng: random.Random, corpus: Corpus, answer: str, long: bool) -> str:
    """The corpus answer, plus a few sentences of other answers (2 + Geometric(0.35) when long, one 30% of
    the time otherwise), sometimes as a list."""
    num_extra = 2 + _geometric(rng, 0.35) if long else (1 if rng.random() < 0.3 else 0)
    extra = [rng.choice(_split_sentences(other)) for _, other in rng.sample(corpus.qa_pairs, num_extra)]
    extra = [sentence for sentence in extra if sentence not in answer]
    if not extra:
        return answer
    if long and rng.random() < 0.5:
        return answer + "\n\n" + "\n".join(f"- {sentence}" for sentence in extra)
    return answer + " " + " ".join(extra)


def synthesize_chat(rng: random.Random, corpus: Corpus) -> tuple[list[dict], str]:
    """One (messages, completion) pair; completion is what follows the thinking generation prompt."""
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(1 if rng.random() < 0.15 else 0):  # some chats carry one earlier exchange
        question, answer = rng.choice(corpus.qa_pairs)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    question, answer = rng.choice(corpus.qa_pairs)
    user_text, asks_long = _user_turn(rng, question, corpus)
    messages.append({"role": "user", "content": user_text})
    long = asks_long if asks_long is not None else rng.random() < LONG_FRACTION
    reasoning = _reasoning(rng, corpus, question, long)
    completion = f"{reasoning}\n{THINK_END}\n\n{_answer(rng, corpus, answer, long)}{IM_END}"
    return messages, completion


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------
def train_tokenizer(corpus_path: Path = CORPUS_PATH):
    """Byte-level BPE (GPT-2 / Qwen style: every byte is a token, so any text encodes) over the corpus."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_MAX_VOCAB,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in corpus_path.read_text(encoding="utf-8").splitlines() if not line.startswith("# ")]
    # The role names follow <|im_start|> in every example; they deserve whole tokens.
    scaffolding = [f"{role}\n" for role in ("system", "user", "assistant", "tool")] * 4
    tokenizer.train_from_iterator(lines + scaffolding, trainer)
    # Added after the BPE vocabulary, as in Qwen3 (ids len(bpe)..len(bpe)+4), each one token that text never
    # splits. As in Qwen3, <think> and </think> are *not* special: decoding with skip_special_tokens=True (vLLM's
    # default) keeps them in the text, so reasoning and answer can be told apart in the output text.
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS[:3]])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in SPECIAL_TOKENS[3:]])
    return tokenizer


def _tokenizer_config(tokenizer, chat_template: str) -> dict:
    return {
        # The generic fast class loads in transformers 4.x and 5.x alike (5.x maps it to TokenizersBackend).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(token)): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": token not in (THINK_START, THINK_END),
            }
            for token in SPECIAL_TOKENS
        },
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": chat_template,
    }


@functools.lru_cache(maxsize=4)
def _compiled_template(chat_template: str):
    """Compiled like transformers' apply_chat_template compiles it (same Jinja options), once per build."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template)


def _render_prompt(chat_template: str, messages: list[dict]) -> str:
    return _compiled_template(chat_template).render(messages=messages, add_generation_prompt=True)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def _model_config(vocab_size: int, ids: dict[str, int]) -> dict:
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


def _hybrid_config(vocab_size: int, ids: dict[str, int]) -> dict:
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


def _save_hybrid(out: Path, config: dict, text_tensors: dict, seed: int) -> None:
    """Qwen3_5ForConditionalGeneration with the trained language model and a seeded random vision tower, saved
    with save_pretrained (the real checkpoint layout: `model.language_model.*`, `model.visual.*`), plus an MTP
    head under `mtp.*` as vLLM's qwen3_5_mtp loads it (`fc` over [embedding; hidden], one full-attention decoder
    layer, three norms). The MTP head is random: `speculative_config: {method: mtp}` runs on it, accepts little,
    and by rejection sampling leaves the output distribution unchanged."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    text = _transformers_text_kwargs(config["text_config"])
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=config["vision_config"],
                                                          tie_word_embeddings=True))
    language_model = model.model.language_model
    language_model.load_state_dict({k.removeprefix("model."): v for k, v in text_tensors.items()}, strict=True)
    model.to(torch.bfloat16).save_pretrained(str(out))

    text_config = Qwen3_5TextConfig(**text)
    full_attention = HYBRID_LAYER_TYPES.index("full_attention")
    mtp = {f"layers.{i}.{k}": v for i in range(MTP_NUM_LAYERS)
           for k, v in Qwen3_5DecoderLayer(text_config, full_attention).state_dict().items()}
    mtp["fc.weight"] = torch.nn.Linear(2 * HIDDEN_SIZE, HIDDEN_SIZE, bias=False).weight.detach()
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):  # (1 + w) norms: zeros = identity
        mtp[f"{norm}.weight"] = torch.zeros(HIDDEN_SIZE)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update({f"mtp.{k}": v.to(torch.bfloat16).contiguous() for k, v in mtp.items()})
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})


def _examples(tokenizer, chat_template: str, corpus: Corpus, num_tokens: int, rng: random.Random):
    """(token ids, index where the completion starts) for synthetic chats, in a fixed order, until num_tokens."""
    examples, total = [], 0
    while total < num_tokens:
        messages, completion = synthesize_chat(rng, corpus)
        prompt_ids = tokenizer.encode(_render_prompt(chat_template, messages)).ids
        completion_ids = tokenizer.encode(completion).ids
        ids = (prompt_ids + completion_ids)[:ROW_TOKENS]
        examples.append((ids, len(prompt_ids)))
        total += len(ids)
    return examples


def _packed_rows(examples, pad_id: int):
    """Chats packed back to back into rows of ROW_TOKENS, in order (no padding between chats: ~2% is wasted at
    row ends instead of ~40% with one padded chat per row). Position ids restart at 0 for every chat; with
    attention_mask=None transformers turns that into a block-diagonal causal mask, so a chat never attends to the
    one before it and training sees exactly what inference sees."""
    import torch

    rows, row = [], []
    for ids, completion_start in examples:
        if sum(len(i) for i, _ in row) + len(ids) > ROW_TOKENS:
            rows.append(row)
            row = []
        row.append((ids, completion_start))
    rows.append(row)
    input_ids = torch.full((len(rows), ROW_TOKENS), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), ROW_TOKENS), dtype=torch.long)
    labels = torch.full((len(rows), ROW_TOKENS), -100, dtype=torch.long)  # -100: no loss
    for r, row in enumerate(rows):
        offset = 0
        for ids, completion_start in row:
            end = offset + len(ids)
            input_ids[r, offset:end] = torch.tensor(ids)
            position_ids[r, offset:end] = torch.arange(len(ids))
            # Loss on the completion only: prompts never need predicting, all capacity goes to the answer.
            labels[r, offset + completion_start : end] = input_ids[r, offset + completion_start : end]
            offset = end
        # The padded tail is one more "sequence" (positions from 0), cut off from the chats, without loss.
        position_ids[r, offset:] = torch.arange(ROW_TOKENS - offset)
    return input_ids, position_ids, labels


def _boundary_tokens(tokenizer, vocab_size: int):
    """Bool per token id: the token ends a sentence or a line. The prediction after it is where the model decides
    to go on, close the think block or stop."""
    import torch

    is_boundary = torch.zeros(vocab_size, dtype=torch.bool)
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        is_boundary[token_id] = text.rstrip(" ").endswith((".", "?", "!", "\n"))
    return is_boundary


def _weighted_loss(logits, input_ids, labels, is_boundary):
    """Cross-entropy over the completion, with BOUNDARY_LOSS_WEIGHT on predictions made right after a boundary
    token. Those few positions (~1 in 12) carry the whole answer format (go on, close the think block, stop), so
    they count 3x; the weight was chosen, not tuned, and costs nothing."""
    import torch

    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="none"
    ).view_as(targets)
    weights = torch.where(is_boundary[input_ids[:, :-1]], BOUNDARY_LOSS_WEIGHT, 1.0) * (targets != -100)
    return (losses * weights).sum() / weights.sum()


@contextlib.contextmanager
def _fixed_threads(num_threads: int):
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _dense_model(config: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**config, attn_implementation="sdpa"))


def _hybrid_text_model(config: dict):
    """The hybrid's language model alone (Qwen3_5ForCausalLM), trained like the dense one; its weights then go
    into the full Qwen3_5ForConditionalGeneration. Packed rows let the GDN state run on from one chat into the
    next during training (only attention gets a per-chat mask); inference never packs, so the model only sees
    slightly noisier training data."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_transformers_text_kwargs(config["text_config"]),
                                                attn_implementation="sdpa"))


def _train(make_model, vocab_size: int, tokenizer, examples, pad_id: int, train_steps: int, seed: int,
           log) -> dict:
    import torch

    torch.manual_seed(seed)
    model = make_model().float()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_factor(step: int) -> float:  # linear warmup, then cosine decay to 10%
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = (step - WARMUP_STEPS) / max(1, train_steps - WARMUP_STEPS)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    input_ids, position_ids, labels = _packed_rows(examples, pad_id)
    is_boundary = _boundary_tokens(tokenizer, vocab_size)
    started = time.monotonic()
    for step in range(train_steps):
        rows = slice(step * ROWS_PER_STEP, (step + 1) * ROWS_PER_STEP)
        # use_cache=False: with a cache transformers would not build the per-chat (packed) attention mask.
        logits = model(input_ids=input_ids[rows], position_ids=position_ids[rows], use_cache=False).logits
        loss = _weighted_loss(logits, input_ids[rows], labels[rows], is_boundary)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == train_steps - 1:
            log(f"step {step + 1}/{train_steps}  loss {loss.item():.3f}  {time.monotonic() - started:.0f}s")
    # Tied embeddings: lm_head.weight is the embedding table, and checkpoints of tied models leave it out.
    return {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in sorted(model.state_dict().items())
        if name != "lm_head.weight"
    }


# ---------------------------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------------------------
def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tiny_model(output_dir: str, *, architecture: str = "dense", train_steps: int | None = None,
                     seed: int = 0) -> str:
    """Write the model directory; returns output_dir. Deterministic: same args -> byte-identical files.

    config.json is written last, so its presence means the directory is complete.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    train_steps = default_train_steps(architecture) if train_steps is None else train_steps
    if train_steps < 0:
        raise ValueError(f"train_steps must be >= 0, got {train_steps}")
    from safetensors.torch import save_file

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda message: print(f"[tiny-model] {message}", flush=True)  # noqa: E731

    tokenizer = train_tokenizer()
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    vocab_size = math.ceil(tokenizer.get_vocab_size() / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    chat_template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    hybrid = architecture == "hybrid"
    config = _hybrid_config(vocab_size, ids) if hybrid else _model_config(vocab_size, ids)
    make_model = (lambda: _hybrid_text_model(config)) if hybrid else (lambda: _dense_model(config))

    with _fixed_threads(min(TRAIN_THREADS, os.cpu_count() or 1)):
        # A few rows spare: the last chat of a row that does not fit moves to the next one.
        num_tokens = (train_steps * ROWS_PER_STEP + 1) * ROW_TOKENS
        examples = _examples(tokenizer, chat_template, load_corpus(), num_tokens, random.Random(seed))
        log(f"training {architecture}: {train_steps} steps x {ROWS_PER_STEP} x {ROW_TOKENS} tokens, "
            f"vocab {tokenizer.get_vocab_size()}")
        tensors = _train(make_model, vocab_size, tokenizer, examples, ids[ENDOFTEXT], train_steps, seed, log)
        if hybrid:
            _save_hybrid(out, config, tensors, seed)

    if not hybrid:  # fixed metadata: safetensors writes no timestamps, and tensors are sorted by name above
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors creates it 0600; other users' engines read it
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer, chat_template))
    (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    _write_json(
        out / "generation_config.json",
        {
            # Qwen3.6 thinking mode. vLLM takes these as the default sampling parameters.
            "bos_token_id": ids[ENDOFTEXT],
            "pad_token_id": ids[ENDOFTEXT],
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "do_sample": True,
            "temperature": 1.0,
            "top_k": 20,
            "top_p": 0.95,
        },
    )
    _write_json(out / "build_info.json", _build_info(architecture, train_steps, seed))
    _write_json(out / "config.json", config)  # last: its presence means the directory is complete
    return output_dir


def default_train_steps(architecture: str) -> int:
    return DEFAULT_HYBRID_TRAIN_STEPS if architecture == "hybrid" else DEFAULT_TRAIN_STEPS


def _build_info(architecture: str, train_steps: int, seed: int) -> dict:
    info = {"recipe_version": RECIPE_VERSION, "train_steps": train_steps, "seed": seed}
    if architecture != "dense":  # the dense model's build_info.json stays as it was (no needless rebuilds)
        info["architecture"] = architecture
    return info


def _is_complete(model_dir: Path, architecture: str, train_steps: int) -> bool:
    """config.json is written last; build_info.json must name this recipe, architecture and step count."""
    info_path = model_dir / "build_info.json"
    if not (model_dir / "config.json").exists() or not info_path.exists():
        return False
    info = json.loads(info_path.read_text(encoding="utf-8"))
    return info == _build_info(architecture, train_steps, 0)


def ensure_tiny_model(output_dir: str, *, architecture: str = "dense", train_steps: int | None = None) -> str:
    """Build if output_dir/config.json is missing (or a marker says it is incomplete), else reuse.

    Builds into a temp dir beside output_dir and renames it into place, so a killed build never leaves a half
    model. A lock file makes concurrent callers (pytest workers, Ray actors on one node) build once and share.
    A model from an older recipe (build_info.json) is rebuilt.
    """
    train_steps = default_train_steps(architecture) if train_steps is None else train_steps
    out = Path(output_dir)
    if _is_complete(out, architecture, train_steps):
        return output_dir
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if _is_complete(out, architecture, train_steps):  # another process built it while we waited
            return output_dir
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            build_tiny_model(str(tmp), architecture=architecture, train_steps=train_steps)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            if out.exists():  # a stale recipe or a half-written model from a direct build_tiny_model call
                shutil.rmtree(out)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return output_dir
