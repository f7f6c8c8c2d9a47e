"""One drafter of `python -m job worth` served in this process: `python -m job.worth.engine_pass SPEC.json`, started
by worth/stage.py's Ray task. Prints one line, `RESULT {json}`: job/train/serve.py `serve_buckets`' counts.

The drafter, by `spec["drafter"]`:
    target     the target alone (its tokens/s, and the greedy outputs every drafter must reproduce)
    trained    the draft `python -m job train` left (an s3:// one copied here first: vLLM reads a local directory)
    untrained  the same draft model as speculators initializes it, never trained: what training added
    mtp        the target's own multi-token-prediction head (`{"method": "mtp"}`): what the model already has
"""

from __future__ import annotations

import json
import os
import sys


def speculative_config(spec: dict, stack) -> dict | None:
    """vLLM's `speculative_config` for the drafter, its draft made or brought here first."""
    given = spec["speculative_config"]
    if spec["drafter"] in ("target", "mtp"):
        return given
    if spec["drafter"] == "trained":
        from job.export.local_copy import local_copies
        from job.storage import StorageConfig

        [draft] = stack.enter_context(local_copies([spec["draft_uri"]], StorageConfig(**spec["storage"])))
    else:  # untrained: speculators' own initialization of the same draft config, saved as training saves it
        from job.train.step import OnlineDraftStep

        u = spec["untrained"]
        freq = {int(t): int(n) for t, n in u["token_freq"]} if u.get("token_freq") else None
        step = OnlineDraftStep(u["draft_config"], u["format"], spec["model"], os.path.join(spec["workdir"], "init"),
                               token_freq=freq)
        draft = step.save_served(os.path.join(spec["workdir"], "untrained"), given["num_speculative_tokens"])
    method = json.load(open(os.path.join(draft, "config.json")))["speculators_model_type"]
    return {"model": os.path.abspath(draft), "method": method, **given}


def main(path: str) -> int:
    import contextlib

    from job.config import from_dict
    from job.train.serve import serve_buckets

    spec = json.load(open(path))
    with contextlib.ExitStack() as stack:
        result = serve_buckets(spec["model"], speculative_config(spec, stack), spec["buckets"], spec["sampling"],
                               spec["max_tokens"], run_config=from_dict(spec["run_config"]))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
