"""Streaming: the same mapping as a ray.data transform over job.hidden_states.dataset(...), never written."""

from __future__ import annotations


import numpy as np

from job import schema, target
from job.export.norm import with_final_norm
from job.export.samples import Plan, drop_reason, make_plan, trainer_sample


# ---------------------------------------------------------------------------------------------------------------
# Streaming: the same mapping as a ray.data transform over job.hidden_states.dataset(...)
# ---------------------------------------------------------------------------------------------------------------


class TrainerLayout:
    """`map_batches` callable: batches of `job.hidden_states.dataset(config)` → batches in the trainer's layout, one
    row per kept sample: `id` plus the keys of the trainer's file (SpecForge's .ckpt dict, or speculators'
    safetensors keys plus `loss_mask`). bfloat16 travels as its uint16 bits (numpy has no bfloat16); `collate`
    views them as torch.bfloat16 again. Samples the trainer cannot use are left out (see `drop_reason`)."""

    def __init__(self, plan: Plan, dtype: str):
        self.plan, self.dtype = plan, dtype

    def __call__(self, batch: dict) -> dict:
        import torch

        from job.hidden_states.shards import _torch_dtype

        out: dict[str, list] = {}
        for i, sid in enumerate(batch[schema.ID]):
            ids = torch.from_numpy(np.asarray(batch[schema.INPUT_IDS][i]))
            mask = self.plan.loss_mask(ids, torch.from_numpy(np.asarray(batch[schema.LOSS_MASK][i])))
            if drop_reason(mask, self.plan):
                continue
            hidden = torch.from_numpy(np.ascontiguousarray(batch[schema.HIDDEN_STATES][i]))
            if self.dtype == "bfloat16":
                hidden = hidden.view(torch.bfloat16)
            assert hidden.dtype == _torch_dtype(self.dtype)
            sample = trainer_sample(ids, mask, hidden, self.plan)
            if self.plan.to == "speculators":
                sample["loss_mask"] = mask.to(torch.int64)
            out.setdefault(schema.ID, []).append(str(sid))
            for key, t in sample.items():
                out.setdefault(key, []).append((t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy())
        if not out:
            return {schema.ID: np.array([], dtype=object)}
        from job.hidden_states.actor import _ragged

        return {k: np.array(v, dtype=object) if k == schema.ID else _ragged(v) for k, v in out.items()}


def stream(config, *, to: str, format: str, layers: list[int] | None = None, loss_turns: str | None = None):
    """`job.hidden_states.dataset(config)` mapped to a trainer's layout, never written: a `ray.data.Dataset` for an
    online trainer (`ds.iter_torch_batches(batch_size=N, collate_fn=collate)`)."""
    from job.config import resolve_layer_ids
    from job.hidden_states import dataset

    num_layers = target.shape(config.model).num_layers
    hs = config.hidden_states
    plan = with_final_norm(make_plan(to, format, resolve_layer_ids(hs.layer_ids, num_layers), num_layers,
                                     hs.last_layer_before_norm, layers, model=config.model, dtype=hs.dtype,
                                     loss_turns=loss_turns))
    return dataset(config).map_batches(TrainerLayout, fn_constructor_kwargs={"plan": plan, "dtype": hs.dtype},
                                       batch_size=None, concurrency=1)


FEATURE_KEYS = ("hidden_states", "hidden_state", "aux_hidden_state")


def collate(batch: dict) -> dict:
    """`collate_fn` for `stream(...)`: one tensor per sample (features as torch.bfloat16 again), `id` as str."""
    import torch

    out = {}
    for name, column in batch.items():
        if name == schema.ID:
            out[name] = [str(x) for x in column]
            continue
        tensors = [torch.from_numpy(np.ascontiguousarray(x)) for x in column]
        out[name] = [t.view(torch.bfloat16) if t.dtype == torch.uint16 and name in FEATURE_KEYS else t
                     for t in tensors]
    return out
