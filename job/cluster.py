"""What changes when the job runs on a Ray cluster of several nodes instead of one machine.

- Paths: the driver, the engines and the extractors run on different machines. A local --input or --output is on
  one machine's disk only: refused on a cluster of several nodes before anything is written or any engine starts
  (unless `storage.shared_filesystem` says every node mounts it). The model is a node-local path by design
  (cluster.yaml stages it on every node's NVMe): each engine checks its own node's copy and names the node when
  it is missing or incomplete.
- Engines come and go with nodes: `StageCensus` counts a stage's engine actors as they report themselves (alive, on
  how many nodes, lost with their node or process, replaced) for the progress line.
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


class CensusBook:
    """The Ray actor (created by `StageCensus`, no CPU, on the driver's node) that a stage's actors report to: when
    they start (with their own handle, so the stage can stop them) and when they are ready."""

    def __init__(self):
        self.arrivals: list[tuple[str, str, bool]] = []
        self.ready_ids: set[str] = set()
        self.handles: dict[str, object] = {}

    def arrive(self, actor_id: str, node_id: str, restarted: bool, handle) -> None:
        self.arrivals.append((actor_id, node_id, restarted))
        self.handles[actor_id] = handle

    def ready(self, actor_id: str) -> None:
        self.ready_ids.add(actor_id)

    def read(self) -> tuple[list[tuple[str, str, bool]], set[str]]:
        return list(self.arrivals), set(self.ready_ids)

    def take_handles(self) -> list:
        handles, self.handles = list(self.handles.values()), {}
        return handles


class StageCensus:
    """This stage's engine (or extractor) actors, counted from what they report, and stopped through their own
    handles: public Ray APIs only. Each actor tells the census when it starts (its actor id, its node, whether Ray
    restarted it, its handle: `report_arrival`) and when it is ready (`report_ready`); the census asks Ray which nodes
    are alive. An actor restarted after its process or node died reports again (`restarted`): one engine lost, one
    replaced. Another stage's or another dataset's actors never report here, so `stop_actors` never touches them.
    Called with no argument it gives an `EngineCensus` (Progress's `engines_fn`); None when it cannot be read."""

    def __init__(self):
        import ray  # heavy: imported on use
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # heavy: imported on use

        # On the driver's node: it lives as long as the driver (a worker node that dies would take the book along).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.book = ray.remote(num_cpus=0, max_restarts=0, scheduling_strategy=here)(CensusBook).remote()

    def __call__(self) -> EngineCensus | None:
        import ray  # heavy: imported on use

        try:
            arrivals, ready = ray.get(self.book.read.remote(), timeout=10)
        except Exception:  # Ray going down, or the book gone with the stage
            return None
        live = {n["NodeID"] for n in alive_nodes()}
        latest: dict[str, str] = {}
        for actor_id, node_id, _ in arrivals:
            latest[actor_id] = node_id
        restarts = sum(1 for _, _, restarted in arrivals if restarted)
        alive = [a for a, node in latest.items() if node in live and a in ready]
        lost_now = sum(1 for node in latest.values() if node not in live)
        return EngineCensus(alive=len(alive), nodes=len({latest[a] for a in alive}), lost=restarts + lost_now,
                            replaced=restarts)

    def stop_actors(self) -> int:
        """Kill this stage's actors (those starting included) through the handles they reported; returns how many.
        For a stage that ends on an error: Ray Data lets go of a failed dataset's actors only when its executor is
        collected (measured: an engine actor still alive 40 s after the error), and a driver that lives on (a
        notebook, a test session) would keep the engine and its memory (a GPU on a cluster)."""
        import ray  # heavy: imported on use

        try:
            handles = ray.get(self.book.take_handles.remote(), timeout=10)
        except Exception:  # Ray going down: its actors go with it
            return 0
        for handle in handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # gone meanwhile
                pass
        return len(handles)

    def close(self) -> None:
        import ray  # heavy: imported on use

        try:
            ray.kill(self.book)
        except Exception:  # gone with Ray already
            pass


def report_arrival(book) -> None:
    """In a stage's actor, first thing: tell the stage's census (`StageCensus.book`; None: no census) who and where it
    is, with its handle (so the stage can stop it even while it starts)."""
    if book is None:
        return
    import ray  # heavy: imported on use

    ctx = ray.get_runtime_context()
    book.arrive.remote(ctx.get_actor_id(), ctx.get_node_id(), ctx.was_current_actor_reconstructed, ctx.current_actor)


def report_ready(book) -> None:
    """In a stage's actor, once it has started (its engine loaded, its self-check passed)."""
    if book is not None:
        import ray  # heavy: imported on use

        book.ready.remote(ray.get_runtime_context().get_actor_id())
