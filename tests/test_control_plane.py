"""Stage 2's plan on a run directory made by the project's writers, without a model or Ray: each unit's files
found by grouping hidden_states/ once (issue 48: matching every unit against every file was O(shards²)), the same
files the old all-against-all match found."""

from __future__ import annotations

import uuid

import pyarrow as pa

from job import layout, schema, storage
from job.config import RunConfig
from job.hidden_states.plan import plan_units


def _completion_shard(uri: str, rows: int) -> tuple[int, str]:
    shard_id = uuid.uuid4().hex
    table = pa.table({schema.ID: [f"r{i}" for i in range(rows)], schema.ERROR: pa.nulls(rows, pa.string())})
    data = storage.table_to_ipc_bytes(table.replace_schema_metadata({schema.META_SHARD_ID: shard_id}))
    storage.write_bytes_atomic(uri, data)
    return len(data), shard_id


def test_each_unit_gets_exactly_its_own_parts_and_markers(tmp_path):
    run = str(tmp_path / "run")
    completions = storage.join(run, layout.COMPLETIONS_DIR)
    hidden = storage.join(run, layout.HIDDEN_STATES_DIR)
    names = [layout.completion_shard_name(0, s, s + 8) for s in (0, 8, 16)]
    sources = [_completion_shard(storage.join(completions, n), 8) for n in names]
    stems = [n[:-len(layout.SHARD_SUFFIX)] for n in names]

    def marker(stem: str, size: int, shard_id: str, limit: int | None = None) -> None:
        tag = stem if limit is None else f"{stem}-n{limit}"
        storage.write_json(storage.join(hidden, layout.DONE_DIR, f"{tag}.json"),
                           {"num_parts": 1, "source": {"size": size, "shard_id": shard_id}})

    def part(name: str) -> None:
        storage.write_bytes_atomic(storage.join(hidden, name), b"part")

    # Shard 0: done (two parts, a matching marker). Shard 1: a --limit 5 run's part and marker, and a full marker
    # made from other content (stale). Shard 2: one part of an unfinished unit. And a part of a shard that is gone.
    part(f"{stems[0]}-p0000.arrow")
    part(f"{stems[0]}-p0001.arrow")
    marker(stems[0], *sources[0])
    part(f"{stems[1]}-n5-p0000.arrow")
    marker(stems[1], *sources[1], limit=5)
    marker(stems[1], sources[1][0], "other content")
    part(f"{stems[2]}-p0000.arrow")
    part(f"{layout.completion_shard_name(0, 24, 32)[:-6]}-p0000.arrow")

    orphans: list[str] = []
    units = plan_units(RunConfig(model="unused", output=run), orphans=orphans)
    files = [name for name, _, _ in storage.list_file_infos(hidden, "")]
    assert [u.stem for u in units] == stems
    for unit in units:  # what every unit matched against every file gave
        assert unit.existing == [n for n in files if unit.owns(n) and n not in unit.stale]
    assert units[0].done and units[0].existing == [f"_done/{stems[0]}.json", f"{stems[0]}-p0000.arrow",
                                                   f"{stems[0]}-p0001.arrow"]
    assert not units[1].done and units[1].stale == [f"_done/{stems[1]}.json"]
    assert units[1].existing == [f"_done/{stems[1]}-n5.json", f"{stems[1]}-n5-p0000.arrow"]
    assert not units[2].done and units[2].existing == [f"{stems[2]}-p0000.arrow"]
    assert orphans == [f"{layout.completion_shard_name(0, 24, 32)[:-6]}-p0000.arrow"]
