"""The Ray a stage runs on: the session, the actors' environment, the Ray Data pipeline of its units and how the
driver follows it. job/stage.py's `run_stage` uses these in order; nothing here knows what a stage writes.

- `RaySession`: joins the cluster when there is one (`RAY_ADDRESS`, `ray job submit`), else starts a local Ray of
  the job's own; leaving it shuts down only a Ray it started, and puts back the Ray Data settings a stage changed.
- `runtime_env` / `apply_secrets`: the actors' environment without the run's secrets (Ray records a runtime_env);
  the secrets travel in the actor's constructor arguments and are set in its own process.
- `map_units`: one block per unit, so each unit is its own task; an actor runs `units_per_actor` of them at once,
  and a replaced actor retries exactly its own units.
- `follow`: consumes the per-unit summaries. However it ends it closes the progress line; on an error (or a verdict)
  it closes the dataset's iterator, so Ray Data's executor submits no more units. (The stage runner then stops the
  stage's actors through the handles they reported: job/cluster.py `StageCensus.stop_actors`.) A JobError raised
  inside an actor comes out with its own message (`job_errors_surface`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

from job import progress, redaction
from job.config import RunConfig
from job.errors import job_error_inside
from job.runs import RunError


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
        raise RunError(f"could not start or join Ray: {type(e).__name__}: {first}. Tried {where}; nothing was "
                       "generated, the run directory is as it was") from None
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # our own progress line says more (tokens/s, ETA, quality)
    ctx.print_on_execution_start = False
    return True


class RaySession:
    """The Ray a stage runs on: `start()` joins the cluster or starts a local Ray (`ensure_ray`) and remembers
    whether it started it; leaving the block shuts down only a Ray this session started (a notebook's Ray, the
    tests' session Ray and a cluster live on), and puts back the Ray Data settings the stage changed
    (`set_data_option`), so a notebook that runs a stage keeps its own."""

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


def follow(summaries: Iterable[dict], tracker: progress.Progress, on_summary: Callable[[dict], None]) -> None:
    """Consume the per-unit summary rows as units finish. The progress line stops however this ends; a JobError
    raised inside an actor is raised here with its own message, not Ray's traceback. On an error (or a verdict of
    `on_summary`) the dataset's iterator is closed first, so Ray Data's executor stops submitting units and the error
    is the last thing printed (left open, the executor kept submitting units to the actors being torn down and
    printed "submit failed ... killed by ray.kill" lines after the verdict)."""
    rows = iter(summaries)
    with tracker, job_errors_surface():
        try:
            for s in rows:
                on_summary(s)
        except BaseException:
            close = getattr(rows, "close", None)
            if close is not None:
                try:
                    close()  # its `finally` shuts the streaming executor down
                except Exception:  # the stage's own error is the one to report
                    pass
            raise


@contextmanager
def job_errors_surface():
    """A JobError raised inside a Ray actor or task comes out of this block with its own message, not wrapped in
    Ray's traceback (`follow`, and one-off tasks such as `hidden-states --check`)."""
    try:
        yield
    except Exception as e:
        cause = job_error_inside(e)
        if cause is not None and cause is not e:
            raise cause from None
        raise
