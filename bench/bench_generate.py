"""Stage 1 throughput against plain vLLM and ray.data.llm, measured in ONE run (this machine is shared and noisy:
only ratios between rows of the same run mean anything).

    .venv/bin/python bench/bench_generate.py --prompts 512 [--repeats 1]

Each contender runs in its own subprocess, one after another, on the same prompts and engine arguments
(configs/demo.yaml's engine_kwargs, the tiny model, max_tokens 512, the model's own sampling defaults):
  plain     vllm.LLM(**engine_kwargs).generate(all token-id prompts at once)        — the ceiling
  stage1    job.generate.run_generate (Ray start, read parquet, template, engine actor, write Arrow shards)
  raydata   ray.data.llm.build_processor (its defaults: chat-template, tokenize, detokenize stages on)
Reported: wall time (process start of the measured code to end), engine start, generation window, output tokens,
output tokens/s over the generation window, and ratios against plain.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _setup(num_prompts: int, workdir: str):
    from job.config import load_config
    from job.demo import TINY_MODEL_DIR, write_demo_prompts
    from job.tiny_model import ensure_tiny_model

    model = str(REPO / TINY_MODEL_DIR)
    ensure_tiny_model(model)
    prompts = write_demo_prompts(os.path.join(workdir, "prompts"), num_prompts, 4, num_conversations=0)
    config = load_config(str(REPO / "configs/demo.yaml"), model=model, input=prompts,
                         output=os.path.join(workdir, "run"))
    return config


def _token_prompts(config):
    """The exact token-id prompts stage 1 would send (same template, same tokenizer)."""
    import pyarrow.dataset as ds
    from transformers import AutoTokenizer

    from job.prompts import render_prompt_ids

    tok = AutoTokenizer.from_pretrained(config.model)
    rows = ds.dataset(config.input, format="parquet").to_table().to_pylist()
    return [render_prompt_ids(tok, [{"role": "user", "content": r["prompt"]}], chat_template=None,
                              enable_thinking=True, chat_template_kwargs={}) for r in rows], rows


def _sampling(config):
    from job.engine import resolved_sampling

    s = resolved_sampling(config.model, config.generate.sampling)
    s["detokenize"] = False  # as stage 1 does; the text is decoded once afterwards by every contender
    return s


def run_plain(config) -> dict:
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, _ = _token_prompts(config)
    llm = LLM(model=config.model, **config.engine_kwargs)
    t1 = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(**_sampling(config)),
                        use_tqdm=False)
    t2 = time.monotonic()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": t2 - t0, "engine_start_s": t1 - t0, "generation_s": t2 - t1, "output_tokens": tokens,
            "rows": len(outs)}


def run_stage1(config) -> dict:
    t0 = time.monotonic()
    from job.generate import run_generate

    config.quality.canary_rows = 0
    summary = run_generate(config)
    t1 = time.monotonic()
    return {"wall_s": t1 - t0, "generation_s": summary.generation_seconds, "output_tokens": summary.num_output_tokens,
            "rows": summary.num_rows}


def run_raydata(config) -> dict:
    t0 = time.monotonic()
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    # ray.data.llm asks for a GPU, and its chat-template, tokenize, detokenize and engine actors each reserve a
    # logical CPU: with the 2 real CPUs as logical ones it never schedules its engine. 8 logical CPUs on 2 cores.
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    sampling = _sampling(config)
    proc_config = vLLMEngineProcessorConfig(
        model_source=config.model, engine_kwargs=dict(config.engine_kwargs), batch_size=64, concurrency=1,
        log_engine_metrics=False, runtime_env={"env_vars": dict(config.env_vars)})
    processor = build_processor(
        proc_config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["prompt"]}],
                                    sampling_params=sampling, chat_template_kwargs={"enable_thinking": True}),
        postprocess=lambda row: dict(id=row["id"], num_generated_tokens=row["num_generated_tokens"]),
    )
    ds = processor(ray.data.read_parquet(config.input))
    first, tokens, rows = None, 0, 0
    for row in ds.iter_rows():
        first = first or time.monotonic()
        tokens += int(row["num_generated_tokens"])
        rows += 1
    t1 = time.monotonic()
    ray.shutdown()
    # ray.data.llm reports no generation window of its own; the first row out is an upper bound on engine start.
    return {"wall_s": t1 - t0, "first_row_s": first - t0, "output_tokens": tokens, "rows": rows}


def _child(which: str, num_prompts: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        config = _setup(num_prompts, d)
        os.environ.update(config.env_vars)
        result = {"plain": run_plain, "stage1": run_stage1, "raydata": run_raydata}[which](config)
    print("RESULT " + json.dumps(result), flush=True)
    # vLLM's engine processes outlive LLM (and would hold our stdout open): end them, then leave at once.
    import psutil

    for p in psutil.Process().children(recursive=True):
        p.kill()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--only", nargs="*", default=["plain", "stage1", "raydata"])
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.prompts)
        return
    with tempfile.TemporaryDirectory() as d:
        _setup(args.prompts, d)  # build the tiny model before any timing
    results = {}
    for which in args.only:
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, __file__, "--child", which, "--prompts", str(args.prompts)],
                              capture_output=True, text=True, env=env, cwd=REPO)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            raise SystemExit(f"{which} failed")
        results[which] = json.loads(line[0][7:])
        r = results[which]
        r["tok_per_s_window"] = r["output_tokens"] / r["generation_s"] if r.get("generation_s") else None
        print(which, json.dumps(r), flush=True)
    plain = results.get("plain")
    print("\n| contender | rows | output tokens | wall s | generation window s | tok/s (window) | wall vs plain |")
    print("|---|---|---|---|---|---|---|")
    for which, r in results.items():
        ratio = f"{r['wall_s'] / plain['wall_s']:.2f}×" if plain else "-"
        win = f"{r['generation_s']:.1f}" if r.get("generation_s") else "-"
        tps = f"{r['tok_per_s_window']:,.0f}" if r.get("tok_per_s_window") else "-"
        print(f"| {which} | {r['rows']} | {r['output_tokens']:,} | {r['wall_s']:.1f} | {win} | {tps} | {ratio} |")
    if plain and "stage1" in results:
        s = results["stage1"]
        print(f"\nstage1 window throughput / plain: {s['tok_per_s_window'] / plain['tok_per_s_window']:.2f}; "
              f"end to end (plain wall incl. engine start / stage1 wall): {plain['wall_s'] / s['wall_s']:.2f}")


if __name__ == "__main__":
    main()
