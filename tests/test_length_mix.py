"""The length mix `max_num_seqs: auto` sizes for (job/generate/length_mix.py): the in-flight tokens of a configured
lognormal against draws from it, the measured mix from a run's sums, which of pinned / measured / configured wins,
and the refusals of a tail no lognormal has. The simulation that chose the rule (bench/sim_concurrency.py) and its
check against vLLM on an H100 are in docs/BENCHMARKS.md."""

from __future__ import annotations

import math
import random

import pytest
from conftest import DEMO_CONFIG, read_run

from job.config import ConfigError, GenerateConfig, load_config
from job.generate import length_mix
from job.generate.length_mix import LengthMix, capped_lognormal_moments, lognormal_sigma, sizing_tokens


def test_the_closed_form_matches_draws_from_the_mix():
    """E[min(L, cap)] and E[min(L, cap)^2] in closed form against 200,000 draws, for the thinking-mode mix (mean
    2,500, p99 16,000, cap 32,768) and a short one whose cap bites (mean 800, p99 6,000, cap 2,048)."""
    for mean, p99, cap in ((2_500, 16_000, 32_768), (800, 6_000, 2_048)):
        mix = LengthMix.configured(mean, p99, cap)
        rng = random.Random(0)
        draws = [mix.draw(rng) for _ in range(200_000)]
        assert max(draws) <= cap
        assert sorted(draws)[int(0.99 * len(draws))] == pytest.approx(min(p99, cap), rel=0.03)
        assert sum(draws) / len(draws) == pytest.approx(mix.output_mean, rel=0.01)
        assert sum(d * d for d in draws) / len(draws) == pytest.approx(mix.output_second_moment, rel=0.02)


def test_a_sequence_in_flight_holds_its_prompt_and_the_length_biased_half():
    """prompt + E[L^2] / (2 E[L]): a fixed length L gives L / 2; the thinking-mode mix 3,263 (not its 2,484 mean, nor
    the 8,192 it used to be sized for)."""
    fixed = LengthMix.measured(rows=10, prompt_tokens=1_000, output_tokens=20_000, output_tokens_sq=10 * 2_000 ** 2)
    assert fixed.in_flight_tokens == 100 + 1_000
    thinking = LengthMix.configured(2_500, 16_000, 32_768, prompt_mean=256)
    assert round(thinking.sigma, 2) == 1.02 and round(thinking.output_mean) == 2_484
    assert round(thinking.in_flight_tokens) == 256 + 3_263
    assert capped_lognormal_moments(500, 0.0, 300) == (300, 300 ** 2)


def test_pinned_then_measured_then_configured():
    gen = GenerateConfig()
    tokens, why = sizing_tokens(gen, max_tokens=32_768, max_model_len=40_960)
    assert tokens == 3_520 and "configured: output mean 2,500 and p99 16,000" in why
    short, _ = sizing_tokens(gen, max_tokens=128, max_model_len=1_024)  # the cap bites: at most prompt + 128
    assert 256 + 64 <= short <= 256 + 128
    unset, _ = sizing_tokens(gen, max_tokens=None, max_model_len=4_096)  # no max_tokens: what max_model_len leaves
    assert unset < sizing_tokens(gen, max_tokens=None, max_model_len=40_960)[0]
    measured = length_mix.add_lengths(None, length_mix.row_lengths([200] * 64, [1_000] * 32 + [3_000] * 32))
    tokens, why = sizing_tokens(gen, 32_768, 40_960, measured)
    assert tokens == 200 + math.ceil((1_000 ** 2 + 3_000 ** 2) / 2 / (2 * 2_000))  # 200 + 1,250
    assert "measured on the run's first 64 rows" in why
    few = length_mix.row_lengths([200] * 8, [1_000] * 8)  # fewer than MIN_MEASURED_ROWS: the configured mix stays
    assert sizing_tokens(gen, 32_768, 40_960, few)[0] == 3_520
    pinned = GenerateConfig(kv_tokens_per_seq=8_192)
    assert sizing_tokens(pinned, 32_768, 40_960, measured) == (8_192, "generate.kv_tokens_per_seq 8,192, pinned")


def test_lengths_add_up_across_jobs():
    first = length_mix.add_lengths(None, length_mix.row_lengths([10, 20], [5, 7]))
    assert first == {"rows": 2, "prompt_tokens": 30, "output_tokens": 12, "output_tokens_sq": 74}
    assert length_mix.add_lengths(first, first) == {k: 2 * v for k, v in first.items()}


def test_a_tail_no_lognormal_has_is_refused_naming_the_keys():
    """Stage 1's preflight refuses it before any work (`check_config`); a pinned kv_tokens_per_seq needs no mix."""
    assert lognormal_sigma(2_500, 2_500) == 0.0
    with pytest.raises(ConfigError, match="output_tokens_p99.*p99 1,000 is below the mean 2,500"):
        length_mix.check_config(GenerateConfig(output_tokens_p99=1_000))
    with pytest.raises(ConfigError, match="at most 15.0x its mean"):
        length_mix.check_config(GenerateConfig(output_tokens_p99=40_000))
    length_mix.check_config(GenerateConfig(output_tokens_p99=40_000, kv_tokens_per_seq=8_192))
    with pytest.raises(ConfigError, match="generate.output_tokens_mean must be >= 1"):
        load_config(DEMO_CONFIG, **{"generate.output_tokens_mean": 0})


def test_the_run_keeps_the_lengths_of_its_rows_for_the_next_engines(shared_run):
    """run.json's `generate.lengths` are the sums over the run's completed rows (error rows left out), written from the
    canary on through the stage's fence; the next job's engines size for them (`sizing_tokens(..., measured)`)."""
    from job import run_record

    config = load_config(DEMO_CONFIG, model=shared_run.model, output=shared_run.full)
    record = run_record.read(config.output, config.storage).generate
    ok = [r for r in read_run(shared_run.full).to_pylist() if r["error"] is None]
    assert record.lengths == length_mix.row_lengths([r["num_prompt_tokens"] for r in ok],
                                                    [r["num_output_tokens"] for r in ok])
    assert record.lengths["rows"] == len(ok) > 0
    tokens, why = sizing_tokens(GenerateConfig(), 512, 1_024, record.lengths | {"rows": 64})
    assert "measured on the run's first 64 rows" in why and tokens < 512 + 100


def test_the_canary_says_what_its_rows_hold_against_what_the_engines_were_sized_for(tiny_model_dir):
    config = load_config(DEMO_CONFIG, model=tiny_model_dir, **{"engine_kwargs.max_num_seqs": "auto",
                                                                "generate.sampling": {"max_tokens": 4_096}})
    rows = length_mix.row_lengths([100] * 64, [2_000] * 64)
    line = length_mix.canary_line(config, rows)
    assert line.startswith("length mix: the canary's 64 rows hold 1,100 tokens a sequence in flight on average; "
                           "the engines were sized for ") and "A later job of this run (a resume) sizes for" in line
    assert length_mix.canary_line(config, length_mix.row_lengths([100] * 8, [2_000] * 8)) is None  # too few rows
    pinned = load_config(DEMO_CONFIG, model=tiny_model_dir, **{"engine_kwargs.max_num_seqs": "auto",
                                                                "generate.kv_tokens_per_seq": 2_048})
    assert length_mix.canary_line(pinned, rows) is None
    assert length_mix.canary_line(load_config(DEMO_CONFIG, model=tiny_model_dir), rows) is None  # max_num_seqs fixed
