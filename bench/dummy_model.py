"""A model directory of the Qwen3.6-27B shape for vLLM's `load_format: dummy` (random weights, no weight files).

    python bench/dummy_model.py [.cache/dummy-hybrid-27b]

config.json: `Qwen3_5ForConditionalGeneration` with the 27B text shape (bench_hybrid_stage2.SHAPE_27B: hidden 5120,
64 layers, 3 Gated DeltaNet : 1 gated attention, one MTP layer) and a tiny vision tower (`language_model_only`
skips it). The tokenizer and chat template are the tiny hybrid's (.cache/tiny-hybrid, thinking-mode template): its
3,792 ids are a subset of the 248,320 the model samples from.

Output lengths: random weights never pick one EOS id out of 248,320, so every completion would run to max_tokens
and there would be no long tail. generation_config.json therefore lists EOS_FRACTION of the vocabulary as EOS ids:
with near-uniform random sampling each step ends a completion with probability ~1/600, a geometric length
distribution (median ~415, mean ~600, ~3 % cut at max_tokens 2048). Every contender uses the same file.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MEAN_OUTPUT_TOKENS = 600
VOCAB = 248320


def ensure_dummy_hybrid_27b(path: str, tokenizer_from: str = ".cache/tiny-hybrid") -> str:
    from bench_hybrid_stage2 import SHAPE_27B

    if os.path.exists(os.path.join(path, "generation_config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tokenizer_from, name), path)
    tiny = json.load(open(os.path.join(tokenizer_from, "config.json")))
    text = {**tiny["text_config"], **SHAPE_27B, "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16, "max_position_embeddings": 262144}
    assert text["vocab_size"] == VOCAB
    config = {**tiny, "tie_word_embeddings": False, "text_config": text}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    rng = np.random.default_rng(0)
    special = json.load(open(os.path.join(tokenizer_from, "generation_config.json")))["eos_token_id"]
    extra = rng.choice(np.arange(4096, VOCAB), VOCAB // MEAN_OUTPUT_TOKENS, replace=False)
    generation = {"eos_token_id": sorted(set(special) | set(int(i) for i in extra)), "pad_token_id": special[-1],
                  "do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    return path


if __name__ == "__main__":
    print(ensure_dummy_hybrid_27b(sys.argv[1] if len(sys.argv) > 1 else ".cache/dummy-hybrid-27b"))
