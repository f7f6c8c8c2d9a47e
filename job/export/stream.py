"""Streaming: the same mapping as a ray.data transform over job.hidden_states.dataset(...), never written."""

from __future__ import annotations

import numpy as np

from job import schema, target
from job.config import resolve_layer_ids
from job.export.norm import with_final_norm
from job.export.trainer_format import Plan, drop_reason, make_plan, trainer_sample
from job.hidden_states import dataset
from job.hidden_states.actor import ragged
from job.target_weights import torch_dtype

# ---------------------------------------------------------------------------------------------------------------
# Streaming: the same mapping as a ray.data transform over job.hidden_states.dataset(...)
# ---------------------------------------------------------------------------------------------------------------


class TrainerLayout:
    """`map_batches` callable: batches of `job.hidden_states.dataset(config)` → batches in the trainer's layout, one
    row per kept sample: `id` plus the keys of the trainer's file (SpecForge's .ckpt dict, or speculators'
    safetensors keys plus `loss_mask`). bfloat16 travels as its uint16 bits (numpy has no bfloat16);
    `collate` (job.hidden_states.collate) views them as torch.bfloat16 again. Samples the trainer cannot use are left
    out (see `drop_reason`)."""

    def __init__(self, plan: Plan, dtype: str):
        self.plan, self.dtype = plan, dtype

    def __call__(self, batch: dict) -> dict:
        import torch  # heavy: imported on use

        out: dict[str, list] = {}
        for i, sid in enumerate(batch[schema.ID]):
            ids = torch.from_numpy(np.asarray(batch[schema.INPUT_IDS][i]))
            mask = self.plan.loss_mask(ids, torch.from_numpy(np.asarray(batch[schema.LOSS_MASK][i])))
            if drop_reason(mask, self.plan):
                continue
            hidden = torch.from_numpy(np.ascontiguousarray(batch[schema.HIDDEN_STATES][i]))
            if self.dtype == "bfloat16":
                hidden = hidden.view(torch.bfloat16)
            assert hidden.dtype == torch_dtype(self.dtype)
            sample = trainer_sample(ids, mask, hidden, self.plan)
            if self.plan.to == "speculators":
                sample["loss_mask"] = mask.to(torch.int64)
            out.setdefault(schema.ID, []).append(str(sid))
            for key, t in sample.items():
                out.setdefault(key, []).append((t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy())
        if not out:
            return {schema.ID: np.array([], dtype=object)}

        return {k: np.array(v, dtype=object) if k == schema.ID else ragged(v) for k, v in out.items()}


def trainer_plan(config, *, to: str, format: str, layers: list[int] | None = None,
                 loss_turns: str | None = None) -> Plan:
    """The mapping of this run's features to a trainer's layout (the export's), final norm loaded where needed."""
    num_layers = target.shape(config.model).num_layers
    hs = config.hidden_states
    return with_final_norm(make_plan(to, format, resolve_layer_ids(hs.layer_ids, num_layers), num_layers,
                                     hs.last_layer_before_norm, layers, model=config.model, dtype=hs.compute_dtype,
                                     loss_turns=loss_turns))


def stream(config, *, to: str, format: str, layers: list[int] | None = None, loss_turns: str | None = None,
           skip_ids: frozenset[str] = frozenset()):
    """`job.hidden_states.dataset(config)` mapped to a trainer's layout, never written: a `ray.data.Dataset` for an
    online trainer (`ds.iter_torch_batches(batch_size=N, collate_fn=collate)`). `skip_ids`: samples left out before
    extraction (job/train/: what a resumed training's checkpoint covers)."""

    plan = trainer_plan(config, to=to, format=format, layers=layers, loss_turns=loss_turns)
    return dataset(config, skip_ids).map_batches(
        TrainerLayout, fn_constructor_kwargs={"plan": plan, "dtype": config.hidden_states.compute_dtype},
        # A light map (slices and copies per sample; the final norm when a trainer asks for it): a quarter CPU, so
        # that on a small Ray (the tests' 2 CPUs) the extractor and the training workers still fit beside it.
        batch_size=None, concurrency=1, num_cpus=0.25)
