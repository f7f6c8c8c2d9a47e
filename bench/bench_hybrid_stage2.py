"""Stage 2 (transformers backend) on the 27B hybrid shape: padded vs packed batches vs a plain forward, one process.

    PYTHONPATH=.:/root/site python3 bench/bench_hybrid_stage2.py --out $OUT/hybrid_stage2.json    # one H200
        [--layouts padded packed:per_sequence packed:varlen packed:varlen:fuse-compile packed:varlen:fuse-fla:fp8]
        [--profile $OUT/kernels.txt] [--smoke]   (--smoke: a small shape on CPU, to check the script runs)

Qwen3.6-27B text shape (hidden 5120, 64 layers: 3 Gated DeltaNet : 1 gated attention, head_dim 256, 24/4 heads,
16/48 linear heads of 128, intermediate 17408), random bf16 weights, DFlash layers [1, 16, 31, 46, 61]. The samples
are bench_hidden_states.py's (log-normal lengths, median 1400, clipped to [256, 4096]). Timed on the second of two
passes of each (kernel autotuning, first shapes): the extractor end to end (forward with hooks, stopping after layer 61;
checks; device->host copy) in each layout (packed batches: the GDN layers once per sequence through transformers'
own layer, or once per batch through flash-linear-attention's varlen kernels), and a plain transformers forward of all
64 layers over the same padded
batches (no hooks, nothing copied back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_hidden_states import make_samples, plain_forward  # noqa: E402

from job.hidden_states import fp8
from job.hidden_states.samples import plan_batches, plan_parts
from job.hidden_states.transformers_backend import TransformersExtractor

SMOKE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=32,
             linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, max_position_embeddings=4096,
             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                              "mrope_section": [4, 2, 2], "mrope_interleaved": True})
SHAPE_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                 num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=48, max_position_embeddings=40960,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                  "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def run_samples(run: str, limit: int | None = None) -> list:
    """Every kept sample of a run's completion shards (of its first `limit` rows, as `hidden-states --limit`), in
    stage 2's rules (the config's defaults: max_length 4096, flagged rows kept), shard by shard as its units are."""
    from job import layout, scan, storage
    from job.hidden_states.samples import samples_from_completions

    samples, rows = [], 0
    for shard in scan.judge_completion_shards(run).trusted:
        table = storage.read_shard(shard.uri)
        take = table.num_rows if limit is None else min(table.num_rows, limit - rows)
        if take <= 0:
            break
        samples += samples_from_completions(table, max_length=4096, keep_flagged=True, row_limit=take)[0]
        rows += take
    assert samples, f"{run}: no completion shard under {layout.COMPLETIONS_DIR}"
    return samples


def profile(ex, samples, path):
    """Which kernels take the GPU's time: torch.profiler over the first 3 parts (24 samples), CUDA time per kernel
    name."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    parts = list(enumerate(plan_parts(samples, 8)))[:3]
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for part in ex.run(parts):
            part.release()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    with open(path, "w") as f:
        f.write(table)
    print(table[:6000], flush=True)


def main():
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-samples", type=int, default=120)
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--layouts", nargs="*", default=["padded", "packed:per_sequence", "packed:varlen"],
                        help="attention[:gdn[:fuse-KIND][:fp8]] of each extractor timed; fuse-KIND: the extractor's "
                             "`fuse` (compile, fla, off; default off here, so the layouts of earlier runs mean what "
                             "they meant); fp8: FP8 storage's records, quantized on the device before the copy, and "
                             "split on the host as the writer does")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain 64-layer forward at the end")
    parser.add_argument("--profile", help="write the top CUDA kernels of 3 parts of the last layout here")
    parser.add_argument("--smoke", action="store_true", help="a small shape on CPU, few samples: the script runs")
    parser.add_argument("--model", help="a checkpoint directory to load (bench/reduced_checkpoint.py) instead of "
                        "building the 27B shape in process")
    parser.add_argument("--run", help="a run directory: its completion shards' samples (what stage 2 extracts), "
                        "instead of drawn ones")
    parser.add_argument("--layers", help="the layers captured, comma-separated (default: DFlash's on the 27B)")
    parser.add_argument("--rows-per-part", type=int, default=8, help="samples per part (hidden_states.rows_per_shard)")
    parser.add_argument("--limit", type=int, help="with --run: its first N rows only (hidden-states --limit)")
    args = parser.parse_args()
    for layout in args.layouts:  # fail here, not after minutes on the GPU
        attention, gdn, *extra = layout.split(":") + [""]
        assert attention in ("padded", "packed") and gdn in ("", "per_sequence", "varlen"), layout
        assert all(e in ("", "fp8", "fuse-compile", "fuse-fla", "fuse-off", "fuse-reference") for e in extra), layout
    device = "cpu" if args.smoke else "cuda"
    layer_ids = [1, 3, 5, 6] if args.smoke else [1, 16, 31, 46, 61]
    if args.layers:
        layer_ids = [int(x) for x in args.layers.split(",")]
    started = time.perf_counter()
    if args.model:  # as stage 2's worker loads it
        from job.hidden_states.transformers_backend import load_model

        model = load_model(args.model, device=device)
    else:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**(SMOKE if args.smoke else SHAPE_27B),
                                                         attn_implementation="sdpa")).eval()
        torch.set_default_dtype(torch.float32)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    results = {"init_s": time.perf_counter() - started,
               "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
               "torch": torch.__version__}
    if args.run:
        samples = run_samples(args.run, args.limit)
    elif args.smoke:
        samples = make_samples(6, SMOKE["vocab_size"], seed=0, min_len=100, max_len=300)
    else:
        samples = make_samples(args.num_samples, 4096, seed=0, min_len=256, max_len=4096)
    tokens = sum(s.num_tokens for s in samples)
    results["num_tokens"] = tokens
    for layout in args.layouts:
        attention, gdn, *extra = layout.split(":") + [""]
        fuse = next((e.split("-", 1)[1] for e in extra if e.startswith("fuse-")), "off")
        ex = TransformersExtractor(model, layer_ids=layer_ids, batch_tokens=args.batch_tokens, attention=attention,
                                   gdn=gdn or "auto", fuse=fuse)
        ex.fp8_records = "fp8" in extra
        # Timed on the second of two full passes: fla's Triton kernels autotune on every new batch shape, and the
        # first pass pays that (measured: 52 s padded, 33 s packed on the first pass).
        passes = []
        for _ in range(2):
            sync()
            t = time.perf_counter()
            split_s, nbytes = 0.0, 0
            for part in ex.run(list(enumerate(plan_parts(samples, args.rows_per_part)))):
                nbytes += part.features.nbytes  # host bytes the pass copied into parts (pool buffers, exact size)
                if ex.fp8_records:  # the writer thread's share: FP8 records -> the shard's two columns
                    s0 = time.perf_counter()
                    fp8.split_records(part.features, sum(s.num_tokens for s in part.samples), len(layer_ids),
                                      ex.hidden_size)
                    split_s += time.perf_counter() - s0
                part.release()
            sync()
            passes.append(time.perf_counter() - t)
        first_s, seconds = passes
        results[layout] = {"seconds": seconds, "tokens_per_s": tokens / seconds, "split_s": split_s, "fuse": ex.fuse,
                           "gdn": ex.gdn, "first_pass_s": first_s,
                           "part_bytes": nbytes,
                           "padding_waste": ex.stats.padding_waste, "wait_gpu_s": ex.stats.wait_gpu_s}
        if args.profile and layout == args.layouts[-1]:
            profile(ex, samples, args.profile)
        ex.close()
        print(layout, json.dumps(results[layout]), flush=True)
        with open(args.out, "w") as f:  # after every layout: a call cut off at its time limit keeps what it measured
            json.dump(results, f, indent=2)
    if args.no_plain:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        return
    ordered = [s for p in plan_parts(samples, 8) for s in p]
    batches = [ordered[a:b] for a, b in plan_batches([s.num_tokens for s in ordered], args.batch_tokens)]
    plain_forward(model, batches, device, packed=False)  # its shapes are tuned already: one pass to be sure
    seconds = plain_forward(model, batches, device, packed=False)
    results["plain_forward_padded_64_layers"] = {"seconds": seconds, "tokens_per_s": tokens / seconds}
    print("plain", json.dumps(results["plain_forward_padded_64_layers"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
