"""Stage 2: hidden states equal a plain transformers forward, layer by layer, read back through the loader; the
shards hold every kept row exactly once across limits, crashes and reruns; the stream equals the shards; the
feature checks fire. Real Ray (local, 2 CPUs), real transformers, a real S3 protocol server (moto).

Completion shards are written here with the stage-1 schema (token ids chosen by the test, error rows, flagged
rows, a row longer than max_length), so these tests do not depend on vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import ensure_local_ray

from job import layout, runs, schema, storage
from job.config import ConfigError, HiddenStatesConfig, RunConfig
from job.hidden_states import collate, dataset, estimate_storage, load, run_hidden_states
from job.hidden_states.checks import HiddenStateCheckError, check_features
from job.hidden_states.samples import Sample, plan_parts
from job.hidden_states.shards import iter_records
from job.hidden_states.transformers_backend import TransformersExtractor, load_model
from job.runs import RunError

SHARDS = ((0, 8), (8, 20), (20, 26))  # stage-1 shard row ranges
MAX_LENGTH = 128


# ---------------------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["dense", pytest.param("hybrid", marks=pytest.mark.slow)])
def model_dir(request) -> str:
    """Each exactness test runs on both fixtures: dense Qwen3 and the hybrid (Qwen3.5: Gated DeltaNet layers; in
    the slow tier, with every other test of the hybrid)."""
    return request.getfixturevalue("tiny_model_dir" if request.param == "dense" else "tiny_hybrid_dir")


@pytest.fixture(scope="module")
def dense_dir(tiny_model_dir) -> str:
    """Tests of bookkeeping, checks and errors, which do not depend on the architecture: the dense model only."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def vocab_size(tiny_model_dir) -> int:
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]  # the hybrid shares the tokenizer and vocabulary


@pytest.fixture(scope="module")
def reference(model_dir):
    """Plain transformers forward in float32: output_hidden_states of one unpadded sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def forward(input_ids) -> tuple:
        with torch.no_grad():
            return model(torch.as_tensor(np.asarray(input_ids), dtype=torch.long)[None],
                         output_hidden_states=True).hidden_states

    return forward


@pytest.fixture(autouse=True)
def _ray_for_this_module(local_ray):
    """Every test here runs under the session's local Ray (conftest's `local_ray`)."""
    yield


def completion_rows(vocab: int, seed: int = 0) -> list[dict]:
    """26 rows: every 7th (i % 7 == 3) an error row, every 5th (i % 5 == 1) flagged too_short, the first row of
    each shard longer than MAX_LENGTH, one empty completion (row 12)."""
    rng = np.random.default_rng(seed)
    starts = {s for s, _ in SHARDS}
    rows = []
    for i in range(SHARDS[-1][1]):
        prompt = rng.integers(0, vocab, size=int(rng.integers(3, 30))).tolist()
        output = rng.integers(0, vocab, size=int(rng.integers(1, 80) if i not in starts else 200)).tolist()
        if i == 12:
            output = []
        row = {c: None for c in schema.COMPLETION_COLUMNS}
        row.update(id=f"row-{i:04d}", prompt_token_ids=prompt, output_token_ids=output, finish_reason="stop",
                   num_prompt_tokens=len(prompt), num_output_tokens=len(output), seed=i,
                   **{flag: False for flag in schema.QUALITY_FLAGS})
        if i % 7 == 3:
            row.update(error="prompt too long", prompt_token_ids=None, output_token_ids=None, num_prompt_tokens=None,
                       num_output_tokens=None, **{flag: None for flag in schema.QUALITY_FLAGS})
        if i % 5 == 1:
            row[schema.FLAG_TOO_SHORT] = True
        rows.append(row)
    return rows


def write_completions(run: str, rows: list[dict], storage_config=None) -> None:
    for s, e in SHARDS:
        table = pa.Table.from_pylist(rows[s:e], schema=schema.completion_schema())
        storage.write_shard(storage.join(run, layout.COMPLETIONS_DIR, f"f00000-r{s:010d}-{e:010d}.arrow"), table,
                            storage_config)
    storage.write_json(storage.join(run, layout.RUN_JSON), {"config": {"model": "stage-1-model"}}, storage_config)


def hs_config(model_dir: str, output: str, **hs) -> RunConfig:
    # The last layer after the norm, as output_hidden_states returns it: these tests compare with hidden[k + 1].
    hs = {"layer_ids": [0, 1, -1], "max_length": MAX_LENGTH, "batch_tokens": 256, "rows_per_shard": 3,
          "dtype": "float32", "last_layer_before_norm": False, **hs}
    return RunConfig(model=model_dir, output=output, hidden_states=HiddenStatesConfig(**hs))


def kept(rows: list[dict], keep_flagged: bool = True, limit: int | None = None) -> dict[str, dict]:
    rows = rows[:limit] if limit else rows
    return {r["id"]: r for r in rows if r["error"] is None and (r["prompt_token_ids"] or r["output_token_ids"])
            and (keep_flagged or not r[schema.FLAG_TOO_SHORT])}


def part_files(run: str) -> list[str]:
    return sorted(os.listdir(os.path.join(run, layout.HIDDEN_STATES_DIR)))


@pytest.fixture(scope="module")
def float32_run(model_dir, vocab_size, tmp_path_factory):
    ensure_local_ray()
    run = str(tmp_path_factory.mktemp("run-f32"))
    rows = completion_rows(vocab_size)
    write_completions(run, rows)
    summary = run_hidden_states(hs_config(model_dir, run))
    return run, rows, summary


# ---------------------------------------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------------------------------------


def test_features_equal_transformers_output_hidden_states_for_every_layer(float32_run, reference):
    run, rows, summary = float32_run
    want = kept(rows)
    records = list(load(run))
    assert sorted(r["id"] for r in records) == sorted(want)  # each kept row exactly once; errors/empty skipped
    for rec in records:
        row = want[rec["id"]]
        full = row["prompt_token_ids"] + row["output_token_ids"]
        ids = full[:MAX_LENGTH]
        assert rec["layer_ids"] == [0, 1, 3]  # -1 resolved to the last of 4 layers
        assert rec["input_ids"].tolist() == ids
        assert rec["clipped"] == (len(full) > MAX_LENGTH) and rec["original_num_tokens"] == len(full)
        n_prompt = min(len(row["prompt_token_ids"]), MAX_LENGTH)
        assert rec["loss_mask"].tolist() == [0] * n_prompt + [1] * (len(ids) - n_prompt)
        assert rec["hidden_states"].dtype == torch.float32 and rec["hidden_states"].shape == (len(ids), 3, 256)
        hidden = reference(ids)
        for j, k in enumerate(rec["layer_ids"]):
            # float32 on CPU: a padded batch and a lone forward use different GEMM blockings, so sums differ in
            # the last bits (seen: 1e-4 absolute on values ~1). 1e-3 is still 10× tighter than bf16 and 100×
            # below what a neighbouring layer differs by (27–391%).
            torch.testing.assert_close(rec["hidden_states"][:, j], hidden[k + 1][0], rtol=1e-3, atol=1e-3,
                                       msg=lambda m: f"layer {k} of {rec['id']}: {m}")
    assert sum(r["clipped"] for r in records) == 3
    assert summary.num_samples == len(want) and summary.num_errors == 4
    empty = next(r for r in records if r["id"] == "row-0012")  # an empty completion: kept, nothing to learn
    assert empty["loss_mask"].sum() == 0 and len(empty["input_ids"]) > 0


def test_shards_are_mmapped_zero_copy_with_metadata(float32_run, model_dir):
    run, _, summary = float32_run
    uri = summary.files[0]
    table = storage.read_shard(uri, memory_map=True)
    meta = table.schema.metadata
    assert json.loads(meta[schema.META_LAYER_IDS]) == [0, 1, 3]
    assert meta[schema.META_MODEL].decode() == model_dir and meta[schema.META_DTYPE] == b"float32"
    assert meta[schema.META_HIDDEN_SIZE] == b"256" and b"decoder layer" in meta[schema.META_LAYER_CONVENTION]
    data = table.column(schema.HIDDEN_STATES).chunk(0).values.buffers()[1]
    for rec in iter_records(table):  # the tensor points into the file mapping: nothing was copied
        assert data.address <= rec["hidden_states"].data_ptr() < data.address + data.size
    report = storage.read_json(summary.report)
    assert report["padding_waste"] < 0.5 and report["tokens_per_s"] > 0 and report["bytes"] > 0
    assert set(report["layers"]) == {"0", "1", "3"} and report["num_clipped"] == 3


def test_bf16_close_to_float32_and_flagged_rows_skipped_by_config(model_dir, vocab_size, reference, tmp_path):
    rows = completion_rows(vocab_size, seed=1)
    write_completions(str(tmp_path), rows)
    summary = run_hidden_states(hs_config(model_dir, str(tmp_path), dtype="bfloat16", keep_flagged=False,
                                            layer_ids=[0, 3], batch_tokens=512, rows_per_shard=8))
    want = kept(rows, keep_flagged=False)
    records = list(load(str(tmp_path)))
    assert sorted(r["id"] for r in records) == sorted(want)
    assert summary.num_skipped_flagged == sum(1 for r in rows if r["error"] is None and r["too_short"])
    for rec in records:
        assert rec["hidden_states"].dtype == torch.bfloat16
        hidden = reference(rec["input_ids"])
        for j, k in enumerate([0, 3]):
            got, ref = rec["hidden_states"][:, j].float(), hidden[k + 1][0]
            assert (got - ref).norm() / ref.norm() < 2e-2, f"layer {k} of {rec['id']}"


def test_stream_equals_written_shards(float32_run, model_dir):
    run, _, _ = float32_run
    written = {r["id"]: r for r in load(run)}
    streamed = {}
    for batch in dataset(hs_config(model_dir, run)).iter_torch_batches(batch_size=4, collate_fn=collate):
        for i, sid in enumerate(batch[schema.ID]):
            streamed[sid] = {k: v[i] for k, v in batch.items()}
    assert set(streamed) == set(written)
    for sid, rec in streamed.items():
        assert torch.equal(rec[schema.HIDDEN_STATES], written[sid]["hidden_states"])
        assert torch.equal(rec[schema.INPUT_IDS], written[sid]["input_ids"])
        assert torch.equal(rec[schema.LOSS_MASK], written[sid]["loss_mask"])
        assert bool(rec[schema.CLIPPED]) == written[sid]["clipped"]


def test_packed_and_padded_batches_both_equal_transformers(model_dir, vocab_size, reference):
    """Both batch layouts of the core: right-padded rows (SDPA with a mask) and packed rows (positions restart per
    sequence; on CPU the packed attention runs causal SDPA per sequence, on CUDA torch's varlen flash kernel)."""
    rng = np.random.default_rng(5)
    samples = [Sample(id=f"s{i}", input_ids=rng.integers(0, vocab_size, size=int(n), dtype=np.int32),
                      num_prompt_tokens=2, original_num_tokens=int(n), row=i)
               for i, n in enumerate(rng.integers(5, 150, size=10))]
    model = load_model(model_dir, dtype="float32", device="cpu")
    for attention in ("packed", "padded"):
        extractor = TransformersExtractor(model, layer_ids=[0, 2, -1], batch_tokens=300, attention=attention)
        for part in extractor.run(list(enumerate(plan_parts(samples, 4))), pooled=False):
            feats, pos = torch.from_numpy(part.features).view(torch.float32), 0
            for s in part.samples:
                got = feats[pos:pos + s.num_tokens * 3 * 256].view(s.num_tokens, 3, 256)
                pos += s.num_tokens * 3 * 256
                hidden = reference(s.input_ids)
                for j, k in enumerate(extractor.layer_ids):
                    torch.testing.assert_close(got[:, j], hidden[k + 1][0], rtol=1e-3, atol=1e-3)
        extractor.close()
        assert (extractor.stats.num_padded_tokens == extractor.stats.num_tokens) == (attention == "packed")


# ---------------------------------------------------------------------------------------------------------------
# Exactly once: limits, crashes, reruns, drift
# ---------------------------------------------------------------------------------------------------------------


def test_limit_crash_and_rerun_keep_every_row_exactly_once(dense_dir, vocab_size, tmp_path, capsys):
    # ~45-75 s: five stage-2 jobs on one run (a limit, the rest, a crash's rerun, drift refused and allowed), each a
    # Ray Data job with its extractor actors loading the model; resuming between jobs is what is tested.
    run = str(tmp_path)
    rows = completion_rows(vocab_size, seed=2)
    write_completions(run, rows)
    config = hs_config(dense_dir, run)

    # --limit 10: shard 1 whole, the first 2 rows of shard 2 (parts named with their limit).
    config.limit = 10
    run_hidden_states(config)
    assert sorted(r["id"] for r in load(run)) == sorted(kept(rows, limit=10))
    assert any("-n2-p0000" in name for name in part_files(run))

    # The full run replaces the limited unit's parts and adds the rest.
    config.limit = None
    run_hidden_states(config)
    ids = [r["id"] for r in load(run)]
    assert sorted(ids) == sorted(kept(rows)) and len(ids) == len(set(ids))
    assert not any("-n2-" in name for name in part_files(run))

    # A crash mid-unit: one part and the unit's marker missing. The rerun writes exactly that part again: the same
    # rows, the same features (up to float rounding: its rows now share batches with no other part's).
    hs_dir = os.path.join(run, layout.HIDDEN_STATES_DIR)
    victim = os.path.join(hs_dir, "f00000-r0000000008-0000000020-p0001.arrow")
    before = storage.read_shard(victim)
    mtimes = {n: os.path.getmtime(os.path.join(hs_dir, n)) for n in part_files(run) if n.endswith(".arrow")}
    os.remove(victim)
    os.remove(os.path.join(hs_dir, "_done", "f00000-r0000000008-0000000020.json"))
    summary = run_hidden_states(config)
    assert summary.num_tokens_extracted == sum(before.column(schema.NUM_TOKENS).to_pylist())
    after = storage.read_shard(victim)
    assert after.drop_columns([schema.HIDDEN_STATES]).equals(before.drop_columns([schema.HIDDEN_STATES]))
    for a, b in zip(iter_records(after), iter_records(before)):
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], rtol=1e-3, atol=1e-3)
    assert all(os.path.getmtime(os.path.join(hs_dir, n)) == t for n, t in mtimes.items() if n not in victim)
    ids = [r["id"] for r in load(run)]
    assert sorted(ids) == sorted(kept(rows))

    # A finished run does nothing; nor does a small --limit rerun of it, which keeps every committed file (it used
    # to delete the parts of the shard its limit cut into, as another limit's leftovers); changed settings are
    # refused.
    capsys.readouterr()
    summary = run_hidden_states(config)
    assert summary.num_tokens_extracted == 0 and "nothing to do" in capsys.readouterr().out
    # No progress heartbeat outlives a run (a finished rerun used to leave one printing until the process exited).
    assert not [t.name for t in threading.enumerate() if t.name.startswith("progress-")]
    files = {n: os.path.getmtime(os.path.join(hs_dir, n)) for n in part_files(run) if n.endswith(".arrow")}
    config.limit = 10
    summary = run_hidden_states(config)
    assert summary.num_tokens_extracted == 0 and "nothing to do" in capsys.readouterr().out
    assert {n: os.path.getmtime(os.path.join(hs_dir, n)) for n in part_files(run) if n.endswith(".arrow")} == files
    assert sorted(r["id"] for r in load(run)) == sorted(kept(rows))
    config.limit = None
    with pytest.raises(RunError, match="layer_ids.*--allow-drift"):
        run_hidden_states(hs_config(dense_dir, run, layer_ids=[0, 2]))

    # --allow-drift to smaller parts: every part is redone with the new settings; none of the old is kept as done.
    started = time.time()
    summary = run_hidden_states(hs_config(dense_dir, run, rows_per_shard=2), allow_drift=True)
    assert summary.num_tokens_extracted > 0
    ids = [r["id"] for r in load(run)]
    assert sorted(ids) == sorted(kept(rows)) and len(ids) == len(set(ids))
    arrow = [n for n in part_files(run) if n.endswith(".arrow")]
    assert all(os.path.getmtime(os.path.join(hs_dir, n)) >= started for n in arrow)
    assert all(storage.read_shard(os.path.join(hs_dir, n)).num_rows <= 2 for n in arrow)


def test_stage2_over_an_unfinished_stage1_says_so_and_picks_up_the_rest_later(dense_dir, vocab_size, tmp_path,
                                                                              capsys):
    """Stage 1 still running (its run.json says so, one shard not yet written): stage 2 does the committed shards,
    says that it is partial (not "complete"), and a later rerun does only the shard added since."""
    from job.runview import status

    def read_run_json(run, _):
        return storage.read_json(storage.join(run, layout.RUN_JSON))

    run = str(tmp_path)
    rows = completion_rows(vocab_size, seed=3)
    write_completions(run, rows)
    last = os.path.join(run, layout.COMPLETIONS_DIR, f"f00000-r{SHARDS[-1][0]:010d}-{SHARDS[-1][1]:010d}.arrow")
    held_back = tmp_path.parent / f"{tmp_path.name}-held-back.arrow"
    os.rename(last, held_back)
    storage.write_json(storage.join(run, layout.RUN_JSON), {"config": {"model": "stage-1-model"}, "generate": {
        "status": "running", "input": {"num_rows": SHARDS[-1][1]}}})
    config = hs_config(dense_dir, run)

    capsys.readouterr()
    run_hidden_states(config)
    out = capsys.readouterr().out
    assert f"note: stage 1 is not finished (status: running; {SHARDS[1][1]} of {SHARDS[-1][1]} rows written)" in out
    assert read_run_json(run, None)["hidden_states"]["status"] == "partial"
    assert sorted(r["id"] for r in load(run)) == sorted(kept(rows, limit=SHARDS[1][1]))
    assert status.build_status(run)["hidden_states"]["status"] == "partial"

    # Stage 1 finishes; the rerun extracts exactly the added shard (the earlier parts are not rewritten).
    hs_dir = os.path.join(run, layout.HIDDEN_STATES_DIR)
    before = {n: os.path.getmtime(os.path.join(hs_dir, n)) for n in part_files(run) if n.endswith(".arrow")}
    os.rename(held_back, last)
    run_json = read_run_json(run, None)
    run_json["generate"]["status"] = "complete"
    storage.write_json(storage.join(run, layout.RUN_JSON), run_json)
    summary = run_hidden_states(config)
    added = kept(rows[SHARDS[-1][0]:SHARDS[-1][1]])
    new_parts = [n for n in part_files(run) if n.endswith(".arrow") and n not in before]
    assert new_parts and all(n.startswith(os.path.basename(last)[:-len(".arrow")]) for n in new_parts)
    assert sorted(i for n in new_parts for i in storage.read_shard(os.path.join(hs_dir, n)).column("id").to_pylist()) \
        == sorted(added)
    assert summary.num_tokens_extracted > 0
    assert all(os.path.getmtime(os.path.join(hs_dir, n)) == t for n, t in before.items())
    assert "not finished" not in capsys.readouterr().out
    assert read_run_json(run, None)["hidden_states"]["status"] == "complete"
    ids = [r["id"] for r in load(run)]
    assert sorted(ids) == sorted(kept(rows)) and len(ids) == len(set(ids))


def test_s3_output_round_trips(dense_dir, vocab_size, s3_bucket):
    run = f"s3://{s3_bucket}/run"
    rows = completion_rows(vocab_size, seed=3)
    write_completions(run, rows)
    config = hs_config(dense_dir, run, layer_ids=[2])
    # The actors' environment: cluster workers (and a Ray started before the S3 server) lack the driver's.
    config.env_vars = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                  "AWS_REGION")}
    summary = run_hidden_states(config)
    assert summary.files and all(u.startswith(f"{run}/hidden_states/") for u in summary.files)
    assert sorted(r["id"] for r in load(run)) == sorted(kept(rows))


# ---------------------------------------------------------------------------------------------------------------
# Checks, estimate, backends, imports
# ---------------------------------------------------------------------------------------------------------------


def _samples(n: int = 3) -> list[Sample]:
    return [Sample(id=f"s{i}", input_ids=np.arange(5, dtype=np.int32), num_prompt_tokens=2, original_num_tokens=5,
                   row=i) for i in range(n)]


def test_checks_name_layer_and_sample_for_nan_zero_and_implausible_norms():
    samples, ok = _samples(), np.full((3, 2), 5 * 64 * 1.0)  # RMS 1.0 everywhere
    kwargs = dict(layer_ids=[1, 7], hidden_size=64, min_rms=1e-5, max_rms=1e4)
    check_features(samples, ok, np.zeros((3, 2)), **kwargs)
    nonfinite = np.zeros((3, 2))
    nonfinite[1, 1] = 2
    with pytest.raises(HiddenStateCheckError, match=r"layer 7 of sample 's1'.*NaN/inf"):
        check_features(samples, ok, nonfinite, **kwargs)
    zero = ok.copy()
    zero[2, 0] = 0
    with pytest.raises(HiddenStateCheckError, match=r"layer 1 of sample 's2'.*all zero"):
        check_features(samples, zero, np.zeros((3, 2)), **kwargs)
    huge = ok * 1e12
    with pytest.raises(HiddenStateCheckError, match=r"layer 1 of sample 's0'.*RMS"):
        check_features(samples, huge, np.zeros((3, 2)), **kwargs)


def test_checks_fire_on_features_of_a_broken_model(dense_dir, vocab_size, tmp_path):
    # All-zero features: zero embeddings and zero residual writes make every layer output exactly zero.
    model = load_model(dense_dir, dtype="float32", device="cpu")
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    extractor = TransformersExtractor(model, layer_ids=[1])
    with pytest.raises(HiddenStateCheckError, match=r"layer 1 of sample 's0'.*all zero"):
        list(extractor.run(list(enumerate(plan_parts(_samples(), 2)))))

    # NaN weights in layer 2, through the whole Ray job: the job stops and names the layer and a sample.
    broken = str(tmp_path / "nan-model")
    model = load_model(dense_dir, dtype="float32", device="cpu")
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[0, 0] = float("nan")
    model.save_pretrained(broken)
    run = str(tmp_path / "run")
    write_completions(run, completion_rows(vocab_size))
    with pytest.raises(HiddenStateCheckError, match=r"layer 2 of sample 'row-\d+'.*NaN"):
        run_hidden_states(hs_config(broken, run, layer_ids=[0, 2]))


def test_estimate_counts_bytes_per_token_and_clipped_total(dense_dir, vocab_size, tmp_path):
    rows = completion_rows(vocab_size, seed=4)
    write_completions(str(tmp_path), rows)
    est = estimate_storage(hs_config(dense_dir, str(tmp_path), dtype="bfloat16", layer_ids=[0, -1]))
    assert est["feature_bytes_per_token"] == 2 * 256 * 2 and est["bytes_per_token"] == 2 * 256 * 2 + 5
    tokens = sum(min(len(r["prompt_token_ids"]) + len(r["output_token_ids"]), MAX_LENGTH) for r in kept(rows).values())
    assert est["num_tokens"] == tokens and est["total_bytes"] == tokens * est["bytes_per_token"]


def test_vllm_backend_on_cpu_fails_with_a_clear_message(dense_dir, vocab_size, tmp_path):
    write_completions(str(tmp_path), completion_rows(vocab_size))
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*pin_memory"):
        run_hidden_states(hs_config(dense_dir, str(tmp_path), backend="vllm", layer_ids=[1]))


def test_config_errors_are_clear(dense_dir, tmp_path):
    with pytest.raises(ConfigError, match="batch_tokens"):
        HiddenStatesConfig(max_length=4096, batch_tokens=1024)
    with pytest.raises(ConfigError, match="out of range"):
        run_hidden_states(hs_config(dense_dir, str(tmp_path), layer_ids=[4]))
    with pytest.raises(ConfigError, match="no completion shards"):
        run_hidden_states(hs_config(dense_dir, str(tmp_path), layer_ids=[0]))


def test_imports_are_light_and_the_core_runs_without_ray(dense_dir):
    code = ("import sys, job.hidden_states, job.hidden_states.transformers_backend\n"
            "heavy = [m for m in ('torch', 'transformers', 'ray', 'vllm') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    code = ("import sys; sys.modules['ray'] = None; sys.modules['vllm'] = None\n"
            "import numpy as np\n"
            "from job.hidden_states.samples import Sample\n"
            "from job.hidden_states.transformers_backend import TransformersExtractor, load_model\n"
            f"ex = TransformersExtractor(load_model({dense_dir!r}, dtype='float32', device='cpu'), layer_ids=[0])\n"
            "s = [Sample(id='a', input_ids=np.arange(9, dtype=np.int32), num_prompt_tokens=4, original_num_tokens=9,"
            " row=0)]\n"
            "(part,) = ex.run([(0, s)])\n"
            "assert part.features.nbytes == 9 * 256 * 4\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------------------------
# Exactness on the hybrid: packed batches, the self-check, --check
# ---------------------------------------------------------------------------------------------------------------


def test_self_check_passes_on_every_worker_and_is_reported(float32_run):
    _, _, summary = float32_run
    (check,) = summary.self_checks  # one worker
    assert check["num_samples"] == 4 and check["max_difference"] < check["tolerance"] == 1e-3
    assert set(check["max_difference_by_layer"]) == {"0", "1", "3"}


def test_each_units_marker_says_where_its_time_went(float32_run):
    """A slow stage 2 names its cause from its markers: the shard read, the host waiting on the device, sorting into
    part buffers and waiting on writes are each inside the unit's time, and together within its extraction's."""
    run, _, _ = float32_run
    done = os.path.join(run, layout.HIDDEN_STATES_DIR, layout.DONE_DIR)
    markers = [json.load(open(os.path.join(done, name))) for name in sorted(os.listdir(done))]
    assert len(markers) == len(SHARDS)
    for m in markers:
        assert 0 < m["read_s"] < m["seconds"] and 0 < m["extract_seconds"] < m["seconds"]
        assert m["wait_gpu_s"] == 0.0  # on the CPU nothing is copied from a device
        assert 0 < m["host_copy_s"] and m["host_copy_s"] + m["writer_blocked_s"] <= m["extract_seconds"]


@pytest.mark.slow  # the hybrid model
def test_self_check_stops_a_packed_hybrid_whose_state_crosses_sequences(tiny_hybrid_dir, vocab_size, tmp_path,
                                                                         monkeypatch):
    """The bug this project shipped once: a packed batch lets each Gated DeltaNet layer's conv and recurrent state
    run on from one sequence into the next (measured here: 4-24 % relative error on CPU in float32). With the
    per-sequence mixers taken away, the worker's self-check must refuse to start and name a layer and a sample."""
    from job.config import to_dict
    from job.hidden_states.actor import HiddenStateExtractor
    from job.hidden_states.transformers_backend import TransformersExtractor as Extractor

    write_completions(str(tmp_path), completion_rows(vocab_size, seed=6))
    config = hs_config(tiny_hybrid_dir, str(tmp_path), attention="packed")
    source = {"uri": str(tmp_path / "completions" / "f00000-r0000000008-0000000020.arrow"), "row_limit": None}
    worker = HiddenStateExtractor(to_dict(config), [0, 1, 3], "stream", check_source=source)  # exact: passes
    assert worker.self_check["where"] == "transformers backend, packed batches"
    assert worker.self_check["max_difference"] < 1e-3
    monkeypatch.setattr(Extractor, "per_sequence", lambda self, mixer, forward: forward)
    with pytest.raises(HiddenStateCheckError, match=r"self-check failed.*layer \d of sample 'row-\d+' differs from "
                                                    r"a plain transformers forward .* by \d+\.\d+%"):
        HiddenStateExtractor(to_dict(config), [0, 1, 3], "stream", check_source=source)


def test_attention_mode_is_chosen_only_where_exact(dense_dir):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with pytest.raises(ConfigError, match="hidden_states.attention must be auto, packed or padded"):
        HiddenStatesConfig(attention="flash")
    model = load_model(dense_dir, dtype="float32", device="cpu")
    assert TransformersExtractor(model, layer_ids=[0]).attention == "padded"  # auto packs on CUDA only
    assert TransformersExtractor(model, layer_ids=[0], attention="packed").attention == "packed"
    sliding = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                                           use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert TransformersExtractor(sliding, layer_ids=[0]).attention == "padded"
    with pytest.raises(ValueError, match="'sliding_attention', a sequence mixer packed batches cannot keep apart"):
        TransformersExtractor(sliding, layer_ids=[0], attention="packed")


def test_check_of_a_finished_run_passes_and_catches_altered_features(float32_run, model_dir, tmp_path):
    import shutil

    from job.hidden_states import check_run
    from job.hidden_states.shards import part_table, table_to_ipc

    run, _, _ = float32_run
    result = check_run(hs_config(model_dir, run), num_samples=3)
    assert result["num_samples"] == 3 and result["max_difference"] < 1e-3

    altered = str(tmp_path / "altered")
    shutil.copytree(run, altered)
    uri = sorted((tmp_path / "altered" / layout.HIDDEN_STATES_DIR).glob("*.arrow"))[0]
    table = storage.read_shard(str(uri))
    records = list(iter_records(table))
    features = torch.cat([r["hidden_states"].reshape(-1) for r in records]).clone()
    first = records[0]
    n = first["hidden_states"].numel()
    features[:n].view(first["hidden_states"].shape)[:, 1] *= 1.01  # layer 1 of the first sample, off by 1 %
    samples = [Sample(id=r["id"], input_ids=r["input_ids"].numpy(), num_prompt_tokens=int((r["loss_mask"] == 0).sum()),
                      original_num_tokens=r["original_num_tokens"], row=i) for i, r in enumerate(records)]
    meta = table.schema.metadata
    hs_schema = schema.hidden_states_schema(model=meta[schema.META_MODEL].decode(), layer_ids=[0, 1, 3],
                                            hidden_size=256, dtype="float32")
    uri.write_bytes(table_to_ipc(part_table(samples, features.view(torch.uint8).numpy(), hs_schema)).to_pybytes())
    with pytest.raises(HiddenStateCheckError, match=rf"layer 1 of sample {first['id']!r} .* by 1\.\d\d%"):
        check_run(hs_config(model_dir, altered), num_samples=3)


def test_vllm_backend_prefetch_keeps_order_raises_in_place_and_drops_what_nobody_reads():
    """The vllm backend's read-back overlap (the engine works on part i+1 while part i is read back): results come
    in order, at most `depth` ahead, an error surfaces at its own item, and parts made ahead of an early stop are
    handed to on_drop (their /dev/shm files deleted) instead of leaking."""
    import threading

    from job.hidden_states.vllm_backend import ahead

    made, dropped, gate = [], [], threading.Semaphore(0)

    def fn(i):
        made.append(i)
        if i == 3:
            raise ValueError("part 3 is bad")
        return i * 10

    assert list(ahead(fn, [0, 1, 2], 0)) == [0, 10, 20]
    made.clear()
    it = ahead(fn, list(range(6)), 1, on_drop=dropped.append)
    assert [next(it), next(it), next(it)] == [0, 10, 20]
    with pytest.raises(ValueError, match="part 3 is bad"):
        next(it)
    assert made == [0, 1, 2, 3]  # nothing after the failure was started

    # Stop early while the thread is ahead: what it made and nobody took goes to on_drop.
    made.clear()

    def slow(i):
        made.append(i)
        gate.release()
        return i

    it = ahead(slow, list(range(10)), 2, on_drop=dropped.append)
    assert next(it) == 0
    for _ in range(4):  # item 0, two ahead in the queue (depth 2), and item 3 made and waiting for room
        assert gate.acquire(timeout=10)
    it.close()
    assert made == [0, 1, 2, 3]
    assert sorted(dropped) == made[1:]


def test_stage2_refuses_another_model_than_stage1_generated_with(tmp_path, capsys):
    """The model is compared by its files (config, tokenizer, weights' index), not its path: the same files under
    another path pass with a note; other files are refused, naming both, unless --allow-drift."""
    from job.hidden_states.run import HiddenStatesStage
    from job.run_record import RunRecord

    def model(name: str, config: dict) -> str:
        os.makedirs(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    generated = model("hybrid", {"model_type": "qwen3_5"})
    record = RunRecord.from_dict({"config": {"model": "/mnt/models/hybrid"}, "generate": {
        "status": "complete", "identity": {"model": "/mnt/models/hybrid",
                                           "model_files": runs.model_files_digest(generated)}}})

    def check(model_dir: str, record, allow_drift: bool = False) -> None:
        s = HiddenStatesStage(RunConfig(model=model_dir, output=str(tmp_path / "run")))
        s.allow_drift = allow_drift  # as run_stage sets it
        s.check_model(record, runs.model_files_digest(model_dir))

    check(generated, record)  # the same files under another path
    assert "stage 1 ran with model '/mnt/models/hybrid'" in capsys.readouterr().out
    other = model("dense", {"model_type": "qwen3"})
    with pytest.raises(ConfigError, match="generated these completions with '/mnt/models/hybrid'.*another model.*"
                                          "--allow-drift"):
        check(other, record)
    check(other, record, allow_drift=True)
    assert "another model (--allow-drift)" in capsys.readouterr().out
    check(other, None)  # no stage-1 record (completions from elsewhere): nothing to compare
