"""`python -m job train`'s options, checked before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from job import layout
from job.config import ConfigError

# Ray Data's object store budget for the samples when the user names none: 2 GiB holds ~50 samples of the 27B
# target's 4 layers × 5120 × bf16 at 1,000 tokens (40 KB a token, 41 MB a sample), ~16 of Ray Data's 128 MiB
# blocks: enough to keep the trainers fed, small beside a GPU node's object store (30 % of its RAM by default).
DEFAULT_OBJECT_STORE_BYTES = 2 * 1024**3


@dataclass(kw_only=True)
class TrainOptions:
    format: str = "eagle3"
    """eagle3 or dflash: speculators' draft model and loss."""
    name: str | None = None
    """The draft's name: RUN/drafts/<name>/ (default: the format). A rerun with the same name resumes."""
    stream: bool = False
    """Train on stage 2's stream (nothing stored) instead of the run's stored hidden states."""
    to: str = "speculators"
    layers: list[int] | None = None
    """Aux / context layers in our ids (default: the trainer's own for this target, job/drafters.py)."""
    num_workers: int = 1
    cpus_per_worker: float = 1.0
    """CPUs each training worker holds. They must leave CPUs to Ray Data: on a 2-CPU Ray, 2 workers at 1 CPU each
    starve the samples' tasks and nothing ever runs; 0.5 works."""
    gpus_per_worker: float = 0.0
    """GPUs each training worker holds (0: CPU training). With --stream on one GPU, a fraction shares it with the
    extractor (hidden_states.gpus_per_worker the rest)."""
    object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES
    """Ray Data's object store limit for the samples: past it their reading (or extraction) is held back."""
    checkpoint_every: int = 10
    """Optimizer steps between checkpoints: what a worker failure costs at most, in steps trained again."""
    max_failures: int = 1
    """Worker-group restarts Ray Train allows (-1: forever)."""
    epochs: int = 1
    max_steps: int | None = None
    """Stop after this many optimizer steps in all (None: every epoch whole): a short draft, such as `worth`'s on a
    large run. The samples the steps trained are recorded as trained; a rerun trains nothing more."""
    draft_vocab: int | None = None
    """The draft's output vocabulary: the N ids the run's completions use most (train/vocab.py). None: speculators'
    32,000, or the target's whole vocabulary where it is smaller."""
    lr: float | None = None
    """speculators' default when None."""
    speculative_tokens: int | None = None
    """The served draft's draft length (default: speculators' for the format)."""
    checkpoints: str | None = None
    """Where Ray Train keeps checkpoints (default RUN/drafts/<name>/checkpoints; a shared path or s3:// on a
    cluster)."""
    holdout: float | None = None
    """The fraction of samples left untrained, by a hash of the id (export's `--sample` rule: the same ids every
    time): `python -m job worth` serves the draft on them. None: every sample trains."""
    worker_env: dict = field(default_factory=dict)
    """Environment variables of the training workers only (Ray Train's worker_runtime_env)."""

    def __post_init__(self):
        self.name = self.name or self.format
        self.check()

    def check(self) -> None:
        if self.to != "speculators":
            raise ConfigError(f"train: --to {self.to!r}: only speculators trains here (SpecForge pins torch 2.11 and "
                              "sglang, which do not fit the job's environment; export the run for its launcher)")
        if self.format not in ("eagle3", "dflash"):
            raise ConfigError(f"train: --format {self.format!r}: speculators trains eagle3 or dflash")
        try:
            layout.draft_dir(self.name)
        except ValueError as e:
            raise ConfigError(f"train: --name: {e}") from None
        for name in ("num_workers", "checkpoint_every", "epochs", "object_store_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train: {name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"train: --steps must be at least 1, got {self.max_steps}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ConfigError(f"train: --draft-vocab must be at least 1, got {self.draft_vocab}")
        if self.holdout is not None and not 0 < self.holdout < 1:
            raise ConfigError(f"train: --holdout {self.holdout}: a fraction between 0 and 1")
        if self.holdout is not None and self.stream:
            raise ConfigError("train: --holdout trains on the stored hidden states: run stage 2 first, without "
                              "--stream")
        if self.cpus_per_worker <= 0 and self.gpus_per_worker <= 0:
            raise ConfigError("train: a training worker needs a CPU or a GPU share (--cpus-per-worker > 0)")
        if self.gpus_per_worker > 1 and self.gpus_per_worker != int(self.gpus_per_worker):
            raise ConfigError(f"train: --gpus-per-worker {self.gpus_per_worker}: a fraction of one GPU, or whole GPUs")
