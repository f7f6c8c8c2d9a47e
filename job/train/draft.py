"""What training leaves in the run directory, under RUN/drafts/<name>/ (job/layout.py), every file through the
stage's fence:

    draft/        the draft as vLLM serves it: speculators' config.json + model.safetensors in bf16, as its own
                  checkpointer writes them (trainers/speculators_train.py `save_draft`), the verifier named by its
                  path. Rewritten at each epoch's end by rank 0:
                      vllm serve TARGET --speculative-config '{"model": "RUN/drafts/NAME/draft",
                                                              "num_speculative_tokens": 3}'
    train.json    its manifest: target, format, layers, the draft's vocabulary size, data (stored or stream,
                  samples and tokens per epoch), steps, the loss curve, the settings, where the checkpoints are
    checkpoints/  Ray Train's (weights + the ids trained), to resume: a rerun of the same name continues from them
"""

from __future__ import annotations

import os

from job import layout, lock, storage


def publish_served_draft(local_dir: str, uri: str, fence: lock.Fence) -> list[str]:
    """Copy the draft directory written on this worker's disk to `uri` (the run's drafts/<name>/draft, local or
    s3://), each file whole, through the fence. The config last: a reader that finds it finds the weights."""
    names = sorted(os.listdir(local_dir), key=lambda n: n == "config.json")
    for name in names:
        with open(os.path.join(local_dir, name), "rb") as f:
            fence.write_bytes(storage.join(uri, name), f.read())
    return names


def served_draft_uri(output: str, name: str) -> str:
    return storage.join(output, layout.draft_dir(name), layout.SERVED_DRAFT_DIR)


def manifest_uri(output: str, name: str) -> str:
    return storage.join(output, layout.draft_dir(name), layout.TRAIN_MANIFEST)


def served_config(draft_uri: str, speculative_tokens: int) -> dict:
    """The `--speculative-config` (vLLM's `speculative_config`) that serves the draft: vLLM reads the method
    (eagle3, dflash) from the draft's own config."""
    return {"model": draft_uri, "num_speculative_tokens": speculative_tokens}
