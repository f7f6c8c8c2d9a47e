"""run.json, typed: the one module that reads, checks and writes a run's record.

    <output>/run.json
    {"config": {...}, "versions": {...}, "git_sha": "...", "created_at": "...",       the run's provenance (stage 1's)
     "generate": {"status": ..., "identity": {...}, "input": {...}, "sampling": {...}, "canary_passed": ..., ...},
     "hidden_states": {"status": ..., "identity": {...}, "estimate": {...}, "provenance": {...}}}

`RunRecord.from_dict` reads any run.json this project ever wrote: a field an older file lacks takes its default, a
field it does not know (a newer writer's, or a stage it does not model) is kept as it is and written back unchanged.
A field of the wrong type is refused in one line naming it (`RunError`). Writers go through `update`, which merges
the fields of one stage's section under the stage's fence, with a conditional write (two stages may run at once).

run.json holds no credentials: everything written passes job/redaction.py's `redact` first (by key name at any
depth, and by value). Reports and the notebook read run.json, so they never see them either.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from job import conditional, layout, storage
from job.config import RunConfig, to_dict
from job.redaction import redact
from job.runs import RunError, git_sha, package_versions

# A stage's status in its section: what `status`, the notebook and the next command read.
RUNNING, COMPLETE, FAILED, PARTIAL, CANARY_FAILED = "running", "complete", "failed", "partial", "canary_failed"


@dataclass(kw_only=True)
class StageRecord:
    """What every stage records of itself."""
    status: str | None = None
    """running, complete, failed, canary_failed (stage 1) or partial (stage 2 over an unfinished stage 1)."""
    identity: dict = field(default_factory=dict)
    """The settings that shape the stage's output: a resume that changes one is refused (job/stage.py)."""
    error: str | None = None
    """The one line a failed job ended with."""
    provenance: dict | None = None
    """A later stage's own config, package versions and git sha (stage 1's are the run's, at the top)."""
    extra: dict = field(default_factory=dict)
    """Fields this version does not model (a newer writer's): kept and written back as they are."""


@dataclass(kw_only=True)
class InputRecord:
    """Stage 1's input as it was when the run started: the next resume refuses other content."""
    uri: str | None = None
    format: str | None = None
    num_files: int | None = None
    num_rows: int | None = None
    """The rows this run produces (all, or --limit's)."""
    files: list | None = None
    """Each file's name, size and content digests (job/generate/inputs.py `describe_files`)."""
    columns: str | None = None
    """The carried columns' Arrow schema, serialized (base64)."""
    extra: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class GenerateRecord(StageRecord):
    input: InputRecord = field(default_factory=InputRecord)
    sampling: dict = field(default_factory=dict)
    """The sampling settings the engines used (the model's generation_config under the config's)."""
    canary_passed: bool = False
    num_engines: int | None = None
    max_num_seqs: dict = field(default_factory=dict)
    """Device name → the max_num_seqs its engines ran with."""
    max_num_seqs_auto: dict = field(default_factory=dict)
    output_tokens_per_s: float | None = None
    lengths: dict = field(default_factory=dict)
    """The completed rows' token counts (rows, prompt_tokens, output_tokens, output_tokens_sq: sums, error rows left
    out), from the canary on: the measured length mix a later job's `max_num_seqs: auto` sizes for
    (job/generate/length_mix.py)."""


@dataclass(kw_only=True)
class HiddenStatesRecord(StageRecord):
    estimate: dict | None = None
    """What stage 2 said it would store (bytes per token, tokens, bytes): job/hidden_states/plan.py."""


@dataclass(kw_only=True)
class TrainRecord(StageRecord):
    """One trained draft (`python -m job train --name NAME`: the section `train-NAME`)."""
    draft: str | None = None
    """The directory vLLM serves."""
    format: str | None = None
    epochs_done: int = 0
    steps: int = 0
    samples: int = 0
    """Samples trained, every epoch counted."""
    tokens: int = 0
    last_loss: float | None = None


@dataclass(kw_only=True)
class WorthRecord(StageRecord):
    """`python -m job worth --format FMT` (the section `worth-FMT`): its verdict; the figures are in
    reports/worth.json."""
    verdict: str | None = None
    worth_training: bool | None = None
    """True / False against the target's MTP head; None where the target has none (or it could not be served)."""


STAGE_RECORDS: dict[str, type[StageRecord]] = {"generate": GenerateRecord, "hidden_states": HiddenStatesRecord}
"""The section of each stage, by its key (job/stage.py `Stage.key`); `train-<name>` reads as a TrainRecord,
`worth-<format>` as a WorthRecord, another key as a plain StageRecord."""


def record_class(key: str) -> type[StageRecord]:
    if key in STAGE_RECORDS:
        return STAGE_RECORDS[key]
    return TrainRecord if key.startswith("train-") else WorthRecord if key.startswith("worth-") else StageRecord


@dataclass(kw_only=True)
class RunRecord:
    config: dict = field(default_factory=dict)
    """Stage 1's resolved config (job/config.py `to_dict`), redacted."""
    versions: dict = field(default_factory=dict)
    git_sha: str | None = None
    created_at: str | None = None
    stages: dict[str, StageRecord] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def generate(self) -> GenerateRecord | None:
        return self.stages.get("generate")  # type: ignore[return-value]

    @property
    def hidden_states(self) -> HiddenStatesRecord | None:
        return self.stages.get("hidden_states")  # type: ignore[return-value]

    def status(self, stage_key: str, default: str | None = None) -> str | None:
        record = self.stages.get(stage_key)
        return record.status if record is not None and record.status is not None else default

    def setting(self, dotted: str, default: Any = None) -> Any:
        """A value of the run's recorded config by its dotted key (`generate.rows_per_shard`), or `default`."""
        value: Any = self.config
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                return default
            value = value[part]
        return value

    @property
    def rows_total(self) -> int | None:
        """The rows the run produces, as stage 1 recorded (None before it started)."""
        return self.generate.input.num_rows if self.generate is not None else None

    # --- JSON ------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, where: str = layout.RUN_JSON) -> RunRecord:
        if not isinstance(data, dict):
            raise RunError(f"{where}: not a JSON object")
        top = {f.name for f in dataclasses.fields(cls)} - {"stages", "extra"}
        stages, extra = {}, {}
        for key, value in data.items():
            if key in top:
                continue
            if key in STAGE_RECORDS or (isinstance(value, dict) and "status" in value):
                stages[key] = _build(record_class(key), value, f"{where}: {key}")
            else:
                extra[key] = value
        fields = {k: _checked(cls, k, data[k], where) for k in top if k in data}
        return cls(**fields, stages=stages, extra=extra)

    def to_dict(self) -> dict:
        out = dict(self.extra)
        out.update({k: getattr(self, k) for k in ("config", "versions", "git_sha", "created_at")})
        out.update({key: _unbuild(record) for key, record in self.stages.items()})
        return out


def _hint(cls, name: str):
    return {f.name: f for f in dataclasses.fields(cls)}[name].type


_TYPES = {"dict": dict, "list": list, "str": str, "int": int, "float": (int, float), "bool": bool}


def _checked(cls, name: str, value, where: str):
    """`value` for field `name` of `cls`, refused (RunError naming it) when it is not of the field's type."""
    hint = str(_hint(cls, name)).replace("dict[str, StageRecord]", "dict")
    if value is None and "None" in hint:
        return value
    kind = hint.split("[")[0].split(" |")[0].strip()
    expected = _TYPES.get(kind)
    if expected is not None and not isinstance(value, expected):
        raise RunError(f"{where}: {name} is {value!r}, not a {kind}: this run.json was changed by hand or by "
                       "another program; restore it, or use a new --output")
    return value


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise RunError(f"{where}: not a JSON object")
    known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    values = {}
    for name in known & data.keys():
        if name == "input" and cls is GenerateRecord:
            values[name] = _build(InputRecord, data[name], f"{where}.input")
        else:
            values[name] = _checked(cls, name, data[name], where)
    return cls(**values, extra={k: v for k, v in data.items() if k not in known})


def _unbuild(record) -> dict:
    out = dict(record.extra)
    for f in dataclasses.fields(record):
        if f.name == "extra":
            continue
        value = getattr(record, f.name)
        out[f.name] = _unbuild(value) if dataclasses.is_dataclass(value) else value
    return out


def _apply(record: StageRecord, fields: dict) -> None:
    """Set `fields` on a stage's section; a name the section does not have is a programmer's error."""
    known = {f.name for f in dataclasses.fields(record)} - {"extra"}
    unknown = set(fields) - known
    assert not unknown, f"{type(record).__name__} has no field {sorted(unknown)}"
    for name, value in fields.items():
        if name == "input" and isinstance(value, dict):
            value = _build(InputRecord, value, "input")
        setattr(record, name, value)


# --- reading and writing ---------------------------------------------------------------------------------------


def run_json_uri(output: str) -> str:
    return storage.join(output, layout.RUN_JSON)


def read(output: str, storage_config) -> RunRecord | None:
    """The run's record, or None. Every command reads it first: a run location that cannot work at all (a host
    that does not resolve, a bucket that does not exist) is refused here, at once, in one line."""
    storage.check_reachable(output, storage_config)
    uri = run_json_uri(output)
    if not storage.exists(uri, storage_config):
        return None
    return RunRecord.from_dict(storage.read_json(uri, storage_config), uri)


def update(config: RunConfig, stage_key: str, fence, **fields) -> RunRecord:
    """Merge `fields` into run.json's `stage_key` section and return the record as written. Two stages may run at
    once (each has its own writer lock), so the update is a read-modify-write made conditional on run.json being
    unchanged since the read (S3 If-Match; locally under a flock), retried on a conflict; it commits only while
    `fence` (the stage's, job/lock.py) is current."""
    uri = run_json_uri(config.output)
    store = conditional.conditional_object(uri, config.storage)
    provenance = {"config": to_dict(config), "versions": package_versions(), "git_sha": git_sha()}
    for _ in range(20):
        try:
            data, etag, _ = store.read()
        except FileNotFoundError:
            data, etag = {}, None
        record = RunRecord.from_dict(data, uri)
        if stage_key == "generate" or not record.config:  # the run's own: stage 1's config (rows, sampling, input)
            record.config, record.versions, record.git_sha = (provenance["config"], provenance["versions"],
                                                              provenance["git_sha"])
            section_fields = fields
        else:  # a later stage keeps stage 1's provenance and records its own beside it
            section_fields = {**fields, "provenance": provenance}
        record.created_at = record.created_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        section = record.stages.setdefault(stage_key, record_class(stage_key)())
        _apply(section, section_fields)
        body = json.dumps(redact(record.to_dict()), indent=2, sort_keys=True, default=str).encode() + b"\n"
        try:
            with fence.guard():
                if etag is None:
                    store.create(body)
                else:
                    store.replace(body, etag)
            return record
        except conditional.Conflict:  # the other stage wrote in between: read again and merge again
            time.sleep(0.05)
    raise RunError(f"{uri}: could not update it (it kept changing under this job)")
