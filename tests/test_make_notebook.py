"""`make notebook RUN_DIR=...` as a user runs it: Jupyter installed into .venv on first use, a server that serves the
notebook on the session's shared run. What the notebook shows is tests/test_inspect.py's.

A file of its own, taken last (tests/conftest.py `LAST_FILES`): installing Jupyter brings jsonschema's optional
rfc3987-syntax, which every later `import ray` then loads (it builds a grammar at import: ray 0.8 s → 2.2 s, this
machine), so every Ray process started after it, in any test, starts ~1.3 s slower.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def run_dir(shared_run) -> str:
    return shared_run.full


@pytest.mark.slow  # the notebook: Jupyter installed into .venv on first use, a server started
def test_make_notebook_serves_the_notebook_on_the_run(run_dir):
    """`make notebook RUN_DIR=...`: Jupyter installed into .venv on first use, a server that serves
    notebooks/inspect_outputs.ipynb (Jupyter serves the folder of the file it opens), started with RUN_DIR in its
    environment (the kernels it starts inherit it;
    what the notebook does with RUN_DIR is test_notebook_runs_*). Stopped again with its process group."""
    import json
    import secrets
    import signal
    import socket
    import subprocess
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = secrets.token_hex(16)
    log = open(Path(run_dir).parent / "make-notebook.log", "w+")
    proc = subprocess.Popen(["make", "notebook", f"RUN_DIR={run_dir}",
                             f"NOTEBOOK_ARGS=--no-browser --ip=127.0.0.1 --port={port} "
                             f"--IdentityProvider.token={token}"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api/contents/inspect_outputs.ipynb?token={token}"
    try:
        deadline, served = time.monotonic() + 300, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                served = json.loads(urllib.request.urlopen(url, timeout=5).read())
                break
            except OSError:
                time.sleep(1)
        log.seek(0)
        assert served is not None, log.read()[-3000:]
        assert served["type"] == "notebook" and served["content"]["cells"], served.get("name")
        # The server (started by make) has RUN_DIR in its environment.
        envs = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) == proc.pid and b"jupyter" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    envs.append(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            except (OSError, ProcessLookupError):
                continue
        assert envs and all(f"RUN_DIR={run_dir}".encode() in env for env in envs), envs[:1]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
