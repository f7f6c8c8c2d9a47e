"""Fault injection for tests/test_resume.py, kept out of the production write path: a process started with this
folder on PYTHONPATH (the driver, and the Ray workers, which inherit its environment) imports it at start-up.
With DATAGEN_TEST_WRITE_DELAY_S set, every local atomic write (job/storage.py: temp file, then os.replace) pauses
that long between the temp file and the rename, so a test can kill a job in the middle of a write."""

import os
import time

_DELAY_S = float(os.environ.get("DATAGEN_TEST_WRITE_DELAY_S", "0"))

if _DELAY_S:
    _replace = os.replace

    def _slow_replace(src, dst, *args, **kwargs):
        if ".tmp-" in os.path.basename(os.fspath(src)):
            time.sleep(_DELAY_S)
        return _replace(src, dst, *args, **kwargs)

    os.replace = _slow_replace

# DATAGEN_TEST_KILL_TRAIN_RANK="<rank>:<marker path>" (tests/test_train.py, set for the Ray Train workers only
# through their runtime_env): the training worker of that rank SIGKILLs itself right after its first
# `ray.train.report` with a checkpoint, once (the marker file says it happened), as a crashed node's would die. It
# waits 5 s first: Ray Train's controller collects reports when it polls the workers (every 2 s,
# RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), and a checkpoint not yet collected when its worker dies is lost (the restart
# then starts from the one before: as correct, but no resume to test).
_KILL = os.environ.get("DATAGEN_TEST_KILL_TRAIN_RANK")

if _KILL:
    import signal

    import ray.train

    _rank, _marker = _KILL.split(":", 1)
    _report = ray.train.report

    def _report_then_die(*args, **kwargs):
        result = _report(*args, **kwargs)
        if (kwargs.get("checkpoint") is not None and ray.train.get_context().get_world_rank() == int(_rank)
                and not os.path.exists(_marker)):
            open(_marker, "w").close()
            time.sleep(5)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    ray.train.report = _report_then_die
