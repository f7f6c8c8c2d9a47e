"""Stage 2's driver, on job/stage.py's runner; also `dataset` (the stream) and `check_run`.

Reads top to bottom: plan the work units (one per completion shard; a `--limit` cuts the last one) → check the
run directory (drift, lock) → print what the run will store → Ray Data streams the units through extractor
actors (one per GPU), each writing its unit's parts → the driver follows the per-unit summaries → report.

Exactly once: a unit's parts have deterministic names (`<completion shard>-p0003.arrow`, rows sorted by length
then cut every `rows_per_shard`), each written atomically; a part already there is skipped, and a unit is done
when its marker `hidden_states/_done/<shard>.json` exists (written after its last part). A rerun redoes only
the parts that were in flight; a finished run starts no actor. Parts a different `--limit` left behind are
deleted before the unit writes its own, so the shards always hold each kept row exactly once.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from job import cluster, layout, progress, runs, scan, schema, stage, storage, target
from job.config import ConfigError, RunConfig, from_dict, resolve_layer_ids, to_dict
from job.drafters import EVERY_TRAINER
from job.drafters import describe as describe_layers
from job.formatting import format_bytes
from job.hidden_states.actor import HiddenStateExtractor, vllm_unavailable_reason
from job.hidden_states.checks import HiddenStateCheckError, compare, reference_features, tolerance_for, verdict
from job.hidden_states.samples import Sample
from job.hidden_states.shards import iter_records, record_dtype
from job.hidden_states.transformers_backend import load_model
from job.layout import HiddenStateUnit

STAGE = "hidden_states"


# ---------------------------------------------------------------------------------------------------------------
# Work units and names
# ---------------------------------------------------------------------------------------------------------------


def _out_dir(config: RunConfig) -> str:
    return storage.join(config.output, layout.HIDDEN_STATES_DIR)


def plan_units(config: RunConfig, orphans: list[str] | None = None,
               seen: list | None = None) -> list[HiddenStateUnit]:
    """One unit per completion shard that can be read whole (name order = input order); `config.limit` keeps the
    first N rows. The shards and their rows come from scan's one listing; a unit is done when a marker made from
    the shard's current content covers it (scan.marker_matches, the one rule). Markers made from other content
    (the shard was regenerated since) are the unit's `stale` ones; shards that cannot be read whole are named in one
    line and left out. `orphans` receives the names of parts and markers whose completion shard no longer exists;
    `seen` the Stage2Markers read (its trust cache: stage 2 saves it under its lock)."""
    found = scan.trusted_completion_shards(config.output, config.storage)
    completions = storage.join(config.output, layout.COMPLETIONS_DIR)
    if not found.listed:
        raise ConfigError(f"no completion shards under {completions}: run stage 1 first "
                          "(`python -m job generate ...`) or point --output at its run directory")
    line = found.problem_line("left out of stage 2. Run stage 1 again on this output: it moves them aside and "
                              "generates their rows again")
    if line:
        print(line, flush=True)
    # Judged against every listed shard: a damaged one's markers are stale (its rows will be generated again), not
    # orphans.
    markers = scan.stage2_markers(config.output, found.listed, found.checks, config.storage)
    shards = found.trusted
    units, left = [], config.limit
    for shard in shards:
        n = shard.stop - shard.start
        stem = layout.hidden_state_stem(shard.uri, completions)
        if left is not None and n >= left:
            units.append(HiddenStateUnit(uri=shard.uri, stem=stem, num_rows=left, row_limit=left if left < n else None))
            break
        units.append(HiddenStateUnit(uri=shard.uri, stem=stem, num_rows=n))
        if left is not None:
            left -= n
    if orphans is not None:
        orphans.extend(markers.orphans)
    if seen is not None:
        seen.append(markers)
    # hidden_states/'s files by the completion shard they belong to: each unit looks at its own only (matching every
    # unit against every file was O(shards²): 20,000 shards × 40,000 files, tens of minutes; issue 48).
    files_of: dict[str, list[str]] = {}
    for name, _, _ in markers.files:
        if (stem := layout.hidden_state_file_stem(name)) is not None:
            files_of.setdefault(stem, []).append(name)
    for unit, shard in zip(units, shards):  # units are the first shards, in order
        unit.counts = found.checks[shard.name].counts  # its footer's counts: stage 2's estimate reads no column
        unit.stale = markers.stale.get(shard.name, [])
        unit.existing = [name for name in files_of.get(unit.stem, []) if unit.owns(name) and name not in unit.stale]
        if unit.row_limit is not None:
            # A --limit unit whose shard is done further (its full marker, or one of a larger limit) is that done
            # unit: a small --limit rerun of a finished stage 2 keeps what is committed instead of deleting it.
            full = shard.stop - shard.start
            rows, limit, marker = markers.covered(shard.name, full)
            if marker is not None and rows >= unit.row_limit:
                unit.row_limit = None if limit is None or limit >= full else limit
                unit.num_rows = full if unit.row_limit is None else limit
        covering = markers.matching.get(shard.name, {}).get(unit.row_limit)
        if unit.done and covering is not None and covering[0] == unit.marker_name:
            unit.marker = covering[1]
    return units


def _remove_outputs(config: RunConfig, units: list[HiddenStateUnit]) -> None:
    """Delete every unit's parts and markers: markers first, so a crash in between leaves units not-done."""
    out = _out_dir(config)
    for name in sorted((n for u in units for n in u.existing), key=lambda n: not n.startswith(layout.DONE_DIR)):
        storage.delete(storage.join(out, name), config.storage)
    for unit in units:
        unit.existing = []


def _forget_stale(config: RunConfig, units: list[HiddenStateUnit], orphans: list[str], fence) -> None:
    """Delete, saying so, the markers made from an earlier content of a completion shard (regenerated since): the
    unit is then not done, and its actor redoes every part not made from the current content. And the parts and
    markers of completion shards that no longer exist (moved aside, or re-cut into other units by a rerun of stage
    1): nothing reads them, they would only be counted as stored bytes."""
    changed = [u for u in units if u.stale]
    if changed:
        names = ", ".join(u.stem for u in changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        print(f"hidden states: {len(changed)} completion shard(s) changed since their hidden states were made "
              f"({names}): their hidden states are made again", flush=True)
    if orphans:
        print(f"hidden states: deleting {len(orphans)} part(s) and marker(s) of completion shards that no longer "
              f"exist (e.g. {orphans[0]})", flush=True)
    doomed = [n for u in changed for n in u.stale] + sorted(orphans, key=lambda n: not n.startswith(layout.DONE_DIR))
    for name in doomed:  # markers first: a crash in between leaves parts nobody counts, never a marker without parts
        with fence.guard():
            storage.delete(storage.join(_out_dir(config), name), config.storage)
    for unit in changed:
        unit.stale = []


# ---------------------------------------------------------------------------------------------------------------
# Model shape, identity, storage estimate
# ---------------------------------------------------------------------------------------------------------------


def _identity(config: RunConfig, layer_ids: list[int], num_layers: int) -> dict:
    """What must not change when stage 2 resumes into the same shards."""
    hs = config.hidden_states
    # The norm side matters only when the last layer is stored. Recorded as false otherwise, what a run made before
    # the default became true recorded: such a run (DFlash's layers, say) resumes instead of being refused.
    last_stored = num_layers - 1 in layer_ids
    return {"model": config.model, "layer_ids": layer_ids, "dtype": hs.dtype, "max_length": hs.max_length,
            "keep_flagged": hs.keep_flagged, "rows_per_shard": hs.rows_per_shard, "backend": hs.backend,
            "last_layer_before_norm": hs.last_layer_before_norm and last_stored}



def _kept_tokens(unit: HiddenStateUnit, config: RunConfig) -> tuple[int, int]:
    hs = config.hidden_states
    if unit.row_limit is None and unit.counts and unit.counts.get("rows", 0) <= unit.num_rows:
        # The whole shard, counted by its writer (scan.shard_counts, from its footer or the trust cache).
        counted = scan.counted_kept_tokens(unit.counts, hs.keep_flagged, hs.max_length)
        if counted is not None:
            return counted
    cols = [schema.NUM_PROMPT_TOKENS, schema.NUM_OUTPUT_TOKENS, schema.ERROR, *schema.QUALITY_FLAGS]
    t = storage.read_shard_columns(unit.uri, cols, config.storage).slice(0, unit.num_rows)
    return scan.kept_tokens(t, hs.keep_flagged, hs.max_length)  # the one rule of which rows are kept


def storage_layout(model: str, layer_ids_setting, dtype: str) -> dict:
    """What one stored token costs for this model, layer setting and dtype: the layer ids, hidden size, bytes of
    the features alone and of a whole token (features, FP8 scales, input id and loss mask: schema's rule). The one
    computation `estimate_storage` and the notebook's projection (job/runview/hidden.py) share."""
    shape = target.shape(model)
    layer_ids = resolve_layer_ids(layer_ids_setting, shape.num_layers)
    return {"layer_ids": layer_ids, "num_layers": len(layer_ids), "hidden_size": shape.hidden_size, "dtype": dtype,
            "feature_bytes_per_token": len(layer_ids) * shape.hidden_size * schema.ITEMSIZE[dtype],
            "bytes_per_token": schema.hidden_state_bytes_per_token(len(layer_ids), shape.hidden_size, dtype)}


def estimate_storage(config: RunConfig, units: list[HiddenStateUnit] | None = None) -> dict:
    """What the run will store: bytes per token and the total for the input (clipping and skipped rows counted;
    reads only the length columns of the completion shards)."""
    hs = config.hidden_states
    sizing = storage_layout(config.model, hs.layer_ids, hs.dtype)
    units = units if units is not None else plan_units(config)
    with ThreadPoolExecutor(16) as pool:
        counts = list(pool.map(lambda u: _kept_tokens(u, config), units))
    per_token = sizing["bytes_per_token"]
    tokens = sum(t for _, t in counts)
    pending = sum(t for u, (_, t) in zip(units, counts) if not u.done)
    return {**sizing, "num_samples": sum(r for r, _ in counts), "num_tokens": tokens, "total_bytes": tokens * per_token,
            "num_tokens_pending": pending, "pending_bytes": pending * per_token}


@dataclass(kw_only=True)
class HiddenStatesSummary(stage.StageSummary):
    """What stage 2 returns, and stores as reports/hidden_states.json. Counts are over every unit's marker (this
    invocation's and earlier ones'); `seconds`, `num_tokens_extracted` and the rates are this invocation's."""
    model: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    num_rows: int = 0
    num_samples: int = 0
    num_errors: int = 0
    num_skipped_flagged: int = 0
    num_skipped_empty: int = 0
    num_clipped: int = 0
    num_tokens: int = 0
    num_padded_tokens: int = 0
    num_parts: int = 0
    padding_waste: float = 0.0
    bytes: int = 0
    num_tokens_extracted: int = 0
    total_seconds: float = 0.0
    tokens_per_s: float = 0.0
    feature_bytes_per_s: float = 0.0
    bytes_written: int = 0
    self_checks: list[dict] = field(default_factory=list)
    layers: dict = field(default_factory=dict)
    estimate: dict = field(default_factory=dict)


USER_ERRORS = (HiddenStateCheckError, ConfigError)
"""Errors raised inside an extractor (the self-check, a config the model refuses) that reach the user as such."""


def _extractors(config: RunConfig, units: list[HiddenStateUnit], layer_ids: list[int], mode: str, fence=None,
                skip_ids: frozenset[str] = frozenset()) -> stage.ActorStage:
    """The extractor actors for `units` (one per GPU, or hidden_states.num_workers), in `mode` write or stream."""
    import ray  # heavy: imported on use

    gpus = int(ray.cluster_resources().get("GPU", 0))
    if config.hidden_states.backend == "vllm" and not gpus:
        raise ConfigError(vllm_unavailable_reason() or "hidden_states.backend 'vllm' needs a GPU in the cluster")
    workers = config.hidden_states.num_workers or max(1, gpus)
    # The exactness self-check of every worker uses samples of the first unit: the run's own data.
    check_source = {"uri": units[0].uri, "row_limit": units[0].row_limit} if units else None
    return stage.ActorStage(
        HiddenStateExtractor,
        {"config": to_dict(config), "layer_ids": layer_ids, "mode": mode, "check_source": check_source,
         "fence": fence, "skip_ids": skip_ids},
        min_actors=workers, max_actors=workers, gpus_per_actor=1 if gpus else 0,
        max_retries=3,  # a killed actor is replaced and its unit retried; a deterministic crash is not, forever
        runtime_env=stage.runtime_env(config))  # secrets: at construction (actor.py)


# ---------------------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------------------


def run_hidden_states(config: RunConfig, *, allow_drift: bool = False, take_lock: bool = False) -> HiddenStatesSummary:
    """Extract the hidden states of every kept completion row into `<output>/hidden_states/*.arrow`.

    Returns a summary (rows, tokens, tokens/s, bytes written, shard URIs, report path); the same goes to
    `<output>/reports/hidden_states.json`.
    """

    started = time.monotonic()
    hs = config.hidden_states
    with stage.RaySession(config) as ray_session:
        if cluster.joining_cluster():  # before anything is written: the extractors' nodes must see the run directory
            ray_session.start()
            cluster.check_paths_reach_workers(config, {"--output": config.output})
        shape = target.shape(config.model)
        num_layers, hidden = shape.num_layers, shape.hidden_size
        try:
            layer_ids = resolve_layer_ids(hs.layer_ids, num_layers)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None
        # run.json before the listing: stage 1's status as it was when the completion shards were listed.
        previous = runs.read_run_json(config.output, config.storage) or {}
        orphans: list[str] = []
        seen: list[scan.Stage2Markers] = []
        units = plan_units(config, orphans=orphans, seen=seen)
        if previous.get("config", {}).get("model") not in (None, config.model):
            print(f"note: stage 1 ran with model {previous['config']['model']!r}; extracting with {config.model!r}",
                  flush=True)
        ident = _identity(config, layer_ids, num_layers)
        changed = stage.check_identity(previous, STAGE, ident, allow_drift,
                                       consequence="mix features made two ways in one output")
        with stage.writing(config, STAGE, layout.HIDDEN_STATES_DIR, take_lock=take_lock) as held:
            # The markers read now are not read again by the next command (job/trust_cache.py).
            scan.remember_markers(config.output, seen[0], config.storage, held.fence)
            _forget_stale(config, units, orphans, held.fence)
            if changed:  # allowed drift: every setting in the identity shapes the parts, so all of them are redone
                print(f"hidden states: settings changed ({', '.join(changed)}): --allow-drift redoes every "
                      "completion shard's hidden states with the new settings", flush=True)
                _remove_outputs(config, units)
            estimate = estimate_storage(config, units)
            _print_estimate(config, estimate, num_layers)
            this_run, seconds = _extract(config, units, layer_ids, ident, estimate, ray_session, held.fence)
            summary = _report(config, units, layer_ids, hidden, estimate, this_run, seconds,
                              time.monotonic() - started, held.fence)
            if any(not u.done for u in units):  # the markers this job wrote, read once now: the next command reads none
                found = scan.trusted_completion_shards(config.output, config.storage)
                scan.remember_markers(config.output, scan.stage2_markers(config.output, found.listed, found.checks,
                                                                         config.storage), config.storage, held.fence)
            # Stage 2 follows the completion shards that exist. While stage 1 is unfinished, that is not the run.
            stage1 = previous.get("generate", {})
            partial = "status" in stage1 and stage1["status"] != "complete"
            runs.write_run_json(config, STAGE, {"status": "partial" if partial else "complete"}, held.fence)
    if partial:
        written, total = sum(u.num_rows for u in units), stage1.get("input", {}).get("num_rows")
        print(f"note: stage 1 is not finished (status: {stage1['status']}; {written:,} of "
              f"{f'{total:,}' if total is not None else '?'} rows written): the hidden states of those "
              f"{len(units)} committed completion shards are done. Rerun `hidden-states` on this output when stage 1 "
              "has finished: it does only the shards added since.", flush=True)
    print(f"hidden states: {summary.num_samples:,} samples, {summary.num_tokens:,} tokens, "
          f"{len(summary.shards)} shards, {format_bytes(summary.bytes)}; this run: "
          f"{summary.num_tokens_extracted:,} tokens at {summary.tokens_per_s:,.0f} tokens/s, padding "
          f"{summary.padding_waste:.1%} → {summary.report}", flush=True)
    return summary


def _print_estimate(config: RunConfig, estimate: dict, num_layers: int) -> None:
    hs = config.hidden_states
    print(f"hidden states: {estimate['num_layers']} layers {estimate['layer_ids']} x hidden {estimate['hidden_size']} "
          f"x {hs.dtype} = {format_bytes(estimate['bytes_per_token'])}/token; {estimate['num_tokens']:,} tokens in "
          f"{estimate['num_samples']:,} samples → {format_bytes(estimate['total_bytes'])} in total, "
          f"{format_bytes(estimate['pending_bytes'])} still to write", flush=True)
    if hs.layer_ids == EVERY_TRAINER:
        print(f"hidden states: every trainer's layers: {describe_layers(num_layers)}", flush=True)


def _extract(config: RunConfig, units: list[HiddenStateUnit], layer_ids: list[int], ident: dict, estimate: dict,
             ray_session: stage.RaySession, fence) -> tuple[dict, float]:
    """The units not done yet, through the extractor actors; (this invocation's counts, its seconds)."""
    pending = [u for u in units if not u.done]
    runs.write_run_json(config, STAGE, {"identity": ident, "estimate": estimate,
                                        "status": "running" if pending else "complete"}, fence)
    extract_started, this_run = time.monotonic(), {"num_tokens_extracted": 0, "bytes_written": 0}
    if not pending:
        print(f"nothing to do: all {len(units)} completion shards already have their hidden states", flush=True)
        return this_run, time.monotonic() - extract_started
    print(f"hidden states: {len(pending)} of {len(units)} completion shards to do", flush=True)
    with stage.failure_recorded(config, STAGE, fence):
        ray_session.start()
        total = sum(u.num_rows for u in units)
        tracker = progress.Progress(total_rows=total, done_rows=total - sum(u.num_rows for u in pending),
                                    label="hidden-states", tokens_key="num_tokens_extracted")
        stage.run_units(units, _Markers(config, fence), _extractors(config, pending, layer_ids, "write", fence),
                        tracker, lambda s: _take_summary(s, tracker, this_run), USER_ERRORS)
    return this_run, time.monotonic() - extract_started


class _Markers:
    """Stage 2's ledger (stage.UnitLedger): a unit is done when a marker made from its completion shard's current
    content is listed (`unit.done`, judged by plan_units with scan.marker_matches); it is marked done by writing the
    marker its extractor's summary carries, under the fence, once the extractor has committed every part."""

    def __init__(self, config: RunConfig, fence):
        self.config, self.fence = config, fence

    def is_done(self, unit: HiddenStateUnit) -> bool:
        return unit.done

    def mark_done(self, summary: dict) -> None:
        storage.write_json(storage.join(_out_dir(self.config), summary["marker_name"]), json.loads(summary["marker"]),
                           self.config.storage, self.fence.guard)


def _take_summary(s: dict, tracker: progress.Progress, this_run: dict) -> None:
    """What stage 2 does with each unit's summary: its worker's warnings and self-check, progress, totals."""
    for line in json.loads(s["warnings"])["lines"]:
        print(f"WARNING: {line}", flush=True)
    check = json.loads(s["self_check"])
    if check:
        print(f"exactness self-check passed ({check['where']}): {check['num_samples']} samples of this run, batched "
              f"vs each alone in a plain transformers forward, differ by at most {check['max_difference']:.2e} "
              f"(tolerance {check['tolerance']:.0e})", flush=True)
        this_run.setdefault("self_checks", []).append(check)
    tracker.update({k: s[k] for k in ("num_rows", "num_tokens_extracted", "num_errors")})
    this_run["num_tokens_extracted"] += s["num_tokens_extracted"]
    this_run["bytes_written"] += s["bytes_written"]


def _report(config: RunConfig, units: list[HiddenStateUnit], layer_ids: list[int], hidden: int, estimate: dict,
            this_run: dict, seconds: float, total_seconds: float, fence=None) -> HiddenStatesSummary:
    """Totals over every unit's marker (this invocation's and earlier ones') plus this invocation's speed."""
    out = _out_dir(config)

    def marker(u: HiddenStateUnit) -> dict:  # read by the plan (or its trust cache) when done then; else read now
        if u.marker is not None and u.done:
            return u.marker
        return storage.read_json(storage.join(out, u.marker_name), config.storage)

    with ThreadPoolExecutor(storage.PARALLEL_READS) as pool:
        markers = list(pool.map(marker, units))
    keys = ["num_rows", "num_samples", "num_errors", "num_skipped_flagged", "num_skipped_empty", "num_clipped",
            "num_tokens", "num_padded_tokens", "num_parts"]
    totals = {k: sum(int(m.get(k, 0)) for m in markers) for k in keys}
    totals_extracted = sum(int(m.get("num_tokens_extracted", 0)) for m in markers)
    layers = {}
    for k in map(str, layer_ids):  # token-weighted RMS over what each marker's run extracted; min/max over samples
        entries = [(m["num_tokens_extracted"], m["feature_stats"][k]) for m in markers
                   if m.get("num_tokens_extracted") and k in m.get("feature_stats", {})]
        if entries:
            n = sum(t for t, _ in entries)
            layers[k] = {"rms": float(np.sqrt(sum(t * e["rms"] ** 2 for t, e in entries) / max(1, n))),
                         "min_sample_rms": min(e["min_sample_rms"] for _, e in entries),
                         "max_sample_rms": max(e["max_sample_rms"] for _, e in entries)}
    # The parts that count (scan's rule: those its marker vouches for), sizes from one listing. The units are the
    # trusted shards, each with its covering marker (plan_units), so this is scan.done_hidden_state_parts without
    # reading every completion shard's footer again.
    sizes = {name: size for name, size, _ in storage.list_file_infos(out, layout.SHARD_SUFFIX, config.storage)}
    shards = {storage.join(out, name): sizes[name] for u, m in zip(units, markers)
              for name in scan.marker_parts(u.stem, u.row_limit, m) if name in sizes}
    tokens_now = this_run.get("num_tokens_extracted", 0)
    report_uri = storage.join(config.output, layout.REPORTS_DIR, layout.HIDDEN_STATES_REPORT)
    summary = HiddenStatesSummary(
        **totals, output=config.output, model=config.model, layer_ids=layer_ids, hidden_size=hidden,
        dtype=config.hidden_states.dtype,
        # Over the batches that ran (a resumed unit's marker counts only the parts it redid).
        padding_waste=1 - totals_extracted / totals["num_padded_tokens"] if totals["num_padded_tokens"] else 0.0,
        bytes=sum(shards.values()), num_tokens_extracted=tokens_now, seconds=seconds, total_seconds=total_seconds,
        tokens_per_s=tokens_now / seconds if seconds else 0.0,
        feature_bytes_per_s=tokens_now * estimate["feature_bytes_per_token"] / seconds if seconds else 0.0,
        bytes_written=this_run.get("bytes_written", 0), self_checks=this_run.get("self_checks", []),
        layers=layers, estimate=estimate, shards=sorted(shards), report=report_uri)
    storage.write_json(report_uri, asdict(summary), config.storage, fence.guard if fence is not None else None)
    return summary


def dataset(config: RunConfig, skip_ids: frozenset[str] = frozenset()):
    """A `ray.data.Dataset` of the hidden-state records, computed on the fly and never written, for a trainer:
    `ds.iter_torch_batches(batch_size=N, collate_fn=collate)`. Columns as in the shards; `hidden_states` is a
    [num_tokens, num_layers, hidden] array per sample (bfloat16 travels as its uint16 bits; `collate` views
    them as torch.bfloat16 again). `skip_ids`: samples left out before their extraction (a resumed online
    training's checkpoint covers them); the others are batched without them, so their features may differ from a
    full run's within the backend's batching tolerance."""
    num_layers = target.shape(config.model).num_layers
    layer_ids = resolve_layer_ids(config.hidden_states.layer_ids, num_layers)
    stage.ensure_ray(config)  # the caller's Ray (a trainer's) lives on with its dataset: no session ends it here
    units = plan_units(config)
    return stage.map_units(units, _extractors(config, units, layer_ids, "stream", skip_ids=frozenset(skip_ids)))


def check_run(config: RunConfig, num_samples: int = 8) -> dict:
    """`python -m job hidden-states --check`: the exactness self-check over a finished run's shards. Up to
    `num_samples` stored samples, one from each of as many shards spread over the run, against a plain transformers
    forward of each alone. Raises HiddenStateCheckError (naming layer and sample) beyond the tolerance, else returns
    the summary. Runs on a GPU worker when the cluster has one (the driver of a cluster job usually has none)."""
    import ray  # heavy: imported on use

    uris = [uri for uri, _ in scan.done_hidden_state_parts(config.output, config.storage)]  # the one done rule
    if not uris:
        raise ConfigError(f"no hidden-state shards under {_out_dir(config)}: nothing to check")
    step = max(1, len(uris) // num_samples)
    chosen = uris[::step][:num_samples]
    with stage.RaySession(config).start():
        gpus = 1 if ray.cluster_resources().get("GPU", 0) else 0
        task = ray.remote(num_gpus=gpus, num_cpus=1, max_retries=0)(_check_stored)
        task = task.options(runtime_env=stage.runtime_env(config))
        with stage.user_errors_surface(USER_ERRORS):
            return ray.get(task.remote(to_dict(config), chosen))


def _check_stored(config_dict: dict, uris: list[str]) -> dict:
    """The first sample of each shard in `uris`: stored features against a plain forward of the sample alone."""
    import torch  # heavy: imported on use

    stage.apply_secrets(config_dict)  # as the actors do
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
