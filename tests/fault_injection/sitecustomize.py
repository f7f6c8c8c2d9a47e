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
