"""Stage 1: prompt shards (parquet, JSONL, Arrow) → vLLM engine actors → completion shards.

    python -m job generate --config configs/demo.yaml --output demo-run

Reads top to bottom: scan and validate the input → check the run directory (resume, drift, lock) → cut the rows
not yet done into work units → Ray Data streams the units through the engine actors, which write one shard per
unit → the driver follows the per-unit summaries (progress, canary) → report.

Nothing is materialized on the driver: it holds the unit list (one small record per shard) and per-unit counts.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field

import pyarrow as pa

from job import inputs, layout, lock, progress, quality, report, runs, storage
from job.config import ConfigError, RunConfig

log = logging.getLogger("job.generate")


class CanaryFailed(RuntimeError):
    """The first rows say the dataset would be useless; the message says what to check."""


@dataclass
class GenerateSummary:
    output: str
    num_rows_total: int
    num_rows_done_before: int
    num_rows: int = 0
    num_errors: int = 0
    num_output_tokens: int = 0
    seconds: float = 0.0
    generation_seconds: float = 0.0
    already_complete: bool = False
    shards: list[str] = field(default_factory=list)
    units_per_node: dict[str, int] = field(default_factory=dict)  # Ray node id → units its engines wrote

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.generation_seconds if self.generation_seconds else 0.0


def ensure_ray(config: RunConfig, num_cpus: int | None = None) -> bool:
    """Join the cluster when there is one (RAY_ADDRESS, or inside `ray job submit`), else start a local Ray.
    Returns True when this call started Ray (the caller shuts it down again)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        print(f"ray: joined the cluster at {os.environ['RAY_ADDRESS']} (RAY_ADDRESS)", flush=True)
    else:
        # address="local": a Ray of this job's own. Plain ray.init() would find a head started on this machine with
        # `ray start --head` (how one tries `ray job submit` before renting a cluster), join it, and refuse
        # num_cpus with a raw ValueError. Jobs meant for that head get RAY_ADDRESS from `ray job submit`.
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 log_to_driver=True, configure_logging=False)
        print("ray: a local Ray of this job's own (RAY_ADDRESS is not set; `ray job submit` sets it)", flush=True)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # our own progress line says more (tokens/s, ETA, quality)
    ctx.print_on_execution_start = False
    return True


def num_engines(config: RunConfig) -> int:
    import ray

    if config.generate.num_engines:
        return config.generate.num_engines
    gpus = int(ray.cluster_resources().get("GPU", 0))
    return max(1, gpus // config.tensor_parallel_size)


def engine_pool(config: RunConfig) -> tuple[int, int]:
    """(min, max) engines. The minimum is what the cluster holds when the job starts (or generate.num_engines); the
    maximum is generate.max_engines, for GPU nodes that join while the job runs (an autoscaling cluster)."""
    low = num_engines(config)
    return low, max(low, config.generate.max_engines or low)


def read_chat_template(config: RunConfig) -> str | None:
    path = config.generate.chat_template
    if not path:
        return None
    try:
        return storage.read_bytes(path, config.storage).decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"chat template {path} cannot be read: {e}") from None


def check_model(config: RunConfig) -> None:
    model = config.model
    looks_local = model.startswith(("/", ".", "~")) or os.path.exists(model)
    if looks_local and not os.path.isdir(model):
        raise ConfigError(f"model {model!r}: no such directory (build the demo model with "
                          "`python -m job tiny-model --output DIR`)")
    if looks_local and not os.path.exists(os.path.join(model, "config.json")):
        raise ConfigError(f"model {model!r}: no config.json in that directory")


# ---------------------------------------------------------------------------------------------------------------


def run_generate(config: RunConfig, *, allow_drift: bool = False, take_lock: bool = False,
                 canary: bool = True) -> GenerateSummary:
    """Stage 1. `allow_drift`: resume although sampling, template, model or seed changed (the output then mixes
    two settings). `take_lock`: take over another job's writer lock (only when that job is dead). Changed input is
    refused either way."""
    started = time.monotonic()
    if not config.input:
        raise ConfigError("no input: pass --input (a folder, file or s3:// prefix of prompts: parquet, JSONL or "
                          "Arrow / datasets.save_to_disk)")
    check_model(config)
    from job import cluster
    from job.engine import resolved_sampling  # vLLM itself is imported only inside the actors

    # On a cluster, refuse paths the engines' nodes cannot see before anything is written or started.
    joined_ray = ensure_ray(config) if cluster.joining_cluster() else False
    cluster.check_paths_reach_workers(config, {"--input": config.input, "--output": config.output,
                                               "generate.chat_template": config.generate.chat_template})

    chat_template = read_chat_template(config)
    sampling = resolved_sampling(config.model, config.generate.sampling)

    # 1. Input: list files and read their footers (cheap), validate ids once per run.
    files = inputs.list_input_files(config.input, config.storage)
    for note in (inputs.row_group_note(files, config.generate.rows_per_shard),
                 inputs.compressed_note(files, config.generate.rows_per_shard)):
        if note:
            print(note, flush=True)
    previous = runs.read_run_json(config.output, config.storage)
    fingerprint = inputs.fingerprint(files)
    ident = runs.identity(config, sampling, chat_template, fingerprint)
    if previous and "generate" in previous:
        recorded = previous["generate"].get("input", {}).get("files")
        if recorded is not None:  # refused whatever the flags say: never resume across changed input
            file_records = inputs.check_unchanged(recorded, files, config.input, config.storage)
        else:  # a run directory from before files were recorded
            file_records = inputs.describe_files(files, config.input, {})
        runs.check_drift(previous["generate"].get("identity", {}), ident, allow_drift)
        recorded_schema = previous["generate"].get("input", {}).get("columns")
        if recorded_schema:  # the columns validation found (JSONL's are the keys of all rows: no re-parse)
            carried = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(recorded_schema)))
        elif files[0].format == "jsonl":  # cannot happen for runs of this version; validate again, it is safe
            carried = inputs.validate_input(files, config.storage)
        else:
            carried = inputs.read_schema(files[0].uri, config.storage)
    else:
        digests: dict[str, str] = {}
        carried = inputs.validate_input(files, config.storage, ids_digests=digests)
        file_records = inputs.describe_files(files, config.input, digests)
    total_rows = sum(n for _, s, e in inputs.wanted_ranges(files, config.limit) for n in [e - s])

    with lock.WriterLock(config, "generate", take_over=take_lock):
        # 2. What is left: the output listing minus the wanted row ranges.
        completions = storage.join(config.output, layout.COMPLETIONS_DIR)
        storage.remove_temp_files(completions)  # what a killed writer left; we hold the lock, nobody writes now
        done = [u.rsplit("/", 1)[-1] for u in storage.list_files(completions, layout.SHARD_SUFFIX, config.storage)]
        done_rows = inputs.count_done_rows(files, done, config.limit)
        canary_passed = bool(previous and previous.get("generate", {}).get("canary_passed"))
        run_canary = canary and config.quality.canary_rows > 0 and not canary_passed
        units = inputs.pending_units(files, done, config.limit, config.generate.rows_per_shard,
                                     first_unit_rows=config.quality.canary_rows if run_canary and done_rows == 0 else None)
        summary = GenerateSummary(output=config.output, num_rows_total=total_rows, num_rows_done_before=done_rows)
        runs.write_run_json(config, "generate", {
            "identity": ident, "input": {"uri": config.input, "format": files[0].format, "num_files": len(files),
                                         "num_rows": total_rows, "files": file_records,
                                         "columns": base64.b64encode(carried.serialize().to_pybytes()).decode()},
            "sampling": sampling, "status": "running" if units else "complete"})
        if not units:
            summary.already_complete = True
            summary.seconds = time.monotonic() - started
            print(f"nothing to do: all {total_rows:,} rows of this run are already in {completions}", flush=True)
            return summary
        print(f"generate: {len(units):,} work units, {sum(u.num_rows for u in units):,} rows to go "
              f"({done_rows:,} of {total_rows:,} already done)", flush=True)

        # 3. Ray Data: units → engine actors (each writes its shards) → per-unit summaries back here.
        import ray

        started_ray = ensure_ray(config) or joined_ray
        try:
            engines = engine_pool(config)
            _follow(config, _start_pipeline(config, units, carried, chat_template, engines), summary,
                    total_rows, done_rows, run_canary, engines)
        except Exception as e:
            user_error = _user_error_inside(e)
            if user_error is not None:  # a storage or input error inside an actor: its message, not Ray's trace
                raise user_error from None
            raise
        finally:
            if started_ray:  # stop the engines now, so their shutdown logs do not trail the summary
                ray.shutdown()
        runs.write_run_json(config, "generate", {"status": "complete", "num_engines": engines[0],
                                                 "output_tokens_per_s": summary.output_tokens_per_s})
        try:
            report.write_report(config.output, config.storage)
        except storage.StorageError as e:  # every shard is committed: a report that cannot be read now is no failure
            log.warning("the run is complete but its report could not be written (%s); "
                        "`python -m job report %s` makes it later", e, config.output)
    summary.seconds = time.monotonic() - started
    return summary


def _user_error_inside(e: BaseException) -> BaseException | None:
    """The StorageError / InputError / EngineStartError that a Ray task failure wraps, if any."""
    from job.engine import EngineStartError

    user_errors = (storage.StorageError, inputs.InputError, EngineStartError)
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, user_errors):
            return e
        # Ray Data re-raises UDF errors with the remote traceback as text: recover the message from it.
        for cls in user_errors:
            m = re.search(rf"{cls.__module__}\.{cls.__name__}: (.+)", str(e))
            if m:
                return cls(m.group(1).strip())
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None


def _follow(config: RunConfig, summaries, summary: GenerateSummary, total_rows: int, done_rows: int,
            run_canary: bool, engines: tuple[int, int]) -> None:
    """Consume the per-unit summaries as units finish: progress line, canary decision, totals."""
    with progress.Progress(total_rows=total_rows, done_rows=done_rows, label="generate",
                           num_engines=engines[0], max_engines=engines[1]) as tracker:
        _consume(config, summaries, summary, tracker, run_canary)


def _consume(config: RunConfig, summaries, summary: GenerateSummary, tracker: progress.Progress,
             run_canary: bool) -> None:
    canary_rows, window_start = 0, None
    for s in summaries:
        if window_start is None:  # the generation window opens when the first finished unit started
            window_start = time.monotonic() - s["seconds"]
        summary.num_rows += s["num_rows"]
        summary.num_errors += s["num_errors"]
        summary.num_output_tokens += s["num_output_tokens"]
        summary.shards.append(s["shard"])
        summary.units_per_node[s["node"]] = summary.units_per_node.get(s["node"], 0) + 1
        tracker.update(s)
        if run_canary and canary_rows < config.quality.canary_rows:
            canary_rows += s["num_rows"]
            if canary_rows >= config.quality.canary_rows:
                verdict = quality.canary_verdict(tracker.totals, config.quality)
                if verdict:
                    runs.write_run_json(config, "generate", {"status": "canary_failed"})
                    raise CanaryFailed(f"{verdict}\nThe {summary.num_rows} rows written so far stay in "
                                       f"{config.output} for inspection; after fixing, run into a new --output.")
                print(f"canary passed on the first {canary_rows} rows", flush=True)
                runs.write_run_json(config, "generate", {"canary_passed": True})
    summary.generation_seconds = time.monotonic() - window_start if window_start else 0.0


def _start_pipeline(config: RunConfig, units: list[layout.CompletionUnit], carried: pa.Schema,
                    chat_template: str | None, engines: tuple[int, int]):
    import ray

    from job.config import to_dict
    from job.engine import CompletionGenerator

    k = config.generate.units_in_flight_per_engine
    gpus_per_engine = config.tensor_parallel_size if ray.cluster_resources().get("GPU", 0) else 0
    low, high = engines
    if high > low:
        # Ray Data adds an actor when its pool's utilization (units in flight / (actors × max_concurrency)) reaches
        # this. Its default, 1.75, assumes actors queue 4 tasks but run 1; ours run all `k` they hold, so the pool
        # is at most 1.0 busy: "every engine full" must be the trigger, or no engine is ever added.
        ray.data.DataContext.get_current().autoscaling_config.actor_pool_util_upscaling_threshold = 1.0
    # One block per unit: each unit is its own task, so an actor can run `k` of them at once and a failed
    # actor retries exactly its own units.
    ds = ray.data.from_items([u.to_row() for u in units], override_num_blocks=len(units))
    ds = ds.map_batches(
        CompletionGenerator,
        fn_constructor_kwargs={"config": to_dict(config), "carried_schema_bytes": carried.serialize().to_pybytes(),
                               "chat_template": chat_template, "job_token": uuid.uuid4().hex},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(min_size=low, max_size=high, max_tasks_in_flight_per_actor=k),
        max_concurrency=k,
        num_cpus=1,
        num_gpus=gpus_per_engine,
        runtime_env={"env_vars": dict(config.env_vars)},
        # A dead engine kills its actor (see engine.py): restart it and retry its units, forever.
        max_restarts=-1,
        max_task_retries=-1,
    )
    return ds.iter_rows()
