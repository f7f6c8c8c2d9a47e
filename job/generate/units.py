"""Stage 1's work units: the row ranges a run must produce (all rows, or the first --limit), minus the ranges the
listed completion shards already cover, cut every `rows_per_shard` rows. Resume is this arithmetic over a listing,
O(shards), never O(rows)."""

from __future__ import annotations

from job import layout
from job.generate import jsonl_input
from job.generate.inputs import InputFile
from job.layout import CompletionUnit


def wanted_ranges(files: list[InputFile], limit: int | None) -> list[tuple[int, int, int]]:
    """(file_index, start, stop) of the rows this run must produce: all rows, or the first `limit` in order."""
    ranges, left = [], limit
    for i, f in enumerate(files):
        n = f.num_rows if left is None else min(f.num_rows, left)
        if n > 0:
            ranges.append((i, 0, n))
        if left is not None:
            left -= n
            if left <= 0:
                break
    return ranges


def pending_units(files: list[InputFile], done_shard_names: list[str], limit: int | None,
                  rows_per_shard: int, first_unit_rows: int | None = None) -> list[CompletionUnit]:
    """Cut the wanted rows not covered by a done shard into units of `rows_per_shard` rows.

    `first_unit_rows` makes the first units of the run smaller (the canary: their rows come back first).
    """
    covered: dict[int, list[tuple[int, int]]] = {}
    for name in done_shard_names:
        parsed = layout.parse_completion_shard_name(name)
        if parsed:
            covered.setdefault(parsed[0], []).append((parsed[1], parsed[2]))
    units: list[CompletionUnit] = []
    small_left = first_unit_rows or 0
    for file_index, start, stop in wanted_ranges(files, limit):
        gaps, pos = [], start
        for s, e in sorted(covered.get(file_index, [])):
            if s > pos:
                gaps.append((pos, min(s, stop)))
            pos = max(pos, e)
            if pos >= stop:
                break
        if pos < stop:
            gaps.append((pos, stop))
        for gs, ge in gaps:
            pos = gs
            while pos < ge:
                size = rows_per_shard
                if small_left > 0:
                    size = min(size, max(1, small_left // 4), small_left)  # ≥4 units, so several engines share it
                    small_left -= size
                end = min(ge, pos + size)
                seek_row, seek_byte = jsonl_input.checkpoint_for(files[file_index].checkpoints, pos)
                units.append(CompletionUnit(file_index, files[file_index].uri, pos, end, seek_row, seek_byte))
                pos = end
    return units


def count_done_rows(files: list[InputFile], done_shard_names: list[str], limit: int | None) -> int:
    wanted = {i: (s, e) for i, s, e in wanted_ranges(files, limit)}
    total = 0
    for name in done_shard_names:
        parsed = layout.parse_completion_shard_name(name)
        if parsed and parsed[0] in wanted:
            lo, hi = wanted[parsed[0]]
            total += max(0, min(hi, parsed[2]) - max(lo, parsed[1]))
    return total
