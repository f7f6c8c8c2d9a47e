"""The samples a drafter trains on, as a ray.data.Dataset in the trainer's layout, split between the training workers
exactly once per epoch.

- Stored (the default): the run's done hidden-state parts (scan.done_hidden_state_parts, the one rule of which
  parts count) read where they are, one Ray task per part: no export copy, no second stage 2. Each part's records
  go through the export's mapping (export/stream.py `TrainerLayout`: the trainer's layers, the target's final norm
  where the trainer wants the last layer after it, the loss mask the trainer uses).
- Stream (`--stream`): stage 2's stream through the same mapping (export/stream.py `stream`), nothing stored.

Ray Train's default split (`streaming_split(n, equal=True)`) drops rows to give every worker the same number
(ray/data/dataset.py: "dropping data if necessary"): samples would silently go untrained each epoch.
`exactly_once_data_config` splits with `equal=False`, so every row is handed out once; workers may then get
different counts, which the step handles (train/step.py: a rank without a batch adds zero gradients).
"""

from __future__ import annotations

import numpy as np

from job import scan, schema, storage
from job.config import ConfigError, RunConfig
from job.export.files import in_sample, run_layout
from job.export.norm import with_final_norm
from job.export.stream import TrainerLayout, stream, trainer_plan
from job.export.trainer_format import Plan, make_plan
from job.hidden_states.actor import ragged
from job.hidden_states.shards import iter_records, record_dtype
from job.pipeline import ensure_ray


def exactly_once_data_config(object_store_bytes: int):
    """Ray Train's DataConfig with the samples split unevenly (every row once) and their object store use bounded."""
    from ray.data import ExecutionOptions, ExecutionResources
    from ray.train import DataConfig

    class ExactlyOnceDataConfig(DataConfig):
        """DataConfig.configure (ray/train/_internal/data_config.py) for our one dataset, with `equal=False`."""

        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            if set(datasets) != {"train"}:
                raise ValueError(f"train streams one dataset, 'train'; got {sorted(datasets)}")
            ds = datasets["train"].copy(datasets["train"])
            ds.context.execution_options = self._resolve_execution_options("train")
            hints = worker_node_ids if self._enable_shard_locality else None
            return [{"train": s} for s in ds.streaming_split(world_size, equal=False, locality_hints=hints)]

    options = ExecutionOptions(resource_limits=ExecutionResources(object_store_memory=object_store_bytes))
    return ExactlyOnceDataConfig(datasets_to_split=["train"], execution_options=options)


def stored_parts(run: str, storage_config) -> list[str]:
    parts = [uri for uri, _ in scan.done_hidden_state_parts(run, storage_config)]  # stage 2's "done" rule
    if not parts:
        raise ConfigError(f"train: no hidden-state parts under {run}: run stage 2 first (`python -m job "
                          "hidden-states ...`), or train on its stream (--stream)")
    return parts


def stored_plan(parts: list[str], storage_config, *, to: str, format: str, layers: list[int] | None,
                model: str) -> tuple[Plan, str]:
    """(the mapping of the stored parts to the trainer's layout, final norm loaded where needed; the dtype the
    records are read in), from the parts' own metadata."""
    layer_ids, num_layers, before_norm, _, stored_dtype = run_layout(parts, storage_config)
    dtype = record_dtype(stored_dtype)  # FP8 parts are read back as bfloat16
    plan = make_plan(to, format, layer_ids, num_layers, before_norm, layers, model=model, dtype=dtype)
    return with_final_norm(plan), dtype


class StoredParts:
    """`map_batches` callable: one stored hidden-state part per call (its URI) → its samples in the trainer's layout
    (`TrainerLayout`, the export's mapping), less `skip_ids` (a resumed epoch's trained ones) and the ids
    `holdout` holds out (`in_sample`: those `python -m job worth` serves on)."""

    def __init__(self, plan: Plan, dtype: str, storage_config, skip_ids: frozenset[str] = frozenset(),
                 holdout: float | None = None):
        self.layout, self.storage_config, self.skip_ids = TrainerLayout(plan, dtype), storage_config, skip_ids
        self.holdout = holdout

    def __call__(self, batch: dict) -> dict:
        import torch  # heavy: imported on use

        ids, input_ids, loss_mask, hidden = [], [], [], []
        for uri in batch["uri"]:
            table = storage.read_shard(str(uri), self.storage_config, memory_map=not storage.is_s3(str(uri)))
            for rec in iter_records(table):
                if rec[schema.ID] in self.skip_ids or (self.holdout and in_sample(rec[schema.ID], self.holdout)):
                    continue
                h = rec[schema.HIDDEN_STATES]
                ids.append(rec[schema.ID])
                input_ids.append(rec[schema.INPUT_IDS].numpy())
                loss_mask.append(rec[schema.LOSS_MASK].numpy())
                hidden.append((h.view(torch.uint16) if h.dtype == torch.bfloat16 else h).numpy())
        if not ids:
            return {schema.ID: np.array([], dtype=object)}
        return self.layout({schema.ID: np.array(ids, dtype=object), schema.INPUT_IDS: ragged(input_ids),
                            schema.LOSS_MASK: ragged(loss_mask), schema.HIDDEN_STATES: ragged(hidden)})


def stored(config: RunConfig, *, to: str, format: str, layers: list[int] | None = None,
           skip_ids: frozenset[str] = frozenset(), holdout: float | None = None):
    """(the run's stored hidden states in the trainer's layout as a ray.data.Dataset, one task per part (a quarter
    CPU each: light reads and slices); the mapping's plan)."""
    import ray  # heavy: imported on use

    ensure_ray(config)  # the trainer's Ray lives on with its dataset: no session ends it here
    parts = stored_parts(config.output, config.storage)
    plan, dtype = stored_plan(parts, config.storage, to=to, format=format, layers=layers, model=config.model)
    ds = ray.data.from_items([{"uri": u} for u in parts], override_num_blocks=len(parts))
    return ds.map_batches(StoredParts, fn_constructor_kwargs={"plan": plan, "dtype": dtype,
                                                              "storage_config": config.storage,
                                                              "skip_ids": frozenset(skip_ids),
                                                              "holdout": holdout},
                          batch_size=1, compute=ray.data.ActorPoolStrategy(min_size=1, max_size=4), num_cpus=0.25), plan


def samples(config: RunConfig, *, streamed: bool, to: str, format: str, layers: list[int] | None = None,
            skip_ids: frozenset[str] = frozenset(), holdout: float | None = None):
    """(the samples of `config.output`'s run, stored or (`streamed`) stage 2's stream; the mapping's plan)."""
    if streamed:  # TrainOptions refuses a holdout here
        plan = trainer_plan(config, to=to, format=format, layers=layers)
        return stream(config, to=to, format=format, layers=layers, skip_ids=skip_ids), plan
    return stored(config, to=to, format=format, layers=layers, skip_ids=skip_ids, holdout=holdout)


def draft_plan(config: RunConfig, *, streamed: bool, to: str, format: str, layers: list[int] | None = None) -> Plan:
    """The mapping `samples` would use, without building the dataset (what the draft's config is made from)."""
    if streamed:
        return trainer_plan(config, to=to, format=format, layers=layers)
    parts = stored_parts(config.output, config.storage)
    return stored_plan(parts, config.storage, to=to, format=format, layers=layers, model=config.model)[0]
