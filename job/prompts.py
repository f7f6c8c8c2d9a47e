"""One input row → chat messages → the exact prompt token ids, or the reason the row cannot be generated.

Row errors never raise: a bad row becomes an error row in the output and every other row goes on.
Rendering uses the model's own tokenizer and chat template (or the configured override), then tokenizes the
rendered text without adding special tokens, the same way vLLM's chat endpoint does for Qwen models.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from job import schema

ROLES = ("system", "user", "assistant", "tool", "developer")
MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning_content")


class RowError(ValueError):
    """This row cannot be generated; the message goes to the row's `error` column."""


def row_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Messages of an input row: `messages` when present, else `prompt` as one user message."""
    if schema.MESSAGES in row and row[schema.MESSAGES] is not None:
        messages = row[schema.MESSAGES]
        if isinstance(messages, str):  # JSON-encoded messages are common in parquet exports
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError:
                raise RowError("malformed messages: a string that is not JSON") from None
        if not isinstance(messages, (list, tuple)) or not messages:
            raise RowError("malformed messages: expected a non-empty list of {role, content}")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise RowError(f"malformed messages: message {i} is not a {{role, content}} mapping")
            if m["role"] not in ROLES:
                raise RowError(f"unknown role {m['role']!r} in message {i} (known: {', '.join(ROLES)})")
            content = m["content"]
            if content is None and m.get("tool_calls"):  # an assistant turn that only calls tools (OpenAI form)
                content = ""
            if not isinstance(content, str):
                raise RowError(f"malformed messages: message {i} content is not a string")
            message = {"role": m["role"], "content": content}
            # Fields chat templates read besides role and content. A parquet list of structs gives every message
            # every field, absent ones as None: only the present ones are passed on.
            message.update({k: m[k] for k in MESSAGE_FIELDS if m.get(k) is not None})
            out.append(message)
        if not any(m["content"].strip() for m in out):
            raise RowError("empty prompt: every message content is empty")
        return out
    prompt = row.get(schema.PROMPT)
    if prompt is None:
        raise RowError("empty prompt: `prompt` is null and there are no `messages`")
    if not isinstance(prompt, str):
        raise RowError(f"malformed prompt: expected a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise RowError("empty prompt")
    return [{"role": "user", "content": prompt}]


def render_prompt_ids(tokenizer, messages: list[dict], *, chat_template: str | None, enable_thinking: bool,
                      chat_template_kwargs: dict) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
        **chat_template_kwargs,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def row_seed(run_seed: int, row_id: str) -> int:
    """A stable per-row seed from (run seed, id): the same row gets the same seed on every rerun."""
    digest = hashlib.blake2b(f"{run_seed}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def split_completion(tokenizer, output_ids: list[int], think_end_id: int | None, thinking: bool):
    """(reasoning, answer, num_reasoning_tokens, num_answer_tokens, think_closed) from the output token ids.

    With thinking on, the prompt ends in `<think>\\n`, so the output is `reasoning</think>answer<|im_end|>`.
    Without a `</think>` the whole output is (unclosed) reasoning.
    """
    if not thinking:
        answer = tokenizer.decode(output_ids, skip_special_tokens=True).strip()
        return "", answer, 0, len(output_ids), True
    try:
        k = output_ids.index(think_end_id)
    except ValueError:
        reasoning = tokenizer.decode(output_ids, skip_special_tokens=True).strip()
        return reasoning, "", len(output_ids), 0, False
    reasoning = tokenizer.decode(output_ids[:k], skip_special_tokens=True).strip()
    answer = tokenizer.decode(output_ids[k + 1:], skip_special_tokens=True).strip()
    return reasoning, answer, k, len(output_ids) - k - 1, True
