"""Stage 1: prompt shards (parquet, JSONL, Arrow) → vLLM engine actors → completion shards.

    python -m job generate --config configs/demo.yaml --output demo-run

Modules, in the order a row meets them:
    run.py          the stage as job/stage.py's runner takes it (a short declaration)
    preflight.py    before the lock: the config that can work, the input read and identified, the identity
    inputs.py       listing, validation and identity of input files (jsonl_input.py and
                    arrow_input.py read those formats by row range)
    units.py        the work units and the ledger: wanted rows, the pieces done shards cover, the gaps cut
                    every rows_per_shard
    completions.py  the trusted completion shards (others to quarantine/), the caches saved of them
    prompts.py      input rows → chat messages → the model's chat template → token ids
    engine.py       the Ray Data actor: one vLLM engine per GPU (or tensor-parallel group), one unit per call
    summary.py      each unit's summary taken: totals, the canary's verdict
    quality.py      per-row quality flags and the canary's verdict
    report.py       the run report (quality flag rates, lengths, finish reasons, errors), stored when stage 1 ends
"""

from job.generate.report import print_summary
from job.generate.run import CanaryFailed, GenerateSummary, run_generate

__all__ = ["run_generate", "GenerateSummary", "CanaryFailed", "print_summary"]
