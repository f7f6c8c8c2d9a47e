"""Stage 2 on a GPU, on the target's architecture: every batch layout against a plain forward of each sample alone.

    PYTHONPATH=.:/root/site python3 bench/gpu_hybrid_exactness.py --out $OUT/exactness.json

Needs torch, transformers, flash-linear-attention (and vLLM for the vllm backend part); no Ray. What it measures,
on a small random bf16 model of the Qwen3.5/3.6 shape (8 layers: GDN x3 + attention, twice; head_dim 256,
16/48 linear heads of 128) and on the project's tiny hybrid:
- the relative L2 difference per (sample, layer) between the extractor's features and
  `output_hidden_states[k + 1]` of a plain forward of the sample alone, over the sample and its first 16 tokens,
  for padded batches, packed batches (GDN layers once per sequence), and packed batches with that taken away (the
  old behaviour: what the exactness self-check must catch);
- packed batches with the GDN layers once per batch through flash-linear-attention's varlen kernels (`gdn`
  'varlen', the default on GPUs);
- packed varlen batches with the elementwise work fused (`fuse` 'compile' and 'fla'): `--fused` runs
  only these rows and the unfused varlen row beside them;
- the same for the vLLM backend (`extract_hidden_states`), on the tiny hybrid.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from job.hidden_states.checks import compare, reference_features, split_features
from job.hidden_states.samples import Sample, plan_parts
from job.hidden_states.transformers_backend import TransformersExtractor, load_model

SMALL = dict(vocab_size=4096, hidden_size=2048, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
             layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, max_position_embeddings=8192,
             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                              "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def samples_of(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [Sample(id=f"s{i}", input_ids=rng.integers(0, vocab, size=int(n)).astype(np.int32), num_prompt_tokens=8,
                   original_num_tokens=int(n), row=i) for i, n in enumerate(lengths)]


def measure(model, samples, layer_ids, attention, leak=False, gdn="per_sequence", fuse="off"):
    import torch

    original = TransformersExtractor.per_sequence
    if leak:
        TransformersExtractor.per_sequence = lambda self, mixer, forward: forward
    ex = TransformersExtractor(model, layer_ids=layer_ids, batch_tokens=65536, attention=attention,
                               gdn="per_sequence" if leak or attention == "padded" else gdn, fuse=fuse)
    started = time.perf_counter()
    (part,) = list(ex.run([(0, plan_parts(samples, len(samples))[0])], pooled=False))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    got = split_features(part.samples, part.features, len(layer_ids), ex.hidden_size, "bfloat16")
    ref = reference_features(model, part.samples, layer_ids)
    diffs = compare(part.samples, got, ref, layer_ids)
    ex.close()
    TransformersExtractor.per_sequence = original
    by_order = {s.id: i for i, s in enumerate(part.samples)}
    layout = ex.attention + (" without per-sequence GDN (old)" if leak else f", GDN {ex.gdn}" if ex.packed else "")
    layout += f", fused {ex.fuse}" if ex.fuse != "off" else ""
    return {"attention": layout, "seconds": seconds,
            "max_whole": max(d.whole for d in diffs), "max_first16": max(d.first for d in diffs),
            "first_in_batch_max": max(max(d.whole, d.first) for d in diffs if by_order[d.sample] == 0),
            "later_in_batch_max": max(max(d.whole, d.first) for d in diffs if by_order[d.sample] > 0)}


def main():
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", default=".cache/tiny-hybrid")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU, short samples: check the script runs")
    parser.add_argument("--fused", action="store_true",
                        help="only packed batches: varlen GDN unfused, fused by torch.compile and by fla")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    try:
        import fla
        results["fla"] = fla.__version__
    except ImportError:
        results["fla"] = None

    torch.manual_seed(0)
    with torch.device(device):
        small = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL, attn_implementation="sdpa")).to(torch.bfloat16).eval()
    lengths = [90, 70, 40, 17] if args.smoke else [900, 700, 512, 300, 130, 64, 40, 17]
    samples = samples_of(lengths, SMALL["vocab_size"])
    rows = []
    gdn = "per_sequence" if args.smoke else "varlen"
    if args.fused:
        layouts = [("packed", False, gdn, fuse) for fuse in ("off", "compile") + (() if args.smoke else ("fla",))]
    else:
        varlen = [] if args.smoke else [("packed", False, "varlen", "off")]
        layouts = [("padded", False, "", "off"), ("packed", False, "per_sequence", "off"), *varlen,
                   ("packed", True, "", "off")]
    for attention, leak, gdn, fuse in layouts:
        rows.append({"model": "small qwen3_5 shape (8 layers, hidden 2048)",
                     **measure(small, samples, [1, 3, 7], attention, leak, gdn, fuse)})
        print(json.dumps(rows[-1]), flush=True)
    del small
    torch.cuda.empty_cache()

    tiny = load_model(args.tiny, dtype="bfloat16", device=device)
    tiny_samples = samples_of([300, 200, 120, 64, 33, 9], 3700, seed=1)
    for attention, leak, gdn, fuse in layouts:
        if leak:
            continue
        rows.append({"model": "tiny hybrid", **measure(tiny, tiny_samples, [0, 1, 2], attention, gdn=gdn, fuse=fuse)})
        print(json.dumps(rows[-1]), flush=True)
    ref = reference_features(tiny, tiny_samples, [0, 1, 2])
    del tiny
    if device == "cuda":
        torch.cuda.empty_cache()
    results["transformers"] = rows

    if not args.skip_vllm:
        from job.hidden_states.vllm_backend import VllmExtractor

        try:
            started = time.perf_counter()
            ex = VllmExtractor(args.tiny, layer_ids=[0, 1, 2], dtype="bfloat16", max_length=1024, engine_kwargs={
                "language_model_only": True, "gpu_memory_utilization": 0.3, "enforce_eager": True,
                "additional_config": {"gdn_prefill_backend": "triton"}})
            start_s = time.perf_counter() - started
            (part,) = list(ex.run([(0, tiny_samples)], pooled=False))
            got = split_features(part.samples, part.features, 3, ex.hidden_size, "bfloat16")
            diffs = compare(part.samples, got, ref, [0, 1, 2])
            results["vllm"] = {"engine_start_s": start_s, "max_whole": max(d.whole for d in diffs),
                               "max_first16": max(d.first for d in diffs),
                               "by_sample": {d.sample: max(d.whole, d.first) for d in diffs}}
        except Exception as e:  # report, do not lose the transformers figures
            results["vllm"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps(results["vllm"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
