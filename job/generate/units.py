"""Stage 1's work units and its ledger: the row ranges a run must produce (all rows, or the first --limit), cut into
the pieces trusted completion shards already cover (done) and the gaps between them, cut every `rows_per_shard`
rows (to do). Resume is this arithmetic over a listing, O(shards), never O(rows)."""

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


class Coverage:
    """Stage 1's ledger: the rows of each input file that trusted completion shards hold (overlapping shards count
    once). A unit is done when every one of its rows is covered; it is marked done when its engine has committed
    its shard (the shard is the durable mark: a rerun lists it), which `add` records for the rest of this job."""

    def __init__(self, done_shard_names: list[str]):
        parsed = (layout.parse_completion_shard_name(name) for name in done_shard_names)
        self.ranges = rowranges.by_file(p for p in parsed if p is not None)  # names not a shard's are ignored

    def covers(self, unit: CompletionUnit) -> bool:
        return rowranges.covered_rows(self.ranges.get(unit.file_index, []), unit.start, unit.stop) == unit.num_rows

    def add(self, shard_name: str) -> None:
        parsed = layout.parse_completion_shard_name(shard_name)
        if parsed is not None:
            self.ranges.setdefault(parsed[0], []).append((parsed[1], parsed[2]))

    def rows(self, files: list[InputFile], limit: int | None) -> int:
        """Wanted rows a done shard covers, each counted once."""
        return sum(rowranges.covered_rows(self.ranges.get(i, []), s, e) for i, s, e in wanted_ranges(files, limit))


def plan_units(files: list[InputFile], coverage: Coverage, limit: int | None, rows_per_shard: int,
               first_unit_rows: int | None = None) -> list[CompletionUnit]:
    """Every unit of the wanted rows, in row order: each covered piece as one unit (done by `coverage`), each gap
    cut every `rows_per_shard` rows (not done). `first_unit_rows` makes the run's first units to do smaller (the
    canary: their rows come back first)."""
    units: list[CompletionUnit] = []
    small_left = first_unit_rows or 0

    def unit(file_index: int, start: int, stop: int) -> CompletionUnit:
        seek_row, seek_byte = jsonl_input.checkpoint_for(files[file_index].checkpoints, start)
        return CompletionUnit(file_index, files[file_index].uri, start, stop, seek_row, seek_byte)

    for file_index, start, stop in wanted_ranges(files, limit):
        covered = rowranges.merge(coverage.ranges.get(file_index, []))
        gaps = rowranges.gaps(covered, start, stop)
        pieces = [(max(a, start), min(b, stop), True) for a, b in covered if a < stop and b > start]
        for gs, ge, done in sorted(pieces + [(a, b, False) for a, b in gaps]):
            if done:
                units.append(unit(file_index, gs, ge))
                continue
            pos = gs
            while pos < ge:
                size = rows_per_shard
                if small_left > 0:
                    size = min(size, max(1, small_left // 4), small_left)  # ≥4 units, so several engines share it
                    small_left -= size
                end = min(ge, pos + size)
                units.append(unit(file_index, pos, end))
                pos = end
    return units


def pending_units(files: list[InputFile], done_shard_names: list[str], limit: int | None,
                  rows_per_shard: int, first_unit_rows: int | None = None) -> list[CompletionUnit]:
    """The units still to do: `plan_units` less those the done shards cover."""
    coverage = Coverage(done_shard_names)
    return [u for u in plan_units(files, coverage, limit, rows_per_shard, first_unit_rows) if not coverage.covers(u)]


def count_done_rows(files: list[InputFile], done_shard_names: list[str], limit: int | None) -> int:
    """Wanted rows that a done shard covers, each counted once: shards whose ranges overlap (the same rows cut two
    ways) do not count their common rows twice (`pending_units` agrees: it cuts only the rest)."""
    return Coverage(done_shard_names).rows(files, limit)
