"""steady-state output tokens/s against the number of sequences decoded together, from ONE engine start.

    python3 bench/gpu_concurrency_sweep.py --config bench/gpu_stage1_production.yaml --model .cache/dummy-hybrid-27b \
        --levels old,8,16,auto,mix,mix*0.5,mix*0.75,mix*1.25 --kv-mix 512 --max-tokens 256 --out $OUT/sweep.json

Why one start: on a fresh GPU machine the 27B hybrid shape's first engine start takes 5-8 minutes (504 s),
and a different max_num_seqs is a different compile-cache key; a sweep of engines would not fit a device budget. So
vLLM's engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the scheduler is reachable) with max_num_seqs =
the largest level, and each level lowers the scheduler's admission limit to that many running sequences, levels in
rising order, with 2 x the level of requests kept in the engine (stage 1's admission gate: a full batch and a queue
behind it). The KV pool and the CUDA graphs are the largest level's; a batch of N sequences pads to the same capture
size in either engine, so a level runs as an engine started with max_num_seqs N would, up to its pool being that of
the largest level (vLLM profiles the sampler at max_num_seqs rows: a few hundred MiB at most).

Levels: numbers, `auto` (job/generate/engine_sizing.py at the config's length mix, job/generate/length_mix.py),
`mix` (the same at --kv-mix tokens a sequence), `old` (the first version's sums: reserve 8.2 GiB, rounded down to 8) and
fractions of a named level given before them (`mix*0.75`), so that one command line fits an H100 and an H200.
Each level: --warm-s seconds to reach its batch and a steady KV use, then --measure-s seconds measured from vLLM's own
per-step stats (a stat logger): generation tokens/s, mean running, KV use at most, preemptions. One JSON line a level
on stdout, the whole in --out after each level (a call cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: its scheduler reachable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

GIB = 1024 ** 3


def old_auto(model: str, ek: dict, tokens: int) -> int:
    """The first version's choice (before the H100 fit): reserve = 2 x (one prefill's activations + 3 x 512 rows of
    float32 logits) + 2 GiB, and the count rounded down to a multiple of 8 (at least 8)."""
    from vllm.platforms import current_platform

    from job import target
    from job.generate import engine_sizing as es

    config = target.config_json(model)
    text = target.text_config(config)
    batched = int(ek.get("max_num_batched_tokens") or 8192)
    activations = batched * (2 * int(text["intermediate_size"]) + 4 * int(text["hidden_size"])) * 2
    reserve = 2 * (activations + 3 * 512 * int(text["vocab_size"]) * 4) + 2 * GIB
    if not current_platform.is_cuda_alike():
        return 8
    total = current_platform.get_device_total_memory(0)
    pool = total * float(ek.get("gpu_memory_utilization") or 0.9) - reserve - es.weight_bytes(model, ek)
    cost = es.sequence_cost(config, ek, tokens)
    return max(8, int(pool // cost.bytes()) // 8 * 8)


def resolve_levels(spec: str, model: str, ek: dict, kv_tokens: int, kv_mix: int) -> tuple[list[int], dict]:
    from job.generate import engine_sizing as es

    named, levels = {}, []
    for item in spec.split(","):
        if item == "auto":
            sizing = es.auto_max_num_seqs(model, ek, kv_tokens)
            named["auto"] = {"value": sizing.max_num_seqs, "why": sizing.why, "tokens": kv_tokens}
        elif item == "mix":
            sizing = es.auto_max_num_seqs(model, ek, kv_mix)
            named["mix"] = {"value": sizing.max_num_seqs, "why": sizing.why, "tokens": kv_mix}
        elif item == "old":
            named["old"] = {"value": old_auto(model, ek, kv_tokens), "tokens": kv_tokens}
        elif "*" in item:  # a fraction of a named level, for a sweep that fits any GPU: mix*0.5
            name, factor = item.split("*")
            levels.append(max(1, round(named[name]["value"] * float(factor))))
            continue
        else:
            levels.append(int(item))
            continue
        levels.append(named[item]["value"])
        print(f"level {item} = {named[item]['value']}: {named[item].get('why', '')}", flush=True)
    return sorted(set(levels)), named


def token_prompts(config_path: str, model: str, num_prompts: int, workdir: str) -> tuple[list[list[int]], object]:
    """bench/bench_generate.py's prompts (the demo questions in the thinking-mode template), as token ids."""
    from bench_generate import _token_prompts

    from job.builtin.demo import write_demo_prompts
    from job.config import load_config

    prompts = write_demo_prompts(os.path.join(workdir, "prompts"), num_prompts, 1, num_conversations=0)
    config = load_config(config_path, model=model, input=prompts, output=os.path.join(workdir, "run"))
    ids, _ = _token_prompts(config)
    return ids, config


class Steps:
    """vLLM's stats, one row a step: (time, running, waiting, KV use, generation tokens, prompt tokens, preempted).
    vLLM's stats trail the step they count by one (its scheduling runs a step ahead)."""
    rows: list[tuple] = []

    @classmethod
    def factory(cls):
        from vllm.v1.metrics.loggers import StatLoggerBase

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, *args, **kwargs):
                if scheduler_stats is None:
                    return
                it = iteration_stats
                cls.rows.append((time.monotonic(), scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                                 scheduler_stats.kv_cache_usage, it.num_generation_tokens if it else 0,
                                 it.num_prompt_tokens if it else 0, it.num_preempted_reqs if it else 0))

            def log_engine_initialized(self):
                pass

        return Logger


def set_limit(scheduler, n: int) -> None:
    """Admit at most n running sequences (vLLM 0.32 separates admission, max_num_active_reqs, from the runner's slots;
    0.26 has max_num_running_reqs only). Levels rise, so running never exceeds the new limit."""
    if hasattr(scheduler, "max_num_active_reqs"):
        scheduler.max_num_active_reqs = n
    else:
        scheduler.max_num_running_reqs = n


def measure_level(engine, scheduler, n: int, prompts, params, next_id: list[int], warm_s: float,
                  measure_s: float) -> dict:
    from vllm.inputs import TokensPrompt

    set_limit(scheduler, n)
    start = time.monotonic()
    while time.monotonic() - start < warm_s + measure_s:
        while engine.get_num_unfinished_requests() < 2 * n:
            i = next_id[0]
            next_id[0] += 1
            engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]), params)
        engine.step()
    window = [r for r in Steps.rows if r[0] >= start + warm_s]
    Steps.rows.clear()
    seconds = window[-1][0] - window[0][0]
    tokens = sum(r[4] for r in window[1:])  # tokens of the steps that ended inside the window
    return {"level": n, "tok_per_s": tokens / seconds, "seconds": seconds, "steps": len(window),
            "step_ms": 1000 * seconds / max(1, len(window) - 1),
            "mean_running": sum(r[1] for r in window) / len(window), "max_running": max(r[1] for r in window),
            "min_waiting": min(r[2] for r in window), "max_kv_use": max(r[3] for r in window),
            "mean_kv_use": sum(r[3] for r in window) / len(window), "preempted": sum(r[6] for r in window)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "bench/gpu_stage1_production.yaml"))
    parser.add_argument("--model", default=str(REPO / ".cache/dummy-hybrid-27b"))
    parser.add_argument("--levels", default="old,8,16,auto,mix,mix*0.5,mix*0.75,mix*1.25")
    parser.add_argument("--kv-mix", type=int, default=512, help="tokens a sequence for `mix`: the run's length mix")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=512, help="distinct prompts, reused in turn")
    parser.add_argument("--warm-s", type=float, default=10)
    parser.add_argument("--measure-s", type=float, default=20)
    parser.add_argument("--engine-kwargs", default="{}", help="JSON merged over the config's (a CPU try: smaller)")
    parser.add_argument("--workdir", default="/tmp/gpu_concurrency_sweep")
    parser.add_argument("--out")
    args = parser.parse_args()

    from bench_generate import _sampling

    prompts, config = token_prompts(args.config, args.model, args.prompts, args.workdir)
    ek = {**config.engine_kwargs, **json.loads(args.engine_kwargs)}
    from job.generate.length_mix import run_sizing_tokens

    levels, named = resolve_levels(args.levels, args.model, ek, run_sizing_tokens(config)[0], args.kv_mix)
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from job.generate import engine_sizing as es

    ek["max_num_seqs"] = max(levels)
    started = time.monotonic()
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, **ek), stat_loggers=[Steps.factory()])
    result = {"engine_start_s": time.monotonic() - started, "engine_max_num_seqs": max(levels), "named": named,
              "device": es.device_name(), "num_gpu_blocks": engine.vllm_config.cache_config.num_gpu_blocks,
              "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts), "max_tokens": args.max_tokens,
              "levels": []}
    for key in ("auto", "mix"):
        if key in named:
            sizing = es.auto_max_num_seqs(args.model, ek | {"max_num_seqs": "auto"}, named[key]["tokens"])
            named[key]["check"], named[key]["vllm_holds"] = es.check_against_vllm(sizing, result["num_gpu_blocks"])
            print(named[key]["check"], flush=True)
    print(f"engine started in {result['engine_start_s']:.1f} s, {result['num_gpu_blocks']} blocks", flush=True)
    sampling = {**_sampling(config), "max_tokens": args.max_tokens}
    params = SamplingParams(**sampling)
    scheduler = engine.engine_core.engine_core.scheduler
    Steps.rows.clear()
    next_id = [0]
    for n in levels:
        level = measure_level(engine, scheduler, n, prompts, params, next_id, args.warm_s, args.measure_s)
        level["names"] = [k for k, v in named.items() if v["value"] == n]
        result["levels"].append(level)
        print(json.dumps(level), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    best = max(result["levels"], key=lambda r: r["tok_per_s"])
    for r in result["levels"]:
        ratio = r["tok_per_s"] / best["tok_per_s"]
        print(f"{r['level']:5d} {','.join(r['names']):10s} {r['tok_per_s']:9.1f} tok/s  {ratio:.3f}x best  "
              f"running {r['mean_running']:.1f}  KV max {100 * r['max_kv_use']:.0f} %  preempted {r['preempted']}",
              flush=True)


if __name__ == "__main__":
    main()
