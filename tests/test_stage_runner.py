"""The stage runner (job/stage.py, job/pipeline.py) on real Ray, with a stage of the test's own as its fixture: the
runner is the thing under test, the stage only declares units that each write one file through the fence.

- the runner's order and ledger: a rerun does only the units not marked done; `mark_done` is called once per unit;
- the one error surface: a JobError raised inside an actor ends the stage as itself (not Ray's traceback), with
  run.json recording `failed` and its one line, the verdict's own status for a Verdict;
- the fence: a fenced-out stage-2 extractor deletes nothing and commits nothing;
- a failed stage's actors are stopped by Ray Data's executor (through the handles it holds), and another dataset's
  actors running beside it live on.
"""

from __future__ import annotations

import os
import time

import pytest
from conftest import DEMO_CONFIG

from job import layout, lock, run_record, storage
from job.config import load_config, to_dict
from job.errors import JobError, Verdict, job_error_inside
from job.generate import CanaryFailed
from job.lock import FencedOut, WriterLock
from job.pipeline import ActorStage, map_units, runtime_env
from job.stage import Stage, StageSummary, run_stage
from job.storage import StorageError

UNITS_DIR = "toy"


@pytest.fixture(autouse=True)
def _classes_travel_by_value():
    """Ray's workers cannot import this test module: its classes go to them pickled by value."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class ToyUnit:
    def __init__(self, index: int, done: bool = False):
        self.index, self.done, self.num_rows = index, done, 1

    def to_row(self) -> dict:
        return {"index": self.index}


class ToyActor:
    """Writes `toy/<index>.json` through the fence; raises the configured error on the configured unit."""

    def __init__(self, output: str, fence, fail_on: int | None, error: str | None, census=None, slow_s: float = 0):
        from job.cluster import report_arrival, report_ready

        report_arrival(census)
        self.output, self.fence, self.fail_on, self.error, self.slow_s = output, fence, fail_on, error, slow_s
        report_ready(census)

    def __call__(self, batch: dict):
        index = int(batch["index"][0])
        if index == self.fail_on:
            time.sleep(self.slow_s)
            raise {"storage": StorageError("s3://bucket/run: the bucket refused the write (AccessDenied)"),
                   "verdict": CanaryFailed("the toy data failed its check")}[self.error]
        self.fence.write_json(storage.join(self.output, UNITS_DIR, f"{index}.json"), {"index": index})
        yield {"index": [index], "num_rows": [1], "seconds": [0.0]}


class ToyStage(Stage):
    key, directory, label = "toy", UNITS_DIR, "toy"

    def __init__(self, config, num_units: int = 4, fail_on: int | None = None, error: str | None = None,
                 slow_s: float = 0):
        super().__init__(config)
        self.num_units, self.fail_on, self.error, self.marked, self.slow_s = num_units, fail_on, error, [], slow_s

    def identity(self, record) -> dict:
        return {"num_units": self.num_units}

    def plan(self, fence, changed) -> list:
        listed = {os.path.basename(u) for u in storage.list_files(storage.join(self.config.output, UNITS_DIR), ".json")}
        return [ToyUnit(i, done=f"{i}.json" in listed) for i in range(self.num_units)]

    def is_done(self, unit) -> bool:
        return unit.done

    def mark_done(self, summary, fence) -> None:
        self.marked.append(int(summary["index"]))

    def actors(self, pending, fence, census) -> ActorStage:
        return ActorStage(ToyActor, {"output": self.config.output, "fence": fence, "fail_on": self.fail_on,
                                     "error": self.error, "census": census.book, "slow_s": self.slow_s},
                          min_actors=1, max_actors=1, max_retries=0, runtime_env=runtime_env(self.config))

    def finish(self, units, fence):
        return StageSummary(output=self.config.output), {}


def toy_config(tmp_path):
    return load_config(DEMO_CONFIG, output=str(tmp_path / "run"), model="unused")


def test_the_runner_does_what_the_ledger_says_is_not_done_and_records_a_failure_as_one_line(local_ray, tmp_path):
    config = toy_config(tmp_path)
    stage = ToyStage(config, fail_on=2, error="storage")
    with pytest.raises(StorageError, match="AccessDenied") as raised:
        run_stage(stage)
    assert "Traceback" not in str(raised.value) and "RayTaskError" not in type(raised.value).__name__
    record = run_record.read(config.output, config.storage)
    assert record.status("toy") == "failed"
    assert record.stages["toy"].error.startswith("StorageError: s3://bucket/run: the bucket refused the write")
    assert record.stages["toy"].identity == {"num_units": 4}
    done = sorted(os.path.basename(u) for u in storage.list_files(storage.join(config.output, UNITS_DIR), ".json"))
    assert "2.json" not in done

    rerun = ToyStage(config)
    run_stage(rerun)
    assert sorted(rerun.marked) == sorted({0, 1, 2, 3} - {int(n[:-5]) for n in done}), "only what was not done"
    assert run_record.read(config.output, config.storage).status("toy") == "complete"
    again = ToyStage(config)
    run_stage(again)
    assert again.marked == [], "a finished stage rerun does nothing"


def test_a_verdict_inside_an_actor_records_its_own_status(local_ray, tmp_path):
    config = toy_config(tmp_path)
    with pytest.raises(CanaryFailed, match="failed its check") as raised:
        run_stage(ToyStage(config, num_units=2, fail_on=0, error="verdict"))
    assert isinstance(raised.value, Verdict) and raised.value.exit_code == 3
    assert run_record.read(config.output, config.storage).status("toy") == "canary_failed"


def test_a_job_error_raised_while_an_actor_starts_is_recovered_from_rays_text():
    """An error in an actor's constructor reaches the driver only as the text of its traceback: the same class and
    message come back (every JobError subclass, however deep)."""
    text = ("ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task, "
            "ray::MapWorker.__init__() ... job.lock.FencedOut: stopped: another job took over this stage's writer lock")
    found = job_error_inside(RuntimeError(text))
    assert isinstance(found, FencedOut) and found.exit_code == 2 and str(found).startswith("stopped: another job")
    assert job_error_inside(RuntimeError("a plain crash")) is None
    assert isinstance(job_error_inside(StorageError("x")), JobError)


def test_a_fenced_out_extractor_deletes_and_commits_nothing(tiny_model_dir, tmp_path):
    """A stage-2 extractor whose job lost its lock: its unit's leftovers of another --limit stay, no part is written."""
    from job.hidden_states.actor import HiddenStateExtractor
    from job.layout import HiddenStateUnit

    run = str(tmp_path / "run")
    config = load_config(DEMO_CONFIG, output=run, model=tiny_model_dir)
    completions = storage.join(run, layout.COMPLETIONS_DIR)
    name = layout.completion_shard_name(0, 0, 2)
    _write_completion_shard(storage.join(completions, name), tiny_model_dir)
    unit = HiddenStateUnit(uri=storage.join(completions, name), stem=name[:-len(layout.SHARD_SUFFIX)], num_rows=2)
    leftovers = [HiddenStateUnit(uri=unit.uri, stem=unit.stem, num_rows=1, row_limit=1).part_name(0),
                 HiddenStateUnit(uri=unit.uri, stem=unit.stem, num_rows=1, row_limit=1).marker_name]
    hidden = storage.join(run, layout.HIDDEN_STATES_DIR)
    for n in leftovers:
        storage.write_bytes_atomic(storage.join(hidden, n), b"an earlier --limit's file")
    unit.existing = list(leftovers)
    old = WriterLock(config, "hidden_states").__enter__()
    new = WriterLock(config, "hidden_states", take_over=True).__enter__()
    try:
        worker = HiddenStateExtractor(to_dict(config), [0, 1], fence=old.fence)
        with pytest.raises(FencedOut):
            list(worker({k: [v] for k, v in unit.to_row().items()}))
        for n in leftovers:
            assert storage.read_bytes(storage.join(hidden, n)) == b"an earlier --limit's file", n
        assert not os.path.exists(storage.join(hidden, unit.part_name(0)))
    finally:
        new.__exit__(None, None, None)
        old.lost = "taken over"  # it knows; its exit leaves the lock to the new holder
        try:
            old.__exit__(None, None, None)
        except lock.LockError:
            pass


def _write_completion_shard(uri: str, model_dir: str) -> None:
    import pyarrow as pa

    from job import schema

    rows = [{schema.ID: str(i), schema.PROMPT_TOKEN_IDS: [1, 2, 3], schema.OUTPUT_TOKEN_IDS: [4, 5, 6, 7],
             schema.NUM_PROMPT_TOKENS: 3, schema.NUM_OUTPUT_TOKENS: 4, schema.ERROR: None} for i in range(2)]
    table = pa.Table.from_pylist(rows, schema=pa.schema([(schema.ID, pa.string()),
                                                         (schema.PROMPT_TOKEN_IDS, pa.list_(pa.int32())),
                                                         (schema.OUTPUT_TOKEN_IDS, pa.list_(pa.int32())),
                                                         (schema.NUM_PROMPT_TOKENS, pa.int32()),
                                                         (schema.NUM_OUTPUT_TOKENS, pa.int32()),
                                                         (schema.ERROR, pa.string())]))
    storage.write_shard(uri, table)


class Sleeper:
    """A unit that takes SLEEPER_S: the other pipeline, alive while the stage fails."""

    def __call__(self, batch: dict):
        time.sleep(SLEEPER_S)
        yield batch


SLEEPER_S = 15  # the failing stage starts its actor and fails within it (~5 s here)


def _alive(class_part: str) -> int:
    import ray
    from ray._private import state  # the test's own view of the actor table (job/ uses no private Ray API)

    job_id = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return sum(1 for a in state.actors(job_id=job_id).values()
               if class_part in a.get("ActorClassName", "") and a.get("State") == "ALIVE")


def test_a_failed_stages_actors_stop_and_another_pipeline_beside_it_lives_on(local_ray, tmp_path):
    """The stage's actors are stopped through the handles they reported to its census, never by matching class names
    or time windows: a second pipeline's actors (a notebook's, say) keep running."""
    import threading

    beside = map_units([ToyUnit(0)], ActorStage(Sleeper, {}, min_actors=1, max_actors=1))
    thread = threading.Thread(target=lambda: list(beside.iter_rows()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while _alive("Sleeper") < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive("Sleeper") == 1, "the pipeline beside did not start"

    with pytest.raises(StorageError, match="AccessDenied"):
        run_stage(ToyStage(toy_config(tmp_path), num_units=2, fail_on=0, error="storage"))
    deadline = time.monotonic() + 30
    while _alive("ToyActor") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive("ToyActor") == 0, "the failed stage's actor outlived it"
    assert _alive("Sleeper") == 1, "the other pipeline's actor was stopped too"
    thread.join(timeout=SLEEPER_S + 30)  # the other pipeline ends by itself
