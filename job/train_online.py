"""Train a drafter while stage 2 runs: stage 2's stream (job/export/stream.py) is the dataset of a Ray Train
`TorchTrainer`; its workers train speculators' draft model on it (job/trainers/speculators_online.py). Nothing here
moves data: Ray Data runs the extractor actors and the mapping, splits the stream between the training workers and
holds it back when they are slow; Ray Train starts, checkpoints and restarts the workers.

    python -m job train-online --config C.yaml --output RUN --to speculators --format eagle3 --storage-path DIR

Exactly once per epoch: the stream is split unevenly between the workers (`ExactlyOnceDataConfig`), each rank
records the ids it has trained into the weights, and every checkpoint holds the weights (rank 0) and each rank's
ids (`consumed-rank<r>.json`; Ray Train writes every rank's files into one checkpoint directory). After a worker
failure Ray Train restarts the whole group from the last checkpoint and runs the dataset again from its start:
the workers skip the ids the checkpoint covers; samples trained after it are trained again (the weights were
rolled back to before them). A new driver run with the same `--name` and `--storage-path` reads the last checkpoint
first and leaves its ids out before extraction (job/hidden_states/actor.py `skip_ids`): they cost no forward pass.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile
from dataclasses import dataclass, field

from job.config import ConfigError, RunConfig

# Ray Data's object store budget for the stream when the user names none: 2 GiB holds ~50 samples of the 27B
# target's 4 layers × 5120 × bf16 at 1,000 tokens (40 KB a token, 41 MB a sample), ~16 of Ray Data's 128 MiB
# blocks: enough to keep the trainers fed, small beside a GPU node's object store (30 % of its RAM by default).
DEFAULT_OBJECT_STORE_BYTES = 2 * 1024**3
CONSUMED = "consumed-rank{rank}.json"
DRAFTER = "drafter.pt"
STATE = "state.json"


@dataclass
class OnlineOptions:
    storage_path: str
    """Where Ray Train keeps the run's checkpoints (a shared path or s3:// URI on a cluster)."""
    name: str = "train-online"
    """The Ray Train run's name: a rerun with the same name and storage_path resumes from its last checkpoint."""
    to: str = "speculators"
    format: str = "eagle3"
    layers: list[int] | None = None
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    """CPUs each training worker holds. They must leave CPUs to Ray Data: on a 2-CPU Ray, 2 workers at 1 CPU
    each starve the stream's tasks and nothing ever runs (docs/design/ray-train-online.md §4); 0.5 works."""
    gpus_per_worker: float = 0
    object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES
    """Ray Data's object store limit for the stream: past it the extractors are held back (backpressure)."""
    checkpoint_every: int = 10
    """Optimizer steps between checkpoints: what a worker failure costs at most, in steps trained again."""
    max_failures: int = 1
    """Worker-group restarts Ray Train allows (-1: forever)."""
    epochs: int = 1
    lr: float | None = None
    """speculators' default when None."""
    worker_env: dict = field(default_factory=dict)
    """Environment variables of the training workers only (Ray Train's worker_runtime_env)."""

    def check(self) -> None:
        if self.to != "speculators":
            raise ConfigError(f"train-online: --to {self.to!r}: only speculators trains online here (SpecForge pins "
                              "torch 2.11 and sglang, which do not fit the job's environment)")
        if self.format not in ("eagle3", "dflash"):
            raise ConfigError(f"train-online: --format {self.format!r}: speculators trains eagle3 or dflash")
        for name in ("num_workers", "checkpoint_every", "epochs", "object_store_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train-online: {name} must be at least 1, got {getattr(self, name)}")
        if self.cpus_per_worker <= 0 and self.gpus_per_worker <= 0:
            raise ConfigError("train-online: a training worker needs a CPU or a GPU share (cpus_per_worker > 0)")


def exactly_once_data_config(object_store_bytes: int):
    """Ray Train's DataConfig with the stream split unevenly and its object store use bounded.

    Train's default splits with `streaming_split(n, equal=True)`, which drops rows to give every worker the same
    number (ray/data/dataset.py: "dropping data if necessary"): samples would silently go untrained each epoch.
    `equal=False` hands out every row once; workers may then get different counts, which the step handles
    (speculators_online.OnlineDraftStep.step: a rank without a batch adds zero gradients)."""
    from ray.data import ExecutionOptions, ExecutionResources
    from ray.train import DataConfig

    class ExactlyOnceDataConfig(DataConfig):
        """DataConfig.configure (ray/train/_internal/data_config.py) for our one dataset, with `equal=False`."""

        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            if set(datasets) != {"train"}:
                raise ValueError(f"train-online streams one dataset, 'train'; got {sorted(datasets)}")
            ds = datasets["train"].copy(datasets["train"])
            ds.context.execution_options = self._resolve_execution_options("train")
            hints = worker_node_ids if self._enable_shard_locality else None
            return [{"train": s} for s in ds.streaming_split(world_size, equal=False, locality_hints=hints)]

    options = ExecutionOptions(resource_limits=ExecutionResources(object_store_memory=object_store_bytes))
    return ExactlyOnceDataConfig(datasets_to_split=["train"], execution_options=options)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: the weights (rank 0) and the ids each rank trained into them
# ---------------------------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def read_checkpoint(path: str) -> dict:
    """{"state": STATE's dict, "consumed": the union of every rank's ids, "duplicates": ids two ranks both
    claim, "drafter": the weights' path or None}."""
    state = _read_json(os.path.join(path, STATE)) if os.path.exists(os.path.join(path, STATE)) else {}
    seen, duplicates = set(), []
    for f in sorted(glob.glob(os.path.join(path, CONSUMED.format(rank="*")))):
        ids = _read_json(f)["ids"]
        duplicates += [i for i in ids if i in seen]
        seen.update(ids)
    drafter = os.path.join(path, DRAFTER)
    return {"state": state, "consumed": seen, "duplicates": duplicates,
            "drafter": drafter if os.path.exists(drafter) else None}


# Ray Train v2's record of the checkpoints its controller accepted (every rank reported), in the run's folder
# (ray/train/v2/_internal/constants.py CHECKPOINT_MANAGER_SNAPSHOT_FILENAME).
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"


def latest_checkpoint(storage_path: str, name: str) -> str | None:
    """The checkpoint a rerun of `name` resumes from: the one Ray Train's snapshot names as the latest, which is the
    one it hands the workers (`ray.train.get_checkpoint`), else None. Not the newest `checkpoint_*` folder: the ranks
    copy their files into it one by one, and the controller accepts it only once every rank has reported (it polls
    every 2 s), so a folder can exist, even with rank 0's state in it, that Ray will not restore; leaving its ids out
    of the stream would leave samples untrained. A local (or shared-filesystem) storage_path only: with s3:// the
    rerun extracts everything again and the workers skip what the restored checkpoint covers."""
    if "://" in storage_path:
        return None
    snapshot = os.path.join(storage_path, name, RAY_TRAIN_SNAPSHOT)
    if not os.path.exists(snapshot):
        return None
    latest = (_read_json(snapshot).get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    return os.path.join(storage_path, name, latest) if latest else None


def _report(metrics: dict, step, rank: int, state: dict, ids: list[str]):
    """Every rank calls it at the same step (Ray Train needs all ranks' reports); one checkpoint directory gets
    rank 0's weights and state and every rank's ids."""
    import ray.train  # heavy: imported on use

    with tempfile.TemporaryDirectory() as d:
        if rank == 0:
            step.save(os.path.join(d, DRAFTER))
            _write_json(os.path.join(d, STATE), state)
        _write_json(os.path.join(d, CONSUMED.format(rank=rank)), {"epoch": state["epoch"], "ids": ids})
        ray.train.report({**metrics, "epoch": state["epoch"], "global_step": state["global_step"]},
                         checkpoint=ray.train.Checkpoint.from_directory(d))


# ---------------------------------------------------------------------------------------------------------------
# The training workers
# ---------------------------------------------------------------------------------------------------------------


def train_loop_per_worker(cfg: dict) -> None:
    import ray.train  # heavy: imported on use
    import torch  # heavy: imported on use

    from job.hidden_states import collate
    from job.trainers.speculators_online import OnlineDraftStep, workdir_for

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # Ray's CPU share; more threads fight the extractors for the same cores
    step = OnlineDraftStep(cfg["draft_config"], cfg["format"], cfg["model"], workdir_for(rank, cfg["workdir"]),
                           **cfg["overrides"])
    # `history`: the loss of every step the weights went through (steps rolled back by a restart are not in it).
    state = {"epoch": 0, "global_step": 0, "epoch_done": False, "resumed_from_step": None, "history": []}
    inherited = set()
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            previous = read_checkpoint(d)
            step.load(previous["drafter"])
        state.update(previous["state"], resumed_from_step=previous["state"]["global_step"])
        inherited = set() if state["epoch_done"] else previous["consumed"]
        state["epoch"] += state["epoch_done"]
    shard = ray.train.get_dataset_shard("train")
    while state["epoch"] < cfg["epochs"]:
        skip = inherited
        mine = sorted(inherited) if rank == 0 else []  # rank 0 carries the checkpoint's ids forward
        rows = ((sid, step.sample(b["token_ids"][i], b["hidden_states"][i], b["loss_mask"][i]))
                for batch in shard.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=1)
                for b in [collate(batch)] for i, sid in enumerate(b["id"]) if sid not in skip)
        carry = []
        state["epoch_done"] = False
        while True:
            pack = step.pack(rows, carry)
            metrics = step.step([s for _, s in pack])
            if metrics is None:
                break
            mine += [sid for sid, _ in pack]
            state["global_step"] += 1
            state["history"].append({"step": state["global_step"], "loss": metrics["loss"],
                                     "grad_norm": metrics["grad_norm"], "ranks_with_data": metrics["ranks_with_data"]})
            if state["global_step"] % cfg["checkpoint_every"] == 0:
                _report(metrics, step, rank, state, mine)
        state["epoch_done"] = True
        _report({}, step, rank, state, mine)
        state["epoch"], inherited = state["epoch"] + 1, set()


# ---------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------


def train_online(config: RunConfig, options: OnlineOptions):
    """Run stage 2 into a Ray Train TorchTrainer (see the module's docstring). Returns Ray Train's Result: its
    `checkpoint` is the last one (weights and consumed ids), `error` None when training finished."""
    from ray.train import FailureConfig, ScalingConfig
    from ray.train import RunConfig as TrainRunConfig
    from ray.train.torch import TorchTrainer

    from job import pipeline
    from job.export.manifest import manifest_fields
    from job.export.stream import stream, trainer_plan
    from job.trainers import speculators

    options.check()
    if os.path.isdir(config.model):  # Ray Train runs its workers in a directory of its own: a relative path breaks
        config = dataclasses.replace(config, model=os.path.abspath(config.model))
    if options.gpus_per_worker and not config.hidden_states.num_workers:
        raise ConfigError("train-online: set hidden_states.num_workers to the GPUs that extract: by default stage 2 "
                          "takes every GPU in the cluster and the training workers would wait for one forever")
    if pipeline.ensure_ray(config):  # a local Ray of our own: its CPUs are all there will be
        import ray  # heavy: imported on use

        cpus = ray.cluster_resources().get("CPU", 0)
        # Stage 2's extractor takes 1 CPU and the mapping 0.25 (job/export/stream.py); without them free, Ray Data
        # never starts a task and the training workers wait forever, without an error.
        if options.num_workers * options.cpus_per_worker + 1.25 > cpus:
            raise ConfigError(
                f"train-online: {options.num_workers} training workers × {options.cpus_per_worker} CPU leave stage 2 "
                f"less than the 1.25 CPU it needs on this {cpus:g}-CPU Ray: lower --cpus-per-worker (e.g. "
                f"{max(0.05, (cpus - 1.25) / options.num_workers):.2g}) or --num-workers")
    plan = trainer_plan(config, to=options.to, format=options.format, layers=options.layers)
    fields = manifest_fields(plan, config.hidden_states.compute_dtype)
    draft_config = speculators.draft_config({"to": options.to, "format": options.format, **fields})
    previous = latest_checkpoint(options.storage_path, options.name)
    skip = frozenset()
    if previous:  # a rerun: what the last checkpoint covers is not extracted again (this epoch's ids only)
        done = read_checkpoint(previous)
        skip = frozenset() if done["state"].get("epoch_done") else frozenset(done["consumed"])
        print(f"train-online: resuming {options.name} from {previous}: {len(skip):,} samples of epoch "
              f"{done['state'].get('epoch')} already trained, left out of the stream", flush=True)
    if skip and options.epochs > 1:
        skip = frozenset()  # later epochs need every sample: skipping is then the workers' job alone
    dataset = stream(config, to=options.to, format=options.format, layers=options.layers, skip_ids=skip)
    loop_config = {"draft_config": draft_config, "format": options.format, "model": config.model,
                   "epochs": options.epochs, "checkpoint_every": options.checkpoint_every,
                   "workdir": os.path.join(tempfile.gettempdir(), f"train-online-{options.name}"),
                   "overrides": {"lr": options.lr} if options.lr is not None else {}}
    resources = {"CPU": options.cpus_per_worker, **({"GPU": options.gpus_per_worker} if options.gpus_per_worker
                                                      else {})}
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=options.num_workers, use_gpu=options.gpus_per_worker > 0,
                                     resources_per_worker=resources),
        datasets={"train": dataset},
        dataset_config=exactly_once_data_config(options.object_store_bytes),
        run_config=TrainRunConfig(name=options.name, storage_path=os.path.abspath(options.storage_path)
                                  if "://" not in options.storage_path else options.storage_path,
                                  failure_config=FailureConfig(max_failures=options.max_failures),
                                  worker_runtime_env={"env_vars": options.worker_env} if options.worker_env else None),
    )
    return trainer.fit()


def summary(result) -> dict:
    """What the CLI prints: the last checkpoint's counts and the loss of its first and last steps."""
    out = {"error": repr(result.error) if result.error else None,
           "checkpoint": result.checkpoint.path if result.checkpoint else None}
    if result.checkpoint:
        with result.checkpoint.as_directory() as d:
            done = read_checkpoint(d)
        history = done["state"].pop("history", [])
        out.update(samples_trained=len(done["consumed"]), duplicates=len(done["duplicates"]), **done["state"])
        if history:
            out.update(first_loss=history[0]["loss"], last_loss=history[-1]["loss"])
    return out
