"""Input or config a user must fix is refused up front with one clear message (exit 2), before any engine starts
and before anything is written to the output."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import DEMO_CONFIG, REPO, simple_prompts, write_prompts

from job.cli import main


def run_cli(capsys, *args) -> tuple[int, str]:
    rc = main(list(args))
    return rc, capsys.readouterr().err


def generate_args(tiny_model_dir, inp, out):
    return ["generate", "--config", DEMO_CONFIG, "--model", tiny_model_dir, "--input", str(inp), "--output", str(out)]


def _input(tmp_path, case: str) -> str:
    d = tmp_path / "in"
    if case == "missing":
        return str(tmp_path / "does-not-exist")
    if case == "empty_dir":
        d.mkdir()
        (d / "readme.txt").write_text("no parquet here")
    elif case == "corrupt":
        d.mkdir()
        (d / "part-000.parquet").write_bytes(b"this is not parquet at all" * 10)
    elif case == "no_id":
        write_prompts(d, [{"key": 1, "prompt": "hi"}])
    elif case == "no_prompt":
        write_prompts(d, [{"id": 1, "text": "hi"}])
    elif case == "null_id":
        write_prompts(d, [{"id": 1, "prompt": "a"}, {"id": None, "prompt": "b"}])
    elif case == "duplicate_id":  # the duplicate is across two files
        write_prompts(d, [{"id": "x", "prompt": "a"}, {"id": "y", "prompt": "b"}, {"id": "x", "prompt": "c"},
                          {"id": "z", "prompt": "d"}], num_files=2)
    elif case == "nan_id":  # NaN != NaN: two NaN ids used to pass the uniqueness check
        write_prompts(d, [{"id": 1.0, "prompt": "a"}, {"id": float("nan"), "prompt": "b"},
                          {"id": float("nan"), "prompt": "c"}])
    elif case == "schema_mismatch":
        write_prompts(d / "a", [{"id": 1, "prompt": "a"}])
        write_prompts(d / "b", [{"id": "2", "prompt": "b"}])
    return str(d)


@pytest.mark.parametrize("case, words", [
    ("missing", "no such file or directory"),
    ("empty_dir", "no .parquet files"),
    ("corrupt", "not a readable parquet file"),
    ("no_id", "no `id` column"),
    ("no_prompt", "neither a `prompt` nor a `messages` column"),
    ("null_id", "null `id`"),
    ("duplicate_id", "duplicate id"),
    ("schema_mismatch", "disagree on their schema"),
    ("nan_id", "NaN `id`"),
])
def test_bad_input_is_refused_with_a_clear_message(tmp_path, capsys, tiny_model_dir, case, words):
    out = tmp_path / "run"
    rc, err = run_cli(capsys, *generate_args(tiny_model_dir, _input(tmp_path, case), out))
    assert rc == 2
    assert err.startswith("error: ") and words in err, err
    assert "Traceback" not in err
    assert not out.exists(), "nothing is written for refused input"


def test_missing_bucket_is_refused(tmp_path, capsys, tiny_model_dir, s3_server):
    rc, err = run_cli(capsys, *generate_args(tiny_model_dir, "s3://no-such-bucket-here/prompts", tmp_path / "run"))
    assert rc == 2 and "no-such-bucket-here" in err, err


@pytest.mark.parametrize("content, words", [
    ("model: x\noutput: y\nbogus_key: 1\n", "unknown key(s) ['bogus_key']"),
    ("model: x\noutput: y\ngenerate: {rows_per_shard: 0}\n", "rows_per_shard must be >= 1"),
    ("model: [unclosed\n", "not valid YAML"),
    ("model: x\noutput: y\ngenerate: {hang_timeout_s: -1}\n",
     "generate.hang_timeout_s must be >= 0 (0 = no watchdog), got -1"),
])
def test_bad_config_is_refused(tmp_path, capsys, content, words):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(content)
    rc, err = run_cli(capsys, "generate", "--config", str(cfg), "--input", str(tmp_path))
    assert rc == 2 and words in err, err


def test_hang_timeout_zero_means_no_watchdog():
    """`hang_timeout_s: 0` used to start a watchdog that looked without pause and declared every engine with a
    request in flight hung. 0 now means no watchdog (the shared run uses it: its engines finish every row)."""
    from job.generate.engine import watchdog_interval

    assert watchdog_interval(0) is None
    assert watchdog_interval(900) == 5.0 and watchdog_interval(8) == 2.0


@pytest.mark.parametrize("model, words", [
    ("{tmp}/nope", "no such directory"),
    # A hub name that cannot be fetched (no network here; with one, the hub has no such model): refused by the
    # driver at once. It used to fail in the engine actor after the hub client's retries (79 s), with a traceback.
    ("datagen-tests/no-such-model-0B", "'datagen-tests/no-such-model-0B': not a local directory"),
], ids=["missing-directory", "hub-name-not-reachable"])
def test_missing_model_is_refused(tmp_path, capsys, model, words):
    inp = write_prompts(tmp_path / "in", simple_prompts(3))
    rc, err = run_cli(capsys, "generate", "--config", DEMO_CONFIG, "--model", model.format(tmp=tmp_path),
                      "--input", inp, "--output", str(tmp_path / "run"))
    assert rc == 2 and words in err, err
    assert not (tmp_path / "run").exists()


def test_user_error_from_the_command_line_has_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "job", "generate", "--config", DEMO_CONFIG, "--input",
                           str(tmp_path / "missing"), "--output", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: input")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # the hybrid model, and a fault injected into the actors' interpreter
def test_a_model_vllm_cannot_load_stops_the_run_once_with_the_reason(tmp_path, capsys, tiny_hybrid_dir, local_ray):
    """vLLM's Qwen3.5 model imports torchvision. An install without it (a fault injected here: a torchvision that
    fails to import, first on the actors' path) used to end, after Ray Data retried the actor, in a pydantic
    traceback ("architectures ... failed to be inspected"). Now: one line that names the missing module, exit 2."""
    stub = tmp_path / "no-torchvision"
    stub.mkdir()
    # Python imports sitecustomize at start-up: this one hides torchvision as if it were not installed.
    (stub / "sitecustomize.py").write_text("import sys\nsys.modules['torchvision'] = None\n")
    inp = write_prompts(tmp_path / "in", simple_prompts(4))
    config = tmp_path / "hybrid.yaml"
    config.write_text((REPO / "configs" / "demo.yaml").read_text().replace(
        "env_vars:", f"env_vars:\n  PYTHONPATH: \"{stub}:{REPO}\""))
    rc, err = run_cli(capsys, "generate", "--config", str(config), "--model", tiny_hybrid_dir, "--input", inp,
                      "--output", str(tmp_path / "run"))
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: vLLM could not start an engine") and "Qwen3_5ForConditionalGeneration" in last
    assert "No module named 'torchvision" in last and "make install" in last


@pytest.mark.slow  # an engine start that fails at its last step (~60 s), and vLLM imported in this process
def test_an_engine_that_cannot_start_ends_the_run_once_with_vllms_own_reason(tmp_path, capsys, tiny_model_dir,
                                                                              local_ray):
    """Out of memory at load: a KV cache larger than the machine. vLLM's EngineCore logs why and its client in the
    actor only learns "Engine core initialization failed. See root cause above": the job reads the reason from the
    actor's log and ends once (no actor restart) with it. And a truncated weights file, whose reason vLLM's config
    validation (pydantic) keeps out of its first line."""
    import yaml

    data = yaml.safe_load(open(DEMO_CONFIG))
    data["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] = "100000"  # GiB
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    inp = write_prompts(tmp_path / "in", simple_prompts(4))
    rc, err = run_cli(capsys, "generate", "--config", str(cfg), "--model", tiny_model_dir, "--input", inp,
                      "--output", str(tmp_path / "run"), "--no-canary")
    assert rc == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: vLLM could not start an engine for model"), err[-3000:]
    assert "ValueError: Available memory on node 0" in last and "VLLM_CPU_KVCACHE_SPACE" in last, last
    assert not list((tmp_path / "run").glob("completions/*.arrow"))

    import shutil

    from vllm import EngineArgs

    from job.generate.engine_start import why_engine_failed

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(Exception) as e:
        EngineArgs(model=str(broken), dtype="bfloat16", max_model_len=1024).create_engine_config()
    assert "validation error" in str(e.value).splitlines()[0]  # all that the first line says
    assert why_engine_failed(str(broken), e.value).startswith("Value error, Unterminated string"), e.value


def test_uint64_ids_above_2_63_are_validated(tmp_path):
    """uint64 ids beyond int64's range used to end in a raw ArrowInvalid; they are ids like any other."""
    import pyarrow as pa

    from job.generate.inputs import InputError, list_input_files, validate_input
    from job.storage import StorageConfig

    big = [2**63 + 1, 2**64 - 1, 5]
    ok = write_prompts(tmp_path / "ok", [{"id": i, "prompt": "p"} for i in big],
                       schema=pa.schema([("id", pa.uint64()), ("prompt", pa.string())]))
    assert validate_input(list_input_files(ok, StorageConfig()), StorageConfig()).field("id").type == pa.uint64()
    dup = write_prompts(tmp_path / "dup", [{"id": i, "prompt": "p"} for i in big + [2**64 - 1]],
                        schema=pa.schema([("id", pa.uint64()), ("prompt", pa.string())]))
    with pytest.raises(InputError, match="duplicate id.*18446744073709551615"):
        validate_input(list_input_files(dup, StorageConfig()), StorageConfig())


def test_an_engine_that_does_not_start_in_time_ends_the_run_once_with_the_reason(tmp_path, capsys, tiny_model_dir,
                                                                                   local_ray):
    """generate.engine_start_timeout_s is honoured: the CPU engine takes ~15-30 s to start here, so a 1 s limit
    stands in for an engine that hangs while starting (nothing else is faked). One line, exit 2, no shard."""
    import yaml

    data = yaml.safe_load(open(DEMO_CONFIG))
    data["generate"]["engine_start_timeout_s"] = 1
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    inp = write_prompts(tmp_path / "in", simple_prompts(4))
    out = tmp_path / "run"
    rc, err = run_cli(capsys, "generate", "--config", str(cfg), "--model", tiny_model_dir, "--input", inp,
                      "--output", str(out), "--no-canary")
    assert rc == 2, err
    last = err.strip().splitlines()[-1]  # (above it: Ray's log of the actor, forwarded by the local Ray)
    assert last.startswith("error: the vLLM engine for model") and \
        "did not start within 1 s (generate.engine_start_timeout_s)" in last, err[-3000:]
    assert not list(out.glob("completions/*.arrow")), "no shard was written"


def test_per_request_seeds_on_the_cpu_build_are_refused_before_an_engine_starts(tiny_model_dir):
    """vLLM's CPU build dies at the first step on per-request seeds, every time: the actor refuses the setting there
    (known_engine_problem) rather than let Ray replace the engine for ever. GPUs take it (at a throughput cost)."""
    from job.generate.engine_start import known_engine_problem

    problem = known_engine_problem(tiny_model_dir, {}, {}, on_gpu=False, per_request_seed=True)
    assert problem and "generate.per_request_seed: true on vLLM's CPU build" in problem
    assert known_engine_problem(tiny_model_dir, {}, {}, on_gpu=True, per_request_seed=True) is None
    assert known_engine_problem(tiny_model_dir, {}, {}, on_gpu=False) is None  # the default: off
