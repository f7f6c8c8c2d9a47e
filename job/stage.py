"""The stage runner: what both stages do the same way, written once. docs/ARCHITECTURE.md explains the contract.

A stage (job/generate/run.py, job/hidden_states/run.py) supplies only:
- its work units and its `UnitLedger`: whether a unit is done and how it is marked done (from one listing of its
  output directory, job/layout.py's names: stage 1's shard, stage 2's marker; job/scan.py judges both);
- its identity (the settings that shape its output) and what it records in run.json;
- its actor class (a `map_batches` callable that takes one unit per call, writes the unit's files atomically, its
  done mark last, and yields one summary row) and how many actors it wants;
- what it does with each summary row (totals, progress, the canary).

The runner owns the rest, in this order:
    previous = runs.read_run_json(...)                       what an earlier job of this run recorded
    check_identity(previous, stage, identity, allow_drift)   a changed setting is refused, or allowed and named
    with RaySession(config) as session:                      Ray joined or started once; shut down only if started
        with writing(config, stage, directory, take_lock) as held:   the writer lock; temp files of killed writers gone
            runs.write_run_json(... "running" ..., held.fence)      every commit is fenced (job/lock.py)
            session.start()
            run_units(units, ledger, ActorStage(..., runtime_env=runtime_env(config)), progress, on_summary, errors)
            runs.write_run_json(... "complete" ...)
`run_units` skips the units the ledger calls done and marks each unit done as its summary arrives. `follow` always
closes its progress line and, when the stage ends on an error or a verdict, stops it in the order
that lets the verdict be the last thing printed: the dataset's iterator closed (Ray Data's executor stops submitting
work), then the stage's actors killed, then (leaving the session) Ray shut down. An error raised inside an actor
(which Ray hands back as a wrapped traceback) comes out as the stage's own error with its own message.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from job import lock, progress, redaction, runs, storage
from job.cluster import engine_census, kill_stage_actors
from job.config import RunConfig


@dataclass(kw_only=True)
class StageSummary:
    """What a stage returns when it ends, both stages alike (each also stores its own report under reports/)."""
    output: str
    """The run directory."""
    seconds: float = 0.0
    """Wall time of this invocation."""
    shards: list[str] = field(default_factory=list)
    """The shards this stage's summary covers: stage 1, those this job wrote; stage 2, every part of the run."""
    report: str | None = None
    """Where the stage's report is stored (None: it could not be written; `python -m job report` makes it)."""


def ensure_ray(config: RunConfig, num_cpus: int | None = None) -> bool:
    """Join the cluster when there is one (RAY_ADDRESS, or inside `ray job submit`), else start a local Ray.
    Returns True when this call started Ray (the caller shuts it down again)."""
    import ray  # heavy: imported on use

    if ray.is_initialized():
        return False
    try:
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=True)
            print(f"ray: joined the cluster at {os.environ['RAY_ADDRESS']} (RAY_ADDRESS)", flush=True)
        else:
            # address="local": a Ray of this job's own. Plain ray.init() would find a head started on this machine
            # with `ray start --head` (how one tries `ray job submit` before renting a cluster), join it, and refuse
            # num_cpus with a raw ValueError. Jobs meant for that head get RAY_ADDRESS from `ray job submit`.
            for attempt in range(3):
                try:
                    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                             log_to_driver=True, configure_logging=False)
                    break
                except Exception as e:
                    # Ray gives its raylet a fixed 30 s to register (ray/_private/node.py); on a machine busy with
                    # other work (CI, another job's engines) it can miss that once: start again.
                    if "timed out during startup" not in str(e) or attempt == 2:
                        raise
                    print(f"ray: the local Ray did not start within Ray's 30 s (a busy machine?); trying again "
                          f"({attempt + 2} of 3)", flush=True)
                    ray.shutdown()
            print("ray: a local Ray of this job's own (RAY_ADDRESS is not set; `ray job submit` sets it)", flush=True)
    except Exception as e:  # a raw traceback from deep inside Ray says less than this
        first = (str(e).strip().splitlines() or [""])[0][:300]
        where = f"the cluster at {os.environ['RAY_ADDRESS']} (RAY_ADDRESS)" if os.environ.get("RAY_ADDRESS") \
            else "a local Ray (its session directory is under RAY_TMPDIR or /tmp/ray)"
        raise runs.RunError(f"could not start or join Ray: {type(e).__name__}: {first}. Tried {where}; nothing was "
                            "generated, the run directory is as it was") from None
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # our own progress line says more (tokens/s, ETA, quality)
    ctx.print_on_execution_start = False
    return True


class RaySession:
    """The Ray a stage runs on, used the same way by both stages: `start()` joins the cluster or starts a local Ray
    (`ensure_ray`) and remembers whether it started it; leaving the block shuts down only a Ray this session
    started (a notebook's Ray, the tests' session Ray and a cluster live on), and puts back the Ray Data settings
    the stage changed (`set_data_option`), so a notebook that runs a stage keeps its own."""

    def __init__(self, config: RunConfig, num_cpus: int | None = None):
        self.config, self.num_cpus = config, num_cpus
        self.started = False
        """Whether this session started the Ray it runs on (then it shuts it down at the end)."""

    def start(self) -> RaySession:
        """Join or start Ray (idempotent: a second call finds it initialized)."""
        if ensure_ray(self.config, self.num_cpus):
            self.started = True
        return self

    def __enter__(self) -> RaySession:
        return self

    def __exit__(self, *exc) -> None:
        restore_data_options()
        if self.started:
            import ray  # heavy: imported on use

            ray.shutdown()
            self.started = False


_CHANGED_DATA_OPTIONS: list[tuple[object, str, object]] = []


def set_data_option(owner: object, name: str, value) -> None:
    """Set one of Ray Data's process-wide settings for this stage; `restore_data_options` (at the end of the
    RaySession) puts the first value back."""
    _CHANGED_DATA_OPTIONS.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def restore_data_options() -> None:
    while _CHANGED_DATA_OPTIONS:
        owner, name, value = _CHANGED_DATA_OPTIONS.pop()
        setattr(owner, name, value)


def runtime_env(config: RunConfig) -> dict:
    """The runtime_env of a stage's actors and tasks: the run's env_vars without its secrets. Ray records a
    runtime_env (its dashboard, its logs, the GCS); secrets travel in the actor's constructor arguments instead and
    are set in its own process by `apply_secrets` (job/redaction.py tells which names are secrets)."""
    return {"env_vars": redaction.split_env(config.env_vars)[0]}


def apply_secrets(config_dict: dict) -> None:
    """In an actor or task process: set the run's secret env_vars (`runtime_env` left them out)."""
    redaction.apply_secret_env(redaction.split_env(config_dict.get("env_vars") or {})[1])


def check_identity(previous: dict, stage: str, identity: dict, allow_drift: bool, **kwargs) -> dict:
    """The settings of `identity` that differ from what the stage recorded in run.json: refused (RunError naming
    them) unless `allow_drift`. {} on a new run."""
    if stage not in previous:
        return {}
    return runs.check_drift(previous[stage].get("identity", {}), identity, allow_drift, **kwargs)


@contextmanager
def writing(config: RunConfig, stage: str, directory: str, *, take_lock: bool):
    """Hold the stage's writer lock (one writer per run and stage; yields it: its `fence` guards every commit) and
    clear the temp files a killed writer left in `directory` (nobody else writes there while we hold the lock)."""
    with lock.WriterLock(config, stage, take_over=take_lock) as held:
        storage.remove_temp_files(storage.join(config.output, directory))
        yield held


class Verdict(RuntimeError):
    """A stage's own verdict that ends it (the canary's): the stage records its status itself."""


@contextmanager
def failure_recorded(config: RunConfig, stage_key: str, fence):
    """Inside: a failure marks the stage "failed" in run.json (with its one-line reason) before it propagates, so
    run.json never keeps saying "running" for a job that ended. A verdict the stage recorded itself (the canary's)
    and a take-over (the new holder owns run.json now) are left as they are."""
    try:
        yield
    except BaseException as e:
        if not isinstance(e, (lock.LockError, Verdict)):
            reason = (str(e).strip().splitlines() or [""])[0][:500]
            try:
                runs.write_run_json(config, stage_key, {"status": "failed", "error": f"{type(e).__name__}: {reason}"},
                                    fence)
            except Exception:  # the failure itself is what to report
                pass
        raise


@dataclass
class ActorStage:
    """How a stage's units run on Ray Data: `actor` is a `map_batches` callable class built with
    `constructor_kwargs`, called with one unit per batch."""
    actor: type
    constructor_kwargs: dict
    min_actors: int
    max_actors: int
    units_per_actor: int | None = None
    """Units one actor holds and runs at once (its `max_concurrency` and Ray Data's tasks in flight per actor): an
    engine keeps itself full from several units. None: Ray Data's defaults (one at a time, a few queued)."""
    gpus_per_actor: float = 0
    max_retries: int = 3
    """Restarts of a dead actor and retries of its units; -1: forever (an engine that dies with its node)."""
    runtime_env: dict = field(default_factory=dict)


def map_units(units: list, stage: ActorStage):
    """A Ray Data pipeline of `units` (each with `to_row()`) through `stage.actor`, not yet running: iterate it (or
    hand `.iter_rows()` to `follow`) to run it. One block per unit, so each unit is its own task: an actor runs
    `units_per_actor` of them at once, and a replaced actor retries exactly its own units. Call it inside a started
    RaySession."""
    import ray  # heavy: imported on use

    if stage.max_actors > stage.min_actors:
        # Ray Data adds an actor when its pool's utilization (units in flight / (actors × max_concurrency)) reaches
        # this. Its default, 1.75, assumes actors queue 4 tasks but run 1; ours run all they hold, so the pool is
        # at most 1.0 busy: "every actor full" must be the trigger, or no actor is ever added.
        set_data_option(ray.data.DataContext.get_current().autoscaling_config,
                        "actor_pool_util_upscaling_threshold", 1.0)
    # An actor that runs several units at once is handed exactly as many as it runs.
    per_actor = ({"max_tasks_in_flight_per_actor": stage.units_per_actor,
                  "max_concurrent_calls_per_actor": stage.units_per_actor} if stage.units_per_actor else {})
    ds = ray.data.from_items([u.to_row() for u in units], override_num_blocks=len(units))
    return ds.map_batches(
        stage.actor,
        fn_constructor_kwargs=stage.constructor_kwargs,
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(min_size=stage.min_actors, max_size=stage.max_actors, **per_actor),
        num_cpus=1,
        num_gpus=stage.gpus_per_actor,
        runtime_env=stage.runtime_env,
        # Ray 2.60 has no named parameter for these two yet (it warns that `ray_remote_args` goes in 2.64): check
        # them before upgrading Ray, or a crashing actor is restarted forever (Ray Data's default is -1).
        max_restarts=stage.max_retries,
        max_task_retries=stage.max_retries,
    )


class UnitLedger(Protocol):
    """A stage's two answers about its units, the only place each is written: `is_done(unit)` (the runner skips the
    unit) and `mark_done(summary)` (called by the runner with each unit's summary row as it arrives, before the
    stage's own `on_summary`: the commit that makes the unit done, if the actor has not made it already). The model
    is datatrove's executor: skip-if-done and mark-done in one place."""

    def is_done(self, unit) -> bool: ...

    def mark_done(self, summary: dict) -> None: ...


def run_units(units: list, ledger: UnitLedger, actors: ActorStage, tracker: progress.Progress,
              on_summary: Callable[[dict], None], user_errors: tuple[type[BaseException], ...]) -> list:
    """The units `ledger` does not call done, through `actors`, each summary marked done by the ledger and then
    handed to `on_summary` (`follow`). Returns the units that ran. Call it inside a started RaySession."""
    pending = [u for u in units if not ledger.is_done(u)]
    if pending:
        def take(summary: dict) -> None:
            ledger.mark_done(summary)
            on_summary(summary)

        follow(map_units(pending, actors).iter_rows(), tracker, take, user_errors)
    return pending


def follow(summaries: Iterable[dict], tracker: progress.Progress, on_summary: Callable[[dict], None],
           user_errors: tuple[type[BaseException], ...]) -> None:
    """Consume the per-unit summary rows as units finish. The progress line stops however this ends; an error of
    one of `user_errors` raised inside an actor is raised here with its own message, not Ray's traceback."""
    started = time.time()
    rows = iter(summaries)
    with tracker, user_errors_surface(user_errors):
        try:
            for s in rows:
                on_summary(s)
        except BaseException:
            # An error (or the canary's verdict): stop the stage's engines now, whoever lives on after the driver's
            # error (a notebook's Ray, the tests' session Ray, a cluster) would otherwise keep them. The iterator
            # first: left open, Ray Data's executor kept submitting units to the actors being killed ("(raylet) Task
            # MapWorker... submit failed ... killed by ray.kill", 8 lines) and tore itself down only when the
            # iterator was collected, after Ray was shut down (two "Ray is not initialized" tracebacks), all printed
            # after the verdict (issue 43 item 9).
            _close(rows)
            _stop_failed_stage(started)
            raise
        let_actors_stop(started)


def _close(rows) -> None:
    """Close a Ray Data row iterator now: its `finally` shuts its streaming executor down (ray/data/iterator.py
    `_on_iteration_end`), instead of whenever the garbage collector gets to it."""
    close = getattr(rows, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # the stage's own error is the one to report
            pass


@contextmanager
def user_errors_surface(user_errors: tuple[type[BaseException], ...]):
    """An error of one of `user_errors` raised inside a Ray actor or task comes out of this block with its own
    message, not wrapped in Ray's traceback (`follow`, and one-off tasks such as `hidden-states --check`)."""
    try:
        yield
    except Exception as e:
        cause = user_error_inside(e, user_errors)
        if cause is not None:
            raise cause from None
        raise


def _stop_failed_stage(started: float) -> None:
    import ray  # heavy: imported on use

    if ray.is_initialized():
        try:
            kill_stage_actors(started)
        except Exception:  # the stage's own error is the one to report
            pass


def let_actors_stop(since_s: float, timeout_s: float = 30.0) -> None:
    """After the last unit: wait until the stage's actors, which Ray Data lets go when its dataset is consumed, have
    exited, before the driver shuts Ray down or exits (which would kill them mid-exit and print their engines'
    shutdown errors). Measured: they are gone within milliseconds of the last unit; never longer than `timeout_s`."""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        census = engine_census(since_s)
        if census is None or census.alive == 0:
            return
        time.sleep(0.2)


def user_error_inside(e: BaseException, user_errors: tuple[type[BaseException], ...]) -> BaseException | None:
    """The error of one of `user_errors` that a Ray task failure wraps, if any. An error raised while an actor
    starts reaches the driver only as the text of its traceback: the message is recovered from it."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, user_errors):
            return e
        for cls in user_errors:  # Ray Data re-raises UDF errors with the remote traceback as text
            m = re.search(rf"{cls.__module__}\.{cls.__name__}: (.+)", str(e))
            if m:
                return cls(m.group(1).strip())
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None
