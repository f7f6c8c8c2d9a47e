"""The suite's own guard (tests/suite_guard.py), run on a throwaway test session with two pytest-xdist workers, as the
Makefile runs the suite: a test that kills its worker ends the whole session within a minute, named, with the tail of
its output and the machine's memory; `alone` tests never overlap; the deadline stops a hung session, naming it.
A few seconds each: the sessions import nothing heavy."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_session(tmp_path: Path, files: dict[str, str], *args: str, env: dict | None = None,
                timeout_s: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    for name, body in files.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["suite_guard"]\n')
    full_env = {**os.environ, "PYTHONPATH": str(TESTS), **(env or {})}
    for name in ("DATAGEN_SUITE_STATE", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        full_env.pop(name, None)  # the throwaway session is a session of its own, not part of this worker's
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", "--max-worker-restart=0", *args, str(tmp_path)],
                          cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - started


SLEEPER = """
    import time
    def test_sleeper():
        time.sleep(300)
"""


def ended_within_a_minute(proc: subprocess.CompletedProcess, took_s: float, after: str) -> str:
    """The session's output, once it is known to have failed and ended within a minute of `after`."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert took_s < 60, f"the session went on for {took_s:.0f} s after {after}:\n{out}"
    return out


def test_a_test_that_kills_its_worker_ends_the_session_within_a_minute_named(tmp_path):
    proc, took_s = run_session(tmp_path, {
        "test_a_dies.py": """
            import os, signal, time
            def test_killer():
                print("the last words of the dying test")
                time.sleep(2.5)  # the worker mirrors its test's output every second
                os.kill(os.getpid(), signal.SIGKILL)
        """,
        "test_b_long.py": SLEEPER})
    out = ended_within_a_minute(proc, took_s, "its worker died")
    assert "died" in out and "while running test_a_dies.py::test_killer" in out, out
    assert "the last words of the dying test" in out, out
    assert "memory available" in out, out


def test_alone_tests_never_overlap(tmp_path):
    body = """
        import os, time, pytest
        @pytest.mark.alone
        def test_{name}():
            start = time.time()
            time.sleep(2)
            with open(os.path.join(os.environ["SPANS"], "{name}"), "w") as f:
                f.write(f"{{start}} {{time.time()}}")
    """
    spans = tmp_path / "spans"
    spans.mkdir()
    proc, _ = run_session(tmp_path, {"test_one.py": body.format(name="one"), "test_two.py": body.format(name="two")},
                          env={"SPANS": str(spans)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (a0, a1), (b0, b1) = (map(float, (spans / n).read_text().split()) for n in ("one", "two"))
    assert a1 <= b0 or b1 <= a0, f"the two `alone` tests overlapped: {a0}-{a1} and {b0}-{b1}"
    # The log's summary says which test waited, and how long (none, when the workers did not start together).
    waits = [line for line in proc.stdout.splitlines() if line.startswith("alone: ")]
    later = "two" if b0 > a0 else "one"
    assert waits == ["alone: no `alone` test waited for another"] or (
        len(waits) == 1 and waits[0].startswith("alone: waited ") and f"test_{later}.py::test_{later}" in waits[0]
    ), proc.stdout


def test_the_deadline_stops_a_hung_session_and_names_the_test(tmp_path):
    proc, took_s = run_session(tmp_path, {
        "test_hangs.py": """
            import time
            def test_hung():
                time.sleep(300)
        """}, env={"DATAGEN_SUITE_DEADLINE_S": "5", "DATAGEN_SUITE_REPORT_AFTER_S": "3"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert took_s < 60, out
    assert "passed its deadline" in out and "test_hangs.py::test_hung" in out, out


def test_x_stops_the_session_at_the_first_failure_not_after_each_workers_file(tmp_path):
    proc, took_s = run_session(tmp_path, {
        "test_fails.py": """
            def test_wrong():
                assert 1 == 2
            def test_after_it_in_the_same_file():
                import time
                time.sleep(300)
        """,
        "test_long.py": SLEEPER}, "-x")
    out = ended_within_a_minute(proc, took_s, "the first failure")
    assert "test_fails.py::test_wrong failed" in out and "assert 1 == 2" in out, out


def test_files_with_alone_tests_are_never_neighbours_where_it_can_be_helped():
    from conftest import FILE_SECONDS, LAST_FILES, LIGHT_FILE_SECONDS, WITH_THE_LIGHT_FILES, file_order

    files = [*FILE_SECONDS, "test_new_a.py", "test_new_b.py", *LAST_FILES]
    alone = {"test_resume.py", "test_cluster.py", "test_exactly_once.py", "test_train.py",
             *WITH_THE_LIGHT_FILES}
    order = file_order(files, alone)
    assert sorted(order) == sorted(files)
    assert not [pair for pair in zip(order, order[1:]) if set(pair) <= alone], order
    assert order[0] == max(FILE_SECONDS, key=FILE_SECONDS.get), "the longest file first"
    # The held-back files come right after the last file that is not light, and only light ones follow them.
    first_held = order.index(WITH_THE_LIGHT_FILES[0])
    after = order[first_held + len(WITH_THE_LIGHT_FILES):]
    assert order[-len(LAST_FILES):] == list(LAST_FILES), "the files that change the environment at the very end"
    assert after and all(FILE_SECONDS.get(f, 0) < LIGHT_FILE_SECONDS for f in after), after
    assert FILE_SECONDS.get(order[first_held - 1], 0) >= LIGHT_FILE_SECONDS, order
    assert {"test_new_a.py", "test_new_b.py"} <= set(after), "a file without an entry counts as light"
    # More `alone` files than others: they still all run, neighbours only where nothing else is left.
    assert file_order(["a.py", "b.py", "c.py"], {"a.py", "b.py"}) == ["a.py", "c.py", "b.py"]
