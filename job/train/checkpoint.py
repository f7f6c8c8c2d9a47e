"""What a training checkpoint holds and which one a rerun resumes from.

Every checkpoint holds the weights (rank 0's `drafter.pt`: model and optimizer states), the state (`state.json`:
epoch, global step, the loss history) and each rank's ids trained into those weights (`consumed-rank<r>.json`; Ray
Train writes every rank's files into one checkpoint directory). Exactly once per epoch: after a worker failure Ray
Train restarts the group from the last checkpoint and runs the dataset again from its start; the workers skip the
ids the checkpoint covers; samples trained after it are trained again (the weights were rolled back to before
them). A new driver run reads the last checkpoint first and leaves its ids out before they are read or extracted.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

CONSUMED = "consumed-rank{rank}.json"
DRAFTER = "drafter.pt"
STATE = "state.json"
# Ray Train v2's record of the checkpoints its controller accepted (every rank reported), in the run's folder
# (ray/train/v2/_internal/constants.py CHECKPOINT_MANAGER_SNAPSHOT_FILENAME).
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"


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


def latest_checkpoint(storage_path: str, name: str) -> str | None:
    """The checkpoint a rerun of `name` resumes from: the one Ray Train's snapshot names as the latest, which is the
    one it hands the workers (`ray.train.get_checkpoint`), else None. Not the newest `checkpoint_*` folder: the ranks
    copy their files into it one by one, and the controller accepts it only once every rank has reported (it polls
    every 2 s), so a folder can exist, even with rank 0's state in it, that Ray will not restore; leaving its ids out
    would leave samples untrained. A local (or shared-filesystem) storage path only: with s3:// the rerun reads
    everything again and the workers skip what the restored checkpoint covers."""
    if "://" in storage_path:
        return None
    snapshot = os.path.join(storage_path, name, RAY_TRAIN_SNAPSHOT)
    if not os.path.exists(snapshot):
        return None
    latest = (_read_json(snapshot).get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    return os.path.join(storage_path, name, latest) if latest else None


def report(metrics: dict, step, rank: int, state: dict, ids: list[str]):
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


def summary(result) -> dict:
    """What the last checkpoint of a Ray Train Result says: samples trained, duplicates, the state, the loss of its
    first and last steps."""
    out = {"error": repr(result.error) if result.error else None,
           "checkpoint": result.checkpoint.path if result.checkpoint else None}
    if result.checkpoint:
        with result.checkpoint.as_directory() as d:
            done = read_checkpoint(d)
        history = done["state"].pop("history", [])
        out.update(samples_trained=len(done["consumed"]), duplicates=len(done["duplicates"]), **done["state"])
        out["history"] = history
        if history:
            out.update(first_loss=history[0]["loss"], last_loss=history[-1]["loss"])
    return out
