"""Input formats (parquet, JSONL plain/.gz/.zst, Arrow / datasets.save_to_disk), conversation schemas (OpenAI
messages with tools, ShareGPT), conversation checks and `generate.regenerate`, then one stage-1 + stage-2 run on
the tiny model over a multi-turn JSONL input."""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import read_run

from job import layout, storage
from job.generate import inputs, jsonl_input, prompts
from job.generate.units import pending_units
from job.storage import StorageConfig

SC = StorageConfig()
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather now",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def conversation_rows(n: int) -> list[dict]:
    """n rows cycling through: a plain prompt, a 2-turn OpenAI chat, an agent trace with a tool call and `tools`,
    a ShareGPT chat with a system prompt (the last kind has `conversations` instead of `messages`)."""
    rows = []
    for i in range(n):
        kind = i % 4
        row = {"id": f"c{i:05d}", "topic": f"k{kind}"}
        if kind == 0:
            row["prompt"] = f"What is {i} plus one?"
        elif kind == 1:
            row["messages"] = [{"role": "user", "content": f"Name a color ({i})."},
                               {"role": "assistant", "content": "Blue."},
                               {"role": "user", "content": "Another one?"},
                               {"role": "assistant", "content": "Red, which is warmer than blue."}]
        elif kind == 2:
            row["messages"] = [{"role": "system", "content": "You can call tools."},
                               {"role": "user", "content": f"Weather in Oslo, day {i}?"},
                               {"role": "assistant", "content": None, "tool_calls": [CALL]},
                               {"role": "tool", "content": "4 C, rain", "tool_call_id": "c1"},
                               {"role": "assistant", "content": "It is 4 C and raining in Oslo."}]
            row["tools"] = TOOLS
        else:
            row["conversations"] = [{"from": "system", "value": "Be brief."},
                                    {"from": "human", "value": f"Why is the sky blue? ({i})"},
                                    {"from": "gpt", "value": "Rayleigh scattering."},
                                    {"from": "human", "value": "Thanks!"}]
        rows.append(row)
    return rows


def jsonl_text(rows: list[dict]) -> str:
    # CRLF and blank lines on purpose: rows are the non-blank lines.
    return "".join(json.dumps(r) + ("\r\n" if i % 5 == 0 else "\n") + ("\n" if i % 7 == 0 else "")
                   for i, r in enumerate(rows))


def write_save_to_disk(directory, table: pa.Table, num_files: int = 2, batch_rows: int = 10) -> str:
    """The layout `datasets.save_to_disk` writes (the `datasets` package is not installed here): Arrow *stream*
    files `data-0000i-of-0000N.arrow` in batches of `writer_batch_size` rows, with state.json naming them in order
    and dataset_info.json. Written in reverse name order would not matter: state.json's order is the row order."""
    os.makedirs(directory, exist_ok=True)
    per = -(-table.num_rows // num_files)
    names = [f"data-{i:05d}-of-{num_files:05d}.arrow" for i in range(num_files)]
    for i, name in enumerate(names):
        with pa.OSFile(os.path.join(directory, name), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.slice(i * per, per).to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": "train"}, f)
    with open(os.path.join(directory, "dataset_info.json"), "w") as f:
        json.dump({"features": {}}, f)
    return str(directory)


def write_all_formats(tmp_path, rows: list[dict]) -> dict[str, str]:
    """The same rows in every supported form; returns {form: input uri}."""
    text = jsonl_text(rows)
    out = {}
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "rows.jsonl").write_text(text)
    out["jsonl"] = str(tmp_path / "plain" / "rows.jsonl")
    with gzip.open(tmp_path / "rows.jsonl.gz", "wt") as f:
        f.write(text)
    out["jsonl.gz"] = str(tmp_path / "rows.jsonl.gz")
    with pa.CompressedOutputStream(str(tmp_path / "rows.jsonl.zst"), "zstd") as f:
        f.write(text.encode())
    out["jsonl.zst"] = str(tmp_path / "rows.jsonl.zst")
    # Parquet and Arrow hold nested columns natively; messages of different rows have different fields, so the
    # struct has all of them and absent ones are null (what the readers must drop again).
    table = pa.Table.from_struct_array(pa.array(rows))  # the columns of all rows, not just the first's
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 17), str(tmp_path / "pq" / "a.parquet"))
    pq.write_table(table.slice(17), str(tmp_path / "pq" / "b.parquet"))
    out["parquet"] = str(tmp_path / "pq")
    out["save_to_disk"] = write_save_to_disk(tmp_path / "hf", table)
    with pa.OSFile(str(tmp_path / "file-format.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=8):
            w.write_batch(batch)
    out["arrow_file"] = str(tmp_path / "file-format.arrow")
    return out


def read_all_units(uri: str, rows_per_shard: int) -> tuple[list[layout.CompletionUnit], list[dict]]:
    files = inputs.list_input_files(uri, SC)
    carried = inputs.validate_input(files, SC)
    units = pending_units(files, [], None, rows_per_shard)
    got = []
    for u in units:
        table = inputs.read_unit(u, SC, carried)
        assert table.num_rows == u.num_rows
        got += table.to_pylist()
    return units, got


def test_every_format_gives_the_same_rows_and_conversations(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl_input, "CHECKPOINT_ROWS", 8)  # several checkpoints in a small file
    rows = conversation_rows(40)
    expected = [prompts.row_messages(r) for r in rows]
    for form, uri in write_all_formats(tmp_path, rows).items():
        units, got = read_all_units(uri, rows_per_shard=7)
        assert [r["id"] for r in got] == [r["id"] for r in rows], form
        assert [prompts.row_messages(r) for r in got] == expected, form
        assert [prompts.row_tools(r) for r in got] == [r.get("tools") for r in rows], form
        assert [r["topic"] for r in got] == [r["topic"] for r in rows], f"{form}: carried columns"
        if form == "jsonl":  # units start at their checkpoint, not at the file's start
            assert any(u.seek_byte > 0 and u.seek_row <= u.start < u.seek_row + 8 for u in units)
    # ShareGPT mapped to messages, once: roles and contents.
    assert expected[3] == [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Why is the sky blue? (3)"},
                           {"role": "assistant", "content": "Rayleigh scattering."},
                           {"role": "user", "content": "Thanks!"}]
    assert expected[2][2] == {"role": "assistant", "content": "", "tool_calls": [CALL]}


def test_a_jsonl_unit_reads_only_its_rows(tmp_path, monkeypatch):
    """A unit in the middle of a plain file seeks to its checkpoint: bytes before it are never read (here they are
    overwritten after the scan, and the unit still reads). A .gz unit in the middle returns exactly its rows."""
    monkeypatch.setattr(jsonl_input, "CHECKPOINT_ROWS", 64)
    rows = [{"id": i, "prompt": f"question {i}"} for i in range(1000)]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(tmp_path / "big.jsonl.gz", "wt") as f:
        f.write(path.read_text())
    for uri in (str(tmp_path / "big.jsonl.gz"), str(path)):
        files = inputs.list_input_files(uri, SC)
        carried = inputs.validate_input(files, SC)
        assert files[0].num_rows == 1000
        unit = [u for u in pending_units(files, [], None, 100) if u.start == 500][0]
        got = inputs.read_unit(unit, SC, carried)
        assert got.column("id").to_pylist() == [str(i) for i in range(500, 600)]
        assert got.column("prompt").to_pylist() == [f"question {i}" for i in range(500, 600)]
    # Garble the first 400 rows in place after the scan (same size): the unit at 500 (checkpoint 448) still reads
    # its rows, the first unit cannot.
    data = bytearray(path.read_bytes())
    cut = data.index(b'{"id": 400,')
    data[:cut] = b"#" * cut
    path.write_bytes(bytes(data))
    units = {u.start: u for u in pending_units(files, [], None, 100)}
    assert inputs.read_unit(units[500], SC, carried).column("id").to_pylist() == [str(i) for i in range(500, 600)]
    with pytest.raises(inputs.InputError, match="not valid JSON"):
        inputs.read_unit(units[0], SC, carried)


def test_bad_input_files_are_refused_naming_the_problem(tmp_path):
    def refused(name: str, text: str | None = None, *, words: str, setup=None):
        d = tmp_path / name
        d.mkdir()
        if text is not None:
            (d / "in.jsonl").write_text(text)
        if setup:
            setup(d)
        with pytest.raises(inputs.InputError) as e:
            inputs.validate_input(inputs.list_input_files(str(d), SC), SC)
        assert words in str(e.value), str(e.value)

    refused("not_json", '{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": \n', words="row 1 is not valid JSON")
    refused("not_object", '{"id": 1, "prompt": "a"}\n[1, 2]\n', words="row 1 is a JSON list, not an object")
    refused("no_id", '{"id": 1, "prompt": "a"}\n{"prompt": "b"}\n', words="1 row(s) have a null `id`")
    refused("dup", '{"id": 7, "prompt": "a"}\n{"id": "7", "prompt": "b"}\n', words="duplicate id(s), e.g. '7'")
    refused("no_prompt", '{"id": 1, "text": "a"}\n', words="neither a `prompt` nor a `messages` column")
    refused("mixed", '{"id": 1, "prompt": "a"}\n', words="mixes formats",
            setup=lambda d: pq.write_table(pa.table({"id": [2], "prompt": ["b"]}), str(d / "b.parquet")))

    def dataset_dict(d):
        write_save_to_disk(d / "train", pa.table({"id": ["a"], "prompt": ["b"]}), num_files=1)
        (d / "dataset_dict.json").write_text('{"splits": ["train"]}')
    refused("dataset_dict", words="point the input at one split's directory", setup=dataset_dict)


def test_jsonl_and_save_to_disk_on_s3(s3_bucket, tmp_path, monkeypatch):
    import boto3

    monkeypatch.setattr(jsonl_input, "CHECKPOINT_ROWS", 8)
    rows = conversation_rows(24)
    forms = write_all_formats(tmp_path, rows)
    s3 = boto3.client("s3")
    s3.upload_file(forms["jsonl"], s3_bucket, "in-jsonl/rows.jsonl")
    s3.upload_file(forms["jsonl.zst"], s3_bucket, "in-zst/rows.jsonl.zst")
    for name in os.listdir(forms["save_to_disk"]):
        s3.upload_file(os.path.join(forms["save_to_disk"], name), s3_bucket, f"in-hf/{name}")
    for prefix in ("in-jsonl", "in-zst", "in-hf"):
        _, got = read_all_units(f"s3://{s3_bucket}/{prefix}", rows_per_shard=5)
        assert [r["id"] for r in got] == [r["id"] for r in rows], prefix
        assert [prompts.row_messages(r) for r in got] == [prompts.row_messages(r) for r in rows], prefix
    # A re-uploaded file with other ids (same size and row count) is refused on resume, by its content; the same
    # bytes re-uploaded another way (pyarrow's multipart upload: another ETag) are accepted after a hash.
    root = f"s3://{s3_bucket}/in-jsonl"
    files = inputs.list_input_files(root, SC)
    digests: dict = {}
    inputs.validate_input(files, SC, ids_digests=digests)
    recorded = inputs.describe_files(files, root, digests, inputs.content_digests(files, SC))
    assert set(recorded[0]["content"]) == {"sha256", "etag"}
    with open(forms["jsonl"], "rb") as f:
        original = f.read()
    storage.write_bytes_atomic(f"{root}/rows.jsonl", original, SC)
    inputs.check_unchanged(recorded, inputs.list_input_files(root, SC), root, SC)
    storage.write_bytes_atomic(f"{root}/rows.jsonl", original.replace(b'"c00001"', b'"x00001"'), SC)
    with pytest.raises(inputs.InputError, match="rows.jsonl \\(same size and rows, other content\\)"):
        inputs.check_unchanged(recorded, inputs.list_input_files(root, SC), root, SC)


# ---------------------------------------------------------------------------------------------------------------
# Conversations: checks and regeneration targets
# ---------------------------------------------------------------------------------------------------------------

U, A = "user", "assistant"


def msg(role, content="x", **kw):
    return {"role": role, "content": content, **kw}


BAD_CONVERSATIONS = {
    "two_users": ([msg(U), msg(U)], "roles do not alternate: message 1 is 'user' after 'user'"),
    "starts_with_assistant": ([msg(A), msg(U)], "message 0 is 'assistant' after 'the start'"),
    "late_system": ([msg(U), msg(A), msg("system"), msg(U)], "a system message at position 2"),
    "tool_without_call": ([msg(U), msg(A), msg("tool", "42")], "tool message 2 answers no call"),
    "tool_wrong_call": ([msg(U), msg(A, None, tool_calls=[CALL]), msg("tool", "4 C", tool_call_id="c9")],
                        "answers call 'c9', which the assistant did not make"),
    "empty_user": ([msg(U, "hi"), msg(A), msg(U, "  "), msg(A)], "empty turn: user message 2"),
    "empty_assistant": ([msg(U), msg(A, ""), msg(U)], "empty turn: assistant message 1"),
    "only_system": ([msg("system")], "no user turn"),
    "sharegpt_speaker": (None, "unknown ShareGPT speaker 'narrator'"),
}


def test_bad_conversations_are_row_errors_with_a_reason():
    for name, (messages, words) in BAD_CONVERSATIONS.items():
        row = {"id": name, "messages": messages} if messages is not None else \
            {"id": name, "conversations": [{"from": "narrator", "value": "Once"}]}
        with pytest.raises(prompts.RowError) as e:
            prompts.row_messages(row)
        assert words in str(e.value), (name, str(e.value))
    # A trailing empty assistant message is a placeholder for the answer, not an error.
    assert prompts.row_messages({"messages": [msg(U), msg(A, "")]})[-1] == msg(A, "")


def test_regenerate_targets_histories_and_ids():
    convo = prompts.row_messages(conversation_rows(3)[2])  # system, user, assistant(call), tool, assistant
    last = prompts.regeneration_targets("r", convo, "last_turn")
    assert [(t.id, t.turn) for t in last] == [("r", 1)]
    assert last[0].history == convo[:4] and last[0].original == convo[4]
    every = prompts.regeneration_targets("r", convo, "every_assistant_turn")
    assert [(t.id, t.turn) for t in every] == [("r#0", 0), ("r#1", 1)]
    assert every[0].history == convo[:2] and every[0].original == convo[2]
    assert every[1].history == convo[:4] and every[1].original == convo[4]
    # A conversation that waits for an answer: last_turn generates it; every_assistant_turn adds it.
    open_convo = prompts.row_messages(conversation_rows(4)[3])  # system, user, assistant, user
    assert [(t.id, t.turn, t.original) for t in prompts.regeneration_targets("s", open_convo, "last_turn")] == \
        [("s", 1, None)]
    every = prompts.regeneration_targets("s", open_convo, "every_assistant_turn")
    assert [(t.id, len(t.history), t.original is None) for t in every] == [("s#0", 2, False), ("s#1", 4, True)]


def test_conversation_mode_has_every_turn_s_targets_and_own_histories():
    """`conversation` generates the turns every_assistant_turn does (same ids, turns, originals); each turn's history
    is the data's with the assistant turns before it replaced by the model's own, in order: system prompt, user
    turns, tool results and the data's tool calls kept."""
    convo = prompts.row_messages(conversation_rows(3)[2])  # system, user, assistant(call), tool, assistant
    every = prompts.regeneration_targets("r", convo, "every_assistant_turn")
    assert prompts.regeneration_targets("r", convo, "conversation") == every
    own = [prompts.own_answer("I should call the tool.", "Calling it.")]
    history = prompts.with_own_answers(every[1].history, own)
    assert history == [convo[0], convo[1],
                       {"role": "assistant", "content": "Calling it.", "reasoning_content": "I should call the tool.",
                        "tool_calls": [CALL]},
                       convo[3]]
    assert prompts.with_own_answers(every[0].history, []) == every[0].history
    assert prompts.own_answer("", "Hi.") == {"role": "assistant", "content": "Hi."}, "no reasoning: none passed on"
    assert prompts.own_answer(None, None) == {"role": "assistant", "content": ""}, "a turn that produced nothing"
    with pytest.raises(AssertionError, match="1 answers for a history of 3 assistant turns"):
        prompts.with_own_answers(convo + [msg(U), msg(A, "more"), msg(U)], own)


def test_conversation_turn_context_is_the_template_s_rendering_of_the_model_s_own_answers(tokenizer):
    """Token for token: turn 2's prompt is the chat template's rendering of the data's user turns with the model's own
    answers to turns 0 and 1 (never the data's), as served; the reasoning of those turns is kept or dropped as the
    template renders it (the tiny model's Qwen3 template drops reasoning before the last user message)."""
    convo = prompts.row_messages({"messages": [
        msg("system", "Be brief."), msg(U, "Name a color."), msg(A, "DATA-ANSWER-ZERO"),
        msg(U, "Another one?"), msg(A, "DATA-ANSWER-ONE"), msg(U, "And a third?")]})
    targets = prompts.regeneration_targets("r", convo, "conversation")
    assert [(t.id, t.turn) for t in targets] == [("r#0", 0), ("r#1", 1), ("r#2", 2)]
    answers = [prompts.own_answer("thinking about colors", "Green, like grass."),
               prompts.own_answer("another one", "Purple.")]
    template = dict(chat_template=None, enable_thinking=True, chat_template_kwargs={})
    prompt = prompts.render_prompt_ids(tokenizer, prompts.with_own_answers(targets[2].history, answers), **template)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
         {"role": "assistant", "content": "Green, like grass.", "reasoning_content": "thinking about colors"},
         {"role": "user", "content": "Another one?"},
         {"role": "assistant", "content": "Purple.", "reasoning_content": "another one"},
         {"role": "user", "content": "And a third?"}], tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert prompt == tokenizer(expected, add_special_tokens=False)["input_ids"]

    def holds(ids: list[int], text: str) -> bool:
        part = tokenizer(text, add_special_tokens=False)["input_ids"]
        return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))

    for own in ("Green, like grass.", "Purple."):
        assert holds(prompt, own + "<|im_end|>"), f"the model's own answer {own!r}, token for token"
    text = tokenizer.decode(prompt)
    assert "DATA-ANSWER" not in text, "the data's answers are gone"
    assert "thinking about colors" not in text and "another one" not in text, "the template dropped old reasoning"
    # Turn 1's context holds turn 0's own answer and nothing after it.
    turn1 = prompts.render_prompt_ids(tokenizer, prompts.with_own_answers(targets[1].history, answers[:1]), **template)
    assert holds(turn1, "Green, like grass.<|im_end|>") and "Purple" not in tokenizer.decode(turn1)


def test_a_row_s_sampling_variant_is_drawn_from_its_id_reproducibly_and_evenly():
    ids = [f"row{i}" for i in range(3000)]
    drawn = [prompts.variant_index(0, i, 3) for i in ids]
    assert drawn == [prompts.variant_index(0, i, 3) for i in ids], "the same on every rerun"
    assert all(900 < n < 1100 for n in Counter(drawn).values()), Counter(drawn)
    assert drawn != [prompts.variant_index(1, i, 3) for i in ids], "another run seed, another draw"
    assert {prompts.variant_index(0, i, 1) for i in ids} == {0}


def test_the_report_shows_the_variant_mix():
    from job.generate import report

    table = pa.table({"variant": pa.array([0, 1, 1, None, 1], pa.int32())})
    ok = pa.array([True, True, True, False, False]).to_numpy(zero_copy_only=False)
    variants = [{"temperature": 0.6}, {"temperature": 1.0, "enable_thinking": False}]
    mix = report.variant_mix(table, ok, variants)
    assert [(v["variant"], v["rows"], v["share"]) for v in mix] == [(0, 1, 1 / 3), (1, 2, 2 / 3)]
    assert report.variant_mix(table, ok, None) == [] and report.variant_mix(pa.table({"x": [1]}), ok[:1], variants)[0][
        "rows"] == 0, "no variants, or shards made before the column existed"
    rep = {"run": "r", "status": "complete", "rows_total": 5, "rows_done": 5, "rows_error": 2, "output_tokens": 9,
           "flags": {}, "tokens": {}, "finish_reasons": {}, "error_kinds": {}, "variants": mix}
    assert "   1         2   66.7%  temperature=1.0, enable_thinking=False" in report.format_report(rep)


# ---------------------------------------------------------------------------------------------------------------
# End to end: stage 1 (`conversation`, its engine actor killed mid-run) and stage 2 on the tiny model
# ---------------------------------------------------------------------------------------------------------------


def expected_targets(rows: list[dict], mode: str) -> dict[str, tuple[prompts.Target, list | None] | str]:
    """{output id: (target, tools)} for good rows, {id: reason} for bad ones."""
    out = {}
    for r in rows:
        try:
            messages = prompts.row_messages(r)
        except prompts.RowError as e:
            out[r["id"]] = str(e)
            continue
        for t in prompts.regeneration_targets(r["id"], messages, mode):
            out[t.id] = (t, prompts.row_tools(r))
    return out


def holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_multi_turn_jsonl_end_to_end(tmp_path, make_config, tokenizer, local_ray):
    """`generate.regenerate: conversation` over multi-turn JSONL (OpenAI chats, a tool trace with `tools`, ShareGPT,
    bad conversations, one whose second turn outgrows the context): every turn's prompt is the template's rendering of
    the data with the model's OWN earlier answers, checked token for token. The engine actor is SIGKILLed once the
    first shard is written, while other units' conversations are half done: Ray replaces it, the retried units
    regenerate their conversations from turn 0, and every output id is written exactly once; a rerun does nothing.
    Then stage 2. Two engine starts (~100 s: the killed one and its replacement), as the --limit + rest runs of
    every_assistant_turn this test held before (that mode's histories are the pure rule tested above)."""
    import threading

    from test_resume import kill_every, shards, wait_for

    from job.generate import run_generate
    from job.hidden_states import load, run_hidden_states

    rows = conversation_rows(12)
    bad = {"two_users", "tool_without_call", "empty_user"}
    rows += [{"id": name, "messages": BAD_CONVERSATIONS[name][0], "topic": "bad"} for name in sorted(bad)]
    long_turn = " ".join(f"w{i}" for i in range(1100))  # > max_model_len (1024) tokens, from its second turn on
    rows.append({"id": "long", "topic": "long", "messages": [msg(U, "Hi."), msg(A, "Hello."), msg(U, long_turn),
                                                               msg(A, "Ok."), msg(U, "Bye.")]})
    inp = tmp_path / "in.jsonl"
    inp.write_text(jsonl_text(rows))
    # The tiny model's template ignores `tools`; this one (its own, after a tool list) shows they reach it.
    template = "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n{% endif %}" + \
        tokenizer.chat_template
    (tmp_path / "template.jinja").write_text(template)
    run = tmp_path / "run"
    variants = [{"temperature": 0.5}, {"temperature": 1.0, "enable_thinking": False}]  # diversity, per conversation
    # Two rows in the engine and one unit at a time: conversations advance slowly, so the kill finds units half done.
    config = make_config(input=str(inp), output=str(run),
                         **{"generate.chat_template": str(tmp_path / "template.jinja"),
                            "generate.sampling_variants": variants,
                            "generate.rows_per_shard": 4, "generate.regenerate": "conversation",
                            "generate.max_rows_in_flight": 2, "generate.units_in_flight_per_engine": 1,
                            "generate.sampling": {"max_tokens": 24}, "quality.canary_rows": 0,
                            "hidden_states.layer_ids": [0, -1], "hidden_states.rows_per_shard": 16})
    hit, errors = [], []

    def kill_after_first_shard():
        try:
            wait_for(lambda: shards(run), 300, "the first shard")
            kill_every("ray::MapWorker")()
            hit.append(len(shards(run)))
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    killer = threading.Thread(target=kill_after_first_shard, daemon=True)
    killer.start()
    summary = run_generate(config)
    killer.join(5)
    assert not errors, errors
    num_shards = -(-len(rows) // 4)
    assert hit and hit[0] < num_shards, f"the kill landed with {hit} of {num_shards} shards written"
    assert summary.num_rows == len(rows)
    assert run_generate(config).num_rows == 0, "a finished run rerun does nothing"

    table = read_run(config.output)
    want = expected_targets(rows, "conversation")
    assert Counter(table.column("id").to_pylist()) == Counter(list(want)), "every expected id exactly once"
    assert len(want) > len(rows)  # turns expanded
    by_id = {r["id"]: r for r in table.to_pylist()}
    num_answers_seen = 0
    for row in by_id.values():
        expected = want[row["id"]]
        if isinstance(expected, str):
            assert row["error"] == expected and row["id"] in bad and row["topic"] == "bad"
            continue
        target, tools = expected
        variant = prompts.variant_index(0, row["id"].split("#")[0], len(variants))
        thinking = variants[variant].get("enable_thinking", True)
        assert row["topic"] == rows[[r["id"] for r in rows].index(row["id"].split("#")[0])]["topic"]
        if row["id"].startswith("long#"):
            continue
        assert row["error"] is None, row["error"]
        assert row["turn"] == target.turn
        assert row["variant"] == variant, "every turn of a conversation sampled with its row's variant"
        assert (row["num_reasoning_tokens"] > 0 or not row["reasoning"]) if thinking else row["reasoning"] == ""
        # The context: the data's history with each earlier assistant turn replaced by this conversation's own row.
        base = row["id"].split("#")[0]
        own = [by_id[f"{base}#{k}"] for k in range(target.turn)]
        history = prompts.with_own_answers(target.history, [prompts.own_answer(r["reasoning"], r["answer"])
                                                            for r in own])
        assert row["prompt_token_ids"] == prompts.render_prompt_ids(
            tokenizer, history, chat_template=template, enable_thinking=thinking, chat_template_kwargs={},
            tools=tools), f"{row['id']}: the history with the model's own answers, with its tools"
        assert not row["template_mismatch"], "each variant's own generation prompt (thinking on or off)"
        for earlier in own:  # each earlier answer, token for token, in this turn's context
            if earlier["answer"]:  # (a thinking turn cut by max_tokens inside its reasoning answered nothing)
                num_answers_seen += 1
                assert holds(row["prompt_token_ids"], tokenizer(earlier["answer"] + "<|im_end|>",
                                                                add_special_tokens=False)["input_ids"]), row["id"]
        original = None if target.original is None else len(tokenizer(
            prompts.original_turn_text(target.original), add_special_tokens=False)["input_ids"])
        assert row["original_turn_tokens"] == original
    assert num_answers_seen >= 3, "the thinking-off variant's answers were found in later turns' contexts"
    assert "<tools>weather </tools>" in tokenizer.decode(by_id["c00002#1"]["prompt_token_ids"])
    # The conversation whose second turn outgrows the context: its first turn kept, the rest row errors naming why.
    assert by_id["long#0"]["error"] is None
    assert by_id["long#1"]["error"].startswith("prompt too long: "), by_id["long#1"]["error"]
    assert by_id["long#2"]["error"] == f"not generated: turn 1 of this conversation failed ({by_id['long#1']['error']})"
    assert by_id["long#2"]["turn"] == 2 and by_id["long#2"]["topic"] == "long"

    # The mix of variants, as the report (and the notebook, which prints it) shows it.
    from job.generate import report

    mix = report.build_report(config.output)["variants"]
    assert [v["settings"] for v in mix] == variants and all(v["rows"] for v in mix), mix
    assert sum(v["rows"] for v in mix) == sum(r["error"] is None for r in by_id.values())

    # The notebook's per-turn table: rows per turn and the originals' mean length, from the shards.
    from job.runview import notebook as ji

    per_turn = {t["turn"]: t for t in ji.turn_lengths(ji.read_rows(config.output))}
    good = [r for r in table.to_pylist() if r["error"] is None]
    assert {k: v["rows"] for k, v in per_turn.items()} == dict(Counter(r["turn"] for r in good))
    originals = [r["original_turn_tokens"] for r in good if r["turn"] == 1 and r["original_turn_tokens"] is not None]
    assert per_turn[1]["original_tokens"] == pytest.approx(sum(originals) / len(originals))
    assert "turn" in ji.format_turn_lengths(list(per_turn.values()))

    # Stage 2: one sample per output row, turn ids and all.
    run_hidden_states(config)
    samples = {s["id"]: s for s in load(config.output)}
    assert set(samples) == {r["id"] for r in good}
    for r in good:
        assert samples[r["id"]]["input_ids"].tolist() == r["prompt_token_ids"] + r["output_token_ids"]


def test_regenerate_none_keeps_the_data_s_own_turns(tmp_path, make_config, tokenizer, local_ray):
    """`generate.regenerate: none` (the baseline teams train on: their data's own answers): no engine, each row's
    completion is its last assistant turn as the chat template renders the whole conversation, and stage 2 makes
    its hidden states like any run's. Rows without a final answer are row errors naming why. ~20 s: no engine."""
    from job.generate import run_generate
    from job.hidden_states import load, run_hidden_states

    rows = conversation_rows(8)  # prompts and a ShareGPT chat waiting for an answer; chats and traces ending in one
    inp = tmp_path / "in.jsonl"
    inp.write_text(jsonl_text(rows))
    config = make_config(input=str(inp), output=str(tmp_path / "run"),
                         **{"generate.rows_per_shard": 4, "generate.regenerate": "none",
                            "hidden_states.layer_ids": [0, -1], "hidden_states.rows_per_shard": 16})
    summary = run_generate(config)
    assert summary.num_rows == len(rows)
    table = read_run(config.output)
    assert sorted(table.column("id").to_pylist()) == sorted(r["id"] for r in rows), "every id exactly once"
    kept = []
    for row in table.to_pylist():
        source = rows[[r["id"] for r in rows].index(row["id"])]
        messages = prompts.row_messages(source)
        if messages[-1]["role"] != "assistant":
            assert row["error"] == (f"generate.regenerate: none keeps the data's own last assistant turn, and this "
                                    f"conversation ends with a {messages[-1]['role']} message: there is no answer "
                                    "to keep"), row["error"]
            continue
        assert row["error"] is None, row["error"]
        # The whole conversation, rendered by the template, is exactly prompt + output (+ the template's newline).
        whole = tokenizer.apply_chat_template(messages, tools=prompts.row_tools(source), tokenize=False)
        assert tokenizer.decode(row["prompt_token_ids"] + row["output_token_ids"]) + "\n" == whole
        assert tokenizer.decode(row["output_token_ids"]) == messages[-1]["content"] + "<|im_end|>"
        assert tokenizer.decode(row["prompt_token_ids"]).endswith("<|im_start|>assistant\n")
        assert row["finish_reason"] == "data" and row["seed"] is None and not row["template_mismatch"]
        kept.append(row)
    assert len(kept) == 4 and {r["id"][:2] for r in kept} == {"c0"}

    run_hidden_states(config)
    samples = {s["id"]: s for s in load(config.output)}
    assert set(samples) == {r["id"] for r in kept}
    for r in kept:
        assert samples[r["id"]]["input_ids"].tolist() == r["prompt_token_ids"] + r["output_token_ids"]
