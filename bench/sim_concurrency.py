"""max_num_seqs at a thinking-mode length mix, from a simulation of vLLM's scheduler driven by per-step figures
measured on the GPU (bench/gpu_step_times.py), checked first against real runs of the same engine.

    python3 bench/sim_concurrency.py --steps bench/results/h100_step_times/steps.json \
        --check bench/results/h100_step_times/mix_short.json bench/results/h100_step_times/mix_thinking.json \
        --mix 2500:16000:32768 --prompt 256 --levels 14-34 --out bench/results/h100_step_times/sim.json

Why a simulation: at the thinking-mode mix a sequence lives 2,500 steps on average and up to 32,768 (17 minutes
on an H100 at ~31 ms a step), so the KV use settles only after tens of minutes per max_num_seqs, beyond a device
budget. A step's cost is what the GPU is measured for; the rest is vLLM's scheduler, replayed here:

- the pool: the engine's block count (an attention block of `block` tokens is as large as a Gated DeltaNet state;
  a sequence holds `state_blocks` blocks of state, 9 for the 27B with MTP 2, plus one block per `block` tokens);
- each step, vLLM 0.26's V1 rule (v1/core/sched/scheduler.py): running requests first, oldest first, each given
  blocks for its new tokens (1 + num_speculative_tokens, and as many lookahead slots for the drafts); where the pool
  has none, the newest running request is preempted (its blocks freed, it goes to the front of the queue and is
  recomputed from scratch: prompt + what it had generated); then, in a step that preempted nothing, waiting
  requests are admitted in order while fewer than max_num_seqs run and the step's token budget
  (max_num_batched_tokens) and the pool allow, their prompts prefilled in chunks;
- a step takes decode(n, context) + prefill tokens x a prefill token's cost, fitted to the measured steps;
- a decoding sequence adds `--tokens-per-step` tokens a step (1 on random weights, which accept no MTP draft; a
  real target accepts ~2 drafts more, which speeds every level alike and lengthens nothing).

The check replays each measured run (bench/gpu_step_times.py --mix: engine started empty, 2 x level requests kept
in it, the same drawn lengths, warm-up then the measured window) and sets simulated tok/s and preemptions beside the
real ones. Then the mix runs for --hours simulated hours per level after a warm-up of as long as the longest
sequence lives x 2, and the table says each level's tok/s against the best, preemptions and what `max_num_seqs:
auto` chooses for the mix on this pool (job/generate/length_mix.py, engine_sizing.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass
class StepCost:
    """One engine step's seconds: base + per_seq x decoding sequences + per_ktok x their context (thousands of
    tokens) + per_prefill_token x prompt tokens computed in the step + per_prefill_step if it computes any."""
    base: float
    per_seq: float
    per_ktok: float
    per_prefill_token: float
    per_prefill_step: float = 0.0

    def __call__(self, decoding: int, context: int, prefill: int) -> float:
        return (self.base + self.per_seq * decoding + self.per_ktok * context / 1000 + self.per_prefill_token * prefill
                + (self.per_prefill_step if prefill else 0.0))


def fit_step_cost(grid: list[dict]) -> tuple[StepCost, list[dict]]:
    """Least squares over the grid's decode windows (step ms against n and n x context), and the prefill token's
    cost from each point's prefill phase (its seconds less its steps' decode cost, over its prompt tokens). The first
    point is left out of the prefill fit: it holds the engine's first-use kernel builds."""
    import numpy as np

    rows, times = [], []
    for p in grid:
        steps = p["decode_steps"]
        context = p["n"] * (p["prompt"] + len(steps) / 2)
        rows.append([1.0, p["n"], context / 1000])
        times.append(p["step_ms"] / 1000)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    base, per_seq, per_ktok = (float(c) for c in coef)
    per_token = []
    for p in grid[1:]:
        tokens = sum(r[5] for r in p["prefill_steps"])
        decode = len(p["prefill_steps"]) * (base + per_seq * p["n"] / 2)
        if tokens >= 16384:
            per_token.append(max(0.0, p["prefill_s"] - decode) / tokens)
    cost = StepCost(base, per_seq, per_ktok, sum(per_token) / len(per_token))
    residuals = [{"prompt": p["prompt"], "n": p["n"], "measured_ms": p["step_ms"],
                  "fitted_ms": 1000 * cost(p["n"], p["n"] * (p["prompt"] + len(p["decode_steps"]) / 2), 0)}
                 for p in grid]
    return cost, residuals


def fit_admission_cost(run: dict, cost: StepCost) -> tuple[float, int]:
    """What a step that admits a short prompt costs beyond its tokens, from a measured mix run (every level): a step
    that prefills a few hundred tokens among the decodes took ~130 ms where a decode step takes ~32 (H100, 27B
    shape, MTP), while 256 tokens at the grid's prefill rate are ~23 ms. vLLM's stats trail by a step, so each
    admission is the pair of steps ending at the row that counts its prompt tokens, less two median steps and its
    tokens' cost. Returns (seconds, admissions counted)."""
    import statistics

    extra = []
    for level in run["mix"]:
        rows = [r for r in level["steps"] if r[0] >= level["started"] + level["warm_s"]]
        seconds = [b[0] - a[0] for a, b in zip(rows, rows[1:])]
        median = statistics.median(seconds)
        for j in range(2, len(rows)):
            if 0 < rows[j][5] <= 1024:
                extra.append(seconds[j - 2] + seconds[j - 1] - 2 * median - cost.per_prefill_token * rows[j][5])
    return sum(extra) / len(extra), len(extra)


class Request:
    __slots__ = ("prompt", "target", "output", "computed", "blocks", "preempted")

    def __init__(self, prompt: int, target: int):
        self.prompt, self.target, self.output, self.computed, self.blocks, self.preempted = prompt, target, 0, 0, 0, 0

    @property
    def tokens(self) -> int:
        return self.prompt + self.output


@dataclass
class Engine:
    """vLLM's scheduler over a block pool (module docstring)."""
    num_blocks: int
    block: int
    state_blocks: int
    max_num_seqs: int
    cost: StepCost
    spec_tokens: int = 2
    budget: int = 16384
    tokens_per_step: float = 1.0

    def __post_init__(self):
        self.free = self.num_blocks
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.clock = 0.0
        self.generated = 0
        self.preemptions = 0
        self.carry = 0.0  # fractional tokens a step (tokens_per_step not whole)

    def _need(self, r: Request, new_tokens: int) -> int:
        tokens = r.computed + new_tokens + self.spec_tokens
        return self.state_blocks + -(-tokens // self.block) - r.blocks

    def _allocate(self, r: Request, new_tokens: int) -> bool:
        need = self._need(r, new_tokens)
        if need > self.free:
            return False
        self.free -= max(0, need)
        r.blocks += max(0, need)
        return True

    def _release(self, r: Request) -> None:
        self.free += r.blocks
        r.blocks = 0

    def step(self) -> tuple[int, int]:
        """One engine step: (tokens generated, requests preempted)."""
        budget, preempted, scheduled = self.budget, 0, []
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            decoding = r.computed >= r.tokens
            new = (1 + self.spec_tokens) if decoding else min(r.tokens - r.computed, budget)
            while not self._allocate(r, new):
                victim = self.running.pop()
                self._release(victim)
                victim.computed = 0
                victim.preempted += 1
                self.waiting.appendleft(victim)
                preempted += 1
                if victim is r:
                    break
            else:
                scheduled.append((r, decoding, new))
                budget -= new
                i += 1
                continue
            break
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                r = self.waiting[0]
                new = min(r.tokens - r.computed, budget)
                if not self._allocate(r, new):
                    break
                self.waiting.popleft()
                self.running.append(r)
                scheduled.append((r, False, new))
                budget -= new
        decoding = [r for r, d, _ in scheduled if d]
        prefill = sum(new for _, d, new in scheduled if not d)
        self.clock += self.cost(len(decoding), sum(r.tokens for r in decoding), prefill)
        self.carry += self.tokens_per_step
        per_seq, self.carry = int(self.carry), self.carry - int(self.carry)
        generated, done = 0, []
        for r, d, new in scheduled:
            if d:
                add = min(per_seq, r.target - r.output)
                r.output += add
                r.computed = r.tokens
                generated += add
            else:
                r.computed += new
                if r.computed >= r.tokens:  # the last chunk of a prefill samples the first token
                    if r.output < r.target:
                        r.output += 1
                        generated += 1
                    r.computed = r.tokens
            if r.output >= r.target:
                done.append(r)
        for r in done:
            self.running.remove(r)
            self._release(r)
        self.generated += generated
        self.preemptions += preempted
        return generated, preempted


def run_protocol(engine: Engine, lengths, prompt: int, in_engine: int, warm_s: float, measure_s: float) -> dict:
    """bench/gpu_step_times.py's mix protocol: `in_engine` requests kept in the engine (running + waiting)."""
    tokens = preempted = steps = 0
    running_sum = 0
    while engine.clock < warm_s + measure_s:
        while len(engine.running) + len(engine.waiting) < in_engine:
            engine.waiting.append(Request(prompt, next(lengths)))
        generated, p = engine.step()
        if engine.clock >= warm_s:
            tokens += generated
            preempted += p
            steps += 1
            running_sum += len(engine.running)
    return {"tok_per_s": tokens / measure_s, "preempted": preempted, "mean_running": running_sum / max(1, steps)}


def block_layout(model: str, engine_kwargs: dict) -> tuple[int, int]:
    """(state blocks a sequence, tokens a block) as job/generate/engine_sizing.py lays out the cache."""
    from job import target
    from job.generate import engine_sizing as es

    cost = es.sequence_cost(target.config_json(model), engine_kwargs, 1)
    return cost.state_groups * cost.state_slots, cost.block_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", required=True, help="bench/gpu_step_times.py's grid JSON")
    parser.add_argument("--check", nargs="*", default=[], help="bench/gpu_step_times.py --mix JSONs to replay")
    parser.add_argument("--admissions-from", help="the --mix JSON a step's admission cost is fitted on (default: the "
                        "first --check; the others are then checked out of sample)")
    parser.add_argument("--mix", default="2500:16000:32768", help="MEAN:P99:CAP output tokens (lognormal)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--levels", default="14-34")
    parser.add_argument("--num-blocks", type=int, help="the pool (default: the grid engine's)")
    parser.add_argument("--hours", type=float, default=2.0)
    parser.add_argument("--tokens-per-step", type=float, default=1.0)
    parser.add_argument("--model", default=str(REPO / ".cache/dummy-hybrid-27b"))
    parser.add_argument("--config", default=str(REPO / "bench/gpu_stage1_production.yaml"))
    parser.add_argument("--out")
    args = parser.parse_args()

    from job.config import load_config
    from job.generate import engine_sizing as es
    from job.generate.length_mix import LengthMix

    grid = json.load(open(args.steps))
    cost, residuals = fit_step_cost(grid["grid"])
    fit_from = args.admissions_from or (args.check[0] if args.check else None)
    if fit_from:
        cost.per_prefill_step, admissions = fit_admission_cost(json.load(open(fit_from)), cost)
        print(f"a step that admits a prompt: +{1000 * cost.per_prefill_step:.0f} ms besides its tokens ({admissions} "
              f"admissions in {fit_from})", flush=True)
    config = load_config(args.config, model=args.model, input="unused", output="/tmp/sim_concurrency")
    ek = dict(config.engine_kwargs)
    state_blocks, block = block_layout(args.model, ek)
    spec = es.mtp_tokens(ek)
    budget = int(ek.get("max_num_batched_tokens") or 8192)
    result = {"device": grid["device"], "step_cost": cost.__dict__, "fit": residuals, "check": [], "levels": [],
              "layout": {"state_blocks": state_blocks, "block_tokens": block}}
    print(f"{grid['device']}: a step = {1000 * cost.base:.1f} ms + {1000 * cost.per_seq:.3f} ms a sequence + "
          f"{1000 * cost.per_ktok:.4f} ms per 1,000 tokens of context + {1e6 * cost.per_prefill_token:.1f} us a "
          f"prefill token; fit (measured -> fitted ms): "
          + ", ".join(f"{r['n']}x{r['prompt']} {r['measured_ms']:.1f}->{r['fitted_ms']:.1f}" for r in residuals))

    def engine(num_blocks: int, level: int) -> Engine:
        return Engine(num_blocks=num_blocks, block=block, state_blocks=state_blocks, max_num_seqs=level, cost=cost,
                      spec_tokens=spec, budget=budget, tokens_per_step=args.tokens_per_step)

    for path in args.check:
        run = json.load(open(path))
        spec_ = run["mix_spec"]
        mix = LengthMix.configured(spec_["mean"], spec_["p99"], spec_["cap"], spec_["prompt"])
        for level in run["mix"]:
            rng = random.Random(7)
            drawn = iter(level["drawn_lengths"] + [mix.draw(rng) for _ in range(100_000)])
            sim = run_protocol(engine(run["num_gpu_blocks"], level["level"]), drawn, spec_["prompt"],
                               2 * level["level"], level["warm_s"], level["measure_s"])
            row = {"mix": f"{spec_['mean']}:{spec_['p99']}:{spec_['cap']}", "level": level["level"],
                   "measured_tok_per_s": level["tok_per_s"], "simulated_tok_per_s": sim["tok_per_s"],
                   "ratio": sim["tok_per_s"] / level["tok_per_s"], "measured_preempted": level["preempted"],
                   "simulated_preempted": sim["preempted"], "measured_running": level["mean_running"],
                   "simulated_running": sim["mean_running"]}
            result["check"].append(row)
            print(f"check {row['mix']} at {row['level']}: measured {row['measured_tok_per_s']:.0f} tok/s, simulated "
                  f"{row['simulated_tok_per_s']:.0f} ({row['ratio']:.3f}x); preempted {row['measured_preempted']} / "
                  f"{row['simulated_preempted']}; running {row['measured_running']:.1f} / "
                  f"{row['simulated_running']:.1f}", flush=True)

    mean, p99, cap = (int(x) for x in args.mix.split(":"))
    mix = LengthMix.configured(mean, p99, cap, args.prompt)
    num_blocks = args.num_blocks or grid["num_gpu_blocks"]
    tokens = math.ceil(mix.in_flight_tokens)
    auto_blocks = state_blocks + -(-tokens // block)
    auto = num_blocks // auto_blocks
    fixed = num_blocks // (state_blocks + -(-8192 // block))
    result["mix"] = {"spec": args.mix, "prompt": args.prompt, "in_flight_tokens": mix.in_flight_tokens,
                     "num_blocks": num_blocks, "auto": auto, "auto_8192": fixed}
    print(f"mix {args.mix}, prompt {args.prompt}: {mix.in_flight_tokens:,.0f} tokens in flight a sequence on average "
          f"= {auto_blocks} blocks; the pool's {num_blocks} blocks hold {auto} (auto) where 8,192 tokens a sequence "
          f"held {fixed}", flush=True)
    low, high = (int(x) for x in args.levels.split("-"))
    warm = 2 * cap * cost(high, high * tokens, 0)  # the longest sequence's life, twice
    for level in range(low, high + 1):
        rng = random.Random(11)
        lengths = iter(lambda: mix.draw(rng), None)
        sim = run_protocol(engine(num_blocks, level), lengths, args.prompt, 2 * level, warm, args.hours * 3600)
        row = {"level": level, **sim, "preempted_per_hour": sim["preempted"] / args.hours}
        result["levels"].append(row)
        print(f"level {level:3d}: {sim['tok_per_s']:7.1f} tok/s, running {sim['mean_running']:.1f}, "
              f"{row['preempted_per_hour']:.0f} preemptions an hour", flush=True)
    best = max(result["levels"], key=lambda r: r["tok_per_s"])
    for row in result["levels"]:
        row["vs_best"] = row["tok_per_s"] / best["tok_per_s"]
    by_level = {r["level"]: r for r in result["levels"]}
    for name, value in (("auto", auto), ("auto_8192", fixed)):
        if value in by_level:
            print(f"{name} = {value}: {by_level[value]['vs_best']:.3f}x the best ({best['level']}: "
                  f"{best['tok_per_s']:.1f} tok/s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
