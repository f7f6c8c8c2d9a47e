"""Training a drafter on a run: `python -m job train RUN --format eagle3|dflash`, speculators' draft model and loss
in Ray Train workers (GPUs on a cluster), its result a directory vLLM serves.

    python -m job train demo-run --format eagle3                   # the stored hidden states, read where they are
    python -m job train demo-run --format eagle3 --stream          # stage 2's stream instead, nothing stored

Modules, in the order a sample meets them:
    options.py      the options, checked before anything starts (layouts that cannot be scheduled refused)
    data.py         the samples: the run's stored hidden-state parts read directly (no export copy), or stage 2's
                    stream; both mapped to the trainer's layout (export/trainer_format.py) and split between the
                    workers exactly once per epoch
    step.py         speculators' draft model and loss, stepped on packed samples in step with the other ranks (the
                    Qwen3.5/3.6 norm fix: trainers/speculators_train.py `build_model`)
    loop.py         each Ray Train worker's loop: epochs, checkpoints (weights + the ids trained), resume
    checkpoint.py   what a checkpoint holds, which one a rerun resumes from
    draft.py        the served draft (speculators' config + weights, as its own checkpointer writes them) and the
                    manifest, under RUN/drafts/<name>/
    run.py          the stage as job/stage.py's runner takes it
"""

from job.train.options import TrainOptions

__all__ = ["TrainOptions"]  # run_train: job/train/run.py (it imports Ray Train's side of the job)
