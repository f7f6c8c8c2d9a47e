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
sys.path.insert(0, str(REPO / "bench"))


def _setup(num_prompts: int, workdir: str, config_path: str | None = None, overrides: dict | None = None):
    """The run config: configs/demo.yaml on the tiny model, or `config_path` (e.g. bench/gpu_stage1.yaml) with
    its `model` built by bench/dummy_model.py when it is the 27B hybrid shape; then dotted-key `overrides`."""
    from job.builtin.demo import TINY_MODEL_DIR, write_demo_prompts
    from job.builtin.tiny_model import ensure_tiny_model
    from job.config import load_config

    prompts = write_demo_prompts(os.path.join(workdir, "prompts"), num_prompts, max(4, num_prompts // 256),
                                 num_conversations=0)
    if config_path is None:
        model = str(REPO / TINY_MODEL_DIR)
        ensure_tiny_model(model)
        config_path = str(REPO / "configs/demo.yaml")
    else:
        from dummy_model import ensure_dummy_hybrid_27b

        model = ensure_dummy_hybrid_27b(str(REPO / ".cache/dummy-hybrid-27b"))
    return load_config(config_path, model=model, input=prompts, output=os.path.join(workdir, "run"),
                       **(overrides or {}))


def _token_prompts(config):
    """The exact token-id prompts stage 1 would send (same template, same tokenizer)."""
    import pyarrow.dataset as ds
    from transformers import AutoTokenizer

    from job.generate.prompts import render_prompt_ids

    tok = AutoTokenizer.from_pretrained(config.model)
    rows = ds.dataset(config.input, format="parquet").to_table().to_pylist()
    return [render_prompt_ids(tok, [{"role": "user", "content": r["prompt"]}], chat_template=None,
                              enable_thinking=True, chat_template_kwargs={}) for r in rows], rows


def _sampling(config):
    from job.generate.engine_start import resolved_sampling

    s = resolved_sampling(config.model, config.generate.sampling)
    s["detokenize"] = False  # as stage 1 does; the text is decoded once afterwards by every contender
    return s


def sized_engine_kwargs(config) -> dict:
    """The config's engine_kwargs with `max_num_seqs: auto` replaced by the value stage 1's engine works out on this
    device (the same concurrency, and the same compile cache key)."""
    from job.generate import engine_sizing, length_mix

    kwargs = dict(config.engine_kwargs)
    if engine_sizing.is_auto(kwargs):
        tokens, source = length_mix.run_sizing_tokens(config)
        sizing = engine_sizing.auto_max_num_seqs(config.model, kwargs, tokens, source=source)
        kwargs["max_num_seqs"] = sizing.max_num_seqs
        print(sizing.why, flush=True)
    return kwargs


def run_plain(config) -> dict:
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, _ = _token_prompts(config)
    llm = LLM(model=config.model, **sized_engine_kwargs(config))
    t1 = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(**_sampling(config)),
                        use_tqdm=False)
    t2 = time.monotonic()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": t2 - t0, "engine_start_s": t1 - t0, "generation_s": t2 - t1, "output_tokens": tokens,
            "rows": len(outs)}


def log_engine_stats() -> None:
    """Ray's worker_process_setup_hook (BENCH_ENGINE_STATS=1): every VLLM_LOG_STATS_INTERVAL seconds, the engine
    actor calls its AsyncLLM's do_log_stats() and logs its own rows in flight. vLLM's LLM logs "Running: N reqs"
    from its step loop by itself; an AsyncLLM only when its owner calls do_log_stats() (vLLM's API server runs
    that loop; job/generate/engine.py does not), so without this stage 1's log has no in-flight series to plot."""
    import asyncio
    import logging

    from job.generate.engine import CompletionGenerator

    if getattr(CompletionGenerator, "bench_stats_installed", False):
        return
    interval = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "2"))
    log = logging.getLogger("bench.engine_stats")
    call = CompletionGenerator.__call__

    async def loop(self):
        while True:
            await asyncio.sleep(interval)
            log.info("rows in flight %d", self.num_in_flight)
            await self.engine.do_log_stats()

    async def __call__(self, batch):
        if getattr(self, "_bench_stats_task", None) is None:
            self._bench_stats_task = asyncio.get_running_loop().create_task(loop(self))
        async for out in call(self, batch):
            yield out

    CompletionGenerator.__call__ = __call__
    CompletionGenerator.bench_stats_installed = True


def run_stage1(config) -> dict:
    t0 = time.monotonic()
    from job.generate import run_generate

    config.quality.canary_rows = 0
    if os.environ.get("BENCH_ENGINE_STATS") == "1":
        # Start Ray here, as job.generate.ensure_ray would, plus the hook above in every worker (run_generate
        # joins a Ray that is already up and leaves it running: ended below). Counted in the wall time, as there.
        import ray

        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True,
                 configure_logging=False,
                 runtime_env={"worker_process_setup_hook": "bench_generate.log_engine_stats",
                              "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [
                     str(REPO / "bench"), str(REPO), os.environ.get("PYTHONPATH")]))}})
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars, ctx.print_on_execution_start = False, False
    summary = run_generate(config)
    t1 = time.monotonic()
    if os.environ.get("BENCH_ENGINE_STATS") == "1":
        import ray

        ray.shutdown()
    return {"wall_s": t1 - t0, "generation_s": summary.generation_seconds, "output_tokens": summary.num_output_tokens,
            "rows": summary.num_rows}


def run_raydata(config) -> dict:
    t0 = time.monotonic()
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    # ray.data.llm asks for a GPU, and its chat-template, tokenize, detokenize and engine actors each reserve a
    # logical CPU: with the 2 real CPUs as logical ones it never schedules its engine. 8 logical CPUs on 2 cores.
    ray.init(address="local", num_cpus=max(8, os.cpu_count()), num_gpus=1, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    sampling = _sampling(config)
    # On a GPU its documented throughput settings: batches of 64, 16 of them in the engine at once, no detokenize
    # stage (no contender detokenizes inside the generation window).
    # It also gets the same token ids as the others (its chat-template stage would load an AutoProcessor, which a
    # dummy-weight model directory has no preprocessor_config.json for), as in ../shared/gpu/README.md.
    token_ids = os.environ.get("BENCH_RAYDATA_TOKEN_IDS") == "1" or _on_gpu()
    throughput = {"max_concurrent_batches": 16, "chat_template_stage": False, "tokenize_stage": False,
                  "detokenize_stage": False}
    proc_config = vLLMEngineProcessorConfig(
        model_source=config.model, engine_kwargs=dict(config.engine_kwargs), batch_size=64, concurrency=1,
        log_engine_metrics=False, runtime_env={"env_vars": dict(config.env_vars)}, **(throughput if token_ids else {}))
    if token_ids:
        prompts, rows = _token_prompts(config)
        ids = {r["id"]: p for r, p in zip(rows, prompts)}
        preprocess = lambda row: dict(tokenized_prompt=ids[row["id"]], sampling_params=sampling)  # noqa: E731
    else:
        preprocess = lambda row: dict(messages=[{"role": "user", "content": row["prompt"]}],  # noqa: E731
                                      sampling_params=sampling, chat_template_kwargs={"enable_thinking": True})
    processor = build_processor(
        proc_config, preprocess=preprocess,
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


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_contender(spec: str) -> tuple[str, dict]:
    """'stage1+engine_kwargs.max_num_seqs=64+generate.max_rows_in_flight=64' -> ('stage1', {dotted: value})."""
    import yaml

    name, *pairs = spec.split("+")
    return name, {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in pairs)}


def _child(spec: str, num_prompts: int, config_path: str | None) -> None:
    which, overrides = parse_contender(spec)
    with tempfile.TemporaryDirectory() as d:
        config = _setup(num_prompts, d, config_path, overrides)
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
    parser.add_argument("--config", help="a run config in place of configs/demo.yaml (bench/gpu_stage1.yaml)")
    parser.add_argument("--logs", help="keep each contender's output here (vLLM's stats lines: requests running)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per contender")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.prompts, args.config)
        return
    with tempfile.TemporaryDirectory() as d:
        _setup(args.prompts, d, args.config)  # build the model before any timing
    results = {}
    for n, which in enumerate(args.only):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        cmd = [sys.executable, __file__, "--child", which, "--prompts", str(args.prompts)]
        proc = subprocess.Popen(cmd + (["--config", args.config] if args.config else []), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            output = proc.communicate()[0] + f"\n{which}: timed out after {args.timeout} s\n"
        try:  # vLLM's engine core outlives a killed parent and holds the GPU: end the whole process group
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            with open(os.path.join(args.logs, f"{n}-{which.split('+')[0]}.log"), "w") as f:
                f.write(output)
        line = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(output[-4000:], flush=True)
            print(f"{which} failed", flush=True)
            continue
        results[which] = json.loads(line[0][7:])
        r = results[which]
        r["tok_per_s_window"] = r["output_tokens"] / r["generation_s"] if r.get("generation_s") else None
        print(which, json.dumps(r), flush=True)
    by_name = {which.split("+")[0]: r for which, r in results.items()}  # 'plain+generate.x=1' is still plain
    plain = by_name.get("plain")
    print("\n| contender | rows | output tokens | wall s | generation window s | tok/s (window) | wall vs plain |")
    print("|---|---|---|---|---|---|---|")
    for which, r in results.items():
        ratio = f"{r['wall_s'] / plain['wall_s']:.2f}×" if plain else "-"
        win = f"{r['generation_s']:.1f}" if r.get("generation_s") else "-"
        tps = f"{r['tok_per_s_window']:,.0f}" if r.get("tok_per_s_window") else "-"
        print(f"| {which} | {r['rows']} | {r['output_tokens']:,} | {r['wall_s']:.1f} | {win} | {tps} | {ratio} |")
    if plain and "stage1" in by_name:
        s = by_name["stage1"]
        print(f"\nstage1 window throughput / plain: {s['tok_per_s_window'] / plain['tok_per_s_window']:.2f}; "
              f"end to end (plain wall incl. engine start / stage1 wall): {plain['wall_s'] / s['wall_s']:.2f}")


if __name__ == "__main__":
    main()
