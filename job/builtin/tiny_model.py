"""The project's own tiny models: tokenizer, chat template and weights, trained briefly on CPU. Two architectures:

- `dense`:  Qwen3ForCausalLM (the demo's model);
- `hybrid`: the target's own architecture, Qwen3.5/3.6 (`Qwen3_5ForConditionalGeneration`): 3 Gated DeltaNet
            layers (causal conv1d + gated delta rule) then 1 gated full-attention layer, a tiny vision tower, an MTP
            head trained on the frozen language model (~40 s more), saved with `save_pretrained` so its keys carry the
            real `model.language_model.` prefixes.

Nothing can be downloaded in CI or on an offline laptop, yet the tests, the demo and the benchmarks need a real
model that real vLLM (CPU build) and real transformers load and that answers in the same shape as the target
model (Qwen3.6 in thinking mode): `reasoning\n</think>\n\nanswer<|im_end|>` after a generation prompt that
already opened `<think>\n`. This package builds one from `job/builtin/data/corpus.txt` (~35 KB of original text shipped
with the package), deterministically: the same arguments give byte-identical files on the same machine and
package versions.

    python -m job tiny-model --output .cache/tiny-model                  # default recipe, ~85 s on 2 cores
    python -m job tiny-model --output .cache/tiny-hybrid --architecture hybrid
    python -m job tiny-model --output /tmp/tiny --train-steps 5          # ~5 s: loadable, not trained

    from job.builtin.tiny_model import ensure_tiny_model
    model_dir = ensure_tiny_model(".cache/tiny-model")                   # builds once, then reuses

This module is the recipe read top to bottom (corpus → synthetic chats → tokenizer → config → brief training →
files); the steps live beside it in job/builtin/: corpus.py (the corpus and the synthetic chats), tokenizer.py
(special tokens, BPE, the chat template), architectures.py (shapes, config.json, the torch models, saving the
hybrid), training.py (packed rows, weighted loss, the train loop) and mtp_head.py (the hybrid's MTP head: `worth`'s
baseline must be a real one). Nothing else in the package uses them.

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

import fcntl
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

from job.builtin.architectures import (
    ARCHITECTURES,
    HYBRID_LAYER_TYPES,
    MAX_POSITION_EMBEDDINGS,
    VOCAB_PAD_MULTIPLE,
    dense_model,
    hybrid_config,
    hybrid_text_model,
    model_config,
    save_hybrid,
)
from job.builtin.corpus import CORPUS_PATH, load_corpus
from job.builtin.mtp_head import MTP_NUM_CHATS, MTP_TRAIN_STEPS, train_mtp_head
from job.builtin.tokenizer import (
    CHAT_TEMPLATE_PATH,
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    tokenizer_config,
    train_tokenizer,
)
from job.builtin.training import (
    DEFAULT_HYBRID_TRAIN_STEPS,
    DEFAULT_TRAIN_STEPS,
    ROW_TOKENS,
    ROWS_PER_STEP,
    TRAIN_THREADS,
    fixed_threads,
    train,
    training_examples,
)

# Bump when anything in job/builtin/ changes what gets built; ensure_tiny_model() then rebuilds stale cached models.
RECIPE_VERSION = 2


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
    # heavy: keeps python -m job --help fast
    from safetensors.torch import save_file  # heavy: imported on use

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda message: print(f"[tiny-model] {message}", flush=True)  # noqa: E731

    tokenizer = train_tokenizer(CORPUS_PATH)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    vocab_size = math.ceil(tokenizer.get_vocab_size() / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    chat_template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    hybrid = architecture == "hybrid"
    config = hybrid_config(vocab_size, ids) if hybrid else model_config(vocab_size, ids)
    make_model = (lambda: hybrid_text_model(config)) if hybrid else (lambda: dense_model(config))

    with fixed_threads(min(TRAIN_THREADS, os.cpu_count() or 1)):
        # A few rows spare: the last chat of a row that does not fit moves to the next one.
        num_tokens = (train_steps * ROWS_PER_STEP + 1) * ROW_TOKENS
        examples = training_examples(tokenizer, chat_template, load_corpus(), num_tokens, random.Random(seed))
        log(f"training {architecture}: {train_steps} steps x {ROWS_PER_STEP} x {ROW_TOKENS} tokens, "
            f"vocab {tokenizer.get_vocab_size()}")
        tensors = train(make_model, vocab_size, tokenizer, examples, ids[ENDOFTEXT], train_steps, seed, log)
        if hybrid:
            save_hybrid(out, config, tensors, _trained_mtp_head(config, tensors, tokenizer, chat_template, seed, log),
                        seed)

    if not hybrid:  # fixed metadata: safetensors writes no timestamps, and tensors are sorted by name above
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors creates it 0600; other users' engines read it
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, chat_template, MAX_POSITION_EMBEDDINGS))
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


def _trained_mtp_head(config: dict, tensors: dict, tokenizer, chat_template: str, seed: int, log) -> dict:
    """The hybrid's MTP head trained on the trained language model (frozen), on chats it has not seen."""
    model = hybrid_text_model(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)  # tied to the embeddings
    chats, corpus = [], load_corpus()
    rng = random.Random(seed + 1)  # not the language model's own chats
    while len(chats) < MTP_NUM_CHATS:
        chats += training_examples(tokenizer, chat_template, corpus, ROW_TOKENS, rng)
    return train_mtp_head(model, model.config, HYBRID_LAYER_TYPES.index("full_attention"), chats[:MTP_NUM_CHATS],
                          tokenizer.token_to_id(ENDOFTEXT), seed, log)


def default_train_steps(architecture: str) -> int:
    return DEFAULT_HYBRID_TRAIN_STEPS if architecture == "hybrid" else DEFAULT_TRAIN_STEPS


def _build_info(architecture: str, train_steps: int, seed: int) -> dict:
    info = {"recipe_version": RECIPE_VERSION, "train_steps": train_steps, "seed": seed}
    if architecture != "dense":  # the dense model's build_info.json stays as it was (no needless rebuilds)
        info["architecture"] = architecture
        info["mtp_train_steps"] = MTP_TRAIN_STEPS
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
