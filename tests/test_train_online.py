"""Training online (job/train_online.py): stage 2's stream into a 2-worker Ray Train TorchTrainer running speculators'
draft model and loss, a training worker killed mid-epoch, every sample trained exactly once; and the stream's
features against the stored ones, bit for bit."""

from __future__ import annotations

import json
import math
import os
import shutil

import pyarrow as pa
import pytest
import torch
from conftest import DEMO_CONFIG, REPO

from job.config import load_config
from job.export.files import export
from job.hidden_states import collate, dataset, load
from job.train_online import OnlineOptions, read_checkpoint, train_online

FAULTS = str(REPO / "tests" / "fault_injection")


def _kept_ids(shared_run, tmp_path) -> set[str]:
    """The ids speculators trains on, from the files path: the stored run exported (its mapping drops samples
    without a loss-mask token, as the stream's does)."""
    out = tmp_path / "export"
    export(shared_run.full, to="speculators", format="eagle3", output=str(out))
    return {json.loads(line)["id"] for line in open(out / "samples.jsonl")}


# Slow tier: Ray Train's controller and 2 workers start twice (the kill restarts the group), and stage 2's actors
# start twice with them (the restarted epoch runs the dataset again): ~150 s on 2 cores.
@pytest.mark.slow
@pytest.mark.alone  # a Ray Train worker group beside stage 2's actors: the heaviest Ray work of the suite
def test_stage_2_trains_a_drafter_online_exactly_once_through_a_killed_worker(shared_run, tmp_path, local_ray):
    run = str(shutil.copytree(shared_run.stage1, tmp_path / "run"))
    config = load_config(DEMO_CONFIG, model=shared_run.model, output=run,
                         **{"hidden_states.check_samples": 0})  # the self-check has tests of its own
    marker = tmp_path / "rank1-killed"
    options = OnlineOptions(
        storage_path=str(tmp_path / "train"), name="killed", num_workers=2,
        cpus_per_worker=0.25,  # the session Ray has 2 CPUs: 1 extractor + 0.25 mapping + 2 × 0.25 training
        checkpoint_every=2, max_failures=1, object_store_bytes=256 * 1024**2,
        worker_env={"PYTHONPATH": os.pathsep.join(filter(None, [FAULTS, str(REPO), os.environ.get("PYTHONPATH")])),
                    "DATAGEN_TEST_KILL_TRAIN_RANK": f"1:{marker}"})  # SIGKILL after its first checkpoint

    result = train_online(config, options)

    assert result.error is None, result.error
    assert marker.exists()  # rank 1 was killed once...
    final = read_checkpoint(result.checkpoint.path)
    assert final["state"]["resumed_from_step"] == 2  # ...and the group restarted from the step-2 checkpoint
    assert final["state"]["epoch_done"]
    # Every kept sample trained into the final weights exactly once: none twice (a rank's ids or the restart's
    # re-fed ones), none missing (the split drops none), across both ranks' files.
    assert final["duplicates"] == []
    assert final["consumed"] == _kept_ids(shared_run, tmp_path)
    per_rank = [json.load(open(os.path.join(result.checkpoint.path, f"consumed-rank{r}.json")))["ids"] for r in (0, 1)]
    assert all(per_rank), "both workers trained"
    losses = [h["loss"] for h in final["state"]["history"]]
    assert len(losses) >= 4 and all(math.isfinite(v) and v > 0 for v in losses), losses
    assert sum(losses[-2:]) < sum(losses[:2]), losses  # falling: the last two steps below the first two


def test_streamed_features_equal_the_stored_ones_bit_for_bit(shared_run, tmp_path, local_ray):
    """Same completions, same units and batches, same backend: the stream gives the bytes stage 2 stored. With
    `skip_ids` (a resumed online training: job/train_online.py) the skipped samples are left out before extraction;
    here they are a whole completion shard's, so every other shard's batches, and bytes, stay the same."""
    run = str(shutil.copytree(shared_run.stage1, tmp_path / "run"))
    config = load_config(DEMO_CONFIG, model=shared_run.model, output=run, **{"hidden_states.check_samples": 0})
    stored = {r["id"]: r["hidden_states"].clone() for r in load(shared_run.full)}
    first_shard = sorted((tmp_path / "run" / "completions").glob("*.arrow"))[0]
    skipped = {str(i) for i in pa.ipc.open_file(str(first_shard)).read_all().column("id").to_pylist()} & stored.keys()
    assert 0 < len(skipped) < len(stored)
    streamed = {}
    for batch in dataset(config, skip_ids=frozenset(skipped)).iter_torch_batches(batch_size=4, collate_fn=collate):
        streamed.update(zip(batch["id"], batch["hidden_states"]))
    assert streamed.keys() == stored.keys() - skipped
    for sid, features in streamed.items():
        assert features.dtype == stored[sid].dtype == torch.bfloat16
        assert torch.equal(features.view(torch.int16), stored[sid].view(torch.int16)), sid  # bits, NaNs included


def test_a_rerun_resumes_from_the_checkpoint_ray_train_accepted_not_the_newest_folder(tmp_path):
    """A checkpoint folder the ranks were still copying into, or that Ray Train's controller never accepted (not every
    rank had reported, or it died before its next poll), is on disk with rank 0's state in it; Ray restores the one
    its snapshot names. The driver must leave out of the stream only what that one covers, or the samples between
    the two are never trained."""
    from job.train_online import RAY_TRAIN_SNAPSHOT, latest_checkpoint

    run = tmp_path / "killed"
    assert latest_checkpoint(str(tmp_path), "killed") is None  # nothing yet
    for name, ids in [("checkpoint_2026-12-05_07-25-40.221000", ["a", "b"]),
                      ("checkpoint_2026-12-05_07-26-45.267000", ["a", "b", "c", "d"])]:
        (run / name).mkdir(parents=True)
        (run / name / "state.json").write_text(json.dumps({"epoch": 0, "global_step": len(ids), "epoch_done": False}))
        (run / name / "consumed-rank0.json").write_text(json.dumps({"epoch": 0, "ids": ids}))
    assert latest_checkpoint(str(tmp_path), "killed") is None  # folders without Ray's snapshot: none accepted
    # Ray Train 2.60's snapshot (the fields it reads back: checkpoint_manager.py _load_state), naming the older one.
    (run / RAY_TRAIN_SNAPSHOT).write_text(json.dumps({
        "ray_version": "2.60.0", "checkpoint_results": [], "checkpoint_report_indices": [],
        "latest_checkpoint_result": {"version": 0, "checkpoint_dir_name": "checkpoint_2026-12-05_07-25-40.221000",
                                     "metrics": {"epoch": 0, "global_step": 2}}}))
    chosen = latest_checkpoint(str(tmp_path), "killed")
    assert chosen == str(run / "checkpoint_2026-12-05_07-25-40.221000")
    assert read_checkpoint(chosen)["consumed"] == {"a", "b"}
    assert latest_checkpoint("s3://bucket/train", "killed") is None  # s3: the workers skip, not the driver
