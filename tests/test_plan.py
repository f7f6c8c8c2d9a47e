"""`python -m job plan`: the arithmetic (including a real run's numbers), `--from RUN` measurements and
`--from-bench FILE` benchmark results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from job import cli
from job.runview import plan
from job.runview.plan import PlanInputs, estimate
from test_status import steady_shards, write_run

REAL_RUN = ["--prompts", "914000", "--tokens-per-prompt", "2500", "--gpus", "7", "--tokens-per-s-per-gpu", "2000",
            "--usd-per-gpu-hour", "3.81"]


def test_reproduces_the_real_run():
    """914K prompts × 2,500 tokens on 7 GPUs at 2,000 tok/s/GPU and $3.81/GPU-hour: ~45 hours, ~$1,210."""
    e = estimate(PlanInputs(num_prompts=914_000, output_tokens_per_prompt=2500, num_gpus=7,
                            output_tokens_per_s_per_gpu=2000, usd_per_gpu_hour=3.81))
    assert e["output_tokens"] == 2_285_000_000
    assert e["hours"] == pytest.approx(45.34, abs=0.01)
    assert e["cost_usd"] == pytest.approx(1209.3, abs=1)
    assert e["usd_per_million_output_tokens"] == pytest.approx(3.81 / (2000 * 3600) * 1e6)
    # Storage: ~5 B per output token of completions; 7 layers × 5120 × bf16 per token of hidden states (every
    # trainer's layers), of which 2 layers serve EAGLE-3 only.
    assert e["completion_bytes"] == pytest.approx(2_285_000_000 * 5.0)
    assert e["hidden_state_bytes"] == pytest.approx(2_285_000_000 * 71_680)
    assert e["every_trainer_extra_bytes"] == pytest.approx(2_285_000_000 * 20_480)


def test_cli_prints_hours_cost_and_storage(capsys):
    assert cli.main(["plan", *REAL_RUN]) == 0
    out = capsys.readouterr().out
    assert "45.3 hours" in out and "$1,209" in out and "$0.529 per million output tokens" in out
    assert "completions 11.4 GB" in out and "hidden states 163.8 TB" in out
    assert "of which 46.8 TB" in out and "+20,480 B per token over DFlash's 5 layers" in out


def test_cli_json_and_prompt_tokens(capsys):
    assert cli.main(["plan", *REAL_RUN, "--prompt-tokens-per-prompt", "500", "--hidden-bytes-per-token", "1000",
                      "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["hidden_state_bytes"] == pytest.approx(914_000 * 3000 * 1000)  # prompt + completion tokens
    assert e["completion_bytes"] == pytest.approx(914_000 * (2500 * 5.0 + 500 * 4))


def test_missing_or_bad_inputs_name_the_flag(capsys):
    assert cli.main(["plan", "--prompts", "10", "--gpus", "1"]) == 2
    assert "--tokens-per-prompt" in capsys.readouterr().err
    assert cli.main(["plan", *REAL_RUN[:-2], "--usd-per-gpu-hour", "-1"]) == 2
    assert "usd_per_gpu_hour" in capsys.readouterr().err
    assert cli.main(["plan", "--gpus", "0", *REAL_RUN[:4], *REAL_RUN[6:]]) == 2


def test_from_a_run_with_recorded_throughput(tmp_path, capsys):
    run = str(tmp_path / "canary")
    # 10 shards of 4 rows × 250 tokens; the job recorded 4,000 tok/s with 2 engines of 1 GPU (run.json, as
    # job/generate/run.py writes it when a job completes).
    write_run(run, steady_shards(10, tokens=250), total_rows=40,
              generate={"status": "complete", "num_engines": 2, "output_tokens_per_s": 4000.0})
    m = plan.measure_run(run)
    assert m["output_tokens_per_prompt"] == 250 and m["prompt_tokens_per_prompt"] == 10
    assert m["output_tokens_per_s_per_gpu"] == 2000 and m["num_gpus"] == 2
    assert m["completion_bytes_per_prompt"] > 0
    # Plan the full run from the canary: only the prompts, GPUs and price are new.
    assert cli.main(["plan", "--from", run, "--prompts", "914000", "--gpus", "7", "--usd-per-gpu-hour", "3.81",
                      "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["inputs"]["output_tokens_per_prompt"] == 250
    assert e["inputs"]["output_tokens_per_s_per_gpu"] == 2000
    assert e["hours"] == pytest.approx(914_000 * 250 / 14_000 / 3600)
    assert e["completion_bytes"] == pytest.approx(914_000 * m["completion_bytes_per_prompt"])


def test_from_a_run_measured_by_shard_timestamps(tmp_path, capsys):
    run = str(tmp_path / "running")
    write_run(run, steady_shards(10, tokens=100, every_s=10.0), total_rows=1000)  # 40 tok/s, as in test_status
    # No GPU count in run.json: the user must say how many GPUs the measured run had.
    assert cli.main(["plan", "--from", run, "--usd-per-gpu-hour", "2"]) == 2
    assert "--from-gpus" in capsys.readouterr().err
    assert cli.main(["plan", "--from", run, "--from-gpus", "2", "--usd-per-gpu-hour", "2", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["inputs"]["output_tokens_per_s_per_gpu"] == pytest.approx(20.0)
    assert e["inputs"]["num_prompts"] == 1000  # the run's own total
    assert e["inputs"]["num_gpus"] == 2
    # Explicit flags win over measured values.
    assert cli.main(["plan", "--from", run, "--from-gpus", "2", "--usd-per-gpu-hour", "2", "--tokens-per-prompt", "7",
                      "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["output_tokens_per_prompt"] == 7


def test_from_a_run_without_rows(tmp_path, capsys):
    run = str(tmp_path / "empty")
    write_run(run, [], total_rows=10)
    assert cli.main(["plan", "--from", run, *REAL_RUN[2:]]) == 2
    assert "no completion rows yet" in capsys.readouterr().err


H200_BENCH = str(Path(__file__).resolve().parent.parent / "bench" / "results" / "h200_stage1_27b.json")


def test_from_bench_file(capsys):
    """The committed H200 result: its tok/s per GPU replaces the seed's 2,000; everything else is the same plan, so
    GPU-hours shrink by exactly 2,000 / 3,562 and the line says where the figure came from."""
    seed = ["--prompts", "914000", "--tokens-per-prompt", "2500", "--gpus", "8", "--usd-per-gpu-hour", "3.81"]
    assert cli.main(["plan", *seed, "--tokens-per-s-per-gpu", "2000", "--json"]) == 0
    guessed = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", *seed, "--from-bench", H200_BENCH, "--json"]) == 0
    benched = json.loads(capsys.readouterr().out)
    assert benched["inputs"]["output_tokens_per_s_per_gpu"] == 3562
    assert benched["gpu_hours"] == pytest.approx(guessed["gpu_hours"] * 2000 / 3562)
    assert benched["gpu_hours"] == pytest.approx(914_000 * 2500 / 3562 / 3600)
    assert benched["measured"]["bench"]["bench"] == H200_BENCH
    assert cli.main(["plan", *seed, "--from-bench", H200_BENCH]) == 0
    out = capsys.readouterr().out
    assert f"benchmark {H200_BENCH}: 3,562 tok/s per GPU" in out and "8 GPUs × 3,562 tok/s per GPU" in out
    # An explicit flag still wins.
    assert cli.main(["plan", *seed, "--from-bench", H200_BENCH, "--tokens-per-s-per-gpu", "1000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["output_tokens_per_s_per_gpu"] == 1000


def test_from_bench_accepts_bench_generate_results_and_refuses_others(tmp_path, capsys):
    raw = tmp_path / "stage1.json"  # a bench/bench_generate.py RESULT line: two GPUs' tokens over the window
    raw.write_text(json.dumps({"rows": 256, "output_tokens": 400_000, "generation_s": 100.0, "num_gpus": 2}))
    assert plan.read_bench(str(raw))["output_tokens_per_s_per_gpu"] == 2000
    raw.write_text(json.dumps({"tok_per_s_window": 3000.0}))
    assert plan.read_bench(str(raw))["output_tokens_per_s_per_gpu"] == 3000
    for content, expected in (({"gpu": "H200"}, "has none of tokens_per_s_per_gpu"), ([1, 2], "a JSON object"),
                              ("{not json", "not JSON")):
        raw.write_text(content if isinstance(content, str) else json.dumps(content))
        assert cli.main(["plan", *REAL_RUN[:6], "--usd-per-gpu-hour", "1", "--from-bench", str(raw)]) == 2
        assert expected in capsys.readouterr().err
    assert cli.main(["plan", *REAL_RUN, "--from-bench", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_three_ways_to_feed_the_trainer():
    """Issue 32: stored bf16, stored FP8 (half the bytes + a 4 B scale per token and layer), streamed (stage 2 once
    per epoch, nothing stored): GPU-hours, bytes and dollars of each from the same inputs."""
    e = estimate(PlanInputs(num_prompts=914_000, output_tokens_per_prompt=2500, num_gpus=7,
                            output_tokens_per_s_per_gpu=2000, usd_per_gpu_hour=3.81, epochs=3, months_stored=2))
    ways, tokens = e["hidden_state_ways"], 2_285_000_000
    stage2_hours = tokens / plan.DEFAULT_STAGE2_TOKENS_PER_S_PER_GPU / 3600
    bf16, fp8, streamed = ways["stored_bf16"], ways["stored_fp8"], ways["streamed"]
    assert bf16["bytes"] == e["hidden_state_bytes"] == tokens * 71_680
    assert fp8["bytes_per_token"] == 71_680 / 2 + 4 * 7  # 7 layers of hidden 5,120
    assert bf16["stage2_gpu_hours"] == fp8["stage2_gpu_hours"] == pytest.approx(stage2_hours)
    assert streamed["bytes"] == 0 and streamed["stage2_gpu_hours"] == pytest.approx(3 * stage2_hours)
    assert bf16["storage_usd"] == pytest.approx(tokens * 71_680 / 1e9 * 0.023 * 2)
    assert fp8["total_usd"] == pytest.approx(stage2_hours * 3.81 + fp8["bytes"] / 1e9 * 0.023 * 2)


def test_cli_prints_the_three_ways(capsys):
    assert cli.main(["plan", *REAL_RUN]) == 0
    out = capsys.readouterr().out
    assert "three ways" in out
    assert "stored bf16  163.8 TB" in out and "stored FP8    82.0 TB" in out and "streamed          0 B" in out
