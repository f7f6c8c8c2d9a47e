"""Stage 1's work units: the row ranges a run must produce (all rows, or the first --limit), minus the ranges the
listed completion shards already cover, cut every `rows_per_shard` rows. Resume is this arithmetic over a listing,
O(shards), never O(rows)."""

from __future__ import annotations

from job import layout, rowranges
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


def done_ranges(done_shard_names: list[str]) -> dict[int, list[tuple[int, int]]]:
    """{file_index: row ranges} the done shards' names cover (names that are not completion shards' are ignored)."""
    parsed = (layout.parse_completion_shard_name(name) for name in done_shard_names)
    return rowranges.by_file(p for p in parsed if p is not None)


def pending_units(files: list[InputFile], done_shard_names: list[str], limit: int | None,
                  rows_per_shard: int, first_unit_rows: int | None = None) -> list[CompletionUnit]:
    """Cut the wanted rows not covered by a done shard into units of `rows_per_shard` rows.

    `first_unit_rows` makes the first units of the run smaller (the canary: their rows come back first).
    """
    covered = done_ranges(done_shard_names)
    units: list[CompletionUnit] = []
    small_left = first_unit_rows or 0
    for file_index, start, stop in wanted_ranges(files, limit):
        for gs, ge in rowranges.gaps(covered.get(file_index, []), start, stop):
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
    """Wanted rows that a done shard covers, each counted once: shards whose ranges overlap (the same rows cut two
    ways) do not count their common rows twice. (This used to sum each shard's rows, overlaps twice, while `status`
    merged them: the merged count is the true one, and the one `pending_units` agrees with.)"""
    covered = done_ranges(done_shard_names)
    return sum(rowranges.covered_rows(covered.get(i, []), s, e) for i, s, e in wanted_ranges(files, limit))
