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
    # One line per export, in their order (an s3:// export is checked from a local copy: its line names the copy).
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(exports), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = dict(zip(exports, lines))
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
    """...and a sample exported to S3 (`--limit`, as OPERATIONS proves a launcher) is checked from S3."""
    trainers_environment()
    from job import storage
    from job.cli import main

    exports = []
    for to, fmt in FORMATS:
        on_s3 = (to, fmt) == ("speculators", "eagle3")
        out = f"s3://{shared_run.bucket}/exports/{to}-{fmt}-sample" if on_s3 else str(tmp_path / f"{to}-{fmt}")
        assert main(["export", shared_run.full, "--to", to, "--format", fmt, "--output", out,
                     *(["--limit", "24"] if on_s3 else [])]) == 0
        manifest = storage.read_json(storage.join(out, "export.json"))
        assert not on_s3 or manifest["num_samples"] == 24
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


# ---------------------------------------------------------------------------------------------------------------
# The acceptance measurement (issue 30, bench/bench_acceptance.py): its counting proven on known answers, then on
# the shared run's export with speculators' own draft and forward.
# ---------------------------------------------------------------------------------------------------------------
KNOWN_ANSWERS = r'''
import torch
from job.trainers import acceptance as acc

torch.manual_seed(0)
T, V, K = 40, 11, 5
target = torch.randn(T, V) * 3
loss_mask = torch.tensor([0] * 4 + [1] * 14 + [0] * 3 + [1] * 19)   # two samples: prompt 4 + 14, prompt 3 + 19
docs = torch.tensor([0] * 18 + [1] * 22)
valid = acc.chain_valid(loss_mask, docs, K)
# Chains start inside a completion only, and never draft past their sample's last token.
assert valid[:, 0].tolist() == [i not in (17, 39) and bool(loss_mask[i]) for i in range(T)], valid[:, 0]
assert valid[16].tolist() == [True] + [False] * 4 and valid[4].tolist() == [True] * 5
always = acc.known_answer(valid)
blocks = int(valid[:, 0].sum())
assert blocks == 31 and always[0] == 2.0, always
# By hand: a chain starting at completion position i of a sample with n tokens after it drafts min(k, n) slots.
by_hand = [1 + sum(min(k, n) for n in list(range(13, 0, -1)) + list(range(18, 0, -1))) / 31 for k in range(1, 6)]
assert all(abs(a - b) < 1e-4 for a, b in zip(always, by_hand)), (always, by_hand)
sampling = {"temperature": 1.0, "top_k": None, "top_p": None}

def score(steps):
    c = acc.Counts(K)
    c.add(steps, target, valid, sampling)
    return c.result()

itself = score([target[j:] for j in range(K)])
assert itself["greedy_tau"] == always and max(abs(a - b) for a, b in zip(itself["sampled_tau"], always)) < 1e-4
wrong = [target[j:].scatter(-1, target[j:].argmax(-1, keepdim=True), -1e9) for j in range(K)]
assert score(wrong)["greedy_tau"] == [1.0] * K
two = score([target[j:] if j < 2 else wrong[j] for j in range(K)])  # right on the first two slots only
assert [round(t, 4) for t in two["greedy_tau"]] == [always[0], always[1]] + [always[1]] * 3, two
uniform = score([torch.zeros(T - j, V) for j in range(K)])
alpha = torch.minimum(torch.softmax(target, -1), torch.full((T, V), 1 / V)).sum(-1)[valid[:, 0]]
assert abs(uniform["sampled_tau"][0] - (1 + float(alpha.mean()))) < 1e-4, uniform
# top-k / top-p keep what a sampler keeps: top_k 1 is greedy, so Σ min(p, q) is 1 where the argmaxes agree.
greedy_sampling = {"temperature": 1.0, "top_k": 1, "top_p": None}
c = acc.Counts(K)
c.add([target[j:] if j < 2 else wrong[j] for j in range(K)], target, valid, greedy_sampling)
assert [round(t, 4) for t in c.result()["sampled_tau"]] == [round(t, 4) for t in two["greedy_tau"]]
# vLLM's default rule (the draft's argmax proposed, accepted with the target's probability of it): at top_k 1 that
# probability is 1 where the argmaxes agree, the greedy τ; at T 1, the target as its own drafter is accepted with
# p(its argmax) at each slot, below the Σ min(p, q) = 1 of drafting from its own distribution.
assert [round(t, 4) for t in c.result()["sampled_tau_greedy_draft"]] == [round(t, 4) for t in two["greedy_tau"]]
p1 = torch.softmax(target, -1).max(-1).values[valid[:, 0]]
assert abs(itself["sampled_tau_greedy_draft"][0] - (1 + float(p1.mean()))) < 1e-4, itself
p = acc.sampling_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 1.0, None, 0.7)
assert (p[0] > 0).tolist() == [True, True, False, False] and abs(float(p.sum()) - 1) < 1e-6
print("known answers: ok")
'''

ON_THE_EXPORT = r'''
import json, sys
from job.trainers import acceptance as acc, speculators_train as st

export = sys.argv[1]
manifest = json.load(open(export + "/export.json"))
args = st.resolve_args(export, manifest, manifest["draft_config"], sys.argv[2], ttt_steps=5, epochs=1)
_, model = st.build_model(args)
_, val_kwargs = type(model).get_trainer_kwargs(**vars(args))
loader = st.data_loader(args, model, export)
sampling = acc.target_sampling(manifest["model"])
r = acc.evaluate(model, loader, 5, sampling, val_kwargs, max_batches=12)
print(json.dumps(r))
'''


@pytest.mark.slow
def test_acceptance_is_counted_right(shared_run, tmp_path):
    """The acceptance loop on known answers (the target as its own drafter accepts every slot that exists; a
    drafter right on the first two slots only; a uniform one: Σ min(p, 1/V)), then speculators' own EAGLE-3 draft
    on the shared run's export: the target as drafter is always right there too, and the greedy τ equals the one
    the trainer's own per-step conditional accuracies give. ~30 s (12 batches)."""
    trainers_environment()
    from job.cli import main

    run = lambda code, *argv: subprocess.run([str(TRAINERS_PYTHON), "-c", code, *argv], cwd=REPO,  # noqa: E731
                                             capture_output=True, text=True, timeout=600)
    proc = run(KNOWN_ANSWERS)
    assert proc.returncode == 0 and "known answers: ok" in proc.stdout, proc.stderr[-3000:]

    out = str(tmp_path / "eagle3")
    assert main(["export", shared_run.full, "--to", "speculators", "--format", "eagle3", "--output", out]) == 0
    proc = run(ON_THE_EXPORT, out, str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "disagrees with the target's own final norm" not in proc.stderr  # Qwen3's norm is speculators' (Llama's)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["draft"]["blocks"] == r["target_as_drafter"]["blocks"] > 500, r
    # Equal but for at most one slot of the ~1,000 blocks: an argmax tie the two computations break apart (CI saw
    # 3.975 against 3.974 once, 2026-12-07: one slot in 1,000; rounding to 3 places hid it in every other run).
    one_slot = 1 / r["draft"]["blocks"] + 1e-9
    assert max(abs(a - b) for a, b in zip(r["target_as_drafter"]["greedy_tau"], r["always_right"])) <= one_slot, r
    assert max(abs(a - b) for a, b in zip(r["target_as_drafter"]["sampled_tau"], r["always_right"])) < 1e-3
    assert max(abs(a - b) for a, b in zip(r["draft"]["greedy_tau"], r["trainer_cond_acc_tau"])) < 2e-3, r
    assert all(1.0 <= t <= a for t, a in zip(r["draft"]["sampled_tau"], r["always_right"])), r
    assert 0.3 < r["data_is_target_argmax"] <= 1  # the shared run samples at T 1: ~50 % are the target's argmax


def test_train_check_copies_only_a_sample_from_s3(s3_bucket, tmp_path):
    """An s3:// export is copied here for the trainers' loaders, unless it is the size of a run's (then the error
    says to export a sample); a prefix with nothing under it is named. Local exports pass through as they are."""
    from job import storage
    from job.config import ConfigError
    from job.export.local_copy import local_copies

    uri = f"s3://{s3_bucket}/exports/x"
    storage.write_bytes_atomic(f"{uri}/export.json", b"{}")
    storage.write_bytes_atomic(f"{uri}/hidden_states/hs_0.safetensors", b"0" * 1000)
    with local_copies([str(tmp_path), uri]) as local:
        assert local[0] == str(tmp_path)
        assert open(os.path.join(local[1], "hidden_states", "hs_0.safetensors"), "rb").read() == b"0" * 1000
        copy = local[1]
    assert not os.path.exists(copy)
    with pytest.raises(ConfigError, match="export a sample"):
        with local_copies([uri], max_bytes=500):
            pass
    with pytest.raises(ConfigError, match="holds no files"):
        with local_copies([f"s3://{s3_bucket}/exports/none"]):
            pass
