"""Training a drafter, declared for job/stage.py's runner: its units are the epochs (done as the last checkpoint
says), its work Ray Train's workers (loop.py) on the run's samples (data.py), its output RUN/drafts/<name>/
(draft.py). The runner gives it what every stage has: the writer lock (one training per draft name), run.json's
`train-<name>` section, the identity check on resume, one error surface."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field

from job import layout, run_record, runs, storage, target
from job.config import ConfigError, RunConfig
from job.errors import JobError
from job.stage import Stage, StageSummary, run_stage
from job.train import data, vocab
from job.train.checkpoint import latest_checkpoint, read_checkpoint, summary
from job.train.draft import manifest_uri, served_config, served_draft_uri
from job.train.options import TrainOptions


class TrainingFailed(JobError):
    """Ray Train gave up (out of --max-failures): rerun the same command to resume from the last checkpoint."""


@dataclass
class Epoch:
    index: int
    num_rows: int
    done: bool

    def to_row(self) -> dict:
        return {"epoch": self.index}


@dataclass(kw_only=True)
class TrainSummary(StageSummary):
    draft: str | None = None
    """The directory vLLM serves."""
    speculative_config: dict = field(default_factory=dict)
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    duplicates: int = 0
    first_loss: float | None = None
    last_loss: float | None = None


class TrainStage(Stage):
    label, unit_noun = "train", "epochs"

    def __init__(self, config: RunConfig, options: TrainOptions):
        if os.path.isdir(config.model):  # Ray Train runs its workers in a directory of its own
            config = dataclasses.replace(config, model=os.path.abspath(config.model))
        if not storage.is_s3(config.output):
            config = dataclasses.replace(config, output=os.path.abspath(config.output))
        super().__init__(config)
        self.options, self.key = options, layout.draft_stage(options.name)
        self.directory = layout.draft_dir(options.name)
        self.storage_path, self.ray_name = ((options.checkpoints, options.name) if options.checkpoints else
                                            (storage.join(config.output, self.directory), layout.TRAIN_CHECKPOINTS_DIR))

    def worker_paths(self) -> dict:
        return {"--output": self.config.output, "--checkpoints": self.storage_path}

    def identity(self, record) -> dict:
        if record is None:
            raise ConfigError(f"train: {self.config.output} is not a run directory (no run.json): train on the "
                              "--output of a `generate` run")
        o = self.options
        if not o.stream:
            self.check_target(record)
        identity = {"format": o.format, "to": o.to, "layers": o.layers, "model": self.config.model,
                    "data": "stream" if o.stream else "stored", "holdout": o.holdout}
        if o.max_steps is not None:  # only when given: a draft trained before the option keeps its identity
            identity["steps"] = o.max_steps
        if o.draft_vocab is not None:  # the same
            identity["draft_vocab"] = o.draft_vocab
        return identity

    def check_target(self, record) -> None:
        """The stored hidden states are the target's own: stage 2 ran the model this draft is trained for (its
        files, `runs.model_files_digest`). A draft trained on another model's features is served beside a target
        that never computes them (such a DFlash draft was accepted at τ 1.00)."""
        extracted = record.hidden_states.identity.get("model_files") if record.hidden_states else None
        target_files = runs.model_files_digest(self.config.model)
        if extracted is not None and target_files is not None and extracted != target_files:
            raise ConfigError(f"train: the run's hidden states were extracted with "
                              f"{record.hidden_states.identity.get('model')!r} (files {extracted}), not the target "
                              f"{self.config.model!r} (files {target_files}): train for the model stage 2 ran "
                              "(--model), or rerun stage 2 with this one")

    def plan(self, fence, changed) -> list[Epoch]:
        self.previous = latest_checkpoint(self.storage_path, self.ray_name)
        state = read_checkpoint(self.previous)["state"] if self.previous else {}
        done = state.get("epoch", 0) + (1 if state.get("epoch_done") else 0)
        return [Epoch(e, 0, e < done) for e in range(self.options.epochs)]

    def is_done(self, unit: Epoch) -> bool:
        return unit.done

    def execute(self, ray_session, units, pending, fence) -> None:
        import time

        ray_session.start()
        started = time.monotonic()
        self.result = fit(self.config, self.options, self.storage_path, self.ray_name, self.previous, fence)
        self.seconds = time.monotonic() - started
        if self.result.error is not None:
            first = (str(self.result.error).strip().splitlines() or [type(self.result.error).__name__])[0]
            raise TrainingFailed(f"train: training failed after {self.options.max_failures} restart(s): {first}. "
                                 "Rerun the same command to resume from the last checkpoint.")

    def finish(self, units, fence) -> tuple[TrainSummary, dict]:
        c, o = self.config, self.options
        last = getattr(self, "result", None)
        done = summary(last) if last is not None else (read_summary(self.previous) if self.previous else {})
        seconds = getattr(self, "seconds", 0.0)
        trained_now = [h for h in done.get("history", []) if (h["step"] > (done.get("resumed_from_step") or 0))]
        draft = served_draft_uri(c.output, o.name)
        tokens = o.speculative_tokens or default_speculative_tokens(o.format)
        s = TrainSummary(output=c.output, draft=draft, speculative_config=served_config(draft, tokens),
                         steps=done.get("global_step", 0), samples=done.get("samples", 0),
                         tokens=done.get("tokens", 0), duplicates=done.get("duplicates", 0),
                         first_loss=done.get("first_loss"), last_loss=done.get("last_loss"), seconds=seconds,
                         report=manifest_uri(c.output, o.name))
        if seconds and trained_now:
            s.samples_per_s, s.tokens_per_s = s.samples / seconds, s.tokens / seconds
        served = storage.join(draft, "config.json")
        vocab_size = (storage.read_json(served, c.storage).get("draft_vocab_size")
                      if storage.exists(served, c.storage) else None)
        fence.write_json(s.report, {"target": c.model, "format": o.format, "to": o.to, "layers": o.layers,
                                    "draft_vocab_size": vocab_size,
                                    "data": "stream" if o.stream else "stored", "run": c.output,
                                    "speculative_config": s.speculative_config, "steps": s.steps,
                                    "samples": s.samples, "tokens": s.tokens, "epochs": o.epochs,
                                    "checkpoints": storage.join(self.storage_path, self.ray_name),
                                    "loss": done.get("history", []), "options": dataclasses.asdict(o)})
        epochs_done = len(units) if last is not None else sum(u.done for u in units)  # fit ends only when all are
        return s, {"draft": draft, "format": o.format, "epochs_done": epochs_done, "steps": s.steps,
                   "samples": s.samples, "tokens": s.tokens, "last_loss": s.last_loss}

    def report(self, s: TrainSummary, fence) -> None:
        print(f"train: {s.steps:,} steps, {s.samples:,} samples, {s.tokens:,} tokens"
              + (f" ({s.samples_per_s:,.1f} samples/s, {s.tokens_per_s:,.0f} tokens/s)" if s.samples_per_s else "")
              + (f", loss {s.first_loss:.3f} → {s.last_loss:.3f}" if s.last_loss is not None else "")
              + f"\ntrain: the draft vLLM serves: {s.draft}\n"
              f"  vllm serve {self.config.model} --speculative-config '{_json(s.speculative_config)}'\n"
              f"train: manifest {s.report}", flush=True)


def read_summary(path: str) -> dict:
    done = read_checkpoint(path)
    history = done["state"].get("history", [])
    return {**done["state"], "samples_trained": len(done["consumed"]), "duplicates": len(done["duplicates"]),
            "first_loss": history[0]["loss"] if history else None,
            "last_loss": history[-1]["loss"] if history else None}


def default_speculative_tokens(fmt: str) -> int:
    """vLLM's draft length when the user names none: 3 for EAGLE-3 (the target's MTP head is compared at 3), DFlash's
    block less its anchor otherwise."""
    return 3 if fmt == "eagle3" else 7


def _json(obj) -> str:
    import json

    return json.dumps(obj, separators=(",", ": "))


def run_train(config: RunConfig, options: TrainOptions, *, take_lock: bool = False) -> TrainSummary:
    """Train the draft `options.name` on the run `config.output` (see the module docstring)."""
    return run_stage(TrainStage(config, options), take_lock=take_lock)


# ---------------------------------------------------------------------------------------------------------------
# Ray Train
# ---------------------------------------------------------------------------------------------------------------


def check_layout(config: RunConfig, options: TrainOptions) -> RunConfig:
    """The config the layout runs with on this cluster (`plan_layout`)."""
    import ray  # heavy: imported on use

    res = ray.cluster_resources()
    extractors = plan_layout(res.get("GPU", 0), res.get("CPU", 0), options, config.hidden_states)
    if extractors is None:
        return config
    return dataclasses.replace(config, hidden_states=dataclasses.replace(config.hidden_states, num_workers=extractors))


def plan_layout(gpus: float, cpus: float, options: TrainOptions, hs) -> int | None:
    """The extractors a --stream training runs beside its workers on a cluster of `gpus` and `cpus` (None: no
    stream, or no GPU), or a refusal with the reason for a layout Ray cannot schedule (it would wait for ever without
    a word). By default the extractors take the GPUs the training workers leave (hidden_states.num_workers: that
    many instead), each `hidden_states.gpus_per_worker` of one."""
    o = options
    want, extractors = o.num_workers * o.gpus_per_worker, None
    if o.stream and gpus:
        extractors = hs.num_workers or int((gpus - want + 1e-9) // hs.gpus_per_worker)
        if extractors < 1:
            raise ConfigError(f"train --stream: {o.num_workers} training worker(s) × {o.gpus_per_worker:g} GPU leave "
                              f"no GPU of this cluster's {gpus:g} to extract on. Share one (--gpus-per-worker 0.4 "
                              "with hidden_states.gpus_per_worker 0.6), or train on fewer")
        want += extractors * hs.gpus_per_worker
        if want > gpus + 1e-9:
            raise ConfigError(
                f"train --stream: {o.num_workers} training worker(s) × {o.gpus_per_worker:g} GPU beside {extractors} "
                f"extractor(s) × {hs.gpus_per_worker:g} GPU need {want:g} GPUs; this cluster has {gpus:g}. Share a "
                "GPU (--gpus-per-worker 0.4 with hidden_states.gpus_per_worker 0.6), or train on fewer")
    elif want > gpus + 1e-9:
        raise ConfigError(f"train: {o.num_workers} worker(s) × {o.gpus_per_worker:g} GPU need {want:g} GPUs; this "
                          f"cluster has {gpus:g}")
    reader = 1.25 if o.stream else 0.25  # the extractor and the mapping, or the parts' reader
    if o.num_workers * o.cpus_per_worker + reader > cpus + 1e-9:
        raise ConfigError(
            f"train: {o.num_workers} training worker(s) × {o.cpus_per_worker:g} CPU leave the samples' "
            f"{'extractor' if o.stream else 'reader'} less than the {reader:g} CPU it needs on this {cpus:g}-CPU "
            f"Ray: lower --cpus-per-worker (e.g. {max(0.05, (cpus - reader) / o.num_workers):.2g}) or --num-workers")
    return extractors


def fit(config: RunConfig, options: TrainOptions, storage_path: str, ray_name: str, previous: str | None, fence):
    """Ray Train's TorchTrainer over the run's samples; returns its Result."""
    from ray.train import CheckpointConfig, FailureConfig, ScalingConfig
    from ray.train import RunConfig as TrainRunConfig
    from ray.train.torch import TorchTrainer

    from job.train.loop import train_loop_per_worker

    o = options
    config = check_layout(config, o)
    skip = frozenset()
    if previous and o.epochs == 1:  # what the last checkpoint covers is not read (or extracted) again
        done = read_checkpoint(previous)
        skip = frozenset() if done["state"].get("epoch_done") else frozenset(done["consumed"])
        print(f"train: resuming {o.name} from {previous}: {len(skip):,} samples of epoch "
              f"{done['state'].get('epoch')} already trained, left out", flush=True)
    dataset, plan = data.samples(config, streamed=o.stream, to=o.to, format=o.format, layers=o.layers,
                                 skip_ids=skip, holdout=o.holdout)
    draft_config = draft_config_of(config, o, plan)
    token_freq = draft_vocabulary(config, o, draft_config)
    loop_config = {"draft_config": draft_config, "format": o.format, "model": config.model, "epochs": o.epochs,
                   "token_freq": token_freq,
                   "max_steps": o.max_steps, "checkpoint_every": o.checkpoint_every,
                   "workdir": os.path.join(tempfile.gettempdir(), f"train-{o.name}"),
                   "overrides": {"lr": o.lr} if o.lr is not None else {},
                   "served": {"uri": served_draft_uri(config.output, o.name), "fence": fence,
                              "speculative_tokens": o.speculative_tokens or default_speculative_tokens(o.format)}}
    resources = {"CPU": o.cpus_per_worker, **({"GPU": o.gpus_per_worker} if o.gpus_per_worker else {})}
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=o.num_workers, use_gpu=o.gpus_per_worker > 0,
                                     resources_per_worker=resources),
        datasets={"train": dataset}, dataset_config=data.exactly_once_data_config(o.object_store_bytes),
        run_config=TrainRunConfig(name=ray_name, storage_path=storage_path,
                                  failure_config=FailureConfig(max_failures=o.max_failures),
                                  # The last two: the one a rerun resumes from, and the one being written.
                                  checkpoint_config=CheckpointConfig(num_to_keep=2),
                                  worker_runtime_env={"env_vars": o.worker_env} if o.worker_env else None))
    return trainer.fit()


def draft_config_of(config: RunConfig, options: TrainOptions, plan=None) -> dict:
    """speculators' draft-model config for this run and format (the one `fit` trains; `worth` builds its untrained
    baseline from it)."""
    from job.export.manifest import manifest_fields
    from job.trainers import speculators

    o = options
    plan = plan or data.draft_plan(config, streamed=o.stream, to=o.to, format=o.format, layers=o.layers)
    fields = manifest_fields(plan, config.hidden_states.compute_dtype)
    draft = speculators.draft_config({"to": o.to, "format": o.format, **fields})
    if o.draft_vocab is not None:
        target_vocab = draft["derived"]["target_vocab_size"]
        if o.draft_vocab > target_vocab:
            raise ConfigError(f"train: --draft-vocab {o.draft_vocab:,} is more than the target's vocabulary "
                              f"({target_vocab:,} ids)")
        draft["draft_vocab_size"] = o.draft_vocab
    return draft


def draft_vocabulary(config: RunConfig, options: TrainOptions, draft_config: dict) -> dict[int, int] | None:
    """The run's token counts the draft's vocabulary is picked from (train/vocab.py), or None where the draft keeps
    the target's whole vocabulary. What `fit` trains with and `worth`'s untrained draft is built with."""
    if not vocab.needs_mapping(draft_config):
        return None
    target_vocab = draft_config["derived"]["target_vocab_size"]
    freq = vocab.token_frequencies(config.output, config.storage, target_vocab,
                                   keep_flagged=config.hidden_states.keep_flagged, holdout=options.holdout)
    print(f"train: the draft predicts the {draft_config['draft_vocab_size']:,} ids the run's completions use most "
          f"(of the target's {target_vocab:,}; {sum(freq.values()):,} tokens counted, {len(freq):,} distinct)",
          flush=True)
    return freq


def run_config_of(run: str, storage_config, config_path: str | None = None, **overrides) -> RunConfig:
    """The config a training of `run` uses: `config_path` when given, else the run's own (run.json), with the run as
    its output and `overrides` (model, limit)."""
    from job.config import from_dict, load_config

    if config_path:
        return load_config(config_path, output=run, **{k: v for k, v in overrides.items() if v is not None})
    record = run_record.read(run, storage_config)
    if record is None or not record.config:
        raise ConfigError(f"train: {run} is not a run directory (no run.json with its config): pass the run's "
                          "--output, or --config")
    config = from_dict(record.config)
    given = {k: v for k, v in dataclasses.asdict(storage_config).items() if v is not None}
    config = dataclasses.replace(config, output=run, storage=dataclasses.replace(config.storage, **given),
                                 **{k: v for k, v in overrides.items() if v is not None})
    target.shape(config.model)  # the model must be readable here: its config gives the draft's shape
    return config
