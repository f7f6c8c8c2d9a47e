"""Stage 2, declared for job/stage.py's runner: one unit per completion shard (plan.py) → the extractor actors, one
per GPU (actor.py), write each unit's parts → the runner writes its marker (`mark_done`) → the report (report.py).
Also `dataset`: the same extraction as a stream into a trainer, nothing written."""

from __future__ import annotations

import json
import time

from job import layout, scan, storage, target
from job.config import ConfigError, RunConfig, resolve_layer_ids, to_dict
from job.drafters import EVERY_TRAINER
from job.drafters import describe as describe_layers
from job.formatting import format_bytes
from job.hidden_states import plan
from job.hidden_states.actor import HiddenStateExtractor, vllm_unavailable_reason
from job.hidden_states.report import HiddenStatesSummary, ThisRun, write_report
from job.layout import HiddenStateUnit
from job.pipeline import ActorStage, ensure_ray, map_units, runtime_env
from job.stage import Stage, run_stage

STAGE = "hidden_states"


class HiddenStatesStage(Stage):
    key, directory, label, unit_noun = STAGE, layout.HIDDEN_STATES_DIR, "hidden-states", "completion shards"
    tokens_key, drift_consequence = "num_tokens_extracted", "mix features made two ways in one output"

    def identity(self, record) -> dict:
        self.started, self.record = time.monotonic(), record
        shape = target.shape(self.config.model)
        self.num_layers, self.hidden = shape.num_layers, shape.hidden_size
        try:
            self.layer_ids = resolve_layer_ids(self.config.hidden_states.layer_ids, shape.num_layers)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None
        identity = plan.identity(self.config, self.layer_ids, shape.num_layers)
        self.check_model(record, identity["model_files"])
        return identity

    def check_model(self, record, model_files: str | None) -> None:
        """Stage 2 runs the model stage 1 generated with: the same files (`runs.model_files_digest`: config,
        tokenizer, the weights' index), whatever path each names them by. Another model's hidden states under the
        completions would train a draft on features no served target computes (a DFlash draft so made was accepted
        at τ 1.00); refused unless --allow-drift says it is meant (say, an FP8 checkpoint generated, bf16 extracts)."""
        generated = record.generate if record is not None else None
        if generated is None:
            return
        was, now = generated.identity.get("model_files"), model_files
        path = generated.identity.get("model", record.setting("model"))
        if was is not None and now is not None and was != now:
            message = (f"stage 1 generated these completions with {path!r} (files {was}); this config extracts with "
                       f"{self.config.model!r} (files {now}), another model")
            if not self.allow_drift:
                raise ConfigError(f"hidden-states: {message}. Point `model` (or --model) at the model stage 1 ran, "
                                  "or pass --allow-drift to extract with this one on purpose.")
            print(f"note: {message} (--allow-drift)", flush=True)
        elif path not in (None, self.config.model):
            print(f"note: stage 1 ran with model {path!r}; extracting with {self.config.model!r}", flush=True)

    def plan(self, fence, changed) -> list[HiddenStateUnit]:
        c, orphans, seen = self.config, [], []
        units = plan.plan_units(c, orphans=orphans, seen=seen)
        scan.remember_markers(c.output, seen[0], fence)  # the markers read now: the next command reads none
        plan.forget_stale(c, units, orphans, fence)
        if changed:  # allowed drift: every setting in the identity shapes the parts, so all of them are redone
            print(f"hidden states: settings changed ({', '.join(changed)}): --allow-drift redoes every completion "
                  "shard's hidden states with the new settings", flush=True)
            plan.remove_outputs(c, units, fence)
        self.estimate = plan.estimate_storage(c, units)
        print_estimate(c, self.estimate, self.num_layers)
        self.this_run, self.extract_started = ThisRun(), time.monotonic()
        return units

    def is_done(self, unit: HiddenStateUnit) -> bool:
        return unit.done

    def mark_done(self, summary: dict, fence) -> None:  # after its extractor committed every part
        fence.write_json(storage.join(plan.out_dir(self.config), summary["marker_name"]), json.loads(summary["marker"]))

    def recorded(self) -> dict:
        return {"estimate": self.estimate}

    def actors(self, pending, fence, census) -> ActorStage:
        self.extract_started = time.monotonic()
        return extractors(self.config, pending, self.layer_ids, "write", fence, census=census)

    def take(self, summary: dict) -> None:
        self.this_run(summary)

    def finish(self, units, fence) -> tuple[HiddenStatesSummary, dict]:
        c, now = self.config, time.monotonic()
        summary = write_report(c, units, self.layer_ids, self.hidden, self.estimate, self.this_run,
                               now - self.extract_started, now - self.started, fence)
        if any(not u.done for u in units):  # the markers this job wrote, read once now: the next command reads none
            found = scan.judge_completion_shards(c.output, c.storage)
            scan.remember_markers(c.output, scan.stage2_markers(c.output, found.listed, found.checks, c.storage), fence)
        print_closing(summary, units, self.record)
        # Stage 2 follows the completion shards that exist. While stage 1 is unfinished, that is not the run.
        return summary, {"status": "partial" if stage1_unfinished(self.record) else "complete"}


def run_hidden_states(config: RunConfig, *, allow_drift: bool = False, take_lock: bool = False) -> HiddenStatesSummary:
    """Extract the hidden states of every kept completion row into `<output>/hidden_states/*.arrow`. Returns a
    summary (rows, tokens, tokens/s, bytes written, parts, report path); the same goes to reports/hidden_states.json."""
    return run_stage(HiddenStatesStage(config), allow_drift=allow_drift, take_lock=take_lock)


def stage1_unfinished(record) -> bool:
    return record is not None and record.status("generate") not in (None, "complete")


def print_estimate(config: RunConfig, estimate: dict, num_layers: int) -> None:
    hs = config.hidden_states
    print(f"hidden states: {estimate['num_layers']} layers {estimate['layer_ids']} x hidden {estimate['hidden_size']} "
          f"x {hs.dtype} = {format_bytes(estimate['bytes_per_token'])}/token; {estimate['num_tokens']:,} tokens in "
          f"{estimate['num_samples']:,} samples → {format_bytes(estimate['total_bytes'])} in total, "
          f"{format_bytes(estimate['pending_bytes'])} still to write", flush=True)
    if hs.layer_ids == EVERY_TRAINER:
        print(f"hidden states: every trainer's layers: {describe_layers(num_layers)}", flush=True)


def print_closing(summary: HiddenStatesSummary, units: list[HiddenStateUnit], record) -> None:
    if stage1_unfinished(record):
        written, total = sum(u.num_rows for u in units), record.rows_total
        print(f"note: stage 1 is not finished (status: {record.status('generate')}; {written:,} of "
              f"{f'{total:,}' if total is not None else '?'} rows written): the hidden states of those "
              f"{len(units)} committed completion shards are done. Rerun `hidden-states` on this output when stage 1 "
              "has finished: it does only the shards added since.", flush=True)
    print(f"hidden states: {summary.num_samples:,} samples, {summary.num_tokens:,} tokens, "
          f"{len(summary.files)} parts, {format_bytes(summary.bytes)}; this run: "
          f"{summary.num_tokens_extracted:,} tokens at {summary.tokens_per_s:,.0f} tokens/s, padding "
          f"{summary.padding_waste:.1%} → {summary.report}", flush=True)


def extractors(config: RunConfig, units: list[HiddenStateUnit], layer_ids: list[int], mode: str, fence=None,
               skip_ids: frozenset[str] = frozenset(), census=None) -> ActorStage:
    """The extractor actors for `units` (one per GPU, or hidden_states.num_workers), in `mode` write or stream."""
    import ray  # heavy: imported on use

    gpus = int(ray.cluster_resources().get("GPU", 0))
    if config.hidden_states.backend == "vllm" and not gpus:
        raise ConfigError(vllm_unavailable_reason() or "hidden_states.backend 'vllm' needs a GPU in the cluster")
    workers = config.hidden_states.num_workers or max(1, gpus)
    # The exactness self-check of every worker uses samples of the first unit: the run's own data.
    check_source = {"uri": units[0].uri, "row_limit": units[0].row_limit} if units else None
    return ActorStage(
        HiddenStateExtractor,
        {"config": to_dict(config), "layer_ids": layer_ids, "mode": mode, "check_source": check_source,
         "fence": fence, "skip_ids": skip_ids, "census": census.book if census is not None else None},
        min_actors=workers, max_actors=workers, gpus_per_actor=config.hidden_states.gpus_per_worker if gpus else 0,
        max_retries=3,  # a killed actor is replaced and its unit retried; a deterministic crash is not, forever
        runtime_env=runtime_env(config))  # secrets: at construction (actor.py)


def dataset(config: RunConfig, skip_ids: frozenset[str] = frozenset()):
    """A `ray.data.Dataset` of the hidden-state records, computed on the fly and never written, for a trainer:
    `ds.iter_torch_batches(batch_size=N, collate_fn=collate)`. Columns as in the shards; `hidden_states` is a
    [num_tokens, num_layers, hidden] array per sample (bfloat16 travels as its uint16 bits; `collate` views
    them as torch.bfloat16 again). `skip_ids`: samples left out before their extraction (a resumed online
    training's checkpoint covers them); the others are batched without them, so their features may differ from a
    full run's within the backend's batching tolerance."""
    num_layers = target.shape(config.model).num_layers
    layer_ids = resolve_layer_ids(config.hidden_states.layer_ids, num_layers)
    ensure_ray(config)  # the caller's Ray (a trainer's) lives on with its dataset: no session ends it here
    units = plan.plan_units(config)
    return map_units(units, extractors(config, units, layer_ids, "stream", skip_ids=frozenset(skip_ids)))
