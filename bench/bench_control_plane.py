"""The control plane at the seed's scale: what every command costs before (or instead of) any engine, on a run
directory of N completion shards and N stage-2 parts, locally and on S3.

    flock /tmp/heavy.lock .venv/bin/python bench/bench_control_plane.py --shards 7200 20000 --where s3 local \
        [--steps abcdegh] [--tokens-per-row 2] [--workdir DIR]

Builds, with the project's own writers, a finished run: an input of N × rows-per-shard prompts (parquet files of
1,000 units each), run.json (as stage 1's first start writes it: identity, the input's ids digests and content
digests, ETags on S3), N completion shards (storage.write_shard, named by job/layout.py, each with its own content
id and `rows-per-shard` small rows), one stage-2 part per shard (hidden_states/shards.py part_table + table_to_ipc,
stamped with its shard's content id) and its done marker (the fields scan.marker_matches compares). S3 is a moto
server on loopback that counts the requests it serves (bench/s3_counting_server.py); the S3 copy of the shards,
parts and markers is uploaded from the local one (the same bytes), run.json and the input are written there by the
job's code. Then each step runs in a fresh interpreter (its own listing, no warm cache, as a command would), timed
after its imports, with the S3 requests it made and its peak RSS:

  a. generate (resume)   run_generate on the finished run: input listing + footers, run.json, input unchanged?
                         (sha256 locally, one HEAD per file on S3), writer lock, completion listing + every footer,
                         units left; it ends "nothing to do" exactly where it would otherwise start the engines
  b. stage-2 plan        hidden_states.run.plan_units + estimate_storage: what the driver does before its first unit
  c. status              runview.status.build_status + format_status (`python -m job status`)
  d. export selection    scan.done_hidden_state_parts (what export, `load` and the notebook read)
  e. notebook opening    run_overview, build_status, generate.report.build_report, notebook.read_rows (the cells
                         up to `rows`)
  r. stage 1's cache save what a stage 1 on S3 does every ~10 min and at its end (completions.remember_shards,
                         under its writer lock): the trust cache of the footers and the rows cache of the small
                         columns (job/rows_cache.py), reading only the shards neither holds; the run's state after a
                         finished stage 1
  g, h. rerun            the whole `python -m job generate` / `hidden-states` command on the finished run (wall
                         time, imports included): a rerun that has nothing to do.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = {"a": "generate (resume)", "b": "stage-2 plan", "c": "status", "d": "export selection",
         "e": "notebook opening", "r": "stage 1's cache save"}
SHARDS_PER_FILE = 1000
BUCKET = "bench"


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# ---------------------------------------------------------------------------------------------------------------
# One step, in its own interpreter
# ---------------------------------------------------------------------------------------------------------------


def config_file(workdir: str, rows_per_shard: int) -> str:
    """configs/demo.yaml with the seed's rows per shard: what every step and command of the bench runs with."""
    import yaml

    with open(ROOT / "configs" / "demo.yaml") as f:
        data = yaml.safe_load(f)
    data["generate"]["rows_per_shard"] = rows_per_shard
    path = os.path.join(workdir, "bench.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def bench_config(run: str, inp: str, model: str):
    from job.config import load_config

    return load_config(os.environ["BENCH_CONFIG"], model=model, input=inp, output=run)


def run_step(step: str, run: str, inp: str, model: str) -> dict:
    import contextlib
    import io

    from job import scan
    from job.generate import report, run_generate
    from job.hidden_states.plan import estimate_storage, plan_units
    from job.runview import notebook, status

    config = bench_config(run, inp, model)
    # What every step imports and reads of the model whatever the run's size (transformers, torch: ~0.9 GB of RSS,
    # seconds on a busy machine), before the clock and the baseline RSS: the figures are the run directory's.
    import torch  # noqa: F401

    from job import target
    from job.generate.engine_start import resolved_sampling
    target.shape(model)
    resolved_sampling(model, config.generate.sampling)
    base = rss_mib()
    out = io.StringIO()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    profiler = None
    if os.environ.get("BENCH_PROFILE"):  # --profile: the step's driver side under cProfile, top entries to stderr
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    with contextlib.redirect_stdout(out):
        if step == "a":
            summary = run_generate(config)
            assert summary.already_complete, "the bench's run should be complete"
        elif step == "b":
            units = plan_units(config)
            estimate_storage(config, units)
            assert units and all(u.done for u in units), "every unit should be done"
        elif step == "c":
            st = status.build_status(run, config.storage)
            print(status.format_status(st))
            assert st["hidden_states"]["completion_shards_to_do"] == 0, st["hidden_states"]
        elif step == "d":
            parts = scan.done_hidden_state_parts(run, config.storage)
            assert parts, "no done parts"
        elif step == "r":
            from job import layout, stage
            from job.generate.completions import remember_shards

            with stage.writing(config, "generate", layout.COMPLETIONS_DIR, take_lock=False) as fence:
                remember_shards(config, fence)
        elif step == "e":
            notebook.run_overview(run, config.storage)
            found = notebook.judge_completion_shards(run, config.storage)  # as the notebook's cells: one listing
            status.build_status(run, config.storage, found=found)
            unreadable: dict[str, str] = {}  # as the notebook's cells: the rows read once, the report built on them
            rows = notebook.read_rows(run, storage_config=config.storage, unreadable=unreadable, found=found)
            report.build_report(run, config.storage, rows=rows, unreadable=unreadable)
    seconds = time.perf_counter() - t0
    if profiler is not None:
        import pstats

        profiler.disable()
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(int(os.environ["BENCH_PROFILE"]))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    return {"seconds": seconds, "cpu_s": cpu, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_after_imports_mib": base, "output": out.getvalue()[-400:]}


# ---------------------------------------------------------------------------------------------------------------
# Building the run directory
# ---------------------------------------------------------------------------------------------------------------


def write_input(inp: str, num_shards: int, rows_per_shard: int, storage_config) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from job import storage

    for f, first in enumerate(range(0, num_shards, SHARDS_PER_FILE)):
        rows = (min(num_shards, first + SHARDS_PER_FILE) - first) * rows_per_shard
        start = first * rows_per_shard
        table = pa.table({"id": pa.array([f"p{i:09d}" for i in range(start, start + rows)]),
                          "prompt": pa.array([f"prompt {i}" for i in range(start, start + rows)])})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        storage.write_bytes_atomic(storage.join(inp, f"part-{f:05d}.parquet"), sink.getvalue().to_pybytes(),
                                   storage_config)


def write_run_json(config) -> tuple[list, object]:
    """run.json as stage 1's first start writes it (job/generate/preflight.py), then stage 2's section."""
    from job import layout, run_record, stage, target
    from job.config import resolve_layer_ids
    from job.generate import preflight
    from job.hidden_states import plan

    run_input = preflight.read_input(config, None)
    with stage.writing(config, "generate", layout.COMPLETIONS_DIR, take_lock=False) as fence:
        run_record.update(config, "generate", fence, identity=run_input.identity, **run_input.recorded(),
                          status="complete", canary_passed=True)
    shape = target.shape(config.model)
    layer_ids = resolve_layer_ids(config.hidden_states.layer_ids, shape.num_layers)
    with stage.writing(config, "hidden_states", layout.HIDDEN_STATES_DIR, take_lock=False) as fence:
        run_record.update(config, "hidden_states", fence, identity=plan.identity(config, layer_ids, shape.num_layers),
                          status="complete")
    return run_input.files, run_input.carried


def write_shards(config, files, carried, rows_per_shard: int, tokens_per_row: int, num_threads: int = 8) -> None:
    """Completion shard, stage-2 part and marker of every unit, through the project's writers. `tokens_per_row`
    output token ids per row (random, so zstd cannot squeeze them away): what lies between a shard's id column and
    its small columns, so that reading those is as many requests as on a real shard."""
    import hashlib

    import numpy as np
    import pyarrow as pa

    from job import layout, scan, schema, storage, target
    from job.config import resolve_layer_ids
    from job.generate.units import pending_units
    from job.hidden_states.samples import Sample
    from job.hidden_states.shards import part_table, table_to_ipc

    units = pending_units(files, [], None, rows_per_shard)
    shape = target.shape(config.model)
    layer_ids = resolve_layer_ids(config.hidden_states.layer_ids, shape.num_layers)
    hs_schema = schema.hidden_states_schema(model=config.model, layer_ids=layer_ids, hidden_size=shape.hidden_size,
                                            dtype="bfloat16", num_model_layers=shape.num_layers)
    n, tokens = rows_per_shard, 4
    fixed = {schema.PROMPT_TOKEN_IDS: pa.array([[1, 2]] * n, pa.list_(pa.int32())),
             schema.OUTPUT_TOKEN_IDS: pa.ListArray.from_arrays(
                 pa.array(np.arange(n + 1, dtype=np.int32) * tokens_per_row),
                 pa.array(np.random.default_rng(0).integers(0, 3792, n * tokens_per_row, dtype=np.int32))),
             schema.REASONING: pa.array(["r"] * n), schema.ANSWER: pa.array(["a"] * n),
             schema.FINISH_REASON: pa.array(["stop"] * n), schema.NUM_PROMPT_TOKENS: pa.array([2] * n, pa.int32()),
             schema.NUM_OUTPUT_TOKENS: pa.array([tokens_per_row] * n, pa.int32()),
             schema.NUM_REASONING_TOKENS: pa.array([1] * n, pa.int32()),
             schema.NUM_ANSWER_TOKENS: pa.array([1] * n, pa.int32()), schema.SEED: pa.array([0] * n, pa.int64()),
             schema.TURN: pa.array([0] * n, pa.int32()), schema.ORIGINAL_TURN_TOKENS: pa.array([0] * n, pa.int32()),
             **{flag: pa.array([False] * n) for flag in schema.QUALITY_FLAGS},
             schema.ERROR: pa.nulls(n, pa.string())}
    out_schema = schema.completion_schema(carried)
    completions = storage.join(config.output, layout.COMPLETIONS_DIR)
    hidden = storage.join(config.output, layout.HIDDEN_STATES_DIR)
    width = len(layer_ids) * shape.hidden_size * 2
    features = np.zeros(tokens * width, dtype=np.uint8)

    def one(u) -> None:
        ids = [f"p{i:09d}" for i in range(u.start + u.file_index * SHARDS_PER_FILE * n,
                                         u.stop + u.file_index * SHARDS_PER_FILE * n)]
        columns = {**fixed, schema.ID: pa.array(ids), **{f.name: pa.array([f"prompt {i}" for i in ids])
                                                           for _, f in schema.carried_columns(carried)}}
        # A column the engine writes that this builder does not fill (one added to the schema later) is null: the
        # steps read ids, counts and footers, never its values.
        table = pa.Table.from_arrays([columns.get(f.name, pa.nulls(len(ids), f.type)) for f in out_schema],
                                     schema=out_schema)
        shard_id = uuid.uuid4().hex  # as the engine stamps it (job/generate/engine.py `_to_table`)
        table = table.replace_schema_metadata({schema.META_SHARD_ID: shard_id,
                                               schema.META_COUNTS: json.dumps(scan.shard_counts(table))})
        data = storage.table_to_ipc_bytes(table)
        uri = storage.join(completions, u.shard_name)
        storage.write_bytes_atomic(uri, data, config.storage)
        stem = layout.hidden_state_stem(uri, completions)
        unit = layout.HiddenStateUnit(uri=uri, stem=stem, num_rows=n)
        samples = [Sample(id=ids[0], input_ids=np.array([1, 2, 3, 4], np.int32), num_prompt_tokens=2,
                          original_num_tokens=tokens, row=0)]
        part_schema = hs_schema.with_metadata({**hs_schema.metadata, schema.META_SOURCE_SHARD_ID: shard_id})
        buf = table_to_ipc(part_table(samples, features, part_schema))
        storage.write_bytes_atomic(storage.join(hidden, unit.part_name(0)), buf.to_pybytes(), config.storage)
        storage.write_json(storage.join(hidden, unit.marker_name), {
            "unit": unit.tag, "num_rows": n, "num_samples": 1, "num_errors": 0, "num_skipped_flagged": 0,
            "num_skipped_empty": n - 1, "num_clipped": 0, "num_tokens": tokens, "num_tokens_extracted": tokens,
            "num_padded_tokens": tokens, "num_parts": 1, "num_parts_written": 1, "bytes_written": buf.size,
            "source": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "num_rows": n,
                       "shard_id": shard_id}}, config.storage)

    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(one, units))


def upload(local_run: str, s3_run: str, endpoint: str, num_threads: int = 16) -> int:
    """Copy the shards, parts and markers of a local run to S3 (the same bytes; plain PUTs in a thread pool)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    prefix = s3_run[len(f"s3://{BUCKET}/"):]
    paths = [p for d in ("completions", "hidden_states") for p in Path(local_run, d).rglob("*") if p.is_file()]

    def put(p: Path) -> None:
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{p.relative_to(local_run)}", Body=p.read_bytes())

    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(put, paths))
    return len(paths)


def build(where: str, num_shards: int, rows_per_shard: int, tokens_per_row: int, workdir: str, model: str,
          endpoint: str | None) -> tuple:
    """(run URI, input URI) of a finished run of `num_shards` shards, built for `where` (local or s3)."""
    from job import storage

    name = f"{num_shards}-t{tokens_per_row}"
    local_run, local_inp = os.path.join(workdir, f"run-{name}"), os.path.join(workdir, f"in-{num_shards}")
    if not os.path.exists(os.path.join(local_run, "run.json")):
        config = bench_config(local_run, local_inp, model)
        if not os.path.exists(local_inp):
            write_input(local_inp, num_shards, rows_per_shard, config.storage)
        files, carried = write_run_json(config)
        write_shards(config, files, carried, rows_per_shard, tokens_per_row)
    if where == "local":
        return local_run, local_inp
    s3_run, s3_inp = f"s3://{BUCKET}/run-{name}", f"s3://{BUCKET}/in-{num_shards}"
    config = bench_config(s3_run, s3_inp, model)
    if not storage.list_files(s3_inp, ".parquet", config.storage):
        write_input(s3_inp, num_shards, rows_per_shard, config.storage)
    write_run_json(config)
    upload(local_run, s3_run, endpoint)
    return s3_run, s3_inp


# ---------------------------------------------------------------------------------------------------------------
# The driver: server, builds, one child per step, the table
# ---------------------------------------------------------------------------------------------------------------


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "s3_counting_server.py"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_REGION": "us-east-1"})
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    return proc, endpoint


def requests_made(endpoint: str | None, reset: bool = False) -> dict:
    if endpoint is None:
        return {}
    req = urllib.request.Request(f"{endpoint}/__requests", method="POST" if reset else "GET")
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def child(step: str, run: str, inp: str, model: str, endpoint: str | None) -> dict:
    requests_made(endpoint, reset=True)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--step", step, "--run", run, "--input", inp, "--model", model],
                       capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"step {step} on {run} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    if os.environ.get("BENCH_PROFILE"):
        print(p.stderr[p.stderr.find("function calls"):][:6000], flush=True)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["requests"] = requests_made(endpoint)
    out["wall_s"] = wall
    return out


def command(args_: list[str], run: str, inp: str, model: str, endpoint: str | None) -> dict:
    """A whole `python -m job ...` command on the finished run: its wall time (imports included) and requests."""
    requests_made(endpoint, reset=True)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "job", *args_, "--config", os.environ["BENCH_CONFIG"], "--model", model,
                        "--output", run, *(["--input", inp] if args_[0] == "generate" else [])],
                       capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"{args_} on {run} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return {"wall_s": wall, "requests": requests_made(endpoint), "output": (p.stdout + p.stderr)[-600:]}


# S3 Standard request prices (us-east-1 / us-west-2, 2026): GET, HEAD and other reads $0.0004 per 1,000; PUT, COPY,
# POST and LIST $0.005 per 1,000; DELETE free.
USD_PER_1000 = {"GET": 0.0004, "HEAD": 0.0004, "PUT": 0.005, "POST": 0.005, "LIST": 0.005, "DELETE": 0.0}


def usd(requests: dict) -> float:
    return sum(USD_PER_1000.get(k, 0.005) * v / 1000 for k, v in requests.items())


RERUNS = {"g": "generate", "h": "hidden-states"}


def caches(run: str) -> str:
    """Which trust caches (job/trust_cache.py) the run has now: what the next step finds."""
    from job import rows_cache, storage, trust_cache

    found = [kind for kind in (trust_cache.COMPLETIONS, trust_cache.MARKERS)
             if storage.is_s3(run) and storage.exists(trust_cache.uri_of(run, kind))]
    if storage.is_s3(run) and storage.exists(rows_cache.uri_of(run)):
        found.append(rows_cache.KIND)
    return "+".join(found) or "none"


def drop_caches(run: str) -> None:
    """Step 0: delete the run's trust caches and rows cache, so the steps after it read every footer, marker and
    shard again (as on a run made before the caches, until a stage's writer writes them)."""
    from job import rows_cache, storage, trust_cache

    for uri in (trust_cache.uri_of(run, trust_cache.COMPLETIONS), trust_cache.uri_of(run, trust_cache.MARKERS),
                rows_cache.uri_of(run)):
        if storage.is_s3(run) and storage.exists(uri):
            storage.delete(uri)


def rerun(cmd: str, run: str, inp: str, model: str, endpoint: str | None, where: str, n: int) -> None:
    """Steps g, h: `python -m job generate` / `hidden-states` on the finished run, the whole command."""
    cache = caches(run)
    r = command([cmd], run, inp, model, endpoint)
    print(f"rerun `{cmd}` {where} {n:,} (cache {cache}): {r['wall_s']:.1f} s wall, {fmt_requests(r['requests'])} "
          f"(${usd(r['requests']):.4f}), load {os.getloadavg()[0]:.1f}; ends: {r['output'][-300:]!r}", flush=True)


def fmt_requests(r: dict) -> str:
    if not r:
        return "-"
    total = sum(r.values())
    return f"{total:,} (" + ", ".join(f"{k} {v:,}" for k, v in sorted(r.items())) + ")"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, nargs="+", default=[7200, 20000])
    parser.add_argument("--where", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--steps", default="0dbcaghdbce", help="in this order; g, h: the whole `generate` / "
                        "`hidden-states` command on the finished run (wall time, imports included); 0: delete the "
                        "run's trust caches and rows cache (the steps after it read every footer and marker, until "
                        "a stage writes its cache: a and g write the footers', h the markers', r the footers' and the "
                        "rows'); r: stage 1's cache save, as after a finished stage 1")
    parser.add_argument("--rows-per-shard", type=int, default=128, help="the seed: 914K prompts in ~7,200 shards")
    parser.add_argument("--tokens-per-row", type=int, default=2, help="output token ids per row: 2 keeps 20,000 "
                        "shards small (7 KB: every read of a shard is its one tail read); 400 makes ~90 KB shards "
                        "whose small columns lie outside the tail, as a real shard's do")
    parser.add_argument("--model", help="default: .cache/tiny-model, else the tiny model's recipe untrained (no step "
                        "runs it: the driver reads its config, generation config and file digests)")
    parser.add_argument("--workdir", help="keep the built runs here (reused when there)")
    parser.add_argument("--profile", type=int, metavar="N", help="run each step under cProfile and print its N "
                        "entries of most own time")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        print(json.dumps(run_step(args.step, args.run, args.input, args.model)))
        return

    if args.profile:
        os.environ["BENCH_PROFILE"] = str(args.profile)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-control-plane-")
    os.makedirs(workdir, exist_ok=True)
    os.environ["BENCH_CONFIG"] = config_file(workdir, args.rows_per_shard)
    if args.model is None:
        args.model = str(ROOT / ".cache" / "tiny-model")
        if not os.path.exists(os.path.join(args.model, "build_info.json")):
            from job.builtin.tiny_model import ensure_tiny_model

            args.model = ensure_tiny_model(os.path.join(workdir, "tiny-model"), train_steps=0)
    server, endpoint = start_server() if "s3" in args.where else (None, None)
    print(f"load: {os.getloadavg()}; {os.cpu_count()} CPUs; workdir {workdir}", flush=True)
    print("| step | where | shards | trust cache | seconds | driver CPU s | S3 requests | S3 $ | peak RSS MiB "
          "(over imports) | load |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    try:
        for n in args.shards:
            for where in args.where:
                t0 = time.perf_counter()
                run, inp = build(where, n, args.rows_per_shard, args.tokens_per_row, workdir, args.model, endpoint)
                print(f"built {where} {n:,} shards in {time.perf_counter() - t0:.0f} s: {run}", flush=True)
                for step in args.steps:
                    if step == "0":
                        drop_caches(run)
                        continue
                    cache = caches(run) if where == "s3" else "-"
                    if step in RERUNS:
                        rerun(RERUNS[step], run, inp, args.model, endpoint if where == "s3" else None, where, n)
                        continue
                    r = child(step, run, inp, args.model, endpoint if where == "s3" else None)
                    rows.append((STEPS[step], where, n, r))
                    print(f"| {STEPS[step]} | {where} | {n:,} | {cache} | {r['seconds']:.1f} | {r['cpu_s']:.1f} | "
                          f"{fmt_requests(r['requests'])} | {usd(r['requests']):.4f} | "
                          f"{r['peak_rss_mib']:.0f} ({r['peak_rss_mib'] - r['rss_after_imports_mib']:+.0f}) | "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
