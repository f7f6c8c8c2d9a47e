"""Shared fixtures: the tiny models (built once per checkout), a moto S3 server on loopback, one local Ray per test
session, the session's shared run (stage 1 + stage 2 once, read by many tests), and prompt shards and run configs
derived from configs/demo.yaml (the embedded default doubles as the test fixture).

Tiers (README, "Tests"): `make test` runs every test not marked `slow`; `make test-slow` the slow ones; `make
test-all` (and .ci/run) both. A test goes in the slow tier when it needs several nodes, `ray job submit`, injected
faults that cost engine restarts, the notebook, the hybrid model, or a tiny-model build of its own.

Why the suite is shaped like this (measured on the 2-core CI machine, docs/BENCHMARKS.md "The test suite"): a stage-1
run costs ~50 s, nearly all of it vLLM's CPU engine starting (three Python processes, each importing torch and vLLM:
~13 + 17 + 13 s), and generating the tiny model's completions takes ~1 s. So tests share runs instead of making
their own, and a test that needs a run of its own says why.
"""

from __future__ import annotations

import gc
import io
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = str(REPO / "configs" / "demo.yaml")

# Every engine in the tests is a CPU engine with a small KV cache: several may run one after another.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# OpenMP threads that wait sleep instead of spinning, in this process and everything it starts (engines, Ray workers,
# trainers; libgomp reads it when torch loads it). Two workers share 2 cores, and each torch process runs 2 threads:
# a spinning thread burns the core its partner needs. Measured here, two tiny-model builds side by side took 61 s
# each, 14 s alone; with PASSIVE 23 s each, the two cores' ideal (alone it costs ~20 % on this model's small
# kernels, byte-identical results). Issue 47.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Keep Python's bytecode cache, in this process and every process it starts (engine actors, Ray workers, CLIs), also
# when pytest is run without make: with PYTHONDONTWRITEBYTECODE set each of them compiles vLLM, torch and Ray again
# (an engine start 37 s instead of 21 s; Makefile, "unexport PYTHONDONTWRITEBYTECODE").
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


# ---------------------------------------------------------------------------------------------------------------
# Tiers and ordering
# ---------------------------------------------------------------------------------------------------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the slow tier (`make test-slow`): several nodes, `ray job submit`, "
                                       "injected faults, the notebook, the hybrid model, tiny-model builds")
    config.addinivalue_line("markers", "own_ray: starts a Ray of its own (a cluster, a head): first in its file "
                                       "(it shuts the worker's session Ray down)")


# Seconds each file's tests took in one `make test-all` with two workers on 2 cores (the timeline of a fresh-clone
# .ci/run, 2026-12-07), rounded.
# With `--dist loadfile` a file is one unit of work on one worker: the longest go first, so that no worker is left
# with a long file at the end while the other idles. A new file without an entry counts as light (0 s).
FILE_SECONDS = {"test_resume.py": 430, "test_hidden_states.py": 205, "test_train.py": 220, "test_cluster.py": 200,
                "test_trainers.py": 180, "test_exactly_once.py": 180, "test_export.py": 175,
                "test_job_submit.py": 110, "test_generate.py": 100, "test_inputs_formats.py": 100,
                "test_refusals.py": 95, "test_quality.py": 70, "test_inspect.py": 60, "test_stage_runner.py": 40,
                "test_secrets.py": 35, "test_tiny_model.py": 30, "test_fp8.py": 25, "test_lock.py": 25,
                "test_benches.py": 25, "test_suite_guard.py": 20, "test_config.py": 20,
                "test_plan.py": 15}
LIGHT_FILE_SECONDS = 30  # a file under this counts as light: unit tests, a CLI or two, no engine


# Files held back until only light files are left, then taken next: test_job_submit.py's own Ray head failed to come
# up (exited in `ray start`; never got its agent; lost its raylet ~30 s after start; "the current node timed out
# during startup" three times in a row) in 4 of 4 fresh-clone runs on 2 cores, 2026-12-05, each time beside the other
# worker's heaviest Ray work (Ray Train, the take-over, stage 2 on the shared run), and never alone (3 of 3). Run last
# (as it was until 2026-12-06) it ran by itself for its last 2.4 min while the other worker idled; taken before the
# light files, the other worker runs those beside it (unit tests and CLIs: no engine, no Ray of their own).
WITH_THE_LIGHT_FILES = ("test_job_submit.py",)
# Files taken after every other: they change the environment for every process started after them.
# test_make_notebook.py installs Jupyter into .venv, and with it jsonschema's optional rfc3987-syntax, which `import
# ray` then loads in every later process (0.8 s → 2.2 s here: it builds a grammar at import).
LAST_FILES = ("test_make_notebook.py",)


def file_order(files: list[str], alone: set[str]) -> list[str]:
    """The order in which the two workers take files: longest first (FILE_SECONDS), WITH_THE_LIGHT_FILES just before
    the light files (the last ones of LIGHT_FILE_SECONDS or less), LAST_FILES at the very end, and no two files with
    `alone` tests next to each other (the two workers take neighbouring files at about the same time, and two `alone`
    tests at once means one waits on the other's lock: 238 s lost at the start of a run, 2026-12-06)."""
    last = [f for f in LAST_FILES if f in files]
    files = [f for f in files if f not in last]
    ranked = sorted(files, key=lambda f: (-FILE_SECONDS.get(f, 0), f))
    held = [f for f in ranked if f in WITH_THE_LIGHT_FILES]
    heavy = [f for f in ranked if f in alone and f not in held]
    light = [f for f in ranked if f not in heavy and f not in held]
    order: list[str] = []
    while heavy or light:
        if heavy and (not order or order[-1] not in alone or not light):
            order.append(heavy.pop(0))
        if light:
            order.append(light.pop(0))
    cut = next((i for i in range(len(order), 0, -1) if FILE_SECONDS.get(order[i - 1], 0) >= LIGHT_FILE_SECONDS), 0)
    if held and cut and order[cut - 1] in alone and held[0] in alone and cut < len(order):
        cut += 1  # one light file between two `alone` ones
    return order[:cut] + held + order[cut:] + last


def pytest_collection_modifyitems(config, items):
    """Files in `file_order`; within a file, tests that start a Ray of their own first (they shut the worker's session
    Ray down), then the default tier, then the slow one."""
    files = sorted({item.path.name for item in items})
    alone = {item.path.name for item in items if item.get_closest_marker("alone")}
    position = {name: i for i, name in enumerate(file_order(files, alone))}

    def rank(item) -> tuple:
        tier = 0 if item.get_closest_marker("own_ray") else 2 if item.get_closest_marker("slow") else 1
        return position[item.path.name], tier

    items.sort(key=rank)  # stable: file order within each rank


_SESSION_STARTED = time.monotonic()
_TIER_SECONDS = {"default": 0.0, "slow": 0.0}
_FILE_TIMES: dict[str, tuple[float, float, str]] = {}  # file: (first report's start, last report, worker)


def pytest_runtest_logreport(report):
    """Sum each tier's test time (setup, call and teardown). Runs where the reports arrive: in the main process,
    also with workers (pytest-xdist), where the two workers' times add up to more than the wall time."""
    _TIER_SECONDS["slow" if "slow" in report.keywords else "default"] += report.duration
    # The timeline: when each file's first and last report arrived, and on which worker (issue 47: which files ran
    # beside which, and where a worker idled at the end).
    now = time.monotonic() - _SESSION_STARTED
    name = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
    gateway = getattr(getattr(report, "node", None), "gateway", None)  # xdist's worker; none without workers
    started = now - report.duration
    first = _FILE_TIMES.get(name, (started,))[0]
    _FILE_TIMES[name] = (min(first, started), now, gateway.id if gateway else "")


def pytest_terminal_summary(terminalreporter):
    """Each tier's test time and the session's wall time, so every CI log shows them; and each file's minutes from
    the session's start (files with under 10 s of tests left out)."""
    for name, (first, last, worker) in sorted(_FILE_TIMES.items(), key=lambda kv: kv[1][0]):
        if last - first >= 10:
            terminalreporter.write_line(f"timeline: {first / 60:5.1f} - {last / 60:5.1f} min  {worker:4} {name}")
    if any(_TIER_SECONDS.values()):
        terminalreporter.write_line(
            "time in tests: " + ", ".join(f"{tier} tier {s / 60:.1f} min" for tier, s in _TIER_SECONDS.items() if s)
            + f"; wall time of this session {(time.monotonic() - _SESSION_STARTED) / 60:.1f} min")


# What ends the session early (a dead worker, the deadline) and what it prints; the `alone` lock: tests/suite_guard.py.
pytest_plugins = ["suite_guard"]


# ---------------------------------------------------------------------------------------------------------------
# Models, tokenizer, S3, Ray
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    from job.builtin.tiny_model import ensure_tiny_model

    return ensure_tiny_model(str(REPO / ".cache" / "tiny-model"))


@pytest.fixture(scope="session")
def tiny_hybrid_dir() -> str:
    """The target's architecture (Qwen3.5/3.6: Gated DeltaNet + gated attention, vision tower, MTP head) at tiny
    scale, built once per checkout (~2 min on 2 cores, its MTP head trained last). Tests that use it are in the slow
    tier."""
    from job.builtin.tiny_model import ensure_tiny_model

    return ensure_tiny_model(str(REPO / ".cache" / "tiny-hybrid"), architecture="hybrid")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 protocol server (moto) on loopback, in its own process. Yields its endpoint URL and sets the
    standard AWS environment variables, which the session's local Ray (started after it) passes to its workers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_bucket(endpoint: str, name: str) -> str:
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_bucket(s3_server, request):
    return make_bucket(s3_server, "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-"))


def ensure_local_ray() -> None:
    """The session's local Ray: started on first use (after the moto server, whose endpoint and credentials its
    workers inherit) and kept for the rest of the session; every job run in this process joins it instead of
    starting and stopping its own (~10 s each here). A test that needs a Ray of its own (a cluster, a head) shuts
    it down first; the next test that asks for it starts it again."""
    import ray

    if ray.is_initialized():
        return
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=True,
             object_store_memory=512 * 1024**2)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # as job/stage.py's ensure_ray sets for a Ray it starts
    ctx.print_on_execution_start = False


@pytest.fixture
def local_ray(s3_server):
    ensure_local_ray()
    yield


@pytest.fixture(scope="session", autouse=True)
def _stop_local_ray_at_the_end():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def engine_processes() -> list:
    """vLLM engine processes (EngineCore and its CPU worker) among this test process's descendants."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:  # exited; its parent (an actor killed with it) never reaps it
                continue
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "EngineCore" in cmd or "VllmWorker" in cmd:
            found.append(p)
    return found


@pytest.fixture(autouse=True)
def _no_engine_outlives_its_test(request):
    """A job's engines stop with the job. An engine left running (seen once: two orphaned EngineCore processes
    after a CI run, ~3 GB) slows every later test on 2 cores and hides a leak of the job itself: fail the test that
    left it. Ray Data stops a finished job's actors asynchronously: a few seconds are allowed."""
    yield
    if request.node.get_closest_marker("own_ray"):
        return  # those tests stop a whole Ray of their own, engines included
    # Looked for first: most tests start no engine, and the collection below costs 0.42 s in a worker that has
    # imported torch, vLLM and Ray (measured), ~3 min of the suite's 430 tests.
    if not engine_processes():
        return
    # A failed job's actors stop when Ray Data's last handles to them are collected, and a caught exception keeps
    # them alive through its traceback's reference cycle until the cyclic GC runs: collect (CI once saw an
    # EngineCore outlive `pytest.raises(StorageError)` by 30 s). A driver that exits, as a job's does, frees them.
    gc.collect()
    deadline = time.monotonic() + 30
    while (left := engine_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        names = []
        for p in left:
            try:
                names.append(" ".join(p.cmdline())[:120])
                p.kill()
            except Exception:  # gone meanwhile
                pass
        if names:
            pytest.fail(f"{len(names)} vLLM engine process(es) still running 30 s after the test: {names}",
                        pytrace=False)


# ---------------------------------------------------------------------------------------------------------------
# Inputs and configs
# ---------------------------------------------------------------------------------------------------------------


def write_prompts(directory: str | Path, rows: list[dict], num_files: int = 1, schema: pa.Schema | None = None):
    """Write `rows` as `num_files` parquet shards (local path) with one explicit schema."""
    os.makedirs(directory, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema)
    per = -(-len(rows) // num_files)
    for i in range(num_files):
        pq.write_table(table.slice(i * per, per), os.path.join(directory, f"part-{i:03d}.parquet"))
    return str(directory)


def simple_prompts(n: int, prefix: str = "p") -> list[dict]:
    from job.builtin.demo import demo_questions

    questions = demo_questions()
    return [{"id": f"{prefix}{i:04d}", "prompt": questions[i % len(questions)], "topic": f"t{i % 3}"}
            for i in range(n)]


@pytest.fixture
def make_config(tiny_model_dir):
    """RunConfig from configs/demo.yaml with test overrides (dotted keys)."""
    from job.config import load_config

    def make(**overrides):
        overrides.setdefault("model", tiny_model_dir)
        return load_config(DEMO_CONFIG, **overrides)

    return make


def read_run(output: str):
    """All completion rows of a run as a pyarrow Table, through pyarrow.dataset as a user would."""
    import pyarrow.dataset as ds

    from job import storage

    fs, path = storage.resolve(output + "/completions")
    return ds.dataset(path, filesystem=fs, format="arrow").to_table()


def parquet_bytes(table: pa.Table) -> bytes:
    import io

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# The session's shared run: stage 1 and stage 2 once, on S3, read by test_generate, test_inspect, test_status...
# ---------------------------------------------------------------------------------------------------------------

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
SHARED_INPUT_SCHEMA = pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("messages", MESSAGES_TYPE),
                                 ("topic", pa.string()), ("answer", pa.string())])

# Rows that are individually bad, each with the words its error must contain.
BAD_ROWS = {
    1001: ({"prompt": None}, "empty prompt"),
    1002: ({"prompt": "   "}, "empty prompt"),
    1003: ({"messages": [{"role": "wizard", "content": "hello"}]}, "unknown role"),
    1004: ({"messages": [{"role": "user", "content": None}]}, "malformed messages"),
    1005: ({"prompt": "word " * 3000}, "prompt too long"),
    1006: ({"prompt": "INVALID-UTF8"}, "not valid UTF-8"),  # written as bytes 0xff 0xfe: see shared_input_files
}
NUM_PLAIN = 24  # ids 0..23: one prompt each, `answer` (the data's gold answer) carried as `input_answer`
CHAT_ID = NUM_PLAIN  # a system + user chat
BEYOND_LIMIT = [3000, 3001, 3002]  # the input's last rows, left out by the run's --limit
SHARED_ROWS_PER_SHARD = 8


def shared_input_rows() -> list[dict]:
    """The shared run's input rows in input order: 24 plain prompts, a chat, the bad rows, then 3 rows that the
    run's --limit leaves out. Integer ids (the output's ids are their strings)."""
    plain = simple_prompts(NUM_PLAIN)
    rows = [{"id": i, "prompt": p["prompt"], "messages": None, "topic": p["topic"], "answer": f"gold-{i}"}
            for i, p in enumerate(plain)]
    rows.append({"id": CHAT_ID, "prompt": None, "topic": "chat", "answer": None, "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}]})
    for i, (fields, _) in BAD_ROWS.items():
        rows.append({"id": i, "prompt": None, "messages": None, "topic": "bad", "answer": None, **fields})
    rows += [{"id": i, "prompt": "Left out by the limit.", "messages": None, "topic": "cut", "answer": None}
             for i in BEYOND_LIMIT]
    return rows


def shared_input_files(rows: list[dict]) -> dict[str, bytes]:
    """The rows as two parquet files (first 15 rows, then the rest); the prompt "INVALID-UTF8" becomes bytes that
    are not UTF-8 (parquet accepts them in a string column; decoding them used to fail the whole unit, on every
    rerun)."""
    table = pa.Table.from_pylist(rows, schema=SHARED_INPUT_SCHEMA)
    raw = [None if p is None else b"bad \xff\xfe prompt" if p == "INVALID-UTF8" else p.encode()
           for p in table.column("prompt").to_pylist()]
    table = table.set_column(table.schema.get_field_index("prompt"), "prompt", pa.array(raw, pa.binary()).view(
        pa.string()))
    return {"part-000.parquet": parquet_bytes(table.slice(0, 15)), "part-001.parquet": parquet_bytes(table.slice(15))}


@dataclass
class SharedRun:
    """What the shared run's tests read. `s3` is the run itself; `full` and `stage1` are local copies of it after
    stage 2 and between the stages (tests that change a run copy one of these first)."""
    s3: str
    full: str
    stage1: str
    input_uri: str
    rows: list[dict]  # the input rows the run covers (--limit), in input order
    model: str
    config: object  # the RunConfig stage 1 ran with (its endpoint: the fault proxy, since closed)
    summary: object  # stage 1's GenerateSummary
    rerun: object  # the rerun's summary: nothing to do
    num_s3_faults: int
    hidden_states: object  # stage 2's summary (HiddenStatesSummary)
    bucket: str
    secrets: dict  # env_vars of unique fake secrets, one of each shape, given to both stages
    output: str  # everything both stages printed (stdout and stderr)
    ray_session: str  # the session directory of the Ray both stages ran in (the secrets test reads its files)

    @property
    def num_rows(self) -> int:
        return len(self.rows)


@pytest.fixture(scope="session")
def shared_run(request, tmp_path_factory, tiny_model_dir, s3_server) -> SharedRun:
    """The session's shared run (`make_shared_run`), made ONCE per session: with pytest-xdist workers the first
    worker to ask makes it and leaves it (pickled, with its local copies) in the session's common temp directory,
    under a file lock; the other worker waits on the lock, then puts the same run into its own moto server (the
    input files and the finished run, byte for byte: moto's ETags are the bytes' MD5, as the maker's were). Each
    worker used to make it again: 104 + 81 s of the last fresh-clone run's 27.5 min (2026-12-06)."""
    import fcntl
    import pickle

    workerinput = getattr(request.config, "workerinput", None)
    if workerinput is None:  # one process: nobody to share with
        return make_shared_run(tmp_path_factory, tiny_model_dir, s3_server)
    common = tmp_path_factory.getbasetemp().parent / f"shared-run-{workerinput['testrunuid']}"
    common.mkdir(exist_ok=True)
    made = common / "shared-run.pickle"
    with open(common / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the maker holds it for the ~80-100 s of the run
        if not made.exists():
            run = make_shared_run(tmp_path_factory, tiny_model_dir, s3_server)
            made.with_suffix(".tmp").write_bytes(pickle.dumps(run))
            made.with_suffix(".tmp").rename(made)
            return run
    run = pickle.loads(made.read_bytes())
    adopt_shared_run(run, s3_server)
    return run


def adopt_shared_run(run: SharedRun, endpoint: str) -> None:
    """Put a shared run made by another worker into this worker's moto server, at the same URIs: the input files
    (made again from the same rows: `shared_input_files` is deterministic) and the finished run (the maker's local
    copy after stage 2, as it was on S3)."""
    from job import storage

    ensure_local_ray()  # as the maker left its worker: tests of the shared run may expect the session's Ray
    make_bucket(endpoint, run.bucket)
    for name, data in shared_input_files(shared_input_rows()).items():
        storage.write_bytes_atomic(f"{run.input_uri}/{name}", data)
    full = Path(run.full)
    for path in sorted(full.rglob("*")):
        if path.is_file():
            storage.write_bytes_atomic(f"{run.s3}/{path.relative_to(full).as_posix()}", path.read_bytes())


def make_shared_run(tmp_path_factory, tiny_model_dir, s3_server) -> SharedRun:
    """Stage 1 over an S3 input into an S3 output through a proxy that fails ~17 % of requests (503 SlowDown and
    dropped connections: retried), with the canary on its first 16 rows and a --limit that leaves the input's last 3
    rows out, and no hang watchdog (`hang_timeout_s: 0`); a rerun that finds nothing to do; stage 2 on the same S3
    run (direct to moto). ~70 s here.
    Local copies are taken between the stages and at the end."""
    from faulty_proxy import FaultyProxy
    from pyarrow import fs as pafs

    from job import storage
    from job.config import load_config
    from job.generate import run_generate
    from job.hidden_states import run_hidden_states

    ensure_local_ray()
    secrets = fake_secrets()
    secret_env = {f"env_vars.{k}": v for k, v in secrets.items()}
    printed = io.StringIO()
    bucket = make_bucket(s3_server, "shared-run")
    rows = shared_input_rows()
    for name, data in shared_input_files(rows).items():
        storage.write_bytes_atomic(f"s3://{bucket}/prompts/{name}", data)
    limit = len(rows) - len(BEYOND_LIMIT)
    output = f"s3://{bucket}/runs/shared"
    port = int(s3_server.rsplit(":", 1)[1])
    # ~17 % of requests faulted. (A 503 answering a small ranged GET surfaces as INTERNAL_FAILURE "Failed to flush
    # response stream": pyarrow does not retry it, storage.with_retries does.) Spared: the report's reads of the
    # finished shards, several ranged GETs per shard per attempt, which at this rate exhaust their 8 attempts
    # about once a run (the job then warns and leaves the report to `python -m job report`).
    with FaultyProxy(port, fail_every=8, reset_every=20, spare=f"GET /{bucket}/runs/shared/completions/") as proxy:
        config = load_config(DEMO_CONFIG, model=tiny_model_dir, input=f"s3://{bucket}/prompts", output=output,
                             limit=limit, **{"storage.endpoint_url": proxy.url, "storage.retry_base_s": 0.05,
                                             "generate.rows_per_shard": SHARED_ROWS_PER_SHARD,
                                             "quality.canary_rows": 16,
                                             # 0 = no hang watchdog (it once meant: every engine declared hung)
                                             "generate.hang_timeout_s": 0, **secret_env})
        with _tee(printed):
            summary = run_generate(config)
            rerun = run_generate(config)
        num_faults = proxy.num_faults

    base = tmp_path_factory.mktemp("shared-run")
    s3fs, s3_path = storage.resolve(output)

    def copy_to(local: Path) -> str:
        pafs.copy_files(s3_path, str(local), source_filesystem=s3fs, destination_filesystem=pafs.LocalFileSystem())
        return str(local)

    stage1 = copy_to(base / "stage1")
    stage2_config = load_config(DEMO_CONFIG, model=tiny_model_dir, output=output, **secret_env)
    with _tee(printed):
        hidden = run_hidden_states(stage2_config)
    full = copy_to(base / "full")
    import ray

    return SharedRun(ray_session=ray._private.worker._global_node.get_session_dir_path(),
                     s3=output, full=full, stage1=stage1, input_uri=f"s3://{bucket}/prompts", rows=rows[:limit],
                     model=tiny_model_dir, config=config, summary=summary, rerun=rerun,
                     num_s3_faults=num_faults, hidden_states=hidden, bucket=bucket, secrets=secrets,
                     output=printed.getvalue())


def fake_secrets() -> dict[str, str]:
    """One unique fake secret of each shape the job must keep to itself (issue 28), as env_vars: by name (HF_TOKEN,
    SIGNING_PASSPHRASE, GH_PAT, SENTRY_DSN, a connection string) and by value alone (an AWS key id under a name that
    says nothing)."""
    import secrets as rnd
    import string

    def chars(n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
        return "".join(rnd.choice(alphabet) for _ in range(n))

    return {"HF_TOKEN": f"hf_{chars(34)}", "SIGNING_PASSPHRASE": f"pass-{chars(24)}", "GH_PAT": f"ghp_{chars(36)}",
            "SENTRY_DSN": f"https://{rnd.token_hex(16)}@o1.ingest.sentry.io/1",
            "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey="
                                               f"{chars(86)}==;EndpointSuffix=core.windows.net",
            "BACKUP_NOTE": f"AKIA{chars(16, string.ascii_uppercase + string.digits)}"}


def secret_values(secrets: dict[str, str]) -> list[str]:
    """The parts of each fake secret that must appear nowhere (a connection string: its key)."""
    return [v.split("AccountKey=")[1].split(";")[0] if "AccountKey=" in v else
            v.split("//")[1].split("@")[0] if v.startswith("https://") else v for v in secrets.values()]


def files_holding(root: str | Path, needles: list[str]) -> list[str]:
    """'path: needle' for every file under `root` (recursively, any size, binary too) that holds one of `needles`."""
    found, encoded = [], [n.encode() for n in needles]
    for path in Path(root).rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                found += [f"{path}: {n.decode()[:12]}…" for n in encoded if n in data]
        except OSError:  # a socket, or a file removed while we walk
            pass
    return found


@contextmanager
def _tee(buffer: io.StringIO):
    """Print as usual and keep a copy of everything written to stdout and stderr in `buffer`."""
    class Tee(io.TextIOBase):
        def __init__(self, stream):
            self.stream = stream

        def write(self, s):
            buffer.write(s)
            return self.stream.write(s)

        def flush(self):
            self.stream.flush()

    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Tee(out), Tee(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


def check_completions(table: pa.Table, tokenizer, input_rows: list[dict]):
    """The contract every stage-1 output must meet, whatever the storage."""
    from collections import Counter

    from job.generate.prompts import render_prompt_ids

    ids = table.column("id").to_pylist()
    assert Counter(ids) == Counter(str(r["id"]) for r in input_rows), "every input id exactly once"
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    by_id = {str(r["id"]): r for r in input_rows}
    for row in table.to_pylist():
        if row["error"] is not None:
            assert row["prompt_token_ids"] is None and row["output_token_ids"] is None
            continue
        src = by_id[row["id"]]
        messages = src.get("messages") or [{"role": "user", "content": src["prompt"]}]
        expected = render_prompt_ids(tokenizer, messages, chat_template=None, enable_thinking=True,
                                     chat_template_kwargs={})
        assert row["prompt_token_ids"] == expected, "stored prompt ids are the tokenizer's chat-template rendering"
        assert row["num_prompt_tokens"] == len(expected)
        out = row["output_token_ids"]
        assert row["num_output_tokens"] == len(out) > 0
        # The stored text is what the stored output ids decode to.
        if think_end in out:
            k = out.index(think_end)
            assert row["reasoning"] == tokenizer.decode(out[:k], skip_special_tokens=True).strip()
            assert row["answer"] == tokenizer.decode(out[k + 1:], skip_special_tokens=True).strip()
        else:
            assert row["reasoning"] == tokenizer.decode(out, skip_special_tokens=True).strip()
        assert row["finish_reason"] in ("stop", "length")
        assert row["topic"] == src["topic"], "input columns are carried through"
