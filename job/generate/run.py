"""Stage 1, declared for job/stage.py's runner: input checked and read (preflight.py) → the wanted rows cut into
units, the pieces trusted completion shards hold done (units.py) → the engine actors (engine.py) write one shard per
unit → each unit's summary taken (summary.py: totals, canary) → the report (report.py)."""

from __future__ import annotations

import uuid

from job import layout
from job.config import RunConfig, to_dict
from job.generate import completions, preflight, prompts
from job.generate.engine import CompletionGenerator
from job.generate.summary import CanaryFailed, GenerateSummary, UnitTotals, store_report
from job.generate.units import Coverage, plan_units
from job.pipeline import ActorStage, runtime_env
from job.stage import Stage, run_stage

__all__ = ["run_generate", "GenerateStage", "GenerateSummary", "CanaryFailed"]


class GenerateStage(Stage):
    key, directory, label, unit_noun = "generate", layout.COMPLETIONS_DIR, "generate", "work units"

    def __init__(self, config: RunConfig, canary: bool = True):
        super().__init__(preflight.checked_config(config))
        self.canary = canary

    def worker_paths(self) -> dict:
        c = self.config
        return {"--input": c.input, "--output": c.output, "generate.chat_template": c.generate.chat_template}

    def identity(self, record) -> dict:
        self.input = preflight.read_input(self.config, record)
        return self.input.identity

    def plan(self, fence, changed) -> list:
        c, run = self.config, self.input
        self.coverage = Coverage(completions.done_shard_names(c, fence))
        done = self.coverage.rows(run.files, c.limit)
        canary = self.canary and c.quality.canary_rows > 0 and not run.canary_passed
        self.summary = GenerateSummary(output=c.output, num_rows_total=run.total_rows, num_rows_done_before=done,
                                       already_complete=done == run.total_rows)
        self.totals = UnitTotals(c, self.summary, canary, fence, run.lengths)
        return plan_units(run.files, self.coverage, c.limit, c.generate.rows_per_shard,
                          first_unit_rows=c.quality.canary_rows if canary and done == 0 else None)

    def is_done(self, unit) -> bool:
        return self.coverage.covers(unit)

    def mark_done(self, summary: dict, fence) -> None:
        self.coverage.add(summary["shard"])  # its engine committed the shard under the fence: the shard is the mark

    def recorded(self) -> dict:
        return self.input.recorded()

    def actors(self, pending, fence, census) -> ActorStage:
        self.pool = engine_pool(self.config)
        return engines(self.config, self.pool, self.input, fence, census)

    def take(self, summary: dict) -> None:
        self.totals(summary)

    def finish(self, units, fence) -> tuple[GenerateSummary, dict]:
        s = self.summary
        if s.already_complete:
            return s, {}
        s.generation_seconds = self.totals.window()
        return s, {"max_num_seqs": s.max_num_seqs, "max_num_seqs_auto": s.sizing, "lengths": self.totals.lengths,
                   "output_tokens_per_s": s.output_tokens_per_s, "num_engines": self.pool[0]}

    def report(self, summary: GenerateSummary, fence) -> None:
        if not summary.already_complete:
            store_report(self.config, summary, fence)


def run_generate(config: RunConfig, *, allow_drift: bool = False, take_lock: bool = False,
                 canary: bool = True) -> GenerateSummary:
    """Stage 1. `allow_drift`: resume although sampling, template, model or seed changed (the output then mixes
    two settings). `take_lock`: take over another job's writer lock (only when that job is dead). Changed input is
    refused either way."""
    return run_stage(GenerateStage(config, canary), allow_drift=allow_drift, take_lock=take_lock)


def engine_pool(config: RunConfig) -> tuple[int, int]:
    """(min, max) engines. The minimum is generate.num_engines, else what the cluster holds when the job starts (its
    GPUs ÷ tensor_parallel_size); the maximum is generate.max_engines, for GPU nodes that join while the job runs."""
    import ray  # heavy: imported on use

    low = config.generate.num_engines or max(1, int(ray.cluster_resources().get("GPU", 0))
                                             // config.tensor_parallel_size)
    return low, max(low, config.generate.max_engines or low)


def engines(config: RunConfig, pool: tuple[int, int], run_input: preflight.RunInput, fence, census) -> ActorStage:
    import ray  # heavy: imported on use

    low, high = pool
    return ActorStage(
        CompletionGenerator,
        {"config": to_dict(config), "carried_schema_bytes": run_input.carried.serialize().to_pybytes(),
         "chat_template": run_input.chat_template, "job_token": uuid.uuid4().hex, "fence": fence,
         "census": census.book, "lengths": run_input.lengths},
        min_actors=low, max_actors=high,
        # An engine keeps itself full from several units at once (its admission gate, see engine.py).
        units_per_actor=config.generate.units_in_flight_per_engine,
        gpus_per_actor=config.tensor_parallel_size if ray.cluster_resources().get("GPU", 0)
        and config.generate.regenerate != prompts.NONE else 0,  # `none` starts no engine
        max_retries=-1,  # a dead engine kills its actor (see engine.py): restart it and retry its units, forever
        runtime_env=runtime_env(config))  # secrets: at construction (engine.py)
