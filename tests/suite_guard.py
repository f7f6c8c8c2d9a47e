"""What ends a test session early, what it says when it does, and which tests never run beside each other (issue 47).

A pytest plugin (loaded by tests/conftest.py; tests/test_suite_guard.py runs it in a session of its own):

- **A worker that dies ends the session at once, named.** pytest-xdist reports a crashed worker's test only in the
  final summary and, with `-x`, still lets the other worker finish its file: seen in CI 2026-12-05, "[gw0] node down:
  Not properly terminated" at 53 %, then the other worker ran on to CI's 90-minute limit and nothing said which test
  died. Here the controller prints the test the dead worker was running, the tail of that test's output (each worker
  mirrors its capture to a file every second, since a SIGKILLed worker's own capture dies with it), the machine's
  memory and largest processes, then kills the other workers (and their Ray and vLLM processes) so the session ends
  with its summary and JUnit XML within seconds. Run it with `--max-worker-restart=0` (the Makefile does): a
  replaced worker would pick up the next file.
- **A deadline.** At `DATAGEN_SUITE_REPORT_AFTER_S` (75 min) the controller prints what is in flight; at
  `DATAGEN_SUITE_DEADLINE_S` (82 min: CI stops a run at 90, install included) it prints it again and stops the
  session the same way, so a hung test is named rather than cut off by CI.
- **Tests that start a Ray or cluster of their own run alone** among such tests (marker `alone`): a file lock held
  for the test's duration. Beside each other on 2 cores their heads failed to come up (4 of 4 fresh-clone runs,
  2026-12-05) and needed retries; one at a time none does.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPORT_AFTER_S = float(os.environ.get("DATAGEN_SUITE_REPORT_AFTER_S", 75 * 60))
DEADLINE_S = float(os.environ.get("DATAGEN_SUITE_DEADLINE_S", 82 * 60))
TAIL_BYTES = 3000  # of the dead test's output: its last lines, not its whole log
MIRROR_EVERY_S = 1.0

_SESSION_STARTED = time.monotonic()
_IN_FLIGHT: dict[str, float] = {}
_FINISHED: list[tuple[float, str]] = []
_THIS_WORKER: list[str] = []  # this process's xdist worker id (gw0, ...), or empty in the controller
_STOPPING: list[str] = []  # why the controller is ending the session early (once set, later node downs are its own)


def _state_dir() -> Path:
    """A folder the controller and its workers share (the controller makes it; the workers inherit its name)."""
    path = os.environ.get("DATAGEN_SUITE_STATE")
    if not path:
        path = tempfile.mkdtemp(prefix="datagen-suite-")
        os.environ["DATAGEN_SUITE_STATE"] = path
    return Path(path)


def _worker_id(config) -> str | None:
    return getattr(config, "workerinput", {}).get("workerid")


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: starts a Ray or a cluster of its own: never runs beside another "
                                       "`alone` test (a lock held for the test's duration)")
    _state_dir()  # the controller names the folder before xdist starts its workers, which inherit the variable
    worker = _worker_id(config)
    _THIS_WORKER[:] = [worker] if worker is not None else []
    if worker is not None:
        (_state_dir() / f"{worker}.pid").write_text(str(os.getpid()))
        threading.Thread(target=_mirror_capture, args=(config, worker), daemon=True).start()


# ---------------------------------------------------------------------------------------------------------------
# Worker side: the running test's output, mirrored to a file
# ---------------------------------------------------------------------------------------------------------------


def _capture_fds(config) -> list[int]:
    """The file descriptors of pytest's fd-level capture of stdout and stderr (temporary files it truncates after
    each phase of a test), or none where capturing is off or not fd-level."""
    capman = config.pluginmanager.getplugin("capturemanager")
    capturing = getattr(capman, "_global_capturing", None)
    fds = []
    for name in ("out", "err"):
        tmpfile = getattr(getattr(capturing, name, None), "tmpfile", None)
        try:
            fds.append(tmpfile.fileno())
        except (AttributeError, ValueError, OSError):
            pass
    return fds


def _mirror_capture(config, worker: str) -> None:
    """Every second: the last TAIL_BYTES of what the running test printed, into <state>/<worker>.tail. Reads with
    pread, so pytest's own position in its capture files is untouched."""
    target = _state_dir() / f"{worker}.tail"
    last = b""
    while True:
        time.sleep(MIRROR_EVERY_S)
        chunks = []
        for fd in _capture_fds(config):
            try:
                size = os.fstat(fd).st_size
                chunks.append(os.pread(fd, TAIL_BYTES, max(0, size - TAIL_BYTES)))
            except OSError:
                pass
        data = b"\n".join(c for c in chunks if c)
        if data != last:
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
            last = data


ALONE_WAITS = "alone-waits.txt"


def pytest_terminal_summary(terminalreporter):
    """Every wait of an `alone` test for another one, in every log: how much of the wall time the lock cost."""
    if _worker_id(terminalreporter.config) is not None:
        return
    path = _state_dir() / ALONE_WAITS
    waits = path.read_text().splitlines() if path.exists() else []
    for line in waits:
        terminalreporter.write_line(f"alone: waited {line}")
    if not waits:
        terminalreporter.write_line("alone: no `alone` test waited for another")


@pytest.fixture(autouse=True)
def _alone_among_heavy_tests(request):
    """Tests marked `alone` hold one lock for their whole duration (setup included)."""
    if request.node.get_closest_marker("alone") is None:
        yield
        return
    with open(_state_dir() / "alone.lock", "w") as lock:
        waited = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited = time.monotonic() - waited
        if waited > 1:
            print(f"[suite] waited {waited:.0f} s for another `alone` test to finish")
            # For the log's summary (the print above is captured): a wait counts in the test's setup time, and
            # the two workers' file order is chosen to avoid it (conftest.file_order).
            with open(_state_dir() / ALONE_WAITS, "a") as f:
                f.write(f"{waited:.0f} s  {request.node.nodeid}\n")
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------------------
# Controller side: what is in flight, a dead worker, the deadline
# ---------------------------------------------------------------------------------------------------------------


def pytest_runtest_logstart(nodeid, location):
    _IN_FLIGHT[nodeid] = time.monotonic()
    # Whether this process is a worker comes from its config, not from PYTEST_XDIST_WORKER: a session started from
    # inside a worker (tests/test_suite_guard.py) inherits that variable in its controller, which then wrote its
    # workers' tests under the outer worker's name, and a dead worker was named with the other one's test (fresh-clone
    # run, 2026-12-06).
    worker = _THIS_WORKER[0] if _THIS_WORKER else None
    if worker:  # a worker: the controller reads this when the worker dies (xdist names it only after the hook below)
        (_state_dir() / f"{worker}.current").write_text(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    started = _IN_FLIGHT.pop(nodeid, None)
    if started is not None:
        _FINISHED.append((time.monotonic() - started, nodeid))


def state_of_the_session(why: str) -> list[str]:
    """The tests in flight, the longest finished ones, memory and the largest processes (their titles name the test a
    pytest-xdist worker runs), and the kernel's OOM-killer lines where it lets us read them."""
    import psutil

    now = time.monotonic()
    lines = [f"--- {why}, {(now - _SESSION_STARTED) / 60:.1f} min into the session ---"]
    lines += [f"in flight {(now - t) / 60:5.1f} min  {nodeid}" for nodeid, t in list(_IN_FLIGHT.items())]
    lines += [f"finished  {d / 60:5.1f} min  {nodeid}" for d, nodeid in sorted(_FINISHED, reverse=True)[:10]]
    vm = psutil.virtual_memory()
    lines.append(f"memory available {vm.available / 2**30:.1f} of {vm.total / 2**30:.1f} GiB; "
                 f"load average {os.getloadavg()[0]:.1f}")
    procs = []
    for p in psutil.process_iter(["pid", "memory_info", "cmdline"]):
        if p.info["memory_info"] is not None:
            procs.append((p.info["memory_info"].rss, p.info["pid"], " ".join(p.info["cmdline"] or []).strip()[:120]))
    lines += [f"{rss / 2**20:7.0f} MiB  pid {pid}  {cmd}" for rss, pid, cmd in sorted(procs, reverse=True)[:8]]
    try:
        kernel = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout.splitlines()
        lines += [line for line in kernel if "Out of memory" in line or "Killed process" in line][-5:]
    except (OSError, subprocess.SubprocessError):
        pass
    return lines


def _write(config, lines: list[str]) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    out = reporter.write_line if reporter is not None else (lambda s: print(s, file=sys.stderr))
    out("")
    for line in lines:
        out(line)


def _kill_workers(except_worker: str | None = None) -> None:
    """SIGKILL every worker (but `except_worker`, already dead) with all its descendants: Ray, vLLM, moto."""
    import psutil

    for pid_file in _state_dir().glob("*.pid"):
        if pid_file.stem == except_worker:
            continue
        try:
            root = psutil.Process(int(pid_file.read_text()))
            tree = [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, ValueError, OSError):
            continue
        for proc in tree:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass


def _tail_of(worker: str) -> list[str]:
    try:
        text = (_state_dir() / f"{worker}.tail").read_bytes().decode("utf-8", "replace")
    except OSError:
        return [f"(no output of {worker}'s last test was mirrored)"]
    return [f"--- the last {TAIL_BYTES} bytes its test printed ---", *text.splitlines()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    if not error or _STOPPING:
        return
    worker = node.gateway.id
    try:
        test = (_state_dir() / f"{worker}.current").read_text()
    except OSError:
        test = "(no test yet)"
    _STOPPING.append(f"worker {worker} died")
    lines = [f"=== worker {worker} died ({error}) while running {test}: stopping the session (the other workers are "
             f"killed: their tests are reported as crashed too) ==="]
    lines += _tail_of(worker)
    lines += state_of_the_session(f"worker {worker} died")
    _write(node.config, lines)
    _kill_workers(except_worker=worker)


def pytest_runtest_logreport(report):
    """`-x` with workers: pytest-xdist stops only after each worker has run every test of the file it holds (with
    `--dist loadfile` a worker holds a whole file: seen 2026-12-06, a failure 2 min into the session and the session
    still running 10 min later). The controller ends it at the first failure, as `-x` does in one process."""
    config = _CONTROLLER_CONFIG[0] if _CONTROLLER_CONFIG else None
    if config is None or not report.failed or _STOPPING or config.option.maxfail != 1:
        return
    _STOPPING.append("first failure")
    _write(config, [f"=== {report.nodeid} failed ({report.when}): stopping the session (-x); the other workers' "
                    f"tests are killed and reported as crashed ==="])
    _kill_workers()


_CONTROLLER_CONFIG: list = []


def _deadline(config) -> None:
    _STOPPING.append("deadline")
    _write(config, state_of_the_session(f"the session passed its deadline ({DEADLINE_S / 60:.0f} min): stopping it"))
    if hasattr(config, "workerinput") or config.pluginmanager.get_plugin("dsession") is None:
        import _thread

        _thread.interrupt_main()  # one process: KeyboardInterrupt, so pytest still prints its summary
    else:
        _kill_workers()


def pytest_sessionstart(session):
    config = session.config
    if _worker_id(config) is not None:
        return  # the controller watches the time
    if config.pluginmanager.get_plugin("dsession") is not None:
        _CONTROLLER_CONFIG.append(config)  # workers to stop at the first failure under -x
    for delay, action in ((REPORT_AFTER_S, lambda: _write(config, state_of_the_session("the session is running long"))),
                          (DEADLINE_S, lambda: _deadline(config))):
        timer = threading.Timer(delay, action)
        timer.daemon = True
        timer.start()
