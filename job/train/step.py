"""speculators 0.9's draft model and loss, stepped on samples by the data-parallel workers of job/train/loop.py
(Ray Train): the same TrainConfig resolution, `build_draft_model`, CollateFn (+ EAGLE-3's
`shift_batch`), optimizer and loss as `speculators train` (via speculators_train.py), one packed batch per step.

What differs from speculators' own `Trainer.train_epoch`, and why:
- Samples arrive from a Ray Data stream (the stored parts or stage 2's), not from an indexed file dataset: `pack`
  fills one batch of at most `total_seq_len` tokens in arrival order (speculators' multipack sampler needs every
  length up front). A sample longer than that is trained on its first `total_seq_len` tokens, as speculators'
  collate cuts it.
- Gradients are averaged over the ranks that had a batch this step (`all_reduce`), not through DDP: with every
  sample trained once (job/train/data.py splits the stream unevenly on purpose), one rank can run out of
  samples before the others, and DDP would then wait forever in the others' backward. A rank without a batch adds
  zero gradients and still steps, so every rank keeps the same weights.
- Constant learning rate (speculators' `scheduler_type` none): a schedule needs the epoch's length, which a
  stream does not know in advance.

Imports torch and speculators only: no Ray here (job/train/loop.py does the Ray side).
"""

from __future__ import annotations

import os

from job.trainers.speculators_train import (
    build_model,
    import_speculators,
    resolve_args,
    trainer_config,
)


class OnlineDraftStep:
    """One rank's draft model and optimizer. `step(samples)` trains on one pack, in step with the other ranks."""

    def __init__(self, draft_config: dict, fmt: str, model_dir: str, workdir: str,
                 token_freq: dict[int, int] | None = None, **overrides):
        """`token_freq`: the run's token counts (train/vocab.py), from which speculators picks the draft's
        `draft_vocab_size` ids; None: the target's whole vocabulary."""
        import torch  # heavy: imported on use

        import_speculators()
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import CollateFn
        from speculators.train.optimizers import build_optimizers

        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        if token_freq:
            from job.train.vocab import write_token_frequencies

            os.makedirs(workdir, exist_ok=True)
            overrides["token_freq_path"] = write_token_frequencies(token_freq, os.path.join(workdir, "token_freq.pt"))
        self.args = resolve_args(None, {"format": fmt, "model": model_dir}, draft_config, workdir,
                                 cpu=self.device.type == "cpu", epochs=1, scheduler_type="none", **overrides)
        model_class, model = build_model(self.args)
        self.model = model.to(self.device)
        self.train_kwargs, _ = model_class.get_trainer_kwargs(**vars(self.args))
        self.optimizers = build_optimizers(self.model, trainer_config(self.args, model_class, max_steps=None))
        self.hidden_dtype = getattr(torch, self.args.hidden_states_dtype)
        self.max_tokens = self.args.total_seq_len
        self.collate = CollateFn(self.max_tokens, model.config.transformer_layer_config.hidden_size,
                                 num_target_layers=len(model.target_layer_ids), dtype=self.hidden_dtype,
                                 preprocess={"eagle3": shift_batch}.get(self.args.speculator_type))
        self._broadcast_weights()

    # -- samples -------------------------------------------------------------------------------------------------

    @staticmethod
    def sample(token_ids, hidden_states, loss_mask) -> dict:
        """One streamed row in speculators' layout (token_ids, hidden_states [T, aux + 1, H], loss_mask) → the item
        speculators' ArrowDataset yields (`_get_raw_data` + `BaseDataset.__getitem__`)."""
        import torch  # heavy: imported on use

        n = int(token_ids.shape[0])
        return {"hidden_states": hidden_states[:, :-1].flatten(1), "input_ids": token_ids.to(torch.long),
                "verifier_last_hidden_states": hidden_states[:, -1], "loss_mask": loss_mask,
                "lengths": torch.tensor([n], dtype=torch.long), "position_ids": torch.arange(n, dtype=torch.long)}

    def pack(self, rows, carry: list) -> list:
        """The next pack from the iterator `rows` of (id, sample): samples in arrival order while their tokens fit
        `total_seq_len` (at least one), then cut to as many rows as the smallest pack of the ranks that have one.
        `carry` (a stack) holds the rows left for the next pack.

        Why every rank takes the same number of rows: the stream's split hands each new block to the rank that has
        been handed the fewest rows, into that rank's own queue. A rank that ate rows faster (shorter samples) would
        get no new block until the other caught up, while the other waits for it in the step's all_reduce and its
        unread blocks fill the object-store bound: nothing moves until the collective times out."""
        import torch  # heavy: imported on use
        import torch.distributed as dist  # heavy: imported on use

        pack, tokens = [], 0
        while True:
            row = carry.pop() if carry else next(rows, None)
            if row is None:
                break
            n = int(row[1]["input_ids"].shape[0])
            if pack and tokens + n > self.max_tokens:
                carry.append(row)
                break
            pack.append(row)
            tokens += n
        if dist.is_available() and dist.is_initialized():
            fewest = torch.tensor([len(pack) or 2**62], dtype=torch.int64, device=self.device)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
            keep = int(fewest.item())
            if len(pack) > keep:
                carry.extend(reversed(pack[keep:]))  # popped first, in arrival order, before the row that did not fit
                pack = pack[:keep]
        return pack

    # -- the step ------------------------------------------------------------------------------------------------

    def step(self, samples: list[dict]) -> dict | None:
        """Forward, loss and backward on `samples` (may be empty on this rank), gradients averaged over the ranks
        that had samples, clipping at 1.0 and the optimizer step, as speculators' trainer does. None: no rank had a
        sample (the epoch is over everywhere). `loss`: the mean over the ranks that had a batch."""
        import torch  # heavy: imported on use
        import torch.distributed as dist  # heavy: imported on use

        params = [p for p in self.model.parameters() if p.requires_grad]
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=False)
        loss = None
        if samples:
            batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                     for k, v in self.collate([dict(s) for s in samples]).items()}
            with torch.autocast(self.device.type, dtype=self.hidden_dtype, enabled=self.device.type == "cuda"):
                _, loss, _ = self.model(**batch, **(self.train_kwargs or {}))
            loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # [ranks with a batch, their summed loss, samples, tokens]: one all_reduce tells every rank all four.
        tokens = sum(int(s["input_ids"].shape[0]) for s in samples)
        with_data = torch.tensor([1.0 if samples else 0.0, float(loss.detach()) if samples else 0.0,
                                  float(len(samples)), float(tokens)], device=self.device, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(with_data)
            if with_data[0].item() == 0:
                return None
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= with_data[0].item()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        elif not samples:
            return None
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        for opt in self.optimizers:
            opt.step()
        ranks = int(with_data[0].item())
        return {"loss": with_data[1].item() / ranks, "grad_norm": grad_norm, "ranks_with_data": ranks,
                "samples": int(with_data[2].item()), "tokens": int(with_data[3].item())}

    # -- state ---------------------------------------------------------------------------------------------------

    def _broadcast_weights(self) -> None:
        """Every rank starts from rank 0's weights (they are the same seed's anyway; a checkpoint too)."""
        import torch.distributed as dist  # heavy: imported on use

        if dist.is_available() and dist.is_initialized():
            for t in self.model.state_dict().values():
                dist.broadcast(t, src=0)

    def save_served(self, path: str, speculative_tokens: int | None = None) -> str:
        """The draft as a directory vLLM serves (speculators_train.save_draft: the trainer's own checkpointer's
        format), on this rank's disk."""
        from job.trainers.speculators_train import save_draft

        return save_draft(self.model, self.args, path, speculative_tokens)

    def save(self, path: str) -> None:
        import torch  # heavy: imported on use

        torch.save({"model": self.model.state_dict(), "optimizers": [o.state_dict() for o in self.optimizers]},
                   path)

    def load(self, path: str) -> None:
        import torch  # heavy: imported on use

        state = torch.load(path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(s)


def workdir_for(rank: int, root: str) -> str:
    """Each rank's own scratch directory (speculators writes its data and log directories there)."""
    path = os.path.join(root, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    return path
