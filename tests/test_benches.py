"""The benchmarks still run: nothing runs them otherwise, and a schema or API change that breaks one is found only when
someone needs its figure (bench_control_plane.py failed on `KeyError: 'variant'` for days after the sampling-variants
column was added). Every script's imports, in one process; the control-plane bench at its smallest size."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

BENCH = REPO / "bench"


def test_every_bench_script_imports_what_it_names():
    """Each bench/*.py imported as a module (its `main` not run): every name it takes from `job` or a neighbour still
    exists. Scripts that need a GPU import their CUDA-only packages inside `main`, so they import here too."""
    scripts = sorted(p.stem for p in BENCH.glob("*.py"))
    assert len(scripts) >= 15, scripts
    code = ("import importlib, sys\n"
            f"sys.path[:0] = [{str(BENCH)!r}, {str(REPO)!r}]\n"
            "failed = []\n"
            f"for name in {scripts!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception as e:\n"
            "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
            "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_control_plane_bench_builds_a_run_of_today_s_schema_and_times_its_steps(tmp_path, tiny_model_dir):
    """bench_control_plane.py at 20 shards, local: it builds completion and hidden-state shards of today's schema
    (the engine's columns, the stage-2 parts) and times the export selection, stage 2's plan and status over them."""
    done = subprocess.run([sys.executable, str(BENCH / "bench_control_plane.py"), "--shards", "20", "--where", "local",
                           "--steps", "dbc", "--workdir", str(tmp_path), "--model", str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "| local | 20 |" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["export selection", "stage-2 plan", "status"], done.stdout


def test_every_bench_parses_its_arguments():
    """Each bench/*.py with a command line answers `--help` (its parser builds: flags, defaults and choices are
    valid), GPU-only scripts included; run as `main()` under `--help` in one process, so nothing is measured."""
    scripts = sorted(p.stem for p in BENCH.glob("*.py") if "argparse" in p.read_text() and "def main(" in p.read_text())
    assert len(scripts) >= 10, scripts
    code = ("import contextlib, importlib, io, sys\n"
            f"sys.path[:0] = [{str(BENCH)!r}, {str(REPO)!r}]\n"
            "failed = []\n"
            f"for name in {scripts!r}:\n"
            "    sys.argv = [name + '.py', '--help']\n"
            "    out = io.StringIO()\n"
            "    try:\n"
            "        with contextlib.redirect_stdout(out):\n"
            "            importlib.import_module(name).main()\n"
            "        failed.append(f'{name}: --help returned instead of exiting')\n"
            "    except SystemExit as e:\n"
            "        if e.code not in (0, None) or 'usage:' not in out.getvalue():\n"
            "            failed.append(f'{name}: exit {e.code}: {out.getvalue()[-300:]}')\n"
            "    except Exception as e:\n"
            "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
            "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_the_concurrency_simulation_preempts_the_newest_and_loses_no_token():
    """bench/sim_concurrency.py's scheduler, vLLM's rule: a pool of 8 blocks holds two of these sequences grown, so
    the third (the newest) is preempted, recomputed later, and every sequence ends with exactly its tokens; the pool
    is whole again at the end."""
    sys.path.insert(0, str(BENCH))
    from sim_concurrency import Engine, Request, StepCost

    engine = Engine(num_blocks=8, block=100, state_blocks=1, max_num_seqs=3, cost=StepCost(0.03, 0.0003, 0.0, 1e-4),
                    spec_tokens=0, budget=1_000)
    requests = [Request(prompt=50, target=250) for _ in range(3)]
    engine.waiting.extend(requests)
    while engine.running or engine.waiting:
        engine.step()
    assert [r.output for r in requests] == [250, 250, 250] and engine.generated == 750
    assert requests[0].preempted == 0 and requests[2].preempted >= 1 and engine.preemptions >= 1
    assert engine.free == 8 and engine.clock > 0


def test_the_stage2_cli_bench_runs_production_s_stage2_settings():
    """bench/gpu_stage2_cli.yaml is the production config's stage 2 (configs/qwen3.6-27b.yaml) but for the layers
    captured on the reduced-depth checkpoint: a figure from it speaks for what a run does, and a production setting
    changed later shows up here rather than in an unexplained GPU figure."""
    from job.config import load_config

    bench = load_config(str(BENCH / "gpu_stage2_cli.yaml")).hidden_states
    production = load_config(str(REPO / "configs/qwen3.6-27b.yaml"), model="m", input="i", output="o").hidden_states
    assert bench.layer_ids == [7]
    assert {**vars(bench), "layer_ids": None} == {**vars(production), "layer_ids": None}


def test_the_capture_keeps_a_recomputed_position_s_last_row_and_tells_prefill_from_verify_rows():
    """bench/bench_capture_in_vllm.py's `_take`, over the steps its hook records (request ids, query offsets,
    positions, rows), with MTP 2: a prefill of 4 positions, then verify steps of 3 tokens where the third token of
    the first was rejected, so its position (6) is computed again by the next step: the row kept is the later one,
    and the verify steps' positions (4-8) count as decoded, the prefill's (0-3) do not."""
    import numpy as np
    import torch

    sys.path.insert(0, str(BENCH))
    from bench_capture_in_vllm import _take

    def step(req_ids, offsets, positions, fill):
        rows = torch.stack([torch.full((2,), float(fill * 100 + p)) for p in positions])
        return 0, req_ids, np.array(offsets), torch.tensor(positions), rows

    steps = [step(["7-9c53aeb0"], [0, 4], [0, 1, 2, 3], fill=1),
             step(["7-9c53aeb0"], [0, 3], [4, 5, 6], fill=2),
             step(["7-9c53aeb0"], [0, 3], [6, 7, 8], fill=3)]

    class Worker:  # what collective_rpc hands `_take`: the engine's worker, holding the hook's store
        class model_runner:
            _datagen_capture = {"steps": steps, "verify_tokens": 3}

    taken = _take(Worker())
    rows = taken["7"]  # the output's id, without the engine's suffix
    assert {p: float(r[0]) for p, r in rows[0].items()} == {
        0: 100, 1: 101, 2: 102, 3: 103, 4: 204, 5: 205, 6: 306, 7: 307, 8: 308}
    assert rows["decoded"] == {4, 5, 6, 7, 8}
    assert Worker.model_runner._datagen_capture["steps"] == []  # taken once
