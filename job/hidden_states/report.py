"""What stage 2 makes of its units' summaries as they arrive (the workers' warnings and self-checks, totals), and
its report at the end: totals over every unit's marker, this job's speed, stored at reports/hidden_states.json."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from job import layout, lock, scan, storage
from job.config import RunConfig
from job.hidden_states.plan import out_dir
from job.layout import HiddenStateUnit
from job.stage import StageSummary


@dataclass(kw_only=True)
class HiddenStatesSummary(StageSummary):
    """What stage 2 returns, and stores as reports/hidden_states.json. Counts are over every unit's marker (this
    invocation's and earlier ones'); `seconds`, `num_tokens_extracted` and the rates are this invocation's."""
    model: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    num_rows: int = 0
    num_samples: int = 0
    num_errors: int = 0
    num_skipped_flagged: int = 0
    num_skipped_empty: int = 0
    num_clipped: int = 0
    num_tokens: int = 0
    num_padded_tokens: int = 0
    num_parts: int = 0
    padding_waste: float = 0.0
    bytes: int = 0
    num_tokens_extracted: int = 0
    extract_seconds: float = 0.0
    """This invocation's time from its first unit's dispatch to its last summary (`seconds` is its whole time)."""
    tokens_per_s: float = 0.0
    feature_bytes_per_s: float = 0.0
    bytes_written: int = 0
    self_checks: list[dict] = field(default_factory=list)
    layers: dict = field(default_factory=dict)
    estimate: dict = field(default_factory=dict)


class ThisRun:
    """Each unit's summary as it arrives: its worker's warnings and self-check said once, this job's totals."""

    def __init__(self):
        self.num_tokens_extracted = self.bytes_written = 0
        self.self_checks: list[dict] = []

    def __call__(self, s: dict) -> None:
        for line in json.loads(s["warnings"])["lines"]:
            print(f"WARNING: {line}", flush=True)
        check = json.loads(s["self_check"])
        if check:
            print(f"exactness self-check passed ({check['where']}): {check['num_samples']} samples of this run, "
                  f"batched vs each alone in a plain transformers forward, differ by at most "
                  f"{check['max_difference']:.2e} (tolerance {check['tolerance']:.0e})", flush=True)
            self.self_checks.append(check)
        self.num_tokens_extracted += s["num_tokens_extracted"]
        self.bytes_written += s["bytes_written"]


MARKER_TOTALS = ("num_rows", "num_samples", "num_errors", "num_skipped_flagged", "num_skipped_empty", "num_clipped",
                 "num_tokens", "num_padded_tokens", "num_parts")


def write_report(config: RunConfig, units: list[HiddenStateUnit], layer_ids: list[int], hidden: int,
                 estimate: dict, this_run: ThisRun, extract_seconds: float, seconds: float,
                 fence: lock.Fence) -> HiddenStatesSummary:
    """Totals over every unit's marker (this invocation's and earlier ones') plus this invocation's speed, stored
    through the fence."""
    out = out_dir(config)

    def marker(u: HiddenStateUnit) -> dict:  # read by the plan (or its trust cache) when done then; else read now
        if u.marker is not None and u.done:
            return u.marker
        return storage.read_json(storage.join(out, u.marker_name), config.storage)

    with ThreadPoolExecutor(storage.PARALLEL_READS) as pool:
        markers = list(pool.map(marker, units))
    totals = {k: sum(int(m.get(k, 0)) for m in markers) for k in MARKER_TOTALS}
    totals_extracted = sum(int(m.get("num_tokens_extracted", 0)) for m in markers)
    # The parts that count (scan's rule: those its marker vouches for), sizes from one listing. The units are the
    # trusted shards, each with its covering marker (plan_units), so this is scan.done_hidden_state_parts without
    # reading every completion shard's footer again.
    sizes = {name: size for name, size, _ in storage.list_file_infos(out, layout.SHARD_SUFFIX, config.storage)}
    parts = {storage.join(out, name): sizes[name] for u, m in zip(units, markers)
             for name in scan.marker_parts(u.stem, u.row_limit, m) if name in sizes}
    tokens_now = this_run.num_tokens_extracted
    report_uri = storage.join(config.output, layout.REPORTS_DIR, layout.HIDDEN_STATES_REPORT)
    summary = HiddenStatesSummary(
        **totals, output=config.output, model=config.model, layer_ids=layer_ids, hidden_size=hidden,
        dtype=config.hidden_states.dtype,
        # Over the batches that ran (a resumed unit's marker counts only the parts it redid).
        padding_waste=1 - totals_extracted / totals["num_padded_tokens"] if totals["num_padded_tokens"] else 0.0,
        bytes=sum(parts.values()), num_tokens_extracted=tokens_now, seconds=seconds, extract_seconds=extract_seconds,
        tokens_per_s=tokens_now / extract_seconds if extract_seconds else 0.0,
        feature_bytes_per_s=tokens_now * estimate["feature_bytes_per_token"] / extract_seconds
        if extract_seconds else 0.0,
        bytes_written=this_run.bytes_written, self_checks=this_run.self_checks,
        layers=layer_rms(markers, layer_ids), estimate=estimate, files=sorted(parts), report=report_uri)
    fence.write_json(report_uri, asdict(summary))
    return summary


def layer_rms(markers: list[dict], layer_ids: list[int]) -> dict:
    """Per layer: the token-weighted RMS over what each marker's run extracted; min/max over samples."""
    layers = {}
    for k in map(str, layer_ids):
        entries = [(m["num_tokens_extracted"], m["feature_stats"][k]) for m in markers
                   if m.get("num_tokens_extracted") and k in m.get("feature_stats", {})]
        if entries:
            n = sum(t for t, _ in entries)
            layers[k] = {"rms": float(np.sqrt(sum(t * e["rms"] ** 2 for t, e in entries) / max(1, n))),
                         "min_sample_rms": min(e["min_sample_rms"] for _, e in entries),
                         "max_sample_rms": max(e["max_sample_rms"] for _, e in entries)}
    return layers
