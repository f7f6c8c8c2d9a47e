"""What stage 1 makes of its units' summaries as they arrive (totals, the engines' lines, the canary's verdict, the
trust cache kept fresh) and the summary it returns."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from job import errors, layout, lock, run_record, storage
from job.config import RunConfig
from job.generate import length_mix, quality
from job.generate.completions import CACHE_REFRESH_S, remember_shards
from job.generate.report import write_report
from job.stage import StageSummary

log = logging.getLogger("job.generate")


class CanaryFailed(errors.Verdict):
    """The first rows say the dataset would be useless; the message says what to check."""
    run_status = run_record.CANARY_FAILED


@dataclass(kw_only=True)
class GenerateSummary(StageSummary):
    num_rows_total: int
    num_rows_done_before: int
    num_rows: int = 0
    num_errors: int = 0
    num_output_tokens: int = 0
    generation_seconds: float = 0.0
    already_complete: bool = False
    units_per_node: dict[str, int] = field(default_factory=dict)  # Ray node id → units its engines wrote
    max_num_seqs: dict[str, int] = field(default_factory=dict)  # device name → the engines' max_num_seqs on it
    sizing: dict[str, dict] = field(default_factory=dict)  # device name → `max_num_seqs: auto`'s check (engine_sizing)
    quality: dict | None = None  # the quality report as this job stored it (print_summary shows it; no second read)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.generation_seconds if self.generation_seconds else 0.0


class UnitTotals:
    """Each unit's summary as it arrives: the totals, a line per device type the first time its engines report, the
    canary's verdict once its rows are in (`run_canary`), and the trust cache refreshed every CACHE_REFRESH_S."""

    def __init__(self, config: RunConfig, summary: GenerateSummary, run_canary: bool, fence: lock.Fence,
                 lengths: dict | None = None):
        self.config, self.summary, self.run_canary, self.fence = config, summary, run_canary, fence
        # The run's measured length mix: what run.json held when the job started + this job's units (length_mix.py).
        self.lengths = self.lengths_at_start = length_mix.add_lengths(lengths, {})
        self.canary_rows, self.window_start = 0, None
        self.cache_saved = time.monotonic()
        self.flags: dict[str, int] = {}

    def __call__(self, s: dict) -> None:
        summary = self.summary
        if self.window_start is None:  # the generation window opens when the first finished unit started
            self.window_start = time.monotonic() - s["seconds"]
        summary.num_rows += s["num_rows"]
        summary.num_errors += s["num_errors"]
        summary.num_output_tokens += s["num_output_tokens"]
        summary.files.append(s["shard"])
        summary.units_per_node[s["node"]] = summary.units_per_node.get(s["node"], 0) + 1
        for k, v in s.items():
            if k.startswith("num_"):
                self.flags[k] = self.flags.get(k, 0) + int(v)
        self.lengths = length_mix.add_lengths(self.lengths,
                                              {k: s.get(f"lengths_{k}", 0) for k in length_mix.LENGTH_KEYS})
        if s["device"] and summary.max_num_seqs.get(s["device"]) != s["max_num_seqs"]:  # auto: per GPU type
            summary.max_num_seqs[s["device"]] = s["max_num_seqs"]
            print(f"engines on {s['device']}: max_num_seqs {s['max_num_seqs']}"
                  + (f" ({s['sizing']})" if s["sizing"] else ""), flush=True)
            if s["sizing"]:
                summary.sizing[s["device"]] = {"max_num_seqs": s["max_num_seqs"], "vllm_pool_holds": s["sizing_holds"],
                                               "check": s["sizing"]}
        if self.run_canary and self.canary_rows < self.config.quality.canary_rows:
            self._canary(s["num_rows"])
        if time.monotonic() - self.cache_saved > CACHE_REFRESH_S:
            remember_shards(self.config, self.fence)
            run_record.update(self.config, "generate", self.fence, lengths=self.lengths)
            self.cache_saved = time.monotonic()

    def _canary(self, rows: int) -> None:
        self.canary_rows += rows
        if self.canary_rows < self.config.quality.canary_rows:
            return
        verdict = quality.canary_verdict(self.flags, self.config.quality)
        if verdict:  # the stage runner records it (CanaryFailed.run_status)
            raise CanaryFailed(f"{verdict}\nThe {self.summary.num_rows} rows written so far stay in "
                               f"{self.config.output} for inspection; after fixing, run into a new --output.")
        print(f"canary passed on the first {self.canary_rows} rows", flush=True)
        line = length_mix.canary_line(self.config, self.lengths, self.lengths_at_start)
        if line:
            print(line, flush=True)
        run_record.update(self.config, "generate", self.fence, canary_passed=True, lengths=self.lengths)

    def window(self) -> float:
        return time.monotonic() - self.window_start if self.window_start else 0.0


def store_report(config: RunConfig, summary: GenerateSummary, fence: lock.Fence) -> None:
    """At the end, after run.json says complete: the shards remembered (S3: the next command reads no footer) and,
    from the same judgement, the report stored at reports/generate.json through the fence."""
    found = remember_shards(config, fence)
    try:
        summary.quality = write_report(config.output, fence, found=found)
        summary.report = storage.join(config.output, layout.REPORTS_DIR, layout.GENERATE_REPORT)
    except storage.StorageError as e:  # every shard is committed: a report that cannot be read now is no failure
        log.warning("the run is complete but its report could not be written (%s); `python -m job report %s` makes "
                    "it later", e, config.output)
