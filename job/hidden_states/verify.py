"""`python -m job hidden-states --check`: a finished run's stored features against a plain transformers forward of
each sample alone, on a GPU worker when the cluster has one (the driver of a cluster job usually has none)."""

from __future__ import annotations

import os

from job import pipeline, scan, schema, storage
from job.config import ConfigError, RunConfig, from_dict, to_dict
from job.hidden_states.checks import compare, reference_features, tolerance_for, verdict
from job.hidden_states.plan import out_dir
from job.hidden_states.samples import Sample
from job.hidden_states.shards import iter_records, record_dtype
from job.hidden_states.transformers_backend import load_model


def check_run(config: RunConfig, num_samples: int = 8) -> dict:
    """Up to `num_samples` stored samples, one from each of as many shards spread over the run, against a plain
    transformers forward of each alone. Raises HiddenStateCheckError (naming layer and sample) beyond the tolerance,
    else returns the summary."""
    import ray  # heavy: imported on use

    uris = [uri for uri, _ in scan.done_hidden_state_parts(config.output, config.storage)]  # the one done rule
    if not uris:
        raise ConfigError(f"no hidden-state shards under {out_dir(config)}: nothing to check")
    step = max(1, len(uris) // num_samples)
    chosen = uris[::step][:num_samples]
    with pipeline.RaySession(config).start():
        gpus = 1 if ray.cluster_resources().get("GPU", 0) else 0
        task = ray.remote(num_gpus=gpus, num_cpus=1, max_retries=0)(check_stored)
        task = task.options(runtime_env=pipeline.runtime_env(config))
        with pipeline.job_errors_surface():
            return ray.get(task.remote(to_dict(config), chosen))


def check_stored(config_dict: dict, uris: list[str]) -> dict:
    """The first sample of each shard in `uris`: stored features against a plain forward of the sample alone."""
    import torch  # heavy: imported on use

    pipeline.apply_secrets(config_dict)  # as the actors do
    config = from_dict(config_dict)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    samples, stored, layer_ids, dtype, before_norm = [], [], None, None, False
    for uri in uris:
        table = storage.read_shard(uri, config.storage)
        meta = scan.hidden_state_meta(table.schema.metadata)
        layer_ids, dtype, before_norm = meta.layer_ids, meta.dtype, meta.last_before_norm
        record = next(iter_records(table.slice(0, 1)))
        samples.append(Sample(id=record[schema.ID], input_ids=record[schema.INPUT_IDS].numpy(), num_prompt_tokens=0,
                              original_num_tokens=len(record[schema.INPUT_IDS]), row=len(samples)))
        stored.append(record[schema.HIDDEN_STATES].clone())
    model = load_model(config.model, dtype=record_dtype(dtype))  # FP8 shards were computed in bfloat16
    reference = reference_features(model, samples, layer_ids, before_norm)
    tolerance = tolerance_for(dtype, config.hidden_states.check_tolerance)
    summary = verdict(compare(samples, stored, reference, layer_ids), tolerance,
                      f"stored shards of {config.output}")
    return {**summary, "shards": uris}
