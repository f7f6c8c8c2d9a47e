"""The user's path, end to end: a local head started with `ray start --head` (dashboard and job API included),
the demo job sent with `ray job submit --working-dir . -- python -m job generate ...`, SUCCEEDED, shards
checked, and the head stopped again.

The head is started with `--block` in its own session and stopped by signalling that process (Ray's SIGTERM
handler stops every process it started, and the test then kills whatever is left of that session's process
group). `ray stop` is not used: it stops every Ray on the machine, other users' and other tests' too.

Every port is a free one (outside the kernel's ephemeral range: HEAD_PORTS) and --temp-dir is a fresh short
folder, so this head never collides with another local Ray. Real Ray, real vLLM (CPU build), the project's tiny
model; ~1-2 minutes on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
NUM_ROWS = 16


# The kernel hands ports 32768-60999 (ip_local_port_range) to every outgoing connection, and Ray's workers listen on
# 10002-19999 (its default worker port range). A port picked in the ephemeral range and let go again can be taken by
# an outgoing connection (of the other pytest worker's Ray, say) before this head binds it; so the head's ports come
# from between the two ranges, where nothing on this machine picks ports by itself.
HEAD_PORTS = range(20000, 32000)


def free_ports(n: int) -> list[int]:
    """n distinct ports of HEAD_PORTS that nothing listens on now."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.choice(HEAD_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


class HeadDidNotStart(RuntimeError):
    pass


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HeadDidNotStart(f"`ray start` exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except urllib.error.HTTPError:  # e.g. 401 without a token: the server is up
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


@pytest.fixture
def ray_head():
    """A local head with the dashboard/job API; yields (dashboard address, metrics URL, env for the CLI, temp dir).
    The head counts as up once it has run a no-op job: on this 2-core machine under the other test worker's load, a
    head was seen to exit during `ray start`, to answer HTTP while its agent (which runs jobs) never registered, and
    to lose its raylet ~30 s after start. Those are the machine's, not the job's under test: such a head is stopped
    and started again on new ports (3 tries), each failure printed with the tail of its `ray start` log."""
    failures = []
    for _ in range(3):
        head = _start_head()
        try:
            wait_http(f"{head.address}/api/version", 120, head.proc)
            problem = _runs_a_job(head)
        except HeadDidNotStart as e:
            problem = str(e)
        except BaseException:  # it did not answer in time, or the test was interrupted: no head is left running
            head.stop()
            raise
        if problem:
            failures.append(f"{problem}; the end of its `ray start` log:\n{head.log_tail()}")
            print(failures[-1])
            head.stop()
            continue
        try:
            yield head.address, f"http://127.0.0.1:{head.metrics}/metrics", head.env, head.temp_dir
        finally:
            head.stop()
        return
    raise HeadDidNotStart("\n\n".join(failures))


def _runs_a_job(head) -> str | None:
    """None once the head has run `python -c pass` as a job; else what went wrong."""
    deadline = time.monotonic() + 120
    while True:
        if head.proc.poll() is not None:
            return f"`ray start` exited with {head.proc.returncode}"
        try:
            r = subprocess.run([RAY, "job", "submit", "--address", head.address, "--", "python", "-c", "pass"],
                               env=head.env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return "a no-op job did not finish in 120 s"
        out = r.stdout + r.stderr
        if r.returncode == 0 and "succeeded" in out.lower():
            return None
        if NO_AGENT_YET not in out or time.monotonic() > deadline:
            return f"a no-op job failed:\n{out[-2000:]}"
        time.sleep(5)


class _Head:
    def __init__(self, proc, log, tmp, env, address, metrics):
        self.proc, self.log, self.tmp, self.env, self.address, self.metrics = proc, log, tmp, env, address, metrics
        self.temp_dir = os.path.join(tmp, "ray")

    def log_tail(self) -> str:
        self.log.flush()
        return "\n".join(open(self.log.name, errors="replace").read().splitlines()[-40:])

    def stop(self) -> None:
        _stop_head(self.proc)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _start_head() -> _Head:
    gcs, dash, agent_http, agent_grpc, env_agent, client, metrics = free_ports(7)
    tmp = tempfile.mkdtemp(prefix="rjs-", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    temp_dir = os.path.join(tmp, "ray")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    # Ray's default temp dir is $RAY_TMPDIR/ray: this head writes its address where a plain ray.init() on this
    # machine looks for a running head (ray_current_cluster), as `ray start --head` without flags does, but for
    # processes with this environment only.
    env["RAY_TMPDIR"] = tmp
    # The job's entrypoint runs `python` from the head's PATH: this virtualenv's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # SIGTERM stops the head at once (no 30 s node drain)
    # Ray 2.60 turns token auth on for local heads. This head gets its own token through the environment (the
    # CLI, the head and the job all read it), so the user's ~/.ray/auth_token is neither read nor written.
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    env["HF_TOKEN"] = f"hf_{secrets.token_hex(20)}"  # a unique fake secret in the node's environment (issue 28)
    log = open(os.path.join(tmp, "ray-start.log"), "w")
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus", "2", "--port", str(gcs),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--include-dashboard", "true",
         "--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
         "--runtime-env-agent-port", str(env_agent), "--ray-client-server-port", str(client),
         "--metrics-export-port", str(metrics), "--object-store-memory", str(300 * 1024 * 1024),
         "--temp-dir", temp_dir, "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return _Head(proc, log, tmp, env, f"http://127.0.0.1:{dash}", metrics)


def _stop_head(proc: subprocess.Popen) -> None:
    """Stop the head this test started, and only it: SIGTERM to `ray start --block` (it stops its processes),
    then SIGKILL to anything left in its process group (workers, agents)."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow  # `ray job submit`: a head of its own, the job's runtime env, an engine start (~2 min)
@pytest.mark.own_ray
@pytest.mark.alone  # a Ray head of its own (tests/suite_guard.py)
def test_ray_job_submit_round_trip(ray_head, tiny_model_dir, tmp_path):
    from job.builtin.demo import write_demo_prompts

    address, metrics_url, env, temp_dir = ray_head
    prompts = write_demo_prompts(str(tmp_path / "prompts"), num_prompts=32, num_shards=2)
    output = str(tmp_path / "run")
    # A secret as OPERATIONS says to give one (issue 28): in the head node's environment (the head was started with
    # it; the job's driver inherits it), referenced from the config as ${HF_TOKEN}, so the config file holds none.
    token = env["HF_TOKEN"]
    config = tmp_path / "config.yaml"
    config.write_text((REPO / "configs" / "demo.yaml").read_text().replace(
        "env_vars:", "env_vars:\n  HF_TOKEN: ${HF_TOKEN}").replace("canary_rows: 32", "canary_rows: 8"))
    # A user's own chat template (issue 43), named by a path relative to the working directory: the file travels
    # with `--working-dir .` and the canary judges the prompts it renders (its generation prompt is the model's).
    user_template = "tests/data/user_chat_template.jinja"
    # The working dir is uploaded without .gitignored paths (.venv, .cache): the model and data are passed as
    # absolute paths on this machine, as a cluster job would name S3 URIs or node-local paths.
    entrypoint = ["python", "-m", "job", "generate", "--config", str(config),
                  "--model", os.path.abspath(tiny_model_dir), "--input", prompts, "--output", output,
                  "--limit", str(NUM_ROWS), "--chat-template", user_template]
    metrics_seen: set[str] = set()
    job_status, logs = _submit(address, env, entrypoint, metrics_url, metrics_seen)
    if "succeeded" not in job_status.lower() and "Engine core initialization failed" in logs:
        # On this shared 2-core machine a vLLM engine start occasionally fails when other tests start engines at
        # the same moment (~1 run in 5 under load). That is not what this test is about; the user's answer to a
        # failed job is to submit the same command again, which also exercises resuming the same --output.
        print("note: the engine failed to start (machine under load); resubmitting the same job once")
        job_status, logs = _submit(address, env, entrypoint, metrics_url, metrics_seen)
    assert "succeeded" in job_status.lower(), f"{job_status}\n{logs[-3000:]}\n{_error_lines(temp_dir)}"
    # Not a TTY under `ray job submit`: plain progress lines, the last one complete.
    progress = [line for line in logs.splitlines() if line.startswith("[generate] ")]
    assert progress and progress[-1].startswith(f"[generate] {NUM_ROWS}/{NUM_ROWS} rows (100.0%)"), logs[-4000:]
    assert "\r" not in "".join(progress)
    assert "ray: joined the cluster at" in logs  # `ray job submit` sets RAY_ADDRESS: the job says where it runs
    assert re.search(r"\ncanary passed on the first \d+ rows\n", logs), logs[-4000:]  # its first unit's rows
    assert "template_mismatch         0    0.0%" in logs
    run_json = json.loads((Path(output) / "run.json").read_text())
    template_sha = hashlib.sha256((REPO / user_template).read_bytes()).hexdigest()[:16]
    assert run_json["generate"]["identity"]["chat_template_sha"] == template_sha  # the user's file, read by the job

    # The same head still running, a user runs stage 2 on this machine without RAY_ADDRESS (`make demo` does the
    # same). A plain ray.init() would find the head through ray_current_cluster and refuse num_cpus with a raw
    # ValueError; the job starts a Ray of its own instead, and says so.
    local = subprocess.run([sys.executable, "-m", "job", "hidden-states", "--config", str(config),
                            "--output", output], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    assert "\nray: a local Ray of this job's own" in local.stdout, local.stdout[:1000]
    assert f"hidden states: {NUM_ROWS} samples" in local.stdout, local.stdout[-1000:]
    assert "Traceback" not in local.stderr, local.stderr[-3000:]

    # The shards: NUM_ROWS rows, each input id exactly once (the first NUM_ROWS ids, in input order).
    import pyarrow.dataset as ds

    table = ds.dataset(os.path.join(output, "completions"), format="arrow").to_table()
    ids = table.column("id").to_pylist()
    assert len(ids) == NUM_ROWS and len(set(ids)) == NUM_ROWS
    assert sorted(ids) == [f"demo-{i:05d}" for i in range(NUM_ROWS)]

    # `status` and `plan --from` read the finished run directory alone.
    from job import cli
    from job.runview import status

    st = status.build_status(output)
    assert st["rows_done"] == NUM_ROWS and st["rows_remaining"] == 0 and st["output_tokens"] > 0
    assert cli.main(["plan", "--from", output, "--prompts", "914000", "--gpus", "8", "--usd-per-gpu-hour",
                     "3.81"]) == 0

    # The secret reached the job and appears nowhere: not in any file of the head's Ray temp dir (sessions, logs,
    # the uploaded working dir, runtime env logs), not in the run directory, not in the job's output.
    from conftest import files_holding

    assert files_holding(temp_dir, [token]) == [] and files_holding(output, [token]) == []
    assert token not in logs and token not in local.stdout + local.stderr

    # The progress figures reached Ray's Prometheus endpoint (exported from the driver via ray.util.metrics,
    # scraped every 2 s while the job ran; the driver's heartbeat sets them during the ~30 s of engine start-up).
    print("datagen metrics scraped:", sorted(metrics_seen))
    assert {"ray_datagen_rows_total", "ray_datagen_progress_fraction", "ray_datagen_engines_alive"} <= metrics_seen


# Ray's answer while the head node's agent (which runs jobs) has not yet registered with the dashboard: nothing was
# submitted. Seen under load ~30 s after the dashboard answered; Ray's advice is to try again later, as a user would.
NO_AGENT_YET = "No available agent to submit job"


def _submit(address: str, env: dict, entrypoint: list[str], metrics_url: str,
            metrics_seen: set[str]) -> tuple[str, str]:
    """`ray job submit --working-dir . -- ENTRYPOINT`, as a user runs it; returns (`ray job status`, logs)."""
    for attempt in range(6):
        submission_id = f"datagen-test-{os.getpid()}-{time.time_ns()}"
        cmd = [RAY, "job", "submit", "--address", address, "--submission-id", submission_id, "--working-dir", ".",
               "--", *entrypoint]
        submit = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 420
        while submit.poll() is None and time.monotonic() < deadline:
            metrics_seen |= _datagen_metrics(metrics_url)
            time.sleep(2)
        if submit.poll() is None:
            submit.kill()
        logs = submit.communicate()[0]
        if NO_AGENT_YET not in logs:
            break
        print(f"note: {NO_AGENT_YET} (attempt {attempt + 1}): the head's agent is not up yet; submitting again in 10 s")
        time.sleep(10)
    # The job's final state, asked the way a user would (the CLI reads the token from the environment).
    job_status = subprocess.run([RAY, "job", "status", "--address", address, submission_id], env=env,
                                capture_output=True, text=True, timeout=60).stdout
    return job_status, logs


def _datagen_metrics(url: str) -> set[str]:
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return set()
    return set(re.findall(r"^(ray_datagen_\w+)", text, flags=re.M))


def _error_lines(temp_dir: str) -> str:
    """Error lines of every Ray log of this head (the engine's root cause is in a worker's log, not the job's)."""
    out = []
    for path in sorted(Path(temp_dir).glob("session_*/logs/*")):
        if path.suffix in (".err", ".out", ".log") and path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                if re.search(r"ERROR|Error:|Killed|MemoryError|Traceback", line):
                    out.append(f"{path.name}: {line[:300]}")
    return "--- error lines in Ray's logs ---\n" + "\n".join(out[-80:])
