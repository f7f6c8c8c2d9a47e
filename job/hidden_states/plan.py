"""Stage 2's units, what they leave behind and what they will store.

One unit per completion shard that can be read whole (name order = input order; `--limit` keeps the first N rows
and cuts the last unit). A unit's parts have deterministic names (`<completion shard>-p0003.arrow`, rows sorted by
length then cut every `rows_per_shard`), each written atomically; a unit is done when its marker
`hidden_states/_done/<shard>.json` records the shard's current content (scan.marker_matches, the one rule). Parts
and markers of an earlier content, of another --limit, or of shards that no longer exist are deleted through the
stage's fence, markers first, so the shards always hold each kept row exactly once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from job import layout, lock, runs, scan, schema, shard_reads, storage, target
from job.config import ConfigError, RunConfig, resolve_layer_ids
from job.layout import HiddenStateUnit


def out_dir(config: RunConfig) -> str:
    return storage.join(config.output, layout.HIDDEN_STATES_DIR)


def plan_units(config: RunConfig, orphans: list[str] | None = None,
               seen: list | None = None) -> list[HiddenStateUnit]:
    """One unit per completion shard that can be read whole (name order = input order); `config.limit` keeps the
    first N rows. The shards and their rows come from scan's one listing; a unit is done when a marker made from
    the shard's current content covers it (scan.marker_matches, the one rule). Markers made from other content
    (the shard was regenerated since) are the unit's `stale` ones; shards that cannot be read whole are named in one
    line and left out. `orphans` receives the names of parts and markers whose completion shard no longer exists;
    `seen` the Stage2Markers read (its trust cache: stage 2 saves it under its lock)."""
    found = scan.judge_completion_shards(config.output, config.storage)
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
    # unit against every file was O(shards²): 20,000 shards × 40,000 files, tens of minutes).
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


def markers_first(names) -> list[str]:
    """`names` with the markers first: a crash between the deletes leaves parts nobody counts (the unit is not done
    and is redone), never a marker without its parts."""
    return sorted(names, key=lambda n: not n.startswith(layout.DONE_DIR))


def remove_outputs(config: RunConfig, units: list[HiddenStateUnit], fence: lock.Fence) -> None:
    """Delete every unit's parts and markers (settings changed under --allow-drift), through the fence."""
    for name in markers_first(n for u in units for n in u.existing):
        fence.delete(storage.join(out_dir(config), name))
    for unit in units:
        unit.existing = []


def forget_stale(config: RunConfig, units: list[HiddenStateUnit], orphans: list[str], fence: lock.Fence) -> None:
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
    for name in [n for u in changed for n in u.stale] + markers_first(orphans):
        fence.delete(storage.join(out_dir(config), name))
    for unit in changed:
        unit.stale = []


# ---------------------------------------------------------------------------------------------------------------
# Identity and the storage estimate
# ---------------------------------------------------------------------------------------------------------------


def identity(config: RunConfig, layer_ids: list[int], num_layers: int) -> dict:
    """What must not change when stage 2 resumes into the same shards."""
    hs = config.hidden_states
    # The norm side matters only when the last layer is stored. Recorded as false otherwise, what a run made before
    # the default became true recorded: such a run (DFlash's layers, say) resumes instead of being refused.
    last_stored = num_layers - 1 in layer_ids
    return {"model": config.model, "model_files": runs.model_files_digest(config.model), "layer_ids": layer_ids,
            "dtype": hs.dtype, "max_length": hs.max_length, "keep_flagged": hs.keep_flagged,
            "rows_per_shard": hs.rows_per_shard, "backend": hs.backend,
            "last_layer_before_norm": hs.last_layer_before_norm and last_stored}


def kept_tokens(unit: HiddenStateUnit, config: RunConfig) -> tuple[int, int]:
    """(rows, tokens) of the unit that stage 2 keeps: from the shard's footer counts when the unit is the whole
    shard, else from its length columns; scan's one rule either way."""
    hs = config.hidden_states
    if unit.row_limit is None and unit.counts and unit.counts.get("rows", 0) <= unit.num_rows:
        # The whole shard, counted by its writer (scan.shard_counts, from its footer or the trust cache).
        counted = scan.counted_kept_tokens(unit.counts, hs.keep_flagged, hs.max_length)
        if counted is not None:
            return counted
    cols = [schema.NUM_PROMPT_TOKENS, schema.NUM_OUTPUT_TOKENS, schema.ERROR, *schema.QUALITY_FLAGS]
    t = shard_reads.read_shard_columns(unit.uri, cols, config.storage).slice(0, unit.num_rows)
    return scan.kept_tokens(t, hs.keep_flagged, hs.max_length)


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
        counts = list(pool.map(lambda u: kept_tokens(u, config), units))
    per_token = sizing["bytes_per_token"]
    tokens = sum(t for _, t in counts)
    pending = sum(t for u, (_, t) in zip(units, counts) if not u.done)
    return {**sizing, "num_samples": sum(r for r, _ in counts), "num_tokens": tokens, "total_bytes": tokens * per_token,
            "num_tokens_pending": pending, "pending_bytes": pending * per_token}
