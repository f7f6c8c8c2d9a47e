"""Each Ray Train worker's loop: speculators' draft trained on its share of the samples (train/data.py), epoch by
epoch, a checkpoint every `checkpoint_every` steps and at each epoch's end (train/checkpoint.py), resumed from the
one Ray Train hands it. At each epoch's end rank 0 also writes the draft vLLM serves (train/draft.py)."""

from __future__ import annotations

import os
import tempfile

from job.train.checkpoint import read_checkpoint, report


def train_loop_per_worker(cfg: dict) -> None:
    """Ray Train's entry point on each worker: the loop below, with an error Ray can carry back. An exception Ray
    cannot pickle (torch.compile's errors hold weakrefs) otherwise reaches the driver only as "cannot pickle
    'weakref.ReferenceType' object", the real error buried in the worker's log."""
    try:
        _train_loop(cfg)
    except Exception as error:
        import pickle
        import traceback

        try:
            pickle.dumps(error)
        except Exception:
            raise RuntimeError("".join(traceback.format_exception(error)).rstrip()) from None
        raise


def _train_loop(cfg: dict) -> None:
    import ray.train  # heavy: imported on use
    import torch  # heavy: imported on use

    from job.hidden_states import collate
    from job.train.draft import publish_served_draft
    from job.train.step import OnlineDraftStep, workdir_for

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # Ray's CPU share; more threads fight the samples' readers for the same cores
    step = OnlineDraftStep(cfg["draft_config"], cfg["format"], cfg["model"], workdir_for(rank, cfg["workdir"]),
                           token_freq=cfg.get("token_freq"), **cfg["overrides"])
    # `history`: the loss of every step the weights went through (steps rolled back by a restart are not in it).
    state = {"epoch": 0, "global_step": 0, "epoch_done": False, "resumed_from_step": None, "history": [],
             "samples": 0, "tokens": 0}
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
    stopped = lambda state: bool(cfg.get("max_steps")) and state["global_step"] >= cfg["max_steps"]  # noqa: E731
    while state["epoch"] < cfg["epochs"]:
        skip = inherited
        mine = sorted(inherited) if rank == 0 else []  # rank 0 carries the checkpoint's ids forward
        rows = ((sid, step.sample(b["token_ids"][i], b["hidden_states"][i], b["loss_mask"][i]))
                for batch in shard.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=1)
                for b in [collate(batch)] for i, sid in enumerate(b["id"]) if sid not in skip)
        carry = []
        state["epoch_done"] = False
        while True:
            if stopped(state):
                break  # --steps: the samples trained so far are the ones recorded as trained, none later
            pack = step.pack(rows, carry)
            metrics = step.step([s for _, s in pack])
            if metrics is None:
                break
            mine += [sid for sid, _ in pack]
            state["global_step"] += 1
            state["samples"] += metrics["samples"]
            state["tokens"] += metrics["tokens"]
            state["history"].append({"step": state["global_step"], "loss": metrics["loss"],
                                     "grad_norm": metrics["grad_norm"], "ranks_with_data": metrics["ranks_with_data"]})
            if state["global_step"] % cfg["checkpoint_every"] == 0:
                report(metrics, step, rank, state, mine)
        state["epoch_done"] = True
        if stopped(state):
            state["epoch"] = cfg["epochs"] - 1  # the last epoch, done: a rerun trains nothing more
        if rank == 0 and cfg.get("served") is not None:  # the draft as vLLM serves it, the weights of this epoch
            with tempfile.TemporaryDirectory() as d:
                step.save_served(os.path.join(d, "draft"), cfg["served"]["speculative_tokens"])
                publish_served_draft(os.path.join(d, "draft"), cfg["served"]["uri"], cfg["served"]["fence"])
        report({}, step, rank, state, mine)
        state["epoch"], inherited = state["epoch"] + 1, set()
