"""What a run's data is worth, on the user's own target: `python -m job worth RUN [--format eagle3|dflash]`.

    1. a draft trained on the run with a held-out slice of its samples left out (`python -m job train`'s own code,
       `--holdout`: by a hash of the id, the same ids every time);
    2. the target served by vLLM on the held-out prompts, alone and with each drafter in turn: the trained draft,
       the same draft untrained (what training added), and the target's own MTP head where it has one (what the
       model already has); one engine per process, on a GPU of the cluster where it has one (stage.py);
    3. counted by vLLM's own spec-decode counters, greedy and at the run's own sampling settings: τ, acceptance per
       draft position, τ at each draft length, τ by prompt length, decode tokens/s beside the target's alone, and
       whether every drafter's greedy output is the target's (verdict.py);
    4. the verdict on stdout, RUN/reports/worth.json and a plot (RUN/reports/worth-<format>.png).
"""

from job.worth.stage import WorthOptions, run_worth

__all__ = ["WorthOptions", "run_worth"]
