"""The export as a stage of the run, on the workers: `python -m job export RUN --to T --format F --output DIR`.

Where the data is read and written:
- the driver (the `ray job submit` entrypoint, on the head) lists the run's done hidden-state parts, makes the plan
  (its refusals before anything is written), hands out the units, and writes the small files at the end
  (`samples.jsonl`, `dropped.jsonl`, the vocabulary files, speculators' `state.json`, and `export.json` last);
- a Ray task per group of parts counts its samples from the parts' small columns (token ids and loss masks, a few
  bytes a token against the features' kilobytes): which it keeps, which it drops and why, the vocabulary counts;
- from those counts the driver gives every kept sample its trainer index (the trainers name files by it, so it must
  not depend on which worker finishes first), cut at `--limit N` or kept where `--sample F` picks its id;
- an actor per worker writes each group's trainer files (the features read and mapped there, the target's final norm
  applied there where the trainer wants it) and the runner writes the group's done marker (`_export/gNNNNN.json`)
  after them: a rerun redoes only the groups whose marker is missing or was made from other parts, indices or
  settings. Every write goes through the run's writer lock for this export (`export-<to>-<format>-<hash>`), so a
  second exporter into the same output is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from job import layout, scan, storage
from job.config import RunConfig, to_dict
from job.export import files
from job.export.conversations import export_conversations
from job.export.trainer_format import EXPORT_JSON, ExportError
from job.pipeline import job_errors_surface, runtime_env
from job.progress import Progress
from job.stage import Stage, StageSummary, run_stage

DONE_DIR = "_export"
"""Each group's done marker, in the export's output (a trainer reads only its own file kinds)."""
PARTS_PER_GROUP = 16
"""Hidden-state parts per unit: one Ray task each, and one speculators dataset file. At the 27B run's 8 rows of ~2,500
tokens a part (1.4 GB of features), a group is ~23 GB: seconds to minutes of a worker's network."""


@dataclass
class ExportGroup:
    """One unit: a group of the run's done hidden-state parts, the kept samples' ids in it (after --limit/--sample)
    and the trainer index of the first."""
    index: int
    parts: list[tuple[str, int]]
    """(URI, size) of each part."""
    ids: list[str] = field(default_factory=list)
    offset: int = 0
    num_groups: int = 1
    done: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    def marker(self, identity: dict) -> dict:
        """What this group's done marker must say to count: its parts, its samples and indices, the settings."""
        return {"group": self.index, "of": self.num_groups, "parts": [[layout_name(u), s] for u, s in self.parts],
                "offset": self.offset, "num_samples": len(self.ids), "ids_sha256": _sha("\n".join(self.ids)),
                "identity": identity}

    def to_row(self) -> dict:
        return {"index": self.index, "parts": json.dumps(self.parts), "ids": json.dumps(self.ids),
                "offset": self.offset, "num_groups": self.num_groups}


def layout_name(uri: str) -> str:
    return uri.rsplit("/", 1)[-1]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def marker_uri(output: str, group: int) -> str:
    return storage.join(output, DONE_DIR, f"g{group:05d}.json")


@dataclass(kw_only=True)
class ExportSummary(StageSummary):
    num_samples: int = 0
    num_dropped: int = 0
    bytes_written: int = 0
    manifest: dict = field(default_factory=dict)


class ExportStage(Stage):
    label, unit_noun, directory = "export", "groups of parts", None

    def __init__(self, config: RunConfig, request: dict):
        super().__init__(config)
        self.request = request
        self.key = f"export-{request['to']}-{request['format']}-{_sha(request['output'])[:8]}"

    def worker_paths(self) -> dict:
        return {"RUN": self.config.output, "--output": self.request["output"]}

    def identity(self, record) -> dict:
        r = self.request
        return {k: r[k] for k in ("to", "format", "output", "layers", "loss_turns", "limit", "sample",
                                  "parts_per_group")}

    def plan(self, fence, changed) -> list[ExportGroup]:
        c, r = self.config, self.request
        parts = scan.done_hidden_state_parts(c.output, c.storage)
        if not parts:
            raise ExportError(f"export: no hidden-state shards under {storage.join(c.output, layout.HIDDEN_STATES_DIR)}"
                              ": run stage 2 first (`python -m job hidden-states ...`)")
        self.shard_uris = [u for u, _ in parts]
        self.plan_, self.fields, self.vocab = files.plan_export(
            c.output, r["to"], r["format"], r["layers"], r["draft_vocab_size"], r["target_vocab_size"],
            r["loss_turns"], r["draft_config"], r["model"], c.storage, self.shard_uris)
        size = r["parts_per_group"] or PARTS_PER_GROUP
        starts = range(0, len(parts), size)
        groups = [ExportGroup(g, parts[i:i + size], num_groups=len(starts)) for g, i in enumerate(starts)]
        self.ray_session.start()
        self.counts = files.count_groups(groups, self.plan_, c, r["sample"])
        files.assign_indices(groups, self.counts, r["limit"])
        self.marker_identity = {**self.identity(None), "plan": self.plan_.conventions()}
        existing = {name for name, _, _ in storage.list_file_infos(storage.join(r["output"], DONE_DIR), ".json",
                                                                    c.storage)}
        for g in groups:
            name = layout_name(marker_uri(r["output"], g.index))
            g.done = not g.ids or (name in existing and storage.read_json(
                marker_uri(r["output"], g.index), c.storage).get("expected") == g.marker(self.marker_identity))
        return groups

    def is_done(self, unit: ExportGroup) -> bool:
        return unit.done

    def mark_done(self, summary: dict, fence) -> None:  # after its writer committed every file of the group
        fence.write_json(marker_uri(self.request["output"], int(summary["group"])), json.loads(summary["marker"]))

    def execute(self, ray_session, units, pending, fence) -> None:
        """One Ray task per group (`files.write_group`), at most `--workers` at once (default: as many as the cluster
        runs), each group marked done as its task returns; on an error the tasks still running are cancelled."""
        import ray  # heavy: imported on use

        ray_session.start()
        task = ray.remote(num_cpus=1, max_retries=3)(files.write_group).options(runtime_env=runtime_env(self.config))
        window = self.request["workers"] or len(pending)
        total, to_do = sum(u.num_rows for u in units), sum(u.num_rows for u in pending)
        tracker = Progress(total_rows=total, done_rows=total - to_do, label=self.label, tokens_key="num_tokens")
        queue, running = list(pending), {}
        args = (to_dict(self.config), self.plan_, self.request["output"], fence, self.marker_identity)
        with tracker, job_errors_surface():
            try:
                while queue or running:
                    while queue and len(running) < window:
                        group = queue.pop(0)
                        running[task.remote(*args, group.to_row())] = group
                    ready, _ = ray.wait(list(running), num_returns=1)
                    running.pop(ready[0])
                    summary = ray.get(ready[0])
                    self.mark_done(summary, fence)
                    tracker.update(summary)
                    self.take(summary)
            except BaseException:
                for ref in running:
                    ray.cancel(ref, force=True)
                raise

    def take(self, summary: dict) -> None:
        self.bytes_written = getattr(self, "bytes_written", 0) + int(summary["bytes_written"])

    def finish(self, units, fence) -> tuple[ExportSummary, dict]:
        r = self.request
        manifest = files.finish(self.config, r, self.plan_, self.fields, self.vocab, units, self.counts, fence)
        s = ExportSummary(output=r["output"], num_samples=manifest["num_samples"],
                          num_dropped=manifest["num_dropped"], bytes_written=getattr(self, "bytes_written", 0),
                          manifest=manifest, report=storage.join(r["output"], EXPORT_JSON))
        return s, {}


def export(run: str, *, to: str, format: str, output: str, layers: list[int] | None = None,
           draft_vocab_size: int | None = None, target_vocab_size: int | None = None, loss_turns: str | None = None,
           draft_config: dict | None = None, model: str | None = None, storage_config=None, limit: int | None = None,
           sample: float | None = None, workers: int | None = None, take_lock: bool = False,
           parts_per_group: int | None = None) -> dict:
    """Write a run in a trainer's format under `output` (local or s3://), the work on the cluster's workers (see the
    module's docstring); returns the manifest also written to `output/export.json` (job/export/manifest.py). File
    names are deterministic and each is written atomically: a rerun finishes what is missing, never a second copy.
    `limit`: the first N samples the trainer keeps, in the run's order; `sample`: the samples whose id falls in that
    fraction (by a hash of the id: the same ones every time). `draft_config`: the user's own, refused before anything
    is written when its layer ids disagree with the export's. `model`: the target's directory on this machine and the
    workers' (default: the path the run recorded)."""
    from job.config import from_dict

    inside = [a for a, b in ((output, run), (run, output)) if a.rstrip("/").startswith(b.rstrip("/") + "/")]
    if output.rstrip("/") == run.rstrip("/") or inside:
        raise ExportError(f"export: --output {output} must lie outside the run directory {run} (and not hold it)")
    if sample is not None and not 0 < sample <= 1:
        raise ExportError(f"export: --sample {sample}: a fraction in (0, 1]")
    if limit is not None and limit < 1:
        raise ExportError(f"export: --limit {limit}: at least 1")
    if to == "specforge" and format == "conversations":
        return export_conversations(run, output=output, storage_config=storage_config)
    record = scan.require_run(run, storage_config, hint="`export` takes the --output of a finished stage 2")
    config = from_dict(record.config) if record.config else RunConfig(model=model or "")
    import dataclasses

    config = dataclasses.replace(config, output=run, storage=storage_config or config.storage)
    request = {"to": to, "format": format, "output": output, "layers": layers, "draft_vocab_size": draft_vocab_size,
               "target_vocab_size": target_vocab_size, "loss_turns": loss_turns, "draft_config": draft_config,
               "model": model, "limit": limit, "sample": sample, "workers": workers, "parts_per_group": parts_per_group}
    # Other settings into the same output are no drift to refuse: each group's marker holds the settings it was
    # written with, so every group is written again under the new ones, and the trainer files the new export does
    # not name are deleted at its end.
    return run_stage(ExportStage(config, request), allow_drift=True, take_lock=take_lock).manifest
