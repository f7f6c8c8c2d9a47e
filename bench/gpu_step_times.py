"""The per-step figures a concurrency simulation runs on (bench/sim_concurrency.py), from ONE engine start: how long
one engine step takes against the number of sequences it decodes and their context, what a prefill token costs, and
(`--mix`) a real run of a length mix at a few max_num_seqs, for the simulation to be checked against.

    python3 bench/gpu_step_times.py --config bench/gpu_stage1_production.yaml --model .cache/dummy-hybrid-27b \
        --grid "256:8,16,24,32;4096:8,16,22;12288:6,12" --out $OUT/steps.json
    python3 bench/gpu_step_times.py ... --grid "" --mix 800:6000:8192 --mix-levels 17,24,30,33 --out $OUT/mix.json

Grid `P:n1,n2;...`: for each prompt length P and count n, n requests of P random prompt tokens with `ignore_eos` and
room to decode, steps run until all n decode, then --measure-s seconds of decode steps; then they are aborted. Every
step's row is kept (gpu_concurrency_sweep.Steps: time, running, waiting, KV use, generation tokens, prompt tokens,
preempted) with its (P, n), so the fit (decode time against sequences and context; prefill time per token) is made
offline from the same rows.

Mix `MEAN:P99:CAP`: output lengths lognormal through MEAN and P99, capped at CAP (job/generate/length_mix.py), every
request `ignore_eos` with its drawn max_tokens and a prompt of --mix-prompt random tokens; per level the engine starts
empty, the scheduler admits at most that many running sequences with 2 x the level in the engine (stage 1's gate),
--mix-warm-s then --mix-measure-s measured: tok/s, preemptions, KV use. The simulation replays the same protocol.

vLLM's engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as bench/gpu_concurrency_sweep.py): its
scheduler is reachable to lower the admission limit per level. Random weights (load_format: dummy) accept almost no
MTP drafts, so a step adds ~1 token a sequence; the time of a step (what the simulation needs) is the real one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def parse_grid(spec: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, spec.split(";")):
        prompt, counts = part.split(":")
        out += [(int(prompt), int(n)) for n in counts.split(",")]
    return out


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(length)]


def abort_all(engine, ids: list[str]) -> None:
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()


def grid_point(engine, scheduler, params_for, prompt: int, n: int, rng, vocab: int, measure_s: float,
               tag: int) -> dict:
    from gpu_concurrency_sweep import Steps, set_limit
    from vllm.inputs import TokensPrompt

    set_limit(scheduler, n)
    Steps.rows.clear()
    ids = [f"g{tag}-{i}" for i in range(n)]
    started = time.monotonic()
    for rid in ids:
        engine.add_request(rid, TokensPrompt(prompt_token_ids=random_prompt(rng, prompt, vocab)), params_for(100_000))
    while not (Steps.rows and Steps.rows[-1][1] == n and Steps.rows[-1][2] == 0 and Steps.rows[-1][5] == 0):
        engine.step()
    prefill_s = time.monotonic() - started
    prefill_rows = list(Steps.rows)
    Steps.rows.clear()
    t0 = time.monotonic()
    while time.monotonic() - t0 < measure_s:
        engine.step()
    rows = list(Steps.rows)
    abort_all(engine, ids)
    span = rows[-1][0] - rows[0][0]
    steps = len(rows) - 1
    return {"prompt": prompt, "n": n, "prefill_s": prefill_s, "prefill_steps": prefill_rows,
            "decode_steps": rows, "step_ms": 1000 * span / max(1, steps),
            "tok_per_s": sum(r[4] for r in rows[1:]) / span if span else 0.0,
            "preempted": sum(r[6] for r in rows)}


def mix_level(engine, scheduler, params_for, n: int, lengths, prompt: int, rng, vocab: int, warm_s: float,
              measure_s: float, tag: int) -> dict:
    from gpu_concurrency_sweep import Steps, set_limit
    from vllm.inputs import TokensPrompt

    set_limit(scheduler, n)
    Steps.rows.clear()
    ids, drawn = [], []
    start = time.monotonic()
    while time.monotonic() - start < warm_s + measure_s:
        while engine.get_num_unfinished_requests() < 2 * n:
            length = lengths()
            rid = f"m{tag}-{len(ids)}"
            ids.append(rid)
            drawn.append(length)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=random_prompt(rng, prompt, vocab)),
                               params_for(length))
        engine.step()
    rows = list(Steps.rows)
    abort_all(engine, ids)
    window = [r for r in rows if r[0] >= start + warm_s]
    span = window[-1][0] - window[0][0]
    return {"level": n, "warm_s": warm_s, "measure_s": measure_s, "started": start, "steps": rows,
            "drawn_lengths": drawn, "tok_per_s": sum(r[4] for r in window[1:]) / span,
            "mean_running": sum(r[1] for r in window) / len(window), "max_kv_use": max(r[3] for r in window),
            "preempted": sum(r[6] for r in window), "preempted_all": sum(r[6] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "bench/gpu_stage1_production.yaml"))
    parser.add_argument("--model", default=str(REPO / ".cache/dummy-hybrid-27b"))
    parser.add_argument("--max-num-seqs", default="34", help="a number, or 'auto': the value stage 1's engine works "
                        "out on this device at the config's mix (then stage 1's engines share this compile cache)")
    parser.add_argument("--grid", default="256:8,16,24,32;4096:8,16,22;12288:6,12")
    parser.add_argument("--measure-s", type=float, default=6)
    parser.add_argument("--mix", default="", help="MEAN:P99:CAP output lengths (lognormal), '' = none")
    parser.add_argument("--mix-levels", default="17,24,30,33")
    parser.add_argument("--mix-prompt", type=int, default=256)
    parser.add_argument("--mix-warm-s", type=float, default=30)
    parser.add_argument("--mix-measure-s", type=float, default=60)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from gpu_concurrency_sweep import Steps
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from job.config import load_config
    from job.generate import engine_sizing as es

    config = load_config(args.config, model=args.model, input="unused", output="/tmp/gpu_step_times")
    if args.max_num_seqs == "auto":
        from bench_generate import sized_engine_kwargs

        ek = sized_engine_kwargs(config)
    else:
        ek = {**config.engine_kwargs, "max_num_seqs": int(args.max_num_seqs)}
    started = time.monotonic()
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, **ek), stat_loggers=[Steps.factory()])
    cache = engine.vllm_config.cache_config
    result = {"engine_start_s": time.monotonic() - started, "device": es.device_name(), "engine_kwargs": ek,
              "num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size, "grid": [], "mix": []}
    print(f"engine started in {result['engine_start_s']:.0f} s: {cache.num_gpu_blocks} blocks of {cache.block_size}",
          flush=True)
    vocab = 3_700  # the tokenizer's ids (bench/dummy_model.py): any will do, no prefix is shared
    sampling = {"temperature": 1.0, "top_k": 20, "top_p": 0.95, "ignore_eos": True, "detokenize": False}

    def params_for(max_tokens: int):
        return SamplingParams(**sampling, max_tokens=max_tokens)

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f)

    scheduler = engine.engine_core.engine_core.scheduler
    rng = random.Random(0)
    for tag, (prompt, n) in enumerate(parse_grid(args.grid)):
        point = grid_point(engine, scheduler, params_for, prompt, n, rng, vocab, args.measure_s, tag)
        result["grid"].append(point)
        print(f"prompt {prompt:6d} n {n:3d}: step {point['step_ms']:.1f} ms, {point['tok_per_s']:.0f} tok/s, "
              f"prefill {point['prefill_s']:.1f} s, preempted {point['preempted']}", flush=True)
        save()
    if args.mix:
        from job.generate.length_mix import LengthMix

        mean, p99, cap = (int(x) for x in args.mix.split(":"))
        mix = LengthMix.configured(mean, p99, cap, prompt_mean=args.mix_prompt)
        result["mix_spec"] = {"mean": mean, "p99": p99, "cap": cap, "prompt": args.mix_prompt,
                              "in_flight_tokens": mix.in_flight_tokens}
        draw = random.Random(1)
        for tag, n in enumerate(int(x) for x in args.mix_levels.split(",")):
            level = mix_level(engine, scheduler, params_for, n, lambda: mix.draw(draw), args.mix_prompt, rng, vocab,
                              args.mix_warm_s, args.mix_measure_s, tag)
            result["mix"].append(level)
            print(f"mix level {n:3d}: {level['tok_per_s']:.0f} tok/s, running {level['mean_running']:.1f}, KV max "
                  f"{100 * level['max_kv_use']:.0f} %, preempted {level['preempted']} ({level['preempted_all']} "
                  f"with the warm-up)", flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
