"""Stage 1: prompt shards (parquet, JSONL, Arrow) → vLLM engine actors → completion shards.

    python -m job generate --config configs/demo.yaml --output demo-run

Modules, in the order a row meets them:
    run.py          the driver: input scan and validation, resume, units, the pipeline, the canary, the report
    inputs.py       listing, validation and identity of input files (jsonl_input.py and
                    arrow_input.py read those formats by row range)
    units.py        the work units: wanted row ranges minus the listed shards, cut every rows_per_shard
    prompts.py      input rows → chat messages → the model's chat template → token ids
    engine.py       the Ray Data actor: one vLLM engine per GPU (or tensor-parallel group), one unit per call
    quality.py      per-row quality flags and the canary's verdict
    report.py       the run report (quality flag rates, lengths, finish reasons, errors), stored when stage 1 ends
"""

from job.generate.report import print_summary
from job.generate.run import CanaryFailed, GenerateSummary, run_generate

__all__ = ["run_generate", "GenerateSummary", "CanaryFailed", "print_summary"]
