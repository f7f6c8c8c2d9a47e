"""Stage 1's driver, on job/stage.py's runner.

Reads top to bottom: scan and validate the input → check the run directory (identity, drift, lock) → cut the rows
not yet done into completion units (job/layout.py) → Ray Data streams the units through the engine actors
(engine.py), which write one shard per unit → `_Consumer` takes each unit's summary (totals, progress, canary)
→ report.

Nothing is materialized on the driver: it holds the unit list (one small record per shard) and per-unit counts.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import pyarrow as pa

from job import cluster, layout, progress, runs, scan, stage, storage
from job.config import ConfigError, RunConfig, to_dict
from job.generate import engine_sizing, inputs, prompts, quality
from job.generate.engine import CompletionGenerator
from job.generate.engine_start import EngineStartError, resolved_sampling, text_only_engine_kwargs
from job.generate.report import write_report
from job.generate.units import count_done_rows, pending_units, wanted_ranges
from job.lock import FencedOut

log = logging.getLogger("job.generate")


class CanaryFailed(stage.Verdict):
    """The first rows say the dataset would be useless; the message says what to check."""


@dataclass(kw_only=True)
class GenerateSummary(stage.StageSummary):
    num_rows_total: int
    num_rows_done_before: int
    num_rows: int = 0
    num_errors: int = 0
    num_output_tokens: int = 0
    generation_seconds: float = 0.0
    already_complete: bool = False
    units_per_node: dict[str, int] = field(default_factory=dict)  # Ray node id → units its engines wrote
    max_num_seqs: dict[str, int] = field(default_factory=dict)  # device name → the engines' max_num_seqs on it
    sizing: dict[str, dict] = field(default_factory=dict)  # device name → `max_num_seqs: auto`'s check (engine_sizing)
    quality: dict | None = None  # the quality report as this job stored it (print_summary shows it; no second read)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.generation_seconds if self.generation_seconds else 0.0


def num_engines(config: RunConfig) -> int:
    import ray  # heavy: imported on use

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
    if not looks_local and "://" not in model:
        check_hub_model(model, token=config.env_vars.get("HF_TOKEN") or os.environ.get("HF_TOKEN"))


def check_hub_model(name: str, token: str | None = None) -> None:
    """A model given by hub name must be in the local Hugging Face cache or reachable on the hub, checked here in
    a second. Left to the engine actors, a name that cannot be fetched failed after the actor's imports and the hub
    client's retries (79 s here) with a raw traceback. (s3:// and other URIs are the loader's to fetch.)"""
    import huggingface_hub as hub  # heavy: imported on use

    if isinstance(hub.try_to_load_from_cache(name, "config.json"), str):
        return
    try:
        hub.HfApi().model_info(name, timeout=10, token=token or None)
    except (hub.errors.RepositoryNotFoundError, hub.errors.GatedRepoError) as e:
        raise ConfigError(f"model {name!r}: not a local directory, and the Hugging Face hub has no such model, or "
                          f"it is gated or private (set HF_TOKEN in env_vars): {type(e).__name__}") from None
    except Exception as e:  # no network, a proxy, HF_HUB_OFFLINE
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"model {name!r}: not a local directory, not in the Hugging Face cache, and the hub cannot "
                          f"be reached from here ({type(e).__name__}: {first}). Give a model directory (on a "
                          "cluster every node needs it at that path: cluster.yaml stages it), or run where the hub "
                          "is reachable") from None


# ---------------------------------------------------------------------------------------------------------------


def run_generate(config: RunConfig, *, allow_drift: bool = False, take_lock: bool = False,
                 canary: bool = True) -> GenerateSummary:
    """Stage 1. `allow_drift`: resume although sampling, template, model or seed changed (the output then mixes
    two settings). `take_lock`: take over another job's writer lock (only when that job is dead). Changed input is
    refused either way."""
    started = time.monotonic()
    config = _checked_config(config)
    with stage.RaySession(config) as ray_session:
        # On a cluster, refuse paths the engines' nodes cannot see before anything is written or started.
        if cluster.joining_cluster():
            ray_session.start()
        cluster.check_paths_reach_workers(config, {"--input": config.input, "--output": config.output,
                                                   "generate.chat_template": config.generate.chat_template})
        run_input = _read_input(config, allow_drift)
        with stage.writing(config, "generate", layout.COMPLETIONS_DIR, take_lock=take_lock) as held:
            summary = _generate(config, run_input, ray_session, canary, held.fence)
    summary.seconds = time.monotonic() - started
    return summary


def _checked_config(config: RunConfig) -> RunConfig:
    """The config refused at once when it cannot work (no input, no model), with the engine settings a text-only
    run of this model needs; what `max_num_seqs: auto` will do is said first."""
    if not config.input:
        raise ConfigError("no input: pass --input (a folder, file or s3:// prefix of prompts: parquet, JSONL or "
                          "Arrow / datasets.save_to_disk)")
    check_model(config)
    engine_kwargs, note = text_only_engine_kwargs(config.model, config.engine_kwargs)
    if note:
        print(note, flush=True)
        config = dataclasses.replace(config, engine_kwargs=engine_kwargs)
    if engine_sizing.is_auto(config.engine_kwargs):
        print(f"engine: max_num_seqs auto: each engine sizes it from its device's memory for "
              f"{config.generate.kv_tokens_per_seq:,} tokens a sequence (its line 'max_num_seqs auto = N' follows "
              "when it starts)", flush=True)
    return config


@dataclass
class _RunInput:
    """What stage 1 knows of its input and of the run before it takes the lock."""
    files: list
    file_records: list
    carried: pa.Schema
    ident: dict
    sampling: dict
    chat_template: str | None
    previous: dict | None
    total_rows: int


def _read_input(config: RunConfig, allow_drift: bool) -> _RunInput:
    """Input files listed and their footers read (cheap); ids validated once per run; a changed input refused
    whatever the flags say, changed settings unless `allow_drift`."""
    chat_template = read_chat_template(config)
    sampling = resolved_sampling(config.model, config.generate.sampling)
    files = inputs.list_input_files(config.input, config.storage)
    for note in (inputs.row_group_note(files, config.generate.rows_per_shard),
                 inputs.compressed_note(files, config.generate.rows_per_shard)):
        if note:
            print(note, flush=True)
    previous = runs.read_run_json(config.output, config.storage)
    ident = runs.identity(config, sampling, chat_template, inputs.fingerprint(files))
    if previous and "generate" in previous:
        recorded = previous["generate"].get("input", {}).get("files")
        if recorded is not None:  # refused whatever the flags say: never resume across changed input
            file_records = inputs.check_unchanged(recorded, files, config.input, config.storage)
        else:  # a run directory from before files were recorded
            file_records = inputs.describe_files(files, config.input, {}, inputs.content_digests(files, config.storage))
        stage.check_identity(previous, "generate", ident, allow_drift)
        recorded_schema = previous["generate"].get("input", {}).get("columns")
        if recorded_schema:  # the columns validation found (JSONL's are the keys of all rows: no re-parse)
            carried = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(recorded_schema)))
        elif files[0].format == "jsonl":  # cannot happen for runs of this version; validate again, it is safe
            carried = inputs.validate_input(files, config.storage)
        else:
            carried = inputs.read_schema(files[0].uri, config.storage)
    else:
        digests: dict[str, str] = {}
        carried = inputs.validate_input(files, config.storage, ids_digests=digests,
                                        regenerate=config.generate.regenerate)
        file_records = inputs.describe_files(files, config.input, digests,
                                             inputs.content_digests(files, config.storage))
    total_rows = sum(e - s for _, s, e in wanted_ranges(files, config.limit))
    return _RunInput(files=files, file_records=file_records, carried=carried, ident=ident, sampling=sampling,
                     chat_template=chat_template, previous=previous, total_rows=total_rows)


def _generate(config: RunConfig, run_input: _RunInput, ray_session: stage.RaySession, canary: bool,
              fence) -> GenerateSummary:
    """Under the writer lock: what is left (the output listing minus the wanted row ranges), cut into units and
    streamed through the engines; run.json and the report written under the fence."""
    files, total_rows, previous = run_input.files, run_input.total_rows, run_input.previous
    completions = storage.join(config.output, layout.COMPLETIONS_DIR)
    done = _trusted_shards(config, fence)
    done_rows = count_done_rows(files, done, config.limit)
    canary_passed = bool(previous and previous.get("generate", {}).get("canary_passed"))
    run_canary = canary and config.quality.canary_rows > 0 and not canary_passed
    units = pending_units(files, done, config.limit, config.generate.rows_per_shard,
                          first_unit_rows=config.quality.canary_rows if run_canary and done_rows == 0 else None)
    summary = GenerateSummary(output=config.output, num_rows_total=total_rows, num_rows_done_before=done_rows)
    runs.write_run_json(config, "generate", {
        "identity": run_input.ident,
        "input": {"uri": config.input, "format": files[0].format, "num_files": len(files), "num_rows": total_rows,
                  "files": run_input.file_records,
                  "columns": base64.b64encode(run_input.carried.serialize().to_pybytes()).decode()},
        "sampling": run_input.sampling, "status": "running" if units else "complete"}, fence)
    if not units:
        summary.already_complete = True
        print(f"nothing to do: all {total_rows:,} rows of this run are already in {completions}", flush=True)
        return summary
    print(f"generate: {len(units):,} work units, {sum(u.num_rows for u in units):,} rows to go "
          f"({done_rows:,} of {total_rows:,} already done)", flush=True)

    # Ray Data: units → engine actors (each writes its shards) → per-unit summaries back here.
    with stage.failure_recorded(config, "generate", fence):
        ray_session.start()
        engines = engine_pool(config)
        tracker = progress.Progress(total_rows=total_rows, done_rows=done_rows, label="generate",
                                    num_engines=engines[0], max_engines=engines[1])
        consume = _Consumer(config, summary, tracker, run_canary, fence)
        stage.run_units(units, _Shards(done), _engines(config, run_input.carried, run_input.chat_template, engines,
                                                       fence), tracker, consume, _user_errors())
        summary.generation_seconds = consume.window()
    runs.write_run_json(config, "generate", {"status": "complete", "num_engines": engines[0],
                                             "max_num_seqs": summary.max_num_seqs,
                                             "max_num_seqs_auto": summary.sizing,
                                             "output_tokens_per_s": summary.output_tokens_per_s}, fence)
    # The shards this job wrote remembered: the next command (stage 2, `status`) reads no footer. The same listing
    # and judgement serve the report (one footer pass and one rows read at the end, not two).
    found = _remember_shards(config, fence)
    try:
        summary.quality = write_report(config.output, config.storage, guard=fence.guard, found=found)
        summary.report = storage.join(config.output, layout.REPORTS_DIR, layout.GENERATE_REPORT)
    except storage.StorageError as e:  # every shard is committed: a report that cannot be read now is no failure
        log.warning("the run is complete but its report could not be written (%s); "
                    "`python -m job report %s` makes it later", e, config.output)
    return summary


class _Shards:
    """Stage 1's ledger (stage.UnitLedger). A unit is done when its shard is among the trusted ones (the units come
    from `pending_units`, which cut only rows no trusted shard covers, so none is when it runs). It is marked done by
    its engine's atomic commit of its shard, under the fence (engine.py): the shard is the mark, and nothing is left
    for the runner to write."""

    def __init__(self, done_shard_names: list[str]):
        self.done = set(done_shard_names)

    def is_done(self, unit) -> bool:
        return unit.shard_name in self.done

    def mark_done(self, summary: dict) -> None:
        pass


def _trusted_shards(config: RunConfig, fence) -> list[str]:
    """Names of the completion shards that count as done: the trusted ones (scan.trusted_completion_shards). One
    that cannot be trusted (truncated, zero bytes, not a completion shard) is moved aside to quarantine/ (never
    deleted) and its rows are generated again; one line names them."""
    found = scan.trusted_completion_shards(config.output, config.storage)
    aside = storage.join(config.output, layout.QUARANTINE_DIR, layout.COMPLETIONS_DIR)
    line = found.problem_line(f"moved aside to {aside}/ and their rows generated again")
    if line:
        print(line, flush=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        completions = storage.join(config.output, layout.COMPLETIONS_DIR)
        for name in found.problems:
            with fence.guard():
                storage.move(storage.join(completions, name), storage.join(aside, f"{name}.{stamp}"), config.storage)
    # The footers read now are not read again by the next command (job/trust_cache.py): the trusted ones only.
    try:
        scan.remember_completion_shards(config.output, found, config.storage, fence)
    except storage.StorageError as e:  # an optimization: the job goes on without it
        log.warning("the completion shards' trust cache could not be written (%s)", e)
    return [s.name for s in found.trusted]


def _engines(config: RunConfig, carried: pa.Schema, chat_template: str | None,
             engines: tuple[int, int], fence) -> stage.ActorStage:
    import ray  # heavy: imported on use

    return stage.ActorStage(
        CompletionGenerator,
        {"config": to_dict(config), "carried_schema_bytes": carried.serialize().to_pybytes(),
         "chat_template": chat_template, "job_token": uuid.uuid4().hex, "fence": fence},
        min_actors=engines[0], max_actors=engines[1],
        # An engine keeps itself full from several units at once (its admission gate, see engine.py).
        units_per_actor=config.generate.units_in_flight_per_engine,
        gpus_per_actor=config.tensor_parallel_size if ray.cluster_resources().get("GPU", 0)
        and config.generate.regenerate != prompts.NONE else 0,  # `none` starts no engine
        max_retries=-1,  # a dead engine kills its actor (see engine.py): restart it and retry its units, forever
        runtime_env=stage.runtime_env(config))  # secrets: at construction (engine.py)


CACHE_REFRESH_S = 600.0
"""How often a running stage 1 adds the shards it wrote to the trust cache (S3): `status` during a run then reads
only the footers of the last ~10 minutes' shards, not of every shard this job wrote."""


def _remember_shards(config: RunConfig, fence) -> scan.CompletionShards | None:
    """The run's completion shards trusted now (a footer read for each shard the trust cache does not hold) and
    saved as its cache (job/trust_cache.py), with their small columns (job/rows_cache.py). A cache that cannot be
    written now is no failure: it is an optimization, and the next save writes it. Returns the shards as judged
    (None: a local run, which keeps no cache, or no listing now)."""
    if not storage.is_s3(config.output):
        return None
    try:
        found = scan.trusted_completion_shards(config.output, config.storage)
        scan.remember_completion_shards(config.output, found, config.storage, fence)
    except storage.StorageError as e:
        log.warning("the completion shards' trust cache could not be written (%s); the next command reads their "
                    "footers", e)
        return None
    try:
        # And their small columns in one object (job/rows_cache.py): the notebook and the report read it, not every
        # shard. Only the shards written since the last save are read here: their bodies, not only their footers,
        # so a shard moved or damaged since the listing fails this save (never the run; a fenced-out job still stops).
        scan.remember_small_columns(config.output, found, config.storage, fence)
    except (storage.StorageError, OSError, pa.ArrowException) as e:
        log.warning("the completion shards' rows cache could not be written (%s); the notebook and `report` read "
                    "every shard", e)
    return found


class _Consumer:
    """What stage 1 does with each unit's summary as it arrives: totals, progress, the canary decision."""

    def __init__(self, config: RunConfig, summary: GenerateSummary, tracker: progress.Progress, run_canary: bool,
                 fence):
        self.config, self.summary, self.tracker, self.run_canary = config, summary, tracker, run_canary
        self.fence = fence
        self.canary_rows, self.window_start = 0, None
        self.cache_saved = time.monotonic()

    def __call__(self, s: dict) -> None:
        config, summary = self.config, self.summary
        if self.window_start is None:  # the generation window opens when the first finished unit started
            self.window_start = time.monotonic() - s["seconds"]
        summary.num_rows += s["num_rows"]
        summary.num_errors += s["num_errors"]
        summary.num_output_tokens += s["num_output_tokens"]
        summary.shards.append(s["shard"])
        summary.units_per_node[s["node"]] = summary.units_per_node.get(s["node"], 0) + 1
        if s["device"] and summary.max_num_seqs.get(s["device"]) != s["max_num_seqs"]:  # auto: per GPU type
            summary.max_num_seqs[s["device"]] = s["max_num_seqs"]
            print(f"engines on {s['device']}: max_num_seqs {s['max_num_seqs']}"
                  + (f" ({s['sizing']})" if s["sizing"] else ""), flush=True)
            if s["sizing"]:
                summary.sizing[s["device"]] = {"max_num_seqs": s["max_num_seqs"], "vllm_pool_holds": s["sizing_holds"],
                                               "check": s["sizing"]}
        self.tracker.update(s)
        if self.run_canary and self.canary_rows < config.quality.canary_rows:
            self.canary_rows += s["num_rows"]
            if self.canary_rows >= config.quality.canary_rows:
                verdict = quality.canary_verdict(self.tracker.totals, config.quality)
                if verdict:
                    runs.write_run_json(config, "generate", {"status": "canary_failed"}, self.fence)
                    raise CanaryFailed(f"{verdict}\nThe {summary.num_rows} rows written so far stay in "
                                       f"{config.output} for inspection; after fixing, run into a new --output.")
                print(f"canary passed on the first {self.canary_rows} rows", flush=True)
                runs.write_run_json(config, "generate", {"canary_passed": True}, self.fence)
        if time.monotonic() - self.cache_saved > CACHE_REFRESH_S:
            _remember_shards(config, self.fence)
            self.cache_saved = time.monotonic()

    def window(self) -> float:
        return time.monotonic() - self.window_start if self.window_start else 0.0


def _user_errors() -> tuple[type[BaseException], ...]:
    return (storage.StorageError, inputs.InputError, EngineStartError, FencedOut)
