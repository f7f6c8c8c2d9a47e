"""Row ranges: the arithmetic of stage 1's resume and of `status`, written once. Pure (no I/O), so its corner cases
are unit-tested in milliseconds (tests/test_rules.py).

A range is `(start, stop)`, half-open, of one input file's rows; a completion shard's name gives one
(job/layout.py). Ranges of done shards may overlap (a shard regenerated under another cut, a shard written by a
job taken over mid-unit): every count here merges them first, so a row is counted once however many shards hold it.
"""

from __future__ import annotations

from collections.abc import Iterable

Range = tuple[int, int]


def by_file(ranges: Iterable[tuple[int, int, int]]) -> dict[int, list[Range]]:
    """(file_index, start, stop) triples → {file_index: its ranges}, in the order given."""
    out: dict[int, list[Range]] = {}
    for file_index, start, stop in ranges:
        out.setdefault(file_index, []).append((start, stop))
    return out


def merge(ranges: Iterable[Range]) -> list[Range]:
    """The union of `ranges` as sorted, disjoint, non-touching ranges; empty ranges are dropped."""
    out: list[list[int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [(a, b) for a, b in out]


def gaps(covered: Iterable[Range], start: int, stop: int) -> list[Range]:
    """The rows of `start:stop` that no range of `covered` holds, as sorted ranges."""
    out, pos = [], start
    for a, b in merge(covered):
        if b <= pos:
            continue
        if a >= stop:
            break
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < stop:
        out.append((pos, stop))
    return out


def covered_rows(covered: Iterable[Range], start: int = 0, stop: int | None = None) -> int:
    """Rows of `start:stop` (stop None: no upper bound) that some range of `covered` holds, each counted once."""
    total = 0
    for a, b in merge(covered):
        a, b = max(a, start), b if stop is None else min(b, stop)
        total += max(0, b - a)
    return total


def holes(covered: Iterable[Range]) -> list[Range]:
    """Rows missing *between* ranges of `covered` (from row 0 to the last covered row): units in flight in a running
    job, or lost with a dead one. Rows after the last range are not holes (a run directory does not know file
    lengths)."""
    merged = merge(covered)
    return gaps(merged, 0, merged[-1][1]) if merged else []

