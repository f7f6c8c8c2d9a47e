"""The job on a Ray cluster of several nodes, built on this machine with ray.cluster_utils.Cluster: a head without
GPUs (as in cluster.yaml) and worker nodes of one CPU and one logical GPU each, input and output on the moto S3
server. Real Ray, real vLLM (CPU build), the tiny model.

The nodes are started without the driver's PYTHONPATH, S3 endpoint or vLLM settings: what a worker needs reaches
it as on a real cluster — the package through the job's runtime_env working_dir (as `ray job submit --working-dir
.` does), the S3 endpoint and engine environment through the config (storage.endpoint_url, env_vars), the model as
a path staged on every node. Only the S3 credentials come from the nodes' own environment (instance profiles on
AWS).

One test, in order: a local --output refused; a model staged without its weights refused by the engine, naming
its node; stage 1 with engines on both GPU nodes, one node killed mid-run (raylet and workers) while two nodes
join: the lost engine is replaced on a joining node, the pool grows onto the other (min 2, max 3), every id is
written exactly once and the progress line says engines were lost and replaced; stage 2 across the nodes.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import read_run, simple_prompts

from job import storage
from job.config import ConfigError, load_config
from job.generate import run_generate
from job.generate.engine_start import EngineStartError
from job.hidden_states import load, run_hidden_states

REPO = Path(__file__).resolve().parents[1]
NUM_ROWS = 64
NODE = {"num_cpus": 1, "num_gpus": 1, "object_store_memory": 150 * 1024 * 1024}


def _add_node(c, name: str):
    """A GPU node. Each unpacks the job's working_dir into a folder of its own, as on its own disk: nodes sharing
    one would unpack over each other's files while their workers run there."""
    with _node_environment():
        return c.add_node(**NODE, runtime_env_dir_name=f"runtime_resources_{name}")


@contextmanager
def _node_environment():
    """What the nodes must not inherit from this process (they get it from the job, as on a real cluster): removed
    from the environment while a node starts. The driver names its S3 endpoint in the config too."""
    names = ("PYTHONPATH", "AWS_ENDPOINT_URL", "VLLM_CPU_KVCACHE_SPACE")
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@pytest.fixture
def cluster(s3_server):
    """Head (0 CPUs, no GPU) + two GPU nodes; the driver (this process) connected with the repository as its
    working_dir. Yields (Cluster, [node A, node B])."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # the session's local Ray (conftest): the driver joins this cluster instead
        ray.shutdown()
    with _node_environment():
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 150 * 1024 * 1024})
    nodes = [_add_node(c, name) for name in "AB"]
    c.wait_for_nodes()
    ray.init(address=c.address, runtime_env={"working_dir": str(REPO)}, log_to_driver=True)
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def _config(tiny_model_dir, s3_server, **overrides):
    base = load_config(str(REPO / "configs" / "demo.yaml"))
    return load_config(str(REPO / "configs" / "demo.yaml"), **{
        "model": tiny_model_dir, "storage.endpoint_url": s3_server,
        "env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        # 8 sequences per engine: units of 4 rows take a few seconds each, so the run outlives a node's loss.
        "engine_kwargs": {**base.engine_kwargs, "max_num_seqs": 8},
        "generate.rows_per_shard": 4, "generate.units_in_flight_per_engine": 2, "generate.max_engines": 3,
        "generate.sampling": {"max_tokens": 256}, "quality.canary_rows": 0,
        "hidden_states.num_workers": 2, **overrides})


def _actor_nodes(class_part: str, alive_only: bool = True, skip: frozenset = frozenset()) -> set[str]:
    """Nodes of this job's map actors whose class name contains `class_part`, but for the actor ids in `skip`."""
    return {node for actor_id, (node, st) in _actors(class_part).items()
            if actor_id not in skip and node and (st == "ALIVE" or not alive_only)}


def _actors(class_part: str) -> dict[str, tuple[str, str]]:
    """{actor id: (node id, state)} of this job's map actors whose class name contains `class_part`."""
    import ray
    from ray._private import state

    job_id = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return {a["ActorID"]: ((a.get("Address") or {}).get("NodeID"), a.get("State"))
            for a in state.actors(job_id=job_id).values() if class_part in a.get("ActorClassName", "")}


@pytest.mark.slow  # several nodes: four Ray nodes and five engine starts on 2 cores (~4-5 min)
@pytest.mark.own_ray
@pytest.mark.alone  # four Ray nodes of its own (tests/suite_guard.py)
def test_cluster_node_lost_and_nodes_joining(cluster, tiny_model_dir, s3_server, s3_bucket, tmp_path, capsys):
    c, (node_a, node_b) = cluster
    rows = simple_prompts(NUM_ROWS)
    table, half = pa.Table.from_pylist(rows), NUM_ROWS // 2
    for i in range(2):
        storage.write_bytes_atomic(f"s3://{s3_bucket}/prompts/part-{i}.parquet", _parquet(table.slice(i * half, half)))
    prompts = f"s3://{s3_bucket}/prompts"

    # 1. A local output on a cluster of several nodes: refused before anything is written or started.
    local = tmp_path / "local-run"
    with pytest.raises(ConfigError, match=r"--output .*local-run: a local path, but this Ray cluster has 3 nodes"):
        run_generate(_config(tiny_model_dir, s3_server, input=prompts, output=str(local)))
    assert not local.exists()

    # 2. The model staged on the nodes without its weights (as the head gets it): the engine refuses at once and
    # names its node; the job ends once with that message.
    no_weights = tmp_path / "model-without-weights"
    shutil.copytree(tiny_model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(EngineStartError, match=r"no weight files .* on node \S+ \(.*Ray node [0-9a-f]{12}\)") as e:
        run_generate(_config(str(no_weights), s3_server, input=prompts, output=f"s3://{s3_bucket}/runs/bad"))
    assert str(e.value).split("Ray node ")[1][:12] in (node_a.node_id[:12], node_b.node_id[:12])

    # 3. Stage 1 across the nodes, in a thread; this thread plays the cloud. Once the job has placed its two engines
    # (min 2 = the GPUs at the start), node C joins: the pool may grow onto it (max 3). Once shards land, a node
    # whose engine is working dies (raylet and workers killed) and node D joins: the dead engine's units are
    # retried by its replacement on a joining node.
    output = f"s3://{s3_bucket}/runs/r1"
    earlier = frozenset(_actors("CompletionGenerator"))  # step 2's engines, which never started
    config = _config(tiny_model_dir, s3_server, input=prompts, output=output)
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(summary=_catch(run_generate, config)), daemon=True)
    job.start()
    first_two = {node_a.node_id, node_b.node_id}
    _wait(lambda: _actor_nodes("CompletionGenerator", alive_only=False, skip=earlier) >= first_two, job,
          "two engines placed")
    placed_first = _actor_nodes("CompletionGenerator", alive_only=False, skip=earlier)
    node_c = _add_node(c, "C")
    _wait(lambda: storage.list_files(f"{output}/completions", ".arrow", config.storage)
          and _actor_nodes("CompletionGenerator") & {node_a.node_id, node_b.node_id}, job, "a shard and a live engine")
    victim = node_b if node_b.node_id in _actor_nodes("CompletionGenerator") else node_a
    survivor = node_a if victim is node_b else node_b
    c.remove_node(victim, allow_graceful=False)
    node_d = _add_node(c, "D")
    job.join(timeout=420)
    assert not job.is_alive(), "stage 1 did not finish on the remaining and joining nodes"
    summary = result["summary"]
    assert not isinstance(summary, BaseException), repr(summary)
    out = capsys.readouterr().out

    # Every id exactly once; every shard reads whole (a PUT cut short by the node's death leaves no object).
    ids = read_run(output).column("id").to_pylist()
    assert Counter(ids) == Counter(r["id"] for r in rows), "every input id exactly once"
    # An engine on every GPU node at the start (none on the head), then on the joining nodes: the pool's third engine
    # and the lost engine's replacement. Which of C and D gets which, and whether both get one, is a race with the
    # job's own progress on a busy machine (CI once saw the restart take C's free GPU before the pool grew onto it,
    # and D stay empty): at least one joining node must have run an engine, and the lost engine must be replaced.
    names = {survivor.node_id: "survivor", victim.node_id: "victim", node_c.node_id: "C", node_d.node_id: "D"}
    placed = {names.get(n, n) for n in _actor_nodes("CompletionGenerator", alive_only=False, skip=earlier)}
    worked = {names.get(n, n): units for n, units in summary.units_per_node.items()}
    progress = [line for line in out.splitlines() if line.startswith("[generate] ")]
    why = f"engines placed on {sorted(placed)}, units per node {worked}\n" + "\n".join(progress)
    assert placed_first == {node_a.node_id, node_b.node_id}, "an engine on each GPU node, none on the head"
    assert {"C", "D"} & placed, why
    assert progress[-1].startswith(f"[generate] {NUM_ROWS}/{NUM_ROWS} rows (100.0%)"), why
    lost = [re.search(r"(\d+) lost, (\d+) replaced", line) for line in progress]
    assert any(m and int(m[1]) >= 1 and int(m[2]) >= 1 for m in lost), why
    assert "/2-3" in progress[-1], why
    print(why)  # shown with -rP: where the engines ran, the progress lines

    # A rerun finds nothing to do.
    assert run_generate(config).already_complete

    # 4. Stage 2 across the nodes: the same S3 run directory, extractors on GPU nodes only.
    run_hidden_states(config)
    records = list(load(output, config.storage))
    kept = {r["id"] for r in read_run(output).to_pylist() if r["error"] is None}
    assert Counter(r["id"] for r in records) == Counter(kept), "every kept completion's hidden states exactly once"
    extractor_nodes = _actor_nodes("HiddenStateExtractor", alive_only=False)
    gpu_nodes = {survivor.node_id, node_c.node_id, node_d.node_id}
    assert len(extractor_nodes) == 2 and extractor_nodes <= gpu_nodes, "two extractors, on two GPU nodes"


def _wait(condition, job: threading.Thread, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert job.is_alive(), f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s"
        time.sleep(0.5)


def _catch(fn, *args):
    try:
        return fn(*args)
    except BaseException as e:  # handed to the test thread, which asserts on it
        return e


def _parquet(table: pa.Table) -> bytes:
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()
