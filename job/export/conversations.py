"""Completions → SpecForge training conversations (JSONL), with SpecForge's regenerated-data checks."""

from __future__ import annotations

import itertools
import json
import re

from job import layout, run_record, scan, schema, storage
from job.export.trainer_format import ExportError, finish_export
from job.generate.prompts import CONVERSATION, RowError, history_of_turn, row_messages, with_own_answers

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


def validate_row(row: dict, *, expect_reasoning: bool, expect_non_reasoning: bool,
                 every_turn_regenerated: bool = False) -> str | None:
    """SpecForge's `validate_row` (scripts/validate_regenerated_data.py) with --strict-think-markers and
    --expect-reasoning (a thinking run) or --expect-non-reasoning; the reason it fails, or None. One difference:
    the reasoning expectation holds for the last assistant message only, the turn stage 1 regenerated. SpecForge's
    own script regenerates every turn of a conversation, so all of them have reasoning; ours regenerates one turn
    per row (generate.regenerate) on a history of the data's own turns, which rarely carry reasoning, and the
    Qwen3.5/3.6 template does not render reasoning before the last user message anyway. With
    `every_turn_regenerated` (generate.regenerate: conversation, every turn the model's own) it holds for every
    assistant message, as in SpecForge's script."""
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
        regenerated = every_turn_regenerated or index == len(messages) - 1
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


def row_thinking(row: dict, thinking: bool, variants: list[dict]) -> bool:
    """Whether this row was generated with thinking on: the run's setting, or its sampling variant's."""
    variant = row.get(schema.VARIANT)
    if variant is None or variant >= len(variants):
        return thinking
    return bool(variants[variant].get("enable_thinking", thinking))


def unusable(row: dict) -> str | None:
    """Why a completion row cannot become (part of) a training conversation at all, or None."""
    if row.get(schema.ERROR) is not None:
        return f"stage-1 error: {row[schema.ERROR]}"
    if row.get(schema.FLAG_TRUNCATED):
        return ("truncated (finish_reason length): the template would close an assistant turn the model "
                "never finished")
    return None


def assistant_message(row: dict, thinking: bool) -> dict:
    message = {"role": "assistant", "content": row.get(schema.ANSWER) or ""}
    if thinking:
        message["reasoning_content"] = row.get(schema.REASONING) or ""
    return message


def conversation_row(row: dict, thinking: bool) -> tuple[dict | None, str | None]:
    """(SpecForge training row, None) for one completion row, or (None, why it is dropped). The row is what
    regenerate_train_data.py writes: the prompt's messages, then the regenerated assistant turn with its reasoning in
    `reasoning_content` (the Qwen3.5/3.6 template renders it inside <think>...</think>; `content` holds the answer
    alone)."""

    reason = unusable(row)
    if reason:
        return None, reason
    try:
        # The history this turn was generated on: a trailing assistant turn of the data (last_turn), or the turns
        # after it (every_assistant_turn), are not part of it.
        messages = history_of_turn(row_messages(row), row.get(schema.TURN))
    except RowError as e:
        return None, f"prompt: {e}"
    out = {"id": row[schema.ID], "conversations": messages + [assistant_message(row, thinking)], "status": "success"}
    reason = validate_row(out, expect_reasoning=thinking, expect_non_reasoning=not thinking)
    return (None, reason) if reason else (out, None)


def whole_conversation(rows: list[dict], thinking: bool) -> tuple[dict | None, list[dict]]:
    """`generate.regenerate: conversation`: the rows of one conversation (its turns, in order) → one SpecForge row,
    the conversation as it was regenerated (what SpecForge's regenerate_train_data.py writes): the data's system,
    user and tool messages, every assistant turn the model's own with its reasoning. Turns from the first unusable
    one on (an error, a truncated turn) are left out, each with its reason, since every later turn was generated
    after it; what is left ends with an assistant turn. Returns (row or None, [{id, reason} of the rows dropped])."""
    good = list(itertools.takewhile(lambda r: unusable(r) is None, rows))
    dropped = []
    if len(good) < len(rows):
        first = rows[len(good)]
        dropped.append({"id": first[schema.ID], "reason": unusable(first)})
        dropped += [{"id": r[schema.ID], "reason": f"after turn {first[schema.TURN]} of its conversation, which is "
                     f"dropped ({unusable(first)})"} for r in rows[len(good) + 1:]]
    if not good:
        return None, dropped
    base = re.sub(r"#\d+$", "", good[-1][schema.ID])
    try:
        history = history_of_turn(row_messages(good[-1]), good[-1].get(schema.TURN))
    except RowError as e:
        return None, dropped + [{"id": r[schema.ID], "reason": f"prompt: {e}"} for r in good]
    answers = [assistant_message(r, thinking) for r in good]
    out = {"id": base, "conversations": with_own_answers(history, answers[:-1]) + answers[-1:], "status": "success"}
    reason = validate_row(out, expect_reasoning=thinking, expect_non_reasoning=not thinking,
                          every_turn_regenerated=True)
    if reason:
        return None, dropped + [{"id": r[schema.ID], "reason": reason} for r in good]
    return out, dropped


def conversation_groups(rows: list[dict]):
    """The rows of a `conversation` run's shard, grouped per input row (its turns `<id>#<turn>` are consecutive:
    the engine writes a conversation's rows together)."""
    return (list(g) for _, g in itertools.groupby(rows, key=lambda r: re.sub(r"#\d+$", "", r[schema.ID])))


def export_conversations(run: str, *, output: str, storage_config: storage.StorageConfig | None = None) -> dict:
    """Every completion row of the run either becomes one line of `output/conversations.jsonl` or one line of
    `output/dropped.jsonl` with the reason; `export.json` counts both and checks they add up to the input."""

    found = scan.judge_completion_shards(run, storage_config)
    line = found.problem_line("left out of this export; the next `generate` on the run moves them aside to "
                              "quarantine/ and generates their rows again")
    if line:
        print(line, flush=True)
    uris = [s.uri for s in found.trusted]
    if not uris:
        raise ExportError(f"export: no completion shards under {storage.join(run, layout.COMPLETIONS_DIR)}")
    record = run_record.read(run, storage_config) or run_record.RunRecord()
    thinking = bool(record.setting("generate.enable_thinking", True))
    variants = record.setting("generate.sampling_variants") or []
    whole = record.setting("generate.regenerate") == CONVERSATION  # one training row per conversation, all own turns
    kept, dropped, num_rows, num_kept_rows = [], [], 0, 0

    def lines():
        nonlocal num_rows, num_kept_rows
        for uri in uris:
            rows = storage.read_shard(uri, storage_config).to_pylist()
            num_rows += len(rows)
            for group in conversation_groups(rows) if whole else ([row] for row in rows):
                if whole:
                    out, gone = whole_conversation(group, row_thinking(group[0], thinking, variants))
                else:
                    out, reason = conversation_row(group[0], row_thinking(group[0], thinking, variants))
                    gone = [] if out is not None else [{"id": group[0][schema.ID], "reason": reason}]
                dropped.extend(gone)
                if out is not None:
                    kept.append(out["id"])
                    num_kept_rows += len(group) - len(gone)
                    yield json.dumps(out, ensure_ascii=False)

    storage.write_lines(storage.join(output, "conversations.jsonl"), lines(), storage_config)
    assert num_kept_rows + len(dropped) == num_rows, (num_kept_rows, len(dropped), num_rows)
    summary = finish_export(run, output, "specforge", "conversations", kept, dropped, Unfenced(storage_config),
                      {"num_input_rows": num_rows, "num_rows_in_samples": num_kept_rows,
                       "one_sample_per": "conversation" if whole else "row", "thinking": thinking,
                       "validation": "scripts/validate_regenerated_data.py --strict-think-markers "
                                     + ("--expect-reasoning" if thinking else "--expect-non-reasoning")})
    return summary


class Unfenced:
    """The writes of an export that is no stage (the conversations: one small pass over the completions, on the
    driver), with a fence's two methods that `finish_export` calls."""

    def __init__(self, storage_config):
        self.storage_config = storage_config

    def write_bytes(self, uri: str, data: bytes) -> None:
        storage.write_bytes_atomic(uri, data, self.storage_config)

    def write_json(self, uri: str, obj) -> None:
        storage.write_json(uri, obj, self.storage_config)
