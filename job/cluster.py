"""What changes when the job runs on a Ray cluster of several nodes instead of one machine.

- Paths: the driver, the engines and the extractors run on different machines. A local --input or --output is on
  one machine's disk only: refused on a cluster of several nodes before anything is written or any engine starts
  (unless `storage.shared_filesystem` says every node mounts it). The model is a node-local path by design
  (cluster.yaml stages it on every node's NVMe): each engine checks its own node's copy and names the node when
  it is missing or incomplete.
- Engines come and go with nodes: `engine_census` counts this job's engine actors from Ray's actor table (alive,
  on how many nodes, lost with their node or process, replaced) for the progress line.
"""

from __future__ import annotations

import glob
import os
import socket
from dataclasses import dataclass

from job import storage
from job.config import ConfigError, RunConfig

# Files that hold a model's weights; a node whose copy has a config.json but none of these was staged without its
# weights (the head gets config and tokenizer only: cluster.yaml syncs it with --exclude '*.safetensors').
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def joining_cluster() -> bool:
    """True when the job runs on an existing Ray cluster (RAY_ADDRESS, set by `ray job submit`, or a driver that
    connected itself), False when it would start a local Ray of its own (one node: nothing to check)."""
    import ray  # heavy: imported on use

    return ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))


def alive_nodes() -> list[dict]:
    import ray  # heavy: imported on use

    return [n for n in ray.nodes() if n.get("Alive")]


def check_paths_reach_workers(config: RunConfig, paths: dict[str, str | None]) -> None:
    """Refuse local paths that engines on other nodes would need, on a cluster of several nodes. `paths`:
    {what: path}, e.g. {"--output": config.output}. Call it before writing anything."""
    import ray  # heavy: imported on use

    if config.storage.shared_filesystem or not ray.is_initialized():  # not joined: a local Ray, one node
        return
    local = {what: p for what, p in paths.items() if p and not storage.is_s3(p)}
    if not local:
        return
    nodes = alive_nodes()
    if len(nodes) < 2:
        return
    named = ", ".join(f"{what} {p}" for what, p in local.items())
    raise ConfigError(
        f"{named}: a local path, but this Ray cluster has {len(nodes)} nodes and the engines run on other nodes "
        "than the driver: each would read and write its own disk (shards scattered over machines, lost with them). "
        "Use s3:// URIs, or set storage.shared_filesystem: true if every node mounts this path (NFS, FSx, EFS).")


def this_node() -> str:
    """This process's node, for error messages: IP, host name and Ray node id."""
    try:
        import ray  # heavy: imported on use

        ctx = ray.get_runtime_context()
        return f"{ray.util.get_node_ip_address()} ({socket.gethostname()}, Ray node {ctx.get_node_id()[:12]})"
    except Exception:
        return socket.gethostname()


def model_missing_here(model: str, needs_weights: bool = True) -> str | None:
    """Why this node cannot load a local model path, or None. Run inside an engine or extractor, on its node,
    before anything heavy is imported: a node staged without the model fails in seconds with its name.
    `needs_weights=False` for vLLM's `load_format: dummy` (benchmarks: config and tokenizer only)."""
    looks_local = model.startswith(("/", ".", "~"))
    if not looks_local and not os.path.exists(model):
        return None  # a hub name or s3:// URI: fetched by the loader
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        problem = "no such directory"
    elif not os.path.exists(os.path.join(path, "config.json")):
        problem = "no config.json in that directory"
    elif needs_weights and not any(glob.glob(os.path.join(path, "**", p), recursive=True) for p in WEIGHT_PATTERNS):
        problem = f"no weight files ({', '.join(WEIGHT_PATTERNS)}) in that directory"
    else:
        return None
    return (f"model {model}: {problem} on node {this_node()}. Every node that runs engines needs the model at this "
            "path: stage it there (cluster.yaml's initialization_commands sync it from S3 to each node's NVMe), "
            "then rerun")


# ---------------------------------------------------------------------------------------------------------------
@dataclass
class EngineCensus:
    """This job's engine actors now. `lost`: engine processes that died with their node, were killed, or crashed
    (each restart of an actor is one); `replaced`: those of them running again (on any node)."""
    alive: int
    nodes: int
    lost: int = 0
    replaced: int = 0


def stage_actors(since_s: float = 0.0) -> list[dict]:
    """This job's Ray Data map actors (engines, extractors) created after `since_s` (time.time()), as GCS records."""
    import ray  # heavy: imported on use
    from ray._private import state  # heavy: imported on use

    job_id = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return [a for a in state.actors(job_id=job_id).values() if "MapWorker" in a.get("ActorClassName", "")
            and (a.get("StartTime") or a.get("Timestamp") or 0) / 1000 >= since_s - 1]


def kill_stage_actors(since_s: float) -> int:
    """Kill this job's map actors created after `since_s` that are still alive; returns how many. For a failed stage:
    Ray Data lets go of its actors only when its executor is collected, which a failed dataset's is not (measured:
    an engine actor still ALIVE 40 s after the error), so a driver that lives on (a notebook, a test session) would
    keep the engine and its memory (a GPU on a cluster). By actor id: Ray Data holds the handles; `ray.kill` does
    the same through a handle."""
    import ray  # heavy: imported on use
    from ray._private import worker  # heavy: imported on use

    killed = 0
    for a in stage_actors(since_s):
        if a.get("State") in ("ALIVE", "PENDING_CREATION", "RESTARTING", "DEPENDENCIES_UNREADY"):
            try:
                worker.global_worker.core_worker.kill_actor(ray.ActorID.from_hex(a["ActorID"]), True)
                killed += 1
            except Exception:  # gone meanwhile
                pass
    return killed


def engine_census(since_s: float = 0.0) -> EngineCensus | None:
    """Counted from the GCS actor table (no dashboard needed). None outside Ray. An actor is ALIVE once its
    __init__ (the engine load) returned; RESTARTING after its process or node died, until Ray starts it again.
    `since_s`: only actors created after this time (time.time()), i.e. this stage's, not an earlier stage's of the
    same driver."""
    import ray  # heavy: imported on use

    if not ray.is_initialized():
        return None
    actors = stage_actors(since_s)
    alive = [a for a in actors if a.get("State") == "ALIVE"]
    restarts = sum(int(a.get("NumRestarts") or 0) for a in actors)
    # A DEAD actor was either let go by Ray Data (scale-down, end of the stage: "references ... removed") or died
    # past its max_restarts (stage 2): only the latter is a lost engine that nothing replaced.
    dead_for_good = sum(1 for a in actors if a.get("State") == "DEAD"
                        and "all references to the actor were removed" not in str(a.get("DeathCause", "")))
    restarting = sum(1 for a in actors if a.get("State") == "RESTARTING")
    return EngineCensus(alive=len(alive), nodes=len({(a.get("Address") or {}).get("NodeID") for a in alive}),
                        lost=restarts + dead_for_good, replaced=max(0, restarts - restarting))
