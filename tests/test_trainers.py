"""One run serves every trainer, proven by training (issue 29): the shared run (configs/demo.yaml, whose default layer
set is every trainer's) exports to all four trainer formats, and each export trains for 5 optimizer steps of the
trainer's OWN training code (SpecForge 0.2.0, speculators 0.9.0) on CPU, in the trainers' environment
(`make trainers`, .venv-trainers): the loss finite, positive and falling on a repeated batch, gradients non-zero.

Slow tier: the trainers' imports and 4 × 5 steps take ~35 s here, and the environment is built by `make trainers`
(~1 min, once; `make test-all` / `make test-slow` build it first). Outside CI a checkout without it skips the test;
in CI (`CI` set) its absence fails it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

TRAINERS_PYTHON = REPO / ".venv-trainers" / "bin" / "python"
FORMATS = [("specforge", "dflash"), ("specforge", "eagle3"), ("speculators", "dflash"), ("speculators", "eagle3")]


def trainers_environment() -> None:
    if not TRAINERS_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-trainers is missing: `make test-all` builds it (make trainers)")
        pytest.skip("no .venv-trainers: run `make trainers` (~1 min) to run the training check")


def train_check(exports: list[str]) -> dict[str, dict]:
    """`python -m job train-check --json` on the exports: {export dir: its result}; the exit status must agree."""
    proc = subprocess.run([sys.executable, "-m", "job", "train-check", *exports, "--steps", "5", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["export"]] = result
    assert set(results) == set(exports), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == (1 if any(r["problems"] for r in results.values()) else 0), proc.stderr[-3000:]
    return results


def assert_trained(result: dict) -> None:
    steps = result["steps"]
    assert result["problems"] == [], result
    assert len(steps) == 5 and all(s["loss"] > 0 and s["grad_norm"] > 0 for s in steps), steps
    assert steps[-1]["loss"] < steps[0]["loss"], steps
    assert all(0 <= s["accuracy"] <= 1 for s in steps), steps


@pytest.mark.slow
def test_every_export_of_the_demo_run_trains(shared_run, tmp_path):
    trainers_environment()
    from job.cli import main

    exports = []
    for to, fmt in FORMATS:
        out = str(tmp_path / f"{to}-{fmt}")
        assert main(["export", shared_run.full, "--to", to, "--format", fmt, "--output", out]) == 0
        manifest = json.load(open(os.path.join(out, "export.json")))
        # The manifest: the trainer's default layers in both conventions, a draft config that names them.
        assert manifest["layers"]["our_aux_layer_ids"] == [0, 1, 2]
        assert manifest["layers"]["vllm_aux_layer_ids"] == [1, 2, 3]
        last = manifest["layers"].get("last_layer")
        if (to, fmt) == ("specforge", "dflash"):
            assert last is None  # DFlash's context layers [0, 1, 2]: no last layer
        else:  # stored before the norm; SpecForge gets it after (the export applies the norm), speculators before
            assert last["stored"] == "before the final norm" and last["norm_applied_by_export"] == (to == "specforge")
        assert manifest["draft_config"] and manifest["target"]["num_layers"] == 4
        exports.append(out)
    for result in train_check(exports).values():
        assert_trained(result)

    # A draft config naming other layers is refused before anything is written: SpecForge's files carry no layer
    # ids, so the trainer would train on the wrong ones without a word.
    config = json.load(open(os.path.join(exports[0], "export.json")))["draft_config"]
    config["dflash_config"]["target_layer_ids"] = [0, 1, 3]
    bad = tmp_path / "draft.json"
    bad.write_text(json.dumps(config))
    out = tmp_path / "refused"
    assert main(["export", shared_run.full, "--to", "specforge", "--format", "dflash", "--output", str(out),
                 "--draft-config", str(bad)]) == 2
    assert not out.exists()
