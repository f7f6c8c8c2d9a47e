"""Stage-2 extractor throughput against a plain transformers forward over the same tokens, in the same process.

    PYTHONPATH=. python3 bench/bench_hidden_states.py                       # Qwen3-8B shape, random bf16, GPU
    PYTHONPATH=. python3 bench/bench_hidden_states.py --shape tiny --num-samples 16 --device cpu   # smoke test

Needs only torch, transformers, pyarrow and numpy (the GPU machine has neither Ray nor vLLM): it drives the same
core the Ray actors use (job/hidden_states/). What is timed, after one warm-up pass of each:
- `plain forward`: the decoder stack (all layers, no LM head) over the same length-sorted batches, inputs
  copied to the GPU, nothing copied back: what a plain transformers forward costs for these tokens (timed on
  its second full pass, so it pays no first-shape costs);
- `extractor`: end to end, as in a run: batching + forward with hooks (stopping after the deepest captured
  layer) + gather of the real tokens + feature checks + device→host copy + Arrow table + Arrow IPC serialization
  (in memory, on the background writer thread).
Tokens are real tokens (padding not counted); TFLOP/s counts the useful matmul and causal-attention work of the
layers each pass ran. The sequence-length mix is log-normal (median 1400) clipped to [256, 4096].
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from job import schema  # noqa: E402
from job.hidden_states.samples import Sample, plan_batches, plan_parts
from job.hidden_states.shards import BackgroundWriter, part_table, table_to_ipc
from job.hidden_states.transformers_backend import TransformersExtractor

SHAPES = {
    # The reference shape: Qwen3-8B (hidden 4096, 36 layers, 32 heads, 8 kv heads, head_dim 128).
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=2048),
}


def build_model(shape: str, device: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).eval()  # random weights (transformers' init: normal, std 0.02)
    torch.set_default_dtype(default)
    return model


def make_samples(n: int, vocab: int, seed: int, min_len: int, max_len: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(math.log(1400), 0.6, size=n)), min_len, max_len).astype(int)
    out = []
    for i, length in enumerate(lengths):
        prompt = int(rng.integers(64, min(512, length)))
        out.append(Sample(id=f"s{i:06d}", input_ids=rng.integers(0, vocab, size=length, dtype=np.int32),
                          num_prompt_tokens=prompt, original_num_tokens=int(length), row=i))
    return out


def flops(samples: list[Sample], model, num_layers: int) -> float:
    """Useful FLOPs of `num_layers` decoder layers over the real tokens: 2 × layer weights per token, plus causal
    attention (QK^T and PV: 2 × 2 × n²/2 × heads × head_dim per layer per sequence)."""
    layer = model.model.layers[0]
    per_layer_params = sum(p.numel() for n, p in layer.named_parameters() if "norm" not in n)
    cfg = model.config
    tokens = sum(s.num_tokens for s in samples)
    attn = sum(2 * s.num_tokens ** 2 * cfg.num_attention_heads * cfg.head_dim for s in samples)
    return num_layers * (2 * per_layer_params * tokens + attn)


def plain_forward(model, batches, device: str, packed: bool) -> float:
    """Seconds for the decoder stack over the same batches (no hooks, no LM head, nothing copied back), inputs
    staged through pinned memory exactly as the extractor does. packed=False is plain transformers (SDPA over
    right-padded rows with a mask); packed=True uses the extractor's varlen attention on concatenated rows."""
    import torch

    from job.hidden_states.packing import PACKED_ATTENTION, register_packed_attention

    stack, config = model.model, model.model.config
    cuda = device == "cuda"
    dev = (lambda a: torch.from_numpy(a).pin_memory().to(device, non_blocking=True)) if cuda else torch.from_numpy
    if packed:
        register_packed_attention()
    implementation = config._attn_implementation
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        for rows in batches:
            counts = np.array([s.num_tokens for s in rows])
            longest = int(counts.max())
            if packed:
                cu = dev(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
                kwargs = dict(input_ids=dev(np.concatenate([s.input_ids for s in rows]).astype(np.int64)[None]),
                              position_ids=dev(np.concatenate([np.arange(n) for n in counts])[None]),
                              cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
            else:
                ids = np.zeros((len(rows), longest), dtype=np.int64)
                mask = np.zeros_like(ids)
                for r, s in enumerate(rows):
                    ids[r, :s.num_tokens], mask[r, :s.num_tokens] = s.input_ids, 1
                kwargs = dict(input_ids=dev(ids), attention_mask=dev(mask) if counts.sum() < ids.size else None)
            try:
                config._attn_implementation = PACKED_ATTENTION if packed else implementation
                stack(use_cache=False, **kwargs)
            finally:
                config._attn_implementation = implementation
    sync()
    return time.perf_counter() - start


def extract(extractor, parts, hs_schema, write_dir: str | None) -> tuple[float, int, float]:
    """Seconds end to end (forward, checks, copies, Arrow IPC serialization), IPC bytes produced, and the
    seconds the GPU loop was blocked waiting for the writer."""
    import torch

    from job.hidden_states.samples import RunStats

    extractor.stats = RunStats()
    sync = torch.cuda.synchronize if getattr(extractor, "cuda", False) else (lambda: None)
    sync()
    start = time.perf_counter()
    writer = BackgroundWriter(max_pending=2)

    def serialize(part):
        buf = table_to_ipc(part_table(part.samples, part.features, hs_schema))
        part.release()
        if write_dir:
            with open(os.path.join(write_dir, f"part-{part.index:05d}.arrow"), "wb") as f:
                f.write(buf)
        return buf.size

    for part in extractor.run(list(enumerate(parts))):
        writer.submit(serialize, part)
    nbytes = sum(writer.close())
    sync()
    return time.perf_counter() - start, nbytes, writer.blocked_s


def check_against_reference(model, extractor, samples, layer_ids) -> dict:
    """Relative error (‖Δ‖/‖ref‖ per sample and layer) of the extractor's features against transformers' own
    output_hidden_states[k + 1] on each sequence alone; and, as the bf16 noise floor, the same error of
    transformers itself when those sequences share one right-padded batch."""
    import torch

    parts = plan_parts(samples, len(samples))
    (part,) = list(extractor.run(list(enumerate(parts)), pooled=False))
    dtype = model.model.embed_tokens.weight.dtype
    feats = torch.from_numpy(part.features).view(dtype)
    L, H, pos = len(layer_ids), extractor.hidden_size, 0
    ours, floor = {k: 0.0 for k in layer_ids}, {k: 0.0 for k in layer_ids}
    longest = max(s.num_tokens for s in part.samples)
    ids = torch.zeros((len(part.samples), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(part.samples):
        ids[r, :s.num_tokens], mask[r, :s.num_tokens] = torch.from_numpy(s.input_ids.astype(np.int64)), 1
    with torch.inference_mode():
        batched = model(input_ids=ids.to(extractor.device), attention_mask=mask.to(extractor.device),
                        output_hidden_states=True, logits_to_keep=1).hidden_states
    for r, s in enumerate(part.samples):
        got = feats[pos:pos + s.num_tokens * L * H].view(s.num_tokens, L, H).float()
        pos += s.num_tokens * L * H
        with torch.inference_mode():
            single = model(input_ids=ids[r:r + 1, :s.num_tokens].to(extractor.device), output_hidden_states=True,
                           logits_to_keep=1).hidden_states
        for j, k in enumerate(layer_ids):
            ref = single[k + 1][0].float().cpu()
            ours[k] = max(ours[k], float((got[:, j] - ref).norm() / ref.norm()))
            other = batched[k + 1][r, :s.num_tokens].float().cpu()
            floor[k] = max(floor[k], float((other - ref).norm() / ref.norm()))
    return {"rel_err_vs_output_hidden_states": ours, "transformers_padded_batch_vs_single": floor}


def vllm_check(args) -> dict:
    """The vllm backend on a GPU. With --model DIR: the same samples through both backends, each compared with
    transformers' output_hidden_states[k + 1] on single sequences. With --shape: throughput on dummy weights."""
    import torch

    from job.hidden_states.transformers_backend import load_model
    from job.hidden_states.vllm_backend import VllmExtractor

    layer_ids = [int(x) for x in args.layers.split(";")[0].split(",")]
    result = {"backend": "vllm", "layer_ids": layer_ids}
    if args.model:
        import json as _json

        with open(os.path.join(args.model, "config.json")) as f:
            vocab = _json.load(f)["vocab_size"]
        samples = make_samples(args.num_samples, vocab, 2, args.min_len, args.max_len)
        parts = list(enumerate(plan_parts(samples, args.rows_per_shard)))
        started = time.perf_counter()
        vx = VllmExtractor(args.model, layer_ids=layer_ids, max_length=args.max_len,
                           engine_kwargs={"enforce_eager": True, "gpu_memory_utilization": 0.3})
        result["engine_start_s"] = time.perf_counter() - started
        feats = {}
        for part in vx.run(parts, pooled=False):
            pos = 0
            for s in part.samples:
                n = s.num_tokens * vx.width
                feats[s.id] = torch.from_numpy(part.features[pos:pos + n].copy()).view(torch.bfloat16).view(
                    s.num_tokens, len(layer_ids), vx.hidden_size)
                pos += n
        model = load_model(args.model, dtype="bfloat16", device="cuda")
        tx = TransformersExtractor(model, layer_ids=layer_ids, batch_tokens=8192)
        ours = {}
        for part in tx.run(parts, pooled=False):
            pos = 0
            for s in part.samples:
                n = s.num_tokens * tx.width
                ours[s.id] = torch.from_numpy(part.features[pos:pos + n]).view(torch.bfloat16).view(
                    s.num_tokens, len(layer_ids), tx.hidden_size)
                pos += n
        errs = {"vllm_vs_output_hidden_states": {}, "transformers_backend_vs_output_hidden_states": {},
                "vllm_vs_transformers_backend": {}, "vllm_vs_off_by_one_layer": {}}
        for s in samples:
            with torch.inference_mode():
                ref = model(input_ids=torch.from_numpy(s.input_ids.astype(np.int64))[None].cuda(),
                            output_hidden_states=True, logits_to_keep=1).hidden_states
            for j, k in enumerate(layer_ids):
                r, r_next = ref[k + 1][0].float().cpu(), ref[k + 2][0].float().cpu()
                v, t = feats[s.id][:, j].float(), ours[s.id][:, j].float()
                for name, a, b in (("vllm_vs_output_hidden_states", v, r),
                                   ("transformers_backend_vs_output_hidden_states", t, r),
                                   ("vllm_vs_transformers_backend", v, t), ("vllm_vs_off_by_one_layer", v, r_next)):
                    errs[name][k] = max(errs[name].get(k, 0.0), float((a - b).norm() / b.norm()))
        result.update(errs, num_samples=len(samples), num_tokens=sum(s.num_tokens for s in samples))
    else:
        from transformers import Qwen3Config

        engine_kwargs = {"load_format": "dummy", "enforce_eager": args.vllm_eager,
                         "gpu_memory_utilization": 0.85, "max_num_seqs": 256}
        if args.dummy_dir:  # e.g. bench/dummy_model.py's 27B hybrid directory (Qwen3_5ForConditionalGeneration)
            path, shape = args.dummy_dir, os.path.basename(args.dummy_dir.rstrip("/"))
            engine_kwargs.update(language_model_only=True, additional_config={"gdn_prefill_backend": "triton"},
                                 max_num_seqs=64)  # prefill only: 16384 tokens a step hold ~10 such samples
            from transformers import AutoConfig
            vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
        else:
            path, shape, vocab = "/tmp/bench-model-" + args.shape, args.shape, SHAPES[args.shape]["vocab_size"]
            Qwen3Config(**SHAPES[args.shape], max_position_embeddings=40960, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"],
                        dtype="bfloat16").save_pretrained(path)
        samples = make_samples(args.num_samples, vocab, 0, args.min_len, args.max_len)
        tokens = sum(s.num_tokens for s in samples)
        started = time.perf_counter()
        vx = VllmExtractor(path, layer_ids=layer_ids, max_length=args.max_len, engine_kwargs=engine_kwargs)
        result["engine_start_s"] = time.perf_counter() - started
        hs_schema = schema.hidden_states_schema(model=shape, layer_ids=vx.layer_ids, hidden_size=vx.hidden_size,
                                                dtype="bfloat16")
        parts = plan_parts(samples, args.rows_per_shard)
        extract(vx, plan_parts(samples[:16], 16), hs_schema, None)  # warm-up
        result.update(shape=shape, enforce_eager=args.vllm_eager, num_tokens=tokens,
                      rows_per_part=args.rows_per_shard)
        # The ceiling, in the same engine: vLLM's own extraction into files, every sample in one generate call,
        # nothing read back (the files are deleted after the clock stops).
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import cleanup_hidden_states

        started = time.perf_counter()
        outs = vx.llm.generate([{"prompt_token_ids": s.input_ids.tolist()} for s in samples],
                               SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
        engine_s = time.perf_counter() - started
        for out in outs:
            cleanup_hidden_states(out.kv_transfer_params["hidden_states_path"])
        result["engine_alone"] = {"seconds": engine_s, "tokens_per_s": tokens / engine_s}
        for prefetch in [int(x) for x in args.vllm_prefetch.split(",")]:
            vx.prefetch = prefetch
            seconds, nbytes, blocked = extract(vx, parts, hs_schema, None)
            result[f"prefetch_{prefetch}"] = {"seconds": seconds, "tokens_per_s": tokens / seconds,
                                              "vs_engine_alone": engine_s / seconds, "ipc_bytes": nbytes,
                                              "writer_blocked_s": blocked}
            print(json.dumps({f"prefetch_{prefetch}": result[f"prefetch_{prefetch}"],
                              "engine_alone": result["engine_alone"]}), flush=True)
    print(json.dumps(result), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-samples", type=int, default=384)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--layers", default="1,17,32;1,17,35",
                   help="';'-separated layer sets to measure (EAGLE-3's low/mid/high for 36 layers, then one that "
                        "ends in the last layer, so no layer is skipped)")
    p.add_argument("--batch-tokens", default="32768", help="comma-separated batch sizes in tokens")
    p.add_argument("--attention", default="packed,padded", help="extractor attention modes to measure")
    p.add_argument("--rows-per-shard", type=int, default=32)
    p.add_argument("--write-dir", help="also write each part's IPC file here (default: serialize in memory only)")
    p.add_argument("--json-out")
    p.add_argument("--vllm", action="store_true", help="measure the vllm backend instead (needs vLLM and CUDA)")
    p.add_argument("--model", help="with --vllm: a model directory to cross-check both backends on")
    p.add_argument("--vllm-eager", action="store_true", help="with --vllm: enforce_eager (faster start)")
    p.add_argument("--dummy-dir", help="with --vllm: a config-only model directory (load_format dummy) instead "
                                       "of --shape, e.g. the 27B hybrid from bench/dummy_model.py")
    p.add_argument("--vllm-prefetch", default="0,1",
                   help="with --vllm: the read-back overlaps to measure (parts generated ahead; 0 = in line)")
    args = p.parse_args(argv)
    if args.vllm:
        return vllm_check(args)

    import torch
    import transformers

    device = args.device if args.device != "cuda" or torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = build_model(args.shape, device)
    cfg = model.config
    samples = make_samples(args.num_samples, cfg.vocab_size, 0, args.min_len, args.max_len)
    warm = make_samples(max(4, args.num_samples // 16), cfg.vocab_size, 1, args.min_len, args.max_len)
    tokens = sum(s.num_tokens for s in samples)
    lengths = np.array([s.num_tokens for s in samples])
    result = {
        "shape": args.shape, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(model.dtype),
        "num_samples": len(samples), "num_tokens": tokens,
        "lengths": {"mean": float(lengths.mean()), "p10": int(np.percentile(lengths, 10)),
                    "p50": int(np.median(lengths)), "p90": int(np.percentile(lengths, 90)),
                    "max": int(lengths.max())},
        "model_build_s": time.perf_counter() - t0, "runs": [],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    parts = plan_parts(samples, args.rows_per_shard)
    order = [s for part in parts for s in part]
    padded_plain = {}
    for batch_tokens in map(int, args.batch_tokens.split(",")):
        for attention in args.attention.split(","):
            packed = attention == "packed"
            batches = [order[a:b] for a, b in plan_batches([s.num_tokens for s in order], batch_tokens, packed)]
            padded = sum(max(s.num_tokens for s in rows) * (1 if packed else len(rows)) for rows in batches)
            if packed:
                padded = tokens
            plain_forward(model, batches, device, packed)  # warm-up over every batch shape, untimed
            plain_s = plain_forward(model, batches, device, packed)
            if not packed:
                padded_plain[batch_tokens] = plain_s
            plain_flops = flops(samples, model, cfg.num_hidden_layers)
            base = {"batch_tokens": batch_tokens, "attention": attention, "num_batches": len(batches),
                    "padding_waste": 1 - tokens / padded, "plain_forward_s": plain_s,
                    "plain_tokens_per_s": tokens / plain_s, "plain_tflops": plain_flops / plain_s / 1e12}
            print(json.dumps(base), flush=True)
            for layer_set in args.layers.split(";"):
                layer_ids = [int(x) for x in layer_set.split(",")]
                extractor = TransformersExtractor(model, layer_ids=layer_ids, batch_tokens=batch_tokens,
                                                  attention=attention)
                hs_schema = schema.hidden_states_schema(model=args.shape, layer_ids=extractor.layer_ids,
                                                 hidden_size=extractor.hidden_size, dtype=extractor.dtype)
                extract(extractor, plan_parts(warm, args.rows_per_shard), hs_schema, None)  # warm-up
                if args.write_dir:
                    os.makedirs(args.write_dir, exist_ok=True)
                seconds, nbytes, writer_blocked_s = extract(extractor, parts, hs_schema, args.write_dir)
                stats = extractor.stats.to_dict()
                run_flops = flops(samples, model, max(extractor.layer_ids) + 1)
                check = check_against_reference(model, extractor, sorted(warm, key=lambda s: s.num_tokens)[:3],
                                                extractor.layer_ids)
                extractor.close()
                entry = {**base, "layer_ids": extractor.layer_ids, "layers_computed": max(extractor.layer_ids) + 1,
                         "extract_s": seconds, "tokens_per_s": tokens / seconds, "tflops": run_flops / seconds / 1e12,
                         "vs_plain_forward_same_attention": plain_s / seconds,
                         "ipc_bytes": nbytes, "feature_bytes_per_s": tokens * extractor.width / seconds,
                         "host_wait_gpu_s": stats["wait_gpu_s"], "host_copy_s": stats["host_copy_s"],
                         "writer_blocked_s": writer_blocked_s, **check,
                         "layer_rms": extractor.feature_stats.to_dict()}
                if batch_tokens in padded_plain:
                    entry["vs_plain_transformers_padded"] = padded_plain[batch_tokens] / seconds
                if device == "cuda":
                    entry["max_gpu_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
                result["runs"].append(entry)
                print(json.dumps(entry), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
