"""The stage runner: what every stage does the same way, written once (docs/ARCHITECTURE.md explains the contract).

A stage declares what is its own, as a `Stage` subclass (job/generate/run.py, job/hidden_states/run.py): its key
and folder, its identity, its units and ledger (`plan`, `is_done`, `mark_done`), its actors, what it does with each
unit's summary and what it reports at the end. `run_stage` puts the steps in order, the same for every stage:

    with RaySession(config):                                           job/pipeline.py
        on a cluster: Ray joined first, paths the workers cannot see refused    before anything is written
        record = run_record.read(...)                                  what earlier jobs of this run recorded
        identity = stage.identity(record); check_identity(...)         a changed setting is refused (--allow-drift)
        with writing(config, key, directory, take_lock) as fence:      the writer lock; killed writers' temp files gone
            units = stage.plan(fence, changed)                         every unit, done or not
            pending = [u for u in units if not stage.is_done(u)]       the ledger skips what is done
            run_record.update(..., status running, identity)           every write of a stage goes through the fence
            with failure_recorded(...):                                any error: run.json says failed, in one line
                stage.execute(...)       by default: follow(map_units(pending, stage.actors(...)), progress, take)
                summary, fields = stage.finish(units, fence)           totals
            run_record.update(..., status complete, **fields)
            stage.report(summary, fence)                               its report, through the fence

The one error surface: any JobError (job/errors.py), raised on the driver or inside any actor, ends the stage with
run.json recording it (`failed`, or the verdict's own status) and reaches the command line as one line with its exit
code. A stage's actors are stopped by Ray Data's executor (job/pipeline.py `follow`), never by name.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from job import cluster, lock, progress, run_record, runs, storage
from job.config import RunConfig
from job.errors import one_line
from job.pipeline import ActorStage, RaySession, follow, map_units
from job.run_record import RunRecord


@dataclass(kw_only=True)
class StageSummary:
    """What a stage returns when it ends, every stage alike (each also stores its own report under reports/)."""
    output: str
    """The run directory."""
    seconds: float = 0.0
    """Wall time of this invocation."""
    files: list[str] = field(default_factory=list)
    """The files this summary covers: stage 1, the completion shards this job wrote; stage 2, every hidden-state
    part of the run."""
    report: str | None = None
    """Where the stage's report is stored (None: it could not be written; `python -m job report` makes it)."""


class Stage:
    """What one stage declares; `run_stage` does the rest. A unit has `num_rows` and `to_row()` (job/layout.py)."""
    key: str
    """Its section of run.json and the name of its writer lock."""
    directory: str | None
    """The folder of the run directory it writes (temp files a killed writer left there are cleared); None: it
    writes outside the run (an export)."""
    label: str
    """Its name in the progress line."""
    unit_noun: str = "units"
    tokens_key: str = "num_output_tokens"
    """The summary key that counts the stage's tokens, for the progress line's rate."""
    drift_consequence: str = "mix two datasets"
    allow_drift: bool = False
    """Set by `run_stage` before `identity`: --allow-drift, for a stage whose own checks it loosens."""

    def __init__(self, config: RunConfig):
        self.config = config

    def worker_paths(self) -> dict[str, str | None]:
        """The paths the workers must reach ({flag: path}): refused on a cluster when they are local."""
        return {"--output": self.config.output}

    def identity(self, record: RunRecord | None) -> dict:
        """Before the lock: the settings that shape the output (a resume may not change them); may refuse."""
        raise NotImplementedError

    def plan(self, fence: lock.Fence, changed: dict) -> list:
        """Under the lock: every unit of the run, done or not (`changed`: the settings --allow-drift let change)."""
        raise NotImplementedError

    def is_done(self, unit) -> bool:
        raise NotImplementedError

    def mark_done(self, summary: dict, fence: lock.Fence) -> None:
        """A unit's summary has arrived: make the unit done, if its actor's commit did not already."""

    def recorded(self) -> dict:
        """What run.json records of the stage when it starts, besides its identity and status."""
        return {}

    def actors(self, pending: list, fence: lock.Fence, census: cluster.StageCensus) -> ActorStage:
        raise NotImplementedError

    def take(self, summary: dict) -> None:
        """Each unit's summary, after `mark_done`: totals, lines, the canary."""

    def execute(self, ray_session: RaySession, units: list, pending: list, fence: lock.Fence) -> None:
        """Run the pending units: by default through the stage's actors on Ray Data (`actors`), each summary marked
        done, counted and taken as it arrives. A stage whose work is not one task per unit (training: Ray Train's
        workers) runs it here itself."""
        run_units(self, ray_session, units, pending, fence)

    def finish(self, units: list, fence: lock.Fence) -> tuple[StageSummary, dict]:
        """The stage's summary, and what run.json records at its end."""
        raise NotImplementedError

    def report(self, summary: StageSummary, fence: lock.Fence) -> None:
        """After run.json records the end: the stage's report, written through `fence`, and its closing lines."""


def run_stage(stage: Stage, *, allow_drift: bool = False, take_lock: bool = False) -> StageSummary:
    """Run `stage` to its end: see the module docstring for the order of the steps."""
    started, config = time.monotonic(), stage.config
    with RaySession(config) as ray_session:
        stage.ray_session = ray_session  # a stage's plan may need Ray (an export counts its samples on the workers)
        if cluster.joining_cluster():  # the paths every node must see, refused before anything is written
            ray_session.start()
            cluster.check_paths_reach_workers(config, stage.worker_paths())
        record = run_record.read(config.output, config.storage)
        stage.allow_drift = allow_drift
        identity = stage.identity(record)
        changed = check_identity(record, stage.key, identity, allow_drift, stage.drift_consequence)
        with writing(config, stage.key, stage.directory, take_lock=take_lock) as fence:
            units = stage.plan(fence, changed)
            pending = [u for u in units if not stage.is_done(u)]
            run_record.update(config, stage.key, fence, identity=identity, **stage.recorded(),
                              status=run_record.RUNNING if pending else run_record.COMPLETE)
            with failure_recorded(config, stage.key, fence):
                if pending:
                    print(f"{stage.label}: {len(pending):,} of {len(units):,} {stage.unit_noun} to do", flush=True)
                    stage.execute(ray_session, units, pending, fence)
                else:
                    print(f"nothing to do: all {len(units):,} {stage.unit_noun} of this run are done", flush=True)
                summary, fields = stage.finish(units, fence)
            run_record.update(config, stage.key, fence, **{"status": run_record.COMPLETE, **fields})
            stage.report(summary, fence)
    summary.seconds = time.monotonic() - started
    return summary


def run_units(stage: Stage, ray_session: RaySession, units: list, pending: list, fence: lock.Fence) -> None:
    """`pending` through the stage's actors, with a progress line over every unit's rows."""
    total = sum(u.num_rows for u in units)
    to_do = sum(u.num_rows for u in pending)
    print(f"{stage.label}: {to_do:,} rows to do ({total - to_do:,} of {total:,} already done)", flush=True)
    ray_session.start()
    census = cluster.StageCensus()
    try:
        actors = stage.actors(pending, fence, census)
        tracker = progress.Progress(total_rows=total, done_rows=total - to_do, label=stage.label,
                                    tokens_key=stage.tokens_key, num_engines=actors.min_actors,
                                    max_engines=actors.max_actors, engines_fn=census)

        def take(summary: dict) -> None:
            stage.mark_done(summary, fence)
            tracker.update(summary)
            stage.take(summary)

        follow(map_units(pending, actors).iter_rows(), tracker, take)
    except BaseException:
        census.stop_actors()  # through the handles they reported: a failed dataset's actors would linger
        raise
    finally:
        census.close()


def check_identity(record: RunRecord | None, stage_key: str, identity: dict, allow_drift: bool,
                   consequence: str = "mix two datasets") -> dict:
    """The settings of `identity` that differ from what the stage recorded in run.json: refused (RunError naming
    them) unless `allow_drift`. {} on a new run."""
    previous = record.stages.get(stage_key) if record is not None else None
    if previous is None:
        return {}
    return runs.check_drift(previous.identity, identity, allow_drift, consequence=consequence)


@contextmanager
def writing(config: RunConfig, stage_key: str, directory: str | None, *, take_lock: bool):
    """Hold the stage's writer lock (one writer per run and stage) and yield its fence, through which every write
    and delete of the stage commits; the temp files a killed writer left in `directory` are cleared first (nobody
    else writes there while we hold the lock)."""
    with lock.WriterLock(config, stage_key, take_over=take_lock) as held:
        if directory is not None:
            held.fence.clear_temp_files(storage.join(config.output, directory))
        yield held.fence


@contextmanager
def failure_recorded(config: RunConfig, stage_key: str, fence: lock.Fence):
    """Inside: an error marks the stage in run.json before it propagates — `failed` with its one-line reason, or a
    verdict's own status (`run_status`: the canary's `canary_failed`) — so run.json never keeps saying "running"
    for a job that ended. A take-over is left as it is: the new holder owns run.json now."""
    try:
        yield
    except BaseException as e:
        if not isinstance(e, lock.LockError):
            status = getattr(e, "run_status", run_record.FAILED)
            try:
                run_record.update(config, stage_key, fence, status=status, error=f"{type(e).__name__}: {one_line(e)}")
            except Exception:  # the failure itself is what to report
                pass
        raise
