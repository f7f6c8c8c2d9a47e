"""The pure rules of a run's state, each tested at its corners in milliseconds (no Ray, no engine, no model): row
ranges (job/rowranges.py) and stage 1's resume arithmetic over them (job/generate/units.py), stage-2 names
(job/layout.py), the done rules of stage 2 (job/scan.py: `marker_matches`, `Stage2Markers.covered`, `done_parts`),
which completion shards can be trusted (`judge_completion_shards`, over real Arrow files written to tmp), a
hidden-state part's metadata, and the one "not a run directory" refusal."""

from __future__ import annotations

import pyarrow as pa
import pytest

from job import layout, rowranges, scan, schema, storage
from job.generate.inputs import InputFile
from job.generate.units import count_done_rows, pending_units
from job.layout import CompletionUnit, HiddenStateUnit
from job.runs import RunError

# ---------------------------------------------------------------------------------------------------------------
# Row ranges
# ---------------------------------------------------------------------------------------------------------------


def test_merge_joins_overlapping_and_touching_ranges_and_drops_empty_ones():
    assert rowranges.merge([(8, 16), (0, 8), (4, 12), (20, 20), (30, 32)]) == [(0, 16), (30, 32)]
    assert rowranges.merge([]) == []


def test_gaps_within_a_window():
    covered = [(0, 8), (16, 24), (20, 28)]
    assert rowranges.gaps(covered, 0, 40) == [(8, 16), (28, 40)]
    assert rowranges.gaps(covered, 10, 18) == [(10, 16)]
    assert rowranges.gaps(covered, 2, 6) == []
    assert rowranges.gaps([], 5, 9) == [(5, 9)]
    assert rowranges.gaps([(50, 60)], 0, 10) == [(0, 10)], "a range past the window covers nothing of it"


def test_covered_rows_counts_each_row_once():
    assert rowranges.covered_rows([(0, 8), (4, 12)]) == 12, "overlapping shards: the common rows once"
    assert rowranges.covered_rows([(0, 8), (4, 12)], 6, 10) == 4
    assert rowranges.covered_rows([(0, 8)], 10, 20) == 0


def test_holes_are_only_between_covered_ranges():
    assert rowranges.holes([(8, 16), (24, 32)]) == [(0, 8), (16, 24)]
    assert rowranges.holes([(0, 8), (4, 16)]) == []
    assert rowranges.holes([]) == []


def _files(*rows: int) -> list[InputFile]:
    return [InputFile(uri=f"in/{i}.parquet", num_rows=n, size=1) for i, n in enumerate(rows)]


def _name(file_index: int, start: int, stop: int) -> str:
    return CompletionUnit(file_index, "x", start, stop).shard_name


def test_count_done_rows_counts_overlapping_shards_once_and_only_wanted_rows():
    """The count `generate` prints ("N of M already done") used to add each shard's rows, so two shards cutting the
    same rows two ways counted them twice, while `status` merged them: both merge now."""
    files = _files(20, 10)
    done = [_name(0, 0, 8), _name(0, 4, 12), _name(1, 0, 10), "not-a-shard.arrow"]
    assert count_done_rows(files, done, None) == 12 + 10
    assert count_done_rows(files, done, 25) == 12 + 5, "--limit 25: file 1's first 5 rows are wanted"
    assert count_done_rows(files, done, 6) == 6


def test_pending_units_cut_only_the_gaps_and_agree_with_the_count():
    files = _files(20)
    done = [_name(0, 0, 8), _name(0, 4, 12)]
    units = pending_units(files, done, None, rows_per_shard=5)
    assert [(u.start, u.stop) for u in units] == [(12, 17), (17, 20)]
    assert count_done_rows(files, done, None) + sum(u.num_rows for u in units) == 20


def test_pending_units_make_the_canary_units_small():
    units = pending_units(_files(40), [], None, rows_per_shard=16, first_unit_rows=8)
    assert [u.num_rows for u in units] == [2, 1, 1, 1, 1, 1, 1, 16, 16], "8 canary rows in several small units"
    assert [u.start for u in units] == [0, 2, 3, 4, 5, 6, 7, 8, 24]


# ---------------------------------------------------------------------------------------------------------------
# Stage-2 names
# ---------------------------------------------------------------------------------------------------------------


STEM = "f00000-r0000000000-0000000008"


def test_stage2_names_round_trip():
    assert layout.parse_part_name(layout.hidden_state_part_name(STEM, None, 3)) == (STEM, None, 3)
    assert layout.parse_part_name(layout.hidden_state_part_name(STEM, 5, 12)) == (STEM, 5, 12)
    assert layout.parse_marker_name(layout.hidden_state_marker_name(STEM, None)) == (STEM, None)
    assert layout.parse_marker_name(layout.hidden_state_marker_name(STEM, 5)) == (STEM, 5)
    assert layout.parse_part_name("_done/" + layout.hidden_state_part_name(STEM, None, 0)) is None
    assert layout.parse_part_name(STEM + ".arrow") is None and layout.parse_marker_name(STEM + ".json") is None
    sub = "sub__" + STEM  # a completion shard in a subfolder: '/' becomes '__'
    assert layout.hidden_state_file_stem(layout.hidden_state_part_name(sub, 7, 0)) == sub


def test_a_unit_owns_its_files_under_any_limit_and_no_other_shards():
    unit = HiddenStateUnit(uri="u", stem=STEM, num_rows=5, row_limit=5)
    assert unit.part_name(0) == f"{STEM}-n5-p0000.arrow" and unit.marker_name == f"_done/{STEM}-n5.json"
    assert unit.owns(layout.hidden_state_part_name(STEM, None, 2)) and unit.owns(unit.marker_name)
    assert unit.owns(layout.hidden_state_marker_name(STEM, 9))
    other = "f00000-r0000000000-0000000080"  # a stem that starts like ours
    assert not unit.owns(layout.hidden_state_part_name(other, None, 0)) and not unit.owns("notes.txt")


# ---------------------------------------------------------------------------------------------------------------
# The done rules of stage 2
# ---------------------------------------------------------------------------------------------------------------


def _shard(start: int = 0, stop: int = 8, size: int = 1000, run: str = "run") -> scan.CompletionShard:
    name = _name(0, start, stop)
    return scan.CompletionShard(name=name, uri=f"{run}/completions/{name}", file_index=0, start=start, stop=stop,
                                size=size, mtime=0.0)


def test_marker_matches_only_the_content_it_was_made_from():
    shard = _shard(size=1000)
    assert scan.marker_matches({"source": {"size": 1000, "shard_id": "a"}}, shard, "a")
    assert not scan.marker_matches({"source": {"size": 1000, "shard_id": "a"}}, shard, "b"), "regenerated"
    assert not scan.marker_matches({"source": {"size": 999, "shard_id": "a"}}, shard, "a"), "same id, other bytes"
    assert scan.marker_matches({}, shard, None), "a marker and a shard from before both recorded ids"
    assert not scan.marker_matches({}, shard, "a"), "an old marker cannot vouch for a shard with an id"


def _markers(found: dict) -> scan.Stage2Markers:
    return scan.Stage2Markers(matching=found, stale={}, files=[], orphans=[])


def test_covered_prefers_a_full_marker_then_the_widest_limit_and_clips_at_the_shard():
    name = _shard().name
    full, n3, n5, n50 = ({"m": k} for k in ("full", "n3", "n5", "n50"))
    assert _markers({}).covered(name, 8) == (0, None, None)
    assert _markers({name: {3: ("a", n3), 5: ("b", n5)}}).covered(name, 8) == (5, 5, n5)
    assert _markers({name: {3: ("a", n3), None: ("c", full)}}).covered(name, 8) == (8, None, full)
    assert _markers({name: {50: ("d", n50)}}).covered(name, 8) == (8, 50, n50)


def test_done_parts_are_the_covering_markers_parts_that_exist():
    shard = _shard()
    stem = layout.hidden_state_stem(shard.uri, "run/completions")
    listing = [(layout.hidden_state_part_name(stem, 5, j), 100 + j, None) for j in range(3)]
    listing += [(layout.hidden_state_part_name(stem, None, 0), 7, None)]  # an unfinished full unit's part
    markers = scan.Stage2Markers(matching={shard.name: {5: ("m", {"num_parts": 2})}}, stale={}, files=listing,
                                 orphans=[])
    parts = scan.done_parts(markers, [shard], "run")
    assert parts == [(f"run/hidden_states/{stem}-n5-p0000.arrow", 100), (f"run/hidden_states/{stem}-n5-p0001.arrow",
                                                                         101)]
    assert scan.done_parts(markers, [_shard(8, 16)], "run") == [], "no marker: nothing counts"


# ---------------------------------------------------------------------------------------------------------------
# Which completion shards can be trusted, on real files
# ---------------------------------------------------------------------------------------------------------------


def _completion_table(n: int) -> pa.Table:
    rows = [{**{c: None for c in schema.COMPLETION_COLUMNS}, schema.ID: str(i)} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=schema.completion_schema())


def test_trusted_completion_shards_names_each_damage_and_keeps_the_rest(tmp_path):
    run = str(tmp_path)
    directory = tmp_path / layout.COMPLETIONS_DIR
    for start in (0, 4, 8, 12):
        storage.write_shard(str(directory / _name(0, start, start + 4)), _completion_table(4))
    whole, cut, empty, wrong = (directory / _name(0, s, s + 4) for s in (0, 4, 8, 12))
    cut.write_bytes(cut.read_bytes()[:100])
    empty.write_bytes(b"")
    storage.write_shard(str(wrong), pa.table({"x": [1]}))
    (directory / "notes.arrow").write_bytes(b"not ours")  # not a shard's name: not listed at all

    found = scan.judge_completion_shards(run)
    assert [s.name for s in found.listed] == [p.name for p in (whole, cut, empty, wrong)]
    assert [s.name for s in found.trusted] == [whole.name]
    assert set(found.problems) == {cut.name, empty.name, wrong.name}
    assert "truncated?" in found.problems[cut.name] and found.problems[empty.name] == "zero bytes"
    assert "no column" in found.problems[wrong.name]
    line = found.problem_line("left out")
    assert line.startswith("3 completion shard(s) cannot be read whole") and line.endswith(": left out")
    assert scan.trusted_completion_uris(run) == [str(whole)]
    unreadable: dict[str, str] = {}
    assert scan.read_columns(run, [schema.ID], unreadable=unreadable).num_rows == 4
    assert unreadable == found.problems
    assert scan.judge_completion_shards(str(tmp_path / "nothing")).problem_line("x") is None


# ---------------------------------------------------------------------------------------------------------------
# A hidden-state part's metadata; a path that is not a run
# ---------------------------------------------------------------------------------------------------------------


def test_hidden_state_meta_decodes_what_the_schema_writes():
    meta = schema.hidden_states_schema(model="m", layer_ids=[1, 3], hidden_size=8, dtype="bfloat16",
                                      last_layer_before_norm=True, num_model_layers=4).metadata
    m = scan.hidden_state_meta(meta)
    assert (m.model, m.layer_ids, m.dtype, m.hidden_size, m.num_model_layers) == ("m", [1, 3], "bfloat16", 8, 4)
    assert m.last_before_norm and m.bytes_per_token == schema.hidden_state_bytes_per_token(2, 8, "bfloat16")
    old = {k: v for k, v in meta.items() if k not in (schema.META_LAST_LAYER_NORM, schema.META_NUM_MODEL_LAYERS)}
    assert not scan.hidden_state_meta(old).last_before_norm and scan.hidden_state_meta(old).num_model_layers is None
    with pytest.raises(ValueError, match="not a hidden-state part"):
        scan.hidden_state_meta({schema.META_MODEL: b"m"})


def test_a_path_without_run_json_is_refused_one_way(tmp_path):
    with pytest.raises(scan.NotARunDirectory, match="not a run directory.*Set RUN_DIR") as e:
        scan.require_run(str(tmp_path), hint="Set RUN_DIR")
    assert isinstance(e.value, RunError), "the command line prints every RunError in one line"
    storage.write_json(str(tmp_path / layout.RUN_JSON), {"created_at": "x"})
    assert scan.require_run(str(tmp_path)).created_at == "x"


# ---------------------------------------------------------------------------------------------------------------
# Stage 2's plan over a run directory written here (no Ray, no model): which units are done, stale, widened
# ---------------------------------------------------------------------------------------------------------------


def _stage2_run(tmp_path, markers: dict[str, dict]) -> tuple[str, list[str]]:
    """Two 8-row completion shards and the given stage-2 markers ({marker name: marker}); "$size0" in a marker's
    source stands for the first shard's size."""
    run = str(tmp_path)
    names = [_name(0, 0, 8), _name(0, 8, 16)]
    for name in names:
        storage.write_shard(storage.join(run, layout.COMPLETIONS_DIR, name), _completion_table(8))
    size0 = (tmp_path / layout.COMPLETIONS_DIR / names[0]).stat().st_size
    for marker_name, marker in markers.items():
        source = {k: size0 if v == "$size0" else v for k, v in marker.get("source", {}).items()}
        storage.write_json(storage.join(run, layout.HIDDEN_STATES_DIR, marker_name), {**marker, "source": source})
    return run, names


def test_a_small_limit_rerun_of_a_done_shard_keeps_it_done_and_a_changed_shard_is_stale(tmp_path):
    """The corner cases stage 2's plan decides from names and markers alone (test_hidden_states' end-to-end run
    covers them with real extraction, ~60 s): a --limit smaller than what a full marker covers is that done unit (it
    used to delete the committed parts as another limit's leftovers); a marker made from other content is stale."""
    from job.config import RunConfig
    from job.hidden_states.plan import plan_units

    stem0, stem1 = _name(0, 0, 8)[:-6], _name(0, 8, 16)[:-6]
    run, _ = _stage2_run(tmp_path, {
        layout.hidden_state_marker_name(stem0, None): {"num_parts": 1, "source": {"size": "$size0", "shard_id": None}},
        layout.hidden_state_part_name(stem0, None, 0): {},
        layout.hidden_state_marker_name(stem1, None): {"num_parts": 1, "source": {"size": 1, "shard_id": None}},
    })
    units = plan_units(RunConfig(model="m", output=run, limit=5))
    assert len(units) == 1 and units[0].row_limit is None and units[0].num_rows == 8 and units[0].done
    units = plan_units(RunConfig(model="m", output=run))
    assert [u.done for u in units] == [True, False]
    assert units[1].stale == [layout.hidden_state_marker_name(stem1, None)], "made from other content"
