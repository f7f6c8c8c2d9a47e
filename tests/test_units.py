"""Work units and their shard names: the resume arithmetic at the edges of the naming scheme."""

from __future__ import annotations

from job.inputs import InputFile, WorkUnit, parse_shard_name, pending_units


def test_more_than_99999_input_files_keep_distinct_parseable_names():
    files = [InputFile(uri=f"s3://b/p/{i:06d}.parquet", num_rows=3, size=100) for i in range(100_002)]
    last = WorkUnit(100_001, files[-1].uri, 0, 3)
    assert last.shard_name == "f100001-r0000000000-0000000003.arrow"
    assert parse_shard_name(last.shard_name) == (100_001, 0, 3)
    assert parse_shard_name("sub/" + last.shard_name) == (100_001, 0, 3)
    assert parse_shard_name("xf00001-r0000000000-0000000003.arrow") is None  # not ours
    # Files 10000 and 100000 used to collide (f10000… matched both); the done one is skipped, the other is not.
    done = [WorkUnit(100_000, files[100_000].uri, 0, 3).shard_name]
    todo = {(u.file_index, u.start, u.stop) for u in pending_units(files, done, None, rows_per_shard=3)}
    assert (100_000, 0, 3) not in todo and (10_000, 0, 3) in todo and len(todo) == len(files) - 1


def test_message_fields_reach_the_chat_template(tokenizer):
    """tool_calls, tool_call_id and name are passed to the template (they used to be dropped); fields a parquet
    struct gives as None are not; an assistant turn with only tool calls has null content."""
    from job.prompts import render_prompt_ids, row_messages

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
