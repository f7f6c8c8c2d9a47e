"""Completions → SpecForge training conversations (JSONL), with SpecForge's regenerated-data checks."""

from __future__ import annotations

import json

from job import layout, runs, scan, schema, storage
from job.export.trainer_format import ExportError, finish_export
from job.generate.prompts import RowError, history_of_turn, row_messages

# ---------------------------------------------------------------------------------------------------------------
# Completions → SpecForge training conversations
# ---------------------------------------------------------------------------------------------------------------


def has_think_marker(content: str) -> bool:
    """scripts/conversation_validation.py."""
    lowered = content.lower()
    return "<think>" in lowered or "</think>" in lowered


def validate_conversation(messages) -> str | None:
    """SpecForge's `validate_conversation` (scripts/conversation_validation.py, 'validation' error style): non-empty
    string contents, system messages only before the first user, then user/assistant alternating from a user."""
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    expected_role, saw_user = "user", False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} must be an object"
        role, content = message.get("role"), message.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"message {index} content must be a non-empty string"
        if role == "system" and not saw_user:
            continue
        if role not in {"user", "assistant"}:
            return f"message {index} has unsupported role {role!r}"
        if role != expected_role:
            return f"message {index} expected role {expected_role!r}, got {role!r}"
        saw_user = True
        expected_role = "assistant" if role == "user" else "user"
    if not saw_user:
        return "conversation has no user message"
    return None


def validate_row(row: dict, *, expect_reasoning: bool, expect_non_reasoning: bool) -> str | None:
    """SpecForge's `validate_row` (scripts/validate_regenerated_data.py) with --strict-think-markers and
    --expect-reasoning (a thinking run) or --expect-non-reasoning; the reason it fails, or None. One difference:
    the reasoning expectation holds for the last assistant message only, the turn stage 1 regenerated. SpecForge's
    own script regenerates every turn of a conversation, so all of them have reasoning; ours regenerates one turn
    per row (generate.regenerate) on a history of the data's own turns, which rarely carry reasoning, and the
    Qwen3.5/3.6 template does not render reasoning before the last user message anyway."""
    if not isinstance(row.get("id"), str) or not row["id"].strip():
        return "id must be a non-empty string"
    if row.get("status") != "success":
        return "status must be 'success'"
    messages = row.get("conversations")
    error = validate_conversation(messages)
    if error is not None:
        return error
    assistants = 0
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        assistants += 1
        content, reasoning = message["content"], message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return f"assistant message {index} reasoning_content must be a string or null"
        regenerated = index == len(messages) - 1
        if regenerated and expect_non_reasoning and reasoning and reasoning.strip():
            return f"assistant message {index} has non-empty reasoning_content"
        if regenerated and expect_reasoning and (not isinstance(reasoning, str) or not reasoning.strip()):
            return f"assistant message {index} has empty reasoning_content"
        if has_think_marker(content):
            return f"assistant message {index} contains a thinking marker"
        if isinstance(reasoning, str) and has_think_marker(reasoning):
            return f"assistant message {index} reasoning_content contains a thinking marker"
    if assistants == 0:
        return "conversation has no assistant message"
    if messages[-1].get("role") != "assistant":
        return "conversation must end with an assistant message"
    return None


def conversation_row(row: dict, thinking: bool) -> tuple[dict | None, str | None]:
    """(SpecForge training row, None) for one completion row, or (None, why it is dropped). The row is what
    regenerate_train_data.py writes: the prompt's messages, then the regenerated assistant turn with its reasoning in
    `reasoning_content` (the Qwen3.5/3.6 template renders it inside <think>...</think>; `content` holds the answer
    alone)."""

    if row.get(schema.ERROR) is not None:
        return None, f"stage-1 error: {row[schema.ERROR]}"
    if row.get(schema.FLAG_TRUNCATED):
        return None, ("truncated (finish_reason length): the template would close an assistant turn the model "
                      "never finished")
    try:
        # The history this turn was generated on: a trailing assistant turn of the data (last_turn), or the turns
        # after it (every_assistant_turn), are not part of it.
        messages = history_of_turn(row_messages(row), row.get(schema.TURN))
    except RowError as e:
        return None, f"prompt: {e}"
    assistant = {"role": "assistant", "content": row.get(schema.ANSWER) or ""}
    if thinking:
        assistant["reasoning_content"] = row.get(schema.REASONING) or ""
    out = {"id": row[schema.ID], "conversations": messages + [assistant], "status": "success"}
    reason = validate_row(out, expect_reasoning=thinking, expect_non_reasoning=not thinking)
    return (None, reason) if reason else (out, None)


def export_conversations(run: str, *, output: str, storage_config: storage.StorageConfig | None = None) -> dict:
    """Every completion row of the run either becomes one line of `output/conversations.jsonl` or one line of
    `output/dropped.jsonl` with the reason; `export.json` counts both and checks they add up to the input."""

    found = scan.trusted_completion_shards(run, storage_config)
    line = found.problem_line("left out of this export; the next `generate` on the run moves them aside to "
                              "quarantine/ and generates their rows again")
    if line:
        print(line, flush=True)
    uris = [s.uri for s in found.trusted]
    if not uris:
        raise ExportError(f"export: no completion shards under {storage.join(run, layout.COMPLETIONS_DIR)}")
    config = (runs.read_run_json(run, storage_config) or {}).get("config", {})
    thinking = bool(config.get("generate", {}).get("enable_thinking", True))
    kept, dropped, num_rows = [], [], 0

    def lines():
        nonlocal num_rows
        for uri in uris:
            for row in storage.read_shard(uri, storage_config).to_pylist():
                num_rows += 1
                out, reason = conversation_row(row, thinking)
                if out is None:
                    dropped.append({"id": row[schema.ID], "reason": reason})
                    continue
                kept.append(row[schema.ID])
                yield json.dumps(out, ensure_ascii=False)

    storage.write_lines(storage.join(output, "conversations.jsonl"), lines(), storage_config)
    assert len(kept) + len(dropped) == num_rows, (len(kept), len(dropped), num_rows)
    summary = finish_export(run, output, "specforge", "conversations", kept, dropped, storage_config,
                      {"num_input_rows": num_rows, "thinking": thinking,
                       "validation": "scripts/validate_regenerated_data.py --strict-think-markers "
                                     + ("--expect-reasoning" if thinking else "--expect-non-reasoning")})
    return summary
