"""A checkpoint of the Qwen3.6-27B hybrid's widths at reduced depth, random bf16 weights, written as safetensors:
what `python -m job hidden-states` loads on a GPU where the 27B's weights cannot be made (bench/gpu_stage2_cli.sh).

    python3 bench/reduced_checkpoint.py --layers 8 --out /root/reduced-27b     # on the GPU: ~11 GB, ~1 min
    .venv/bin/python bench/reduced_checkpoint.py --smoke --out /tmp/reduced-smoke    # a small shape, CPU

The text model alone (`Qwen3_5ForCausalLM`, model_type qwen3_5_text): hidden 5120, intermediate 17408, 24/4
attention heads of 256, 16/48 linear heads of 128, vocabulary 248,320 (bench_hybrid_stage2.SHAPE_27B), and
`--layers` decoder layers in the 27B's order, 3 Gated DeltaNet : 1 gated attention (8 layers: 6 + 2). The tokenizer
and chat template are the tiny hybrid's, as in bench/dummy_model.py: its ids are a subset of the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def text_config(layers: int, smoke: bool) -> dict:
    from bench_hybrid_stage2 import SHAPE_27B, SMOKE

    shape = {**(SMOKE if smoke else SHAPE_27B), "num_hidden_layers": layers}
    if smoke:  # the tiny hybrid's tokenizer has 3,840 ids
        shape["vocab_size"] = 3840
    return {**shape, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
            + ["linear_attention"] * (layers % 4), "tie_word_embeddings": False, "mtp_num_hidden_layers": 0}


def write_reduced_checkpoint(out: str, layers: int, smoke: bool = False, tokenizer_from: str = ".cache/tiny-hybrid",
                             seed: int = 0) -> dict:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**text_config(layers, smoke))
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):  # initialized where it is made: 5.6 B parameters at 8 layers take seconds on a GPU
        model = Qwen3_5ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    made = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_from, name), out)
    generation = json.load(open(os.path.join(tokenizer_from, "generation_config.json")))
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    facts = {"out": out, "layers": layers, "layer_types": config.layer_types,
             "parameters": sum(p.numel() for p in model.parameters()),
             "bytes": sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)),
             "init_s": made - started, "save_s": time.perf_counter() - made, "device": device}
    print(json.dumps(facts), flush=True)
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="a small shape on CPU (bench_hybrid_stage2.SMOKE)")
    parser.add_argument("--tokenizer-from", default=".cache/tiny-hybrid")
    args = parser.parse_args()
    write_reduced_checkpoint(args.out, args.layers, args.smoke, args.tokenizer_from)


if __name__ == "__main__":
    main()
