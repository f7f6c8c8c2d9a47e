"""A capture of the drafter's hidden states inside vLLM while it generates (stage 2 for free, prototyped on the CPU
build): what it costs stage 1 and how far its rows are from a prefill's.

The capture: a forward hook on each chosen decoder layer of the engine's model (installed through
`LLM.collective_rpc`, so it runs in the engine's worker process), keeping per step one copy of the layer's output rows
(`hidden + residual`: vLLM's layers return the residual stream split in two, fused into the next layer's norm) with
the step's request ids, query offsets and positions (the model runner's `input_batch.req_ids` and
`query_start_loc`). After generation the rows are mapped back to requests by those offsets, one row per position
(a recomputed position, after a preemption, keeps its last). Engines run eager (`enforce_eager`): a hook does not run
inside a compiled graph (the GPU design in docs/design/capture-during-generation.md writes a static buffer instead).

Measured, on the run's prompts:
  - stage 1's output tokens/s with the capture on and off, alternating in one engine (`--repeats` each);
  - the bytes a token adds (layers x hidden x dtype) and the rows' total, written beside a copy of the completions;
  - the rows captured while decoding against vLLM's own prefill of prompt + completion (the same engine, the same
    hook, `max_tokens=1`: the second prefill every tool runs today), and against transformers' prefill (what stage 2
    computes), per layer, relative L2 over the completion's tokens; for scale, bf16 against float32 of the prefill.
The last completion token has no row (it is sampled, then the request ends): the capture leaves it out.

    .venv/bin/python bench/bench_capture_in_vllm.py --run demo-run [--prompts 64] [--max-tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_decode_capture's helpers
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# The hooks travel to the engine's process as functions (pickled), and the rows come back as tensors.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


# ---------------------------------------------------------------------------------------------------------------
# In the engine's worker process (LLM.collective_rpc runs these with the worker as their first argument)
# ---------------------------------------------------------------------------------------------------------------
def _install(worker, layer_ids, verify_tokens=1):
    """Hooks on the decoder layers `layer_ids` (None: every one) of the engine's language model; returns the ids.
    `verify_tokens`: the most tokens a request's step computes while decoding (1, or 1 + the MTP draft tokens)."""
    import torch

    runner = worker.model_runner
    # The decoder's layer list: the longest ModuleList named `layers` outside the vision tower and the MTP head.
    layers = max((m for name, m in runner.model.named_modules() if name.endswith("layers")
                  and isinstance(m, torch.nn.ModuleList) and "visual" not in name and "mtp" not in name), key=len)
    layer_ids = list(range(len(layers))) if layer_ids is None else layer_ids
    store = runner._datagen_capture = {"steps": [], "on": True, "hooks": [], "verify_tokens": verify_tokens}

    def hook(output, k):
        if not store["on"]:
            return
        hidden, residual = output if isinstance(output, tuple) else (output, None)
        rows = hidden if residual is None else hidden + residual
        num_reqs = len(runner.input_batch.req_ids)
        offsets = runner.query_start_loc.np[:num_reqs + 1].copy()
        n = int(offsets[-1])
        # To host memory at once (a copy, on the CPU build too): the rows travel back to the caller pickled, and a
        # GPU's would hold its memory until then. On a GPU this syncs every layer: timings there are eager's plus this.
        store["steps"].append((k, list(runner.input_batch.req_ids), offsets, runner.positions[:n].to("cpu", copy=True),
                               rows[:n].to("cpu", copy=True)))

    for k in layer_ids:
        store["hooks"].append(layers[k].register_forward_hook(lambda module, args, output, k=k: hook(output, k)))
    return layer_ids


def _switch(worker, on):
    worker.model_runner._datagen_capture["on"] = on
    return on


def _take(worker):
    """The rows captured since the last take: {request id: {layer: {position: row}}}, by the id LLM.generate's
    outputs carry (the engine's own adds a random suffix: "16-9c53aeb0" for output "16")."""
    store = worker.model_runner._datagen_capture
    out: dict = {}
    for k, req_ids, offsets, positions, rows in store["steps"]:
        for i, req in enumerate(req_ids):
            a, b = int(offsets[i]), int(offsets[i + 1])
            request = out.setdefault(req.rsplit("-", 1)[0], {})
            by_pos = request.setdefault(k, {})
            for j in range(a, b):
                by_pos[int(positions[j])] = rows[j]
            if b - a <= store["verify_tokens"]:  # a decode (or MTP verify) step's rows, not a prefill's
                request.setdefault("decoded", set()).update(int(positions[j]) for j in range(a, b))
    store["steps"] = []
    return out


# ---------------------------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------------------------
def text_only(model_dir: str) -> dict:
    """As stage 1 runs a *ForConditionalGeneration checkpoint (Qwen3.5/3.6): its language model only."""
    from job.generate.engine_start import text_only_engine_kwargs

    return text_only_engine_kwargs(model_dir, {})[0]


def prompts_of(run: str, n: int) -> list[list[int]]:
    import pyarrow.dataset as ds

    table = ds.dataset(os.path.join(run, "completions"), format="arrow").to_table(
        columns=["id", "prompt_token_ids", "error"])
    rows = sorted((r for r in table.to_pylist() if r["error"] is None), key=lambda r: r["id"])
    return [list(r["prompt_token_ids"]) for r in rows[:n]]


def stacked(by_layer: dict, layer_ids: list[int], positions: range):
    import torch

    return torch.stack([torch.stack([by_layer[k][p] for p in positions]) for k in layer_ids], dim=1)


def mean_relative(a, b) -> float:
    """bench_decode_capture.py's ||a - b|| / ||b|| per row, averaged."""
    return float(per_row(a, b).mean())


def per_row(a, b):
    """[tokens, layers]: ||a - b|| / ||b|| of each row."""
    from bench_decode_capture import relative

    return relative(a.float(), b.float())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a finished stage-1 run (its prompts and model)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed generations each way, alternating")
    p.add_argument("--compare", type=int, default=8, help="completions compared against the prefills")
    p.add_argument("--layers", type=int, nargs="+", help="decoder layers captured (default: every one)")
    p.add_argument("--engine", default="{}", help="more engine kwargs, JSON (on a GPU with vLLM 0.26: "
                   "'{\"additional_config\": {\"gdn_prefill_backend\": \"triton\"}}')")
    p.add_argument("--mtp", type=int, default=0, help="MTP draft tokens (0: off). The rows of a verify step's "
                   "rejected tokens are computed again at the next step, whose row the capture keeps (the last)")
    p.add_argument("--hf-device", default="cpu", help="where transformers' prefill (stage 2's rows) runs")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    from job.hidden_states.transformers_backend import load_model
    from job.train.serve import target_sampling

    record = json.load(open(os.path.join(args.run, "run.json")))
    model_dir = record["config"]["model"]
    prompts = prompts_of(args.run, args.prompts)
    # Prefix caching off: the prefill pass below must compute the prompt's rows, not find them cached.
    engine = {**text_only(model_dir), **json.loads(args.engine)}
    if args.mtp:
        engine["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.mtp}
        if not torch.cuda.is_available():  # vllm-cpu 0.32's expand kernel, mended in this process (serve.py says why)
            from job.train.serve import patch_cpu_expand_kernel

            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            patch_cpu_expand_kernel()
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=2048, seed=0,
              enable_prefix_caching=False, disable_log_stats=True, **engine)
    layer_ids = llm.collective_rpc(_install, args=(args.layers, 1 + args.mtp))[0]
    sampling = SamplingParams(max_tokens=args.max_tokens, **target_sampling(model_dir))
    tokens_in = [{"prompt_token_ids": ids} for ids in prompts]

    def generate(on: bool):
        llm.collective_rpc(_switch, args=(on,))
        started = time.perf_counter()
        outputs = llm.generate(tokens_in, sampling, use_tqdm=False)
        seconds = time.perf_counter() - started
        return outputs, sum(len(o.outputs[0].token_ids) for o in outputs) / seconds

    generate(False)  # warm-up
    rates = {"off": [], "on": []}
    for _ in range(args.repeats):
        for name in ("off", "on"):
            outputs, rate = generate(name == "on")
            rates[name].append(rate)
            if name == "on":
                captured = llm.collective_rpc(_take)[0]
                last_on = outputs
            else:
                llm.collective_rpc(_take)
    hidden = None
    rows_total = 0
    for o in last_on:
        rows = captured.get(o.request_id, {})
        rows_total += len(rows.get(layer_ids[0], {}))
        if hidden is None and rows:
            hidden = next(iter(rows[layer_ids[0]].values())).shape[-1]
    bytes_per_token = len(layer_ids) * hidden * 2

    # Decode rows against the two prefills, on the first `compare` completions with at least 2 tokens.
    chosen = [o for o in last_on if len(o.outputs[0].token_ids) >= 2][:args.compare]
    full = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:-1] for o in chosen]
    llm.collective_rpc(_switch, args=(True,))
    prefill_out = llm.generate([{"prompt_token_ids": ids} for ids in full], SamplingParams(max_tokens=1),
                               use_tqdm=False)
    prefilled = llm.collective_rpc(_take)[0]
    hf = {dt: load_model(model_dir, dtype=dt, device=args.hf_device) for dt in ("float32", "bfloat16")}
    by_layer = []  # decode rows vs vLLM's prefill, [tokens, layers] per completion
    diffs = {"decode_vs_vllm_prefill": [], "decode_vs_transformers_prefill": [], "vllm_vs_transformers_prefill": [],
             "transformers_bf16_vs_float32": []}
    decoded = compared_rows = 0
    for o, ids, po in zip(chosen, full, prefill_out):
        start, end = len(o.prompt_token_ids), len(ids)
        completion = range(start, end)
        decoded += len(captured[o.request_id].get("decoded", set()) & set(completion))
        compared_rows += len(completion)
        decode = stacked(captured[o.request_id], layer_ids, completion)
        vllm_prefill = stacked(prefilled[po.request_id], layer_ids, completion)
        hf_rows = {}
        for dt, model in hf.items():
            got = {}
            hooks = [model.model.layers[k].register_forward_hook(
                lambda m, a, out, k=k: got.__setitem__(k, (out[0] if isinstance(out, tuple) else out)[0]))
                for k in layer_ids]
            with torch.no_grad():
                model(input_ids=torch.tensor([ids], device=args.hf_device), use_cache=False)
            for h in hooks:
                h.remove()
            hf_rows[dt] = torch.stack([got[k][start:end] for k in layer_ids], dim=1).cpu()
        by_layer.append(per_row(decode, vllm_prefill))
        diffs["decode_vs_vllm_prefill"].append(mean_relative(decode, vllm_prefill))
        diffs["decode_vs_transformers_prefill"].append(mean_relative(decode, hf_rows["float32"]))
        diffs["vllm_vs_transformers_prefill"].append(mean_relative(vllm_prefill, hf_rows["float32"]))
        diffs["transformers_bf16_vs_float32"].append(mean_relative(hf_rows["bfloat16"], hf_rows["float32"]))

    result = {
        "model": model_dir, "prompts": len(prompts), "max_tokens": args.max_tokens, "layers": layer_ids,
        "tokens_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
        "ratio_on_over_off": round(statistics.median(rates["on"]) / statistics.median(rates["off"]), 3),
        "bytes_per_token": bytes_per_token, "rows_captured": rows_total,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in last_on),
        "relative_l2_mean": {k: float(f"{statistics.mean(v):.3e}") for k, v in diffs.items() if v},
        "decode_vs_vllm_prefill_by_layer": {
            stat: [float(f"{x:.3e}") for x in fn(torch.cat(by_layer))] for stat, fn in
            (("mean", lambda t: t.mean(0)), ("p99", lambda t: t.quantile(0.99, dim=0)), ("max", lambda t: t.amax(0)))},
        "engine": dict(engine), "device": torch.cuda.get_device_name()
        if torch.cuda.is_available() else "cpu",
        "compared": len(chosen), "compared_rows": compared_rows, "of_them_from_decode_steps": decoded,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
