"""Work units and their shard names: the resume arithmetic at the edges of the naming scheme."""

from __future__ import annotations

from job.generate.inputs import InputFile
from job.generate.units import pending_units
from job.layout import CompletionUnit, parse_completion_shard_name


def test_more_than_99999_input_files_keep_distinct_parseable_names():
    files = [InputFile(uri=f"s3://b/p/{i:06d}.parquet", num_rows=3, size=100) for i in range(100_002)]
    last = CompletionUnit(100_001, files[-1].uri, 0, 3)
    assert last.shard_name == "f100001-r0000000000-0000000003.arrow"
    assert parse_completion_shard_name(last.shard_name) == (100_001, 0, 3)
    assert parse_completion_shard_name("sub/" + last.shard_name) == (100_001, 0, 3)
    assert parse_completion_shard_name("xf00001-r0000000000-0000000003.arrow") is None  # not ours
    # Files 10000 and 100000 used to collide (f10000… matched both); the done one is skipped, the other is not.
    done = [CompletionUnit(100_000, files[100_000].uri, 0, 3).shard_name]
    todo = {(u.file_index, u.start, u.stop) for u in pending_units(files, done, None, rows_per_shard=3)}
    assert (100_000, 0, 3) not in todo and (10_000, 0, 3) in todo and len(todo) == len(files) - 1


def test_message_fields_reach_the_chat_template(tokenizer):
    """tool_calls, tool_call_id and name are passed to the template (they used to be dropped); fields a parquet
    struct gives as None are not; an assistant turn with only tool calls has null content."""
    from job.generate.prompts import render_prompt_ids, row_messages

    template = ("{% for m in messages %}<|{{ m.role }}|>{% if m.name %}[{{ m.name }}]{% endif %}{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<call {{ c.function.name }}({{ c.function.arguments }})>"
                "{% endfor %}{% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}"
                "{% if m.unknown is defined %}LEAK{% endif %}\n{% endfor %}<|assistant|>")
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    row = {"id": "x", "messages": [
        {"role": "user", "content": "Weather in Oslo?", "name": "ann", "tool_calls": None, "tool_call_id": None},
        {"role": "assistant", "content": None, "name": None, "tool_calls": [call], "tool_call_id": None},
        {"role": "tool", "content": "4 C, rain", "name": "weather", "tool_calls": None, "tool_call_id": "c1"}]}
    messages = row_messages(row)
    assert messages[0] == {"role": "user", "content": "Weather in Oslo?", "name": "ann"}
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    ids = render_prompt_ids(tokenizer, messages, chat_template=template, enable_thinking=False,
                            chat_template_kwargs={})
    text = tokenizer.decode(ids)
    assert "[ann]" in text and "weather" in text and "Oslo" in text and "<for c1>" in text and "LEAK" not in text


def test_a_unit_of_a_one_row_group_file_holds_only_its_rows(tmp_path):
    """One row group per file (pq.write_table's and pandas' default for small files): a 128-row unit used to hold
    the whole decoded group (here ~20 MB for 50 KB of rows) for its lifetime. It holds its rows, equal to them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from job.generate.inputs import read_rows
    from job.storage import StorageConfig

    n = 50_000
    table = pa.table({"id": [f"id-{i:06d}" for i in range(n)], "prompt": [f"{i:06d} " + "x" * 400 for i in range(n)]})
    path = str(tmp_path / "one-group.parquet")
    pq.write_table(table, path, row_group_size=n)
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    rows = read_rows(path, StorageConfig(), start=31_000, stop=31_128)
    assert rows.equals(table.slice(31_000, 128))
    assert rows.get_total_buffer_size() < 200_000, rows.get_total_buffer_size()  # 128 × ~420 B, not ~20 MB
    # Row groups about the unit's size take the direct path, also equal.
    pq.write_table(table, str(tmp_path / "small-groups.parquet"), row_group_size=128)
    assert read_rows(str(tmp_path / "small-groups.parquet"), StorageConfig(), start=300, stop=428).equals(
        table.slice(300, 128))
    assert read_rows(path, StorageConfig(), columns=["id"], start=n - 5).column("id").to_pylist() == \
        [f"id-{i:06d}" for i in range(n - 5, n)]


def test_row_groups_that_dwarf_the_units_are_noted(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from job.generate.inputs import list_input_files, row_group_note
    from job.storage import StorageConfig

    table = pa.table({"id": list(range(5000)), "prompt": ["p"] * 5000})
    pq.write_table(table, str(tmp_path / "a.parquet"), row_group_size=5000)
    files = list_input_files(str(tmp_path), StorageConfig())
    assert files[0].max_row_group_rows == 5000 and files[0].size == (tmp_path / "a.parquet").stat().st_size
    assert "5,000 rows in one group" in row_group_note(files, rows_per_shard=64)
    assert row_group_note(files, rows_per_shard=512) is None
