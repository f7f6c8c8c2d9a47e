"""Stage 2's markers and parts, judged the one way every reader shares (stage 2's plan, `status`, export, `load`,
`--check`, the notebook):

- `marker_matches`: whether a marker still covers a completion shard's current content;
- `stage2_markers` / `Stage2Markers.covered`: how much of each completion shard stage 2 has done (a full marker wins
  over `--limit` ones), with the stale markers and the orphans;
- `done_parts` / `done_hidden_state_parts`: which hidden-state parts, and so which stored bytes, count;
- `hidden_state_meta`: a hidden-state part's schema metadata, decoded once.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from job import layout, schema, storage, trust_cache
from job.scan.completions import CompletionShard, ShardCheck, judge_completion_shards, listed_beside_cache
from job.storage import StorageConfig


def marker_matches(marker: dict, shard: CompletionShard, shard_id: str | None) -> bool:
    """THE rule of whether a stage-2 marker still covers a completion shard (stage 2, `status`, the notebook and
    export all come here): it was made from this content — the shard's size and content id as the marker recorded
    them. A shard regenerated under the same name has another id; its old hidden states are stale. A marker from
    before markers recorded their source counts only for a shard from before shards had ids."""
    source = marker.get("source")
    if not source:
        return shard_id is None
    return source.get("size") == shard.size and source.get("shard_id") == shard_id


@dataclass
class Stage2Markers:
    """Stage 2's markers judged against the completion shards they cover."""
    matching: dict[str, dict[int | None, tuple[str, dict]]]
    """Completion shard name → {--limit or None: (marker name, marker)} of the markers that match its content."""
    stale: dict[str, list[str]]
    """Completion shard name → names of its markers made from other content (relative to hidden_states/)."""
    files: list[tuple[str, int, float | None]]
    """hidden_states/'s listing: (name, size, mtime)."""
    orphans: list[str]
    """Markers and parts of completion shards that no longer exist (moved aside, or re-cut into other units by a
    rerun): nothing counts them; stage 2 deletes them."""
    cache: trust_cache.Entries = field(default_factory=trust_cache.Entries)
    """The markers' trust cache as this answer left it: stage 2 saves it (`remember_markers`)."""

    def covered(self, shard_name: str, num_rows: int) -> tuple[int, int | None, dict | None]:
        """THE answer to "how much of this completion shard has its hidden states", for every reader (stage 2's
        plan, `status`, export, `load`, the notebook): (rows covered, the --limit of the widest matching marker or
        None for a full one, that marker); (0, None, None) without one. A full marker wins over any --limit one."""
        found = self.matching.get(shard_name)
        if not found:
            return 0, None, None
        limit = None if None in found else max(found)
        return (num_rows if limit is None else min(limit, num_rows)), limit, found[limit][1]


def stage2_markers(run_uri: str, shards: list[CompletionShard], checks: dict[str, ShardCheck],
                   storage_config: StorageConfig | None = None, num_threads: int = 32) -> Stage2Markers:
    """One listing of hidden_states/, every marker of a listed shard read (one small GET each, none for a marker
    the trust cache holds with its listed size and ETag) and judged by `marker_matches`."""
    hidden_dir = storage.join(run_uri, layout.HIDDEN_STATES_DIR)
    completions_dir = storage.join(run_uri, layout.COMPLETIONS_DIR)
    entries, cache = listed_beside_cache(lambda: storage.list_file_entries(hidden_dir, "", storage_config), run_uri,
                                          trust_cache.MARKERS, storage_config)
    files = [(name, size, mtime) for name, size, mtime, _ in entries]
    etags = {name: (size, etag) for name, size, _, etag in entries}
    by_stem: dict[str, list[tuple[str, int | None]]] = {}
    for name, _, _ in files:
        parsed = layout.parse_marker_name(name)
        if parsed is not None:
            by_stem.setdefault(parsed[0], []).append((name, parsed[1]))
    stems = {layout.hidden_state_stem(shard.uri, completions_dir) for shard in shards}
    wanted = [(shard, name, limit) for shard in shards
              for name, limit in by_stem.get(layout.hidden_state_stem(shard.uri, completions_dir), [])]
    orphans = [name for name, _, _ in files
               if (stem := layout.hidden_state_file_stem(name)) is not None and stem not in stems]

    def read(name: str) -> dict:
        size, etag = etags[name]
        try:
            marker = storage.read_json(storage.join(hidden_dir, name), storage_config)
        except (FileNotFoundError, ValueError):  # deleted since the listing, or not JSON: covers nothing
            return {"source": {"size": -1}}
        if isinstance(marker, dict):
            cache.put(name, size, etag, marker)
        return marker

    # The cache's answers first, in this thread; only the markers it does not hold go to the pool (at 20,000 cached
    # markers, a task each cost ~1 s of the driver's CPU for nothing).
    markers = [cache.get(name, *etags[name]) for _, name, _ in wanted]
    misses = [i for i, marker in enumerate(markers) if marker is None]
    if misses:
        with ThreadPoolExecutor(min(num_threads, len(misses))) as pool:
            for i, marker in zip(misses, pool.map(read, [wanted[i][1] for i in misses])):
                markers[i] = marker
    cache.keep_only({name for _, name, _ in wanted})
    out = Stage2Markers(matching={}, stale={}, files=files, orphans=orphans, cache=cache)
    for (shard, name, limit), marker in zip(wanted, markers):
        check = checks.get(shard.name, ShardCheck())
        if check.problem is None and marker_matches(marker, shard, check.shard_id):
            out.matching.setdefault(shard.name, {})[limit] = (name, marker)
        else:
            out.stale.setdefault(shard.name, []).append(name)
    return out


def remember_markers(run_uri: str, markers: Stage2Markers, fence) -> bool:
    """Save the markers `markers` read as the run's marker trust cache: stage 2 only, under its writer lock's fence.
    Returns whether it wrote."""
    return trust_cache.save(run_uri, trust_cache.MARKERS, markers.cache, fence)


def done_parts(markers: Stage2Markers, shards: list[CompletionShard], run_uri: str) -> list[tuple[str, int]]:
    """(URI, size) of the hidden-state parts that count, sorted by name: those of each shard's covering marker
    (`Stage2Markers.covered`: a full marker before any `--limit` one), named by job/layout.py. Parts of an
    unfinished unit, or made from an earlier content of a regenerated shard, are left out."""
    sizes = {name: size for name, size, _ in markers.files}
    hidden_dir = storage.join(run_uri, layout.HIDDEN_STATES_DIR)
    completions_dir = storage.join(run_uri, layout.COMPLETIONS_DIR)
    out = []
    for shard in shards:
        _, limit, marker = markers.covered(shard.name, shard.stop - shard.start)
        if marker is None:
            continue
        for name in marker_parts(layout.hidden_state_stem(shard.uri, completions_dir), limit, marker):
            if name in sizes:
                out.append((storage.join(hidden_dir, name), sizes[name]))
    return sorted(out)


def marker_parts(stem: str, limit: int | None, marker: dict) -> list[str]:
    """Names (relative to hidden_states/) of the parts a done marker vouches for: the parts that count."""
    return [layout.hidden_state_part_name(stem, limit, j) for j in range(int(marker.get("num_parts", 0)))]


def done_hidden_state_parts(run_uri: str, storage_config: StorageConfig | None = None) -> list[tuple[str, int]]:
    """(URI, size) of a run's hidden-state parts that count (`done_parts`), from one listing of each directory:
    what export, `load`, `hidden-states --check`, stage 2's report and the notebook read. Their sizes summed are THE
    stored bytes of stage 2 (`status`, the report and the notebook's projection count these, nothing else)."""
    found = judge_completion_shards(run_uri, storage_config)
    markers = stage2_markers(run_uri, found.listed, found.checks, storage_config)
    return done_parts(markers, found.trusted, run_uri)


# ---------------------------------------------------------------------------------------------------------------
# A hidden-state part's schema metadata, decoded once
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HiddenStateMeta:
    """What a hidden-state part's schema metadata says (job/schema.py writes it: `hidden_states_schema`)."""
    model: str
    layer_ids: list[int]
    dtype: str
    """As stored (float8_e4m3fn for FP8 storage; job/hidden_states/shards.py `record_dtype` is what reading gives)."""
    hidden_size: int
    layer_convention: str
    last_layer_norm: str
    """schema.LAST_BEFORE_NORM or LAST_AFTER_NORM (after: what parts from before this was recorded hold)."""
    num_model_layers: int | None

    @property
    def last_before_norm(self) -> bool:
        return self.last_layer_norm == schema.LAST_BEFORE_NORM

    @property
    def bytes_per_token(self) -> int:
        return schema.hidden_state_bytes_per_token(len(self.layer_ids), self.hidden_size, self.dtype)


def hidden_state_meta(metadata: dict[bytes, bytes]) -> HiddenStateMeta:
    """A hidden-state part's schema metadata (`table.schema.metadata`, or `shard_reads.read_shard_schema(uri).metadata`)
    decoded; a part that is not one (no layer ids) raises ValueError naming what is missing."""
    meta = metadata or {}
    missing = [k.decode() for k in (schema.META_LAYER_IDS, schema.META_DTYPE, schema.META_HIDDEN_SIZE) if k not in meta]
    if missing:
        raise ValueError(f"not a hidden-state part: its schema metadata has no {', '.join(missing)}")
    layers = meta.get(schema.META_NUM_MODEL_LAYERS)
    return HiddenStateMeta(
        model=meta.get(schema.META_MODEL, b"").decode(), layer_ids=json.loads(meta[schema.META_LAYER_IDS]),
        dtype=meta[schema.META_DTYPE].decode(), hidden_size=int(meta[schema.META_HIDDEN_SIZE]),
        layer_convention=meta.get(schema.META_LAYER_CONVENTION, b"").decode(),
        last_layer_norm=meta.get(schema.META_LAST_LAYER_NORM, schema.LAST_AFTER_NORM.encode()).decode(),
        num_model_layers=int(layers) if layers else None)
