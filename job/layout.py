"""The run directory: where every file of a run lives and what its name means. The one place names are made and
parsed; the column schemas are in job/schema.py.

    <output>/run.json                                   settings, identity and status of each stage (job/runs.py)
    <output>/completions/f00000-r0000000000-0000000256.arrow      stage 1: one shard per completion unit
    <output>/attempts/f00000-r0000000000-0000000256.json          stage 1: a unit's attempts in this job
    <output>/hidden_states/f00000-r0000000000-0000000256-p0003.arrow   stage 2: the parts of one completion shard
    <output>/hidden_states/_done/f00000-r0000000000-0000000256.json    stage 2: that shard's done marker
    <output>/reports/generate.json, reports/hidden_states.json   what each stage reports when it ends
    <output>/locks/generate.json, locks/hidden_states.json   each stage's writer lock and fencing epoch (job/lock.py)
    <output>/quarantine/completions/<shard>.<time>       a completion shard that could not be read whole, moved aside

Words used across the package:
- a *unit* is the work of one Ray task, and the resume bookkeeping's atom: it is done or not;
- a *shard* is one Arrow file. A stage-1 unit writes exactly one completion shard; a stage-2 unit reads one
  completion shard and writes its *parts* (rows sorted by length, cut every `rows_per_shard`) and then its marker.
Both stages know what is done from one listing of the output and these names alone, never from per-row state.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

RUN_JSON = "run.json"
COMPLETIONS_DIR = "completions"
ATTEMPTS_DIR = "attempts"
HIDDEN_STATES_DIR = "hidden_states"
DONE_DIR = "_done"
REPORTS_DIR = "reports"
LOCKS_DIR = "locks"
QUARANTINE_DIR = "quarantine"
CACHE_DIR = "cache"
DRAFTS_DIR = "drafts"
SHARD_SUFFIX = ".arrow"
GENERATE_REPORT = "generate.json"
HIDDEN_STATES_REPORT = "hidden_states.json"


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: a completion unit is a row range of one input file and becomes exactly one completion shard
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionUnit:
    """Rows `start:stop` of input file number `file_index`. Its shard is named after them, so the output listing
    alone says which rows are done: resuming is listing, subtracting covered ranges and cutting the rest."""
    file_index: int
    file_uri: str
    start: int
    stop: int
    seek_row: int = 0
    seek_byte: int = 0
    """Plain JSONL: read from this byte offset, where row `seek_row` (a checkpoint at or before `start`) begins."""

    @property
    def shard_name(self) -> str:
        return completion_shard_name(self.file_index, self.start, self.stop)

    @property
    def stem(self) -> str:
        return self.shard_name[:-len(SHARD_SUFFIX)]

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    def to_row(self) -> dict:
        return asdict(self)

    @classmethod
    def from_row(cls, row: dict) -> CompletionUnit:
        """The unit again from its row of a batch (`to_row` went through Ray Data: numpy scalars)."""
        return cls(file_index=int(row["file_index"]), file_uri=str(row["file_uri"]), start=int(row["start"]),
                   stop=int(row["stop"]), seek_row=int(row["seek_row"]), seek_byte=int(row["seek_byte"]))


def completion_shard_name(file_index: int, start: int, stop: int) -> str:
    return f"f{file_index:05d}-r{start:010d}-{stop:010d}{SHARD_SUFFIX}"


_COMPLETION_SHARD = re.compile(r"(?:^|/)f(\d{5,})-r(\d{10})-(\d{10})\.arrow$")  # f00000…f99999, then f100000…


def parse_completion_shard_name(name: str) -> tuple[int, int, int] | None:
    """(file_index, start, stop) of a completion shard's name (or path), or None for any other name."""
    m = _COMPLETION_SHARD.search(name)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def lock_name(stage: str) -> str:
    """Each stage has its own writer lock: stage 2 may run beside stage 1 (it takes the shards committed so far)."""
    return f"{LOCKS_DIR}/{stage}.json"


def rows_cache_name() -> str:
    """The completion shards' small columns in one object (job/rows_cache.py; stage 1 writes it)."""
    return f"{CACHE_DIR}/rows.arrows"  # a JSON header line, then an Arrow IPC stream


def trust_cache_name(kind: str) -> str:
    """The trust cache of one kind of file (job/trust_cache.py): `completions` (stage 1 writes it) or `markers`
    (stage 2)."""
    return f"{CACHE_DIR}/{kind}.jsonz"  # gzip'd JSON; not .gz: pyarrow would (de)compress it by the name


def draft_dir(name: str) -> str:
    """One trained draft's folder (`python -m job train --name NAME`): `draft/` (the directory vLLM serves: config
    and weights), `train.json` (its manifest), `checkpoints/` (Ray Train's, to resume)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ValueError(f"draft name {name!r}: letters, digits, '.', '_' and '-' only")
    return f"{DRAFTS_DIR}/{name}"


def draft_stage(name: str) -> str:
    """The stage key of training the draft `name`: its writer lock and its run.json section."""
    return f"train-{name}"


SERVED_DRAFT_DIR = "draft"
TRAIN_MANIFEST = "train.json"
TRAIN_CHECKPOINTS_DIR = "checkpoints"
WORTH_DIR = f"{REPORTS_DIR}/worth"
"""`python -m job worth`'s served results, one JSON per drafter and format: a rerun serves only what is missing."""
WORTH_REPORT = "worth.json"


def worth_stage(fmt: str) -> str:
    """The stage key of `python -m job worth --format FMT`: its writer lock and its run.json section."""
    return f"worth-{fmt}"


def attempts_name(unit: CompletionUnit) -> str:
    return f"{ATTEMPTS_DIR}/{unit.stem}.json"


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: a hidden-state unit is one completion shard (or its first `row_limit` rows under --limit)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class HiddenStateUnit:
    uri: str
    """Completion shard."""
    stem: str
    """Its path under completions/ without `.arrow` ('/' as '__'); every output name of the unit starts with it."""
    num_rows: int
    """Rows this unit reads from the shard (all of them, or the first `row_limit`)."""
    row_limit: int | None = None
    existing: list[str] = field(default_factory=list)
    """Names of this unit's files already under hidden_states/ (the driver lists once for all units), without
    `stale` markers."""
    stale: list[str] = field(default_factory=list)
    """Markers of this shard made from another content of it (the driver deletes them; not sent to actors)."""
    counts: dict | None = None
    """The shard's counts from its footer (scan.shard_counts) when it has them: the driver's estimate uses them;
    not sent to actors."""
    marker: dict | None = None
    """The marker that makes this unit done, when the driver read it (its report uses it); not sent to actors."""

    @property
    def tag(self) -> str:
        return hidden_state_tag(self.stem, self.row_limit)

    def part_name(self, index: int) -> str:
        return hidden_state_part_name(self.stem, self.row_limit, index)

    @property
    def marker_name(self) -> str:
        return hidden_state_marker_name(self.stem, self.row_limit)

    @property
    def done(self) -> bool:
        return self.marker_name in self.existing

    def owns(self, name: str) -> bool:
        """Whether `name` (relative to hidden_states/) is a part or marker of this shard, under any limit."""
        return hidden_state_file_stem(name) == self.stem

    def to_row(self) -> dict:
        return {"uri": self.uri, "stem": self.stem, "num_rows": self.num_rows,
                "row_limit": -1 if self.row_limit is None else self.row_limit, "existing": json.dumps(self.existing)}

    @classmethod
    def from_row(cls, row: dict) -> HiddenStateUnit:
        limit = int(row["row_limit"])
        return cls(uri=str(row["uri"]), stem=str(row["stem"]), num_rows=int(row["num_rows"]),
                   row_limit=None if limit < 0 else limit, existing=json.loads(row["existing"]))


def hidden_state_stem(completion_uri: str, completions_dir: str) -> str:
    return completion_uri[len(completions_dir) + 1:-len(SHARD_SUFFIX)].replace("/", "__")


def hidden_state_tag(stem: str, row_limit: int | None) -> str:
    """The stem, plus `-n<limit>` when a --limit cut the shard: parts of different limits never share names."""
    return stem if row_limit is None else f"{stem}-n{row_limit}"


def hidden_state_part_name(stem: str, row_limit: int | None, index: int) -> str:
    """Part `index` of a completion shard's hidden states (relative to hidden_states/)."""
    return f"{hidden_state_tag(stem, row_limit)}-p{index:04d}{SHARD_SUFFIX}"


def hidden_state_marker_name(stem: str, row_limit: int | None) -> str:
    """The done marker of a completion shard's hidden states (relative to hidden_states/), written after its last
    part."""
    return f"{DONE_DIR}/{hidden_state_tag(stem, row_limit)}.json"


_PART = re.compile(r"([^/]+?)(?:-n(\d+))?-p(\d{4})" + re.escape(SHARD_SUFFIX))
_MARKER = re.compile(re.escape(DONE_DIR) + r"/(.+?)(?:-n(\d+))?\.json")


def parse_part_name(name: str) -> tuple[str, int | None, int] | None:
    """(completion-shard stem, --limit or None, part index) of a stage-2 part's name (relative to hidden_states/;
    parts live at its top level), or None for any other name."""
    m = _PART.fullmatch(name)
    return (m[1], int(m[2]) if m[2] else None, int(m[3])) if m else None


def parse_marker_name(name: str) -> tuple[str, int | None] | None:
    """(completion-shard stem, --limit or None for the whole shard) of a stage-2 done marker's name (relative to
    hidden_states/), or None for any other name."""
    m = _MARKER.fullmatch(name)
    return (m[1], int(m[2]) if m[2] else None) if m else None


def hidden_state_file_stem(name: str) -> str | None:
    """The completion-shard stem of a stage-2 part or marker (name relative to hidden_states/), None for others."""
    parsed = parse_marker_name(name) or parse_part_name(name)
    return parsed[0] if parsed else None
