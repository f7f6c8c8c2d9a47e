"""One input row → chat messages → the turns to generate → the exact prompt token ids, or the reason the row
cannot be generated.

Every conversation schema is mapped to OpenAI messages here, once (`row_messages`: `messages`, ShareGPT
`conversations`, or a plain `prompt`), and checked (`check_conversation`); `regeneration_targets` then picks the
assistant turns to generate (`generate.regenerate`).

Row errors never raise: a bad row becomes an error row in the output and every other row goes on.
Rendering uses the model's own tokenizer and chat template (or the configured override), then tokenizes the
rendered text without adding special tokens, the same way vLLM's chat endpoint does for Qwen models.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from job import schema

ROLES = ("system", "user", "assistant", "tool", "developer")
MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning_content")

# ShareGPT speakers (`from`) → OpenAI roles. The one place ShareGPT is read; everything after sees messages.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system", "tool": "tool",
                  "observation": "tool", "function_response": "tool"}
LAST_TURN, EVERY_ASSISTANT_TURN, NONE = "last_turn", "every_assistant_turn", "none"
# Every assistant turn, generated turn by turn on the model's OWN earlier answers (with_own_answers).
CONVERSATION = "conversation"
PER_TURN_MODES = (EVERY_ASSISTANT_TURN, CONVERSATION)  # one output row per assistant turn, ids "<id>#<turn>"


class RowError(ValueError):
    """This row cannot be generated; the message goes to the row's `error` column."""


def _from_json(value, what: str):
    if isinstance(value, str):  # JSON-encoded lists are common in parquet exports, and how JSONL rows arrive
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise RowError(f"malformed {what}: a string that is not JSON") from None
    return value


def _sharegpt_messages(conversations) -> list[dict[str, Any]]:
    conversations = _from_json(conversations, "conversations")
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise RowError("malformed conversations: expected a non-empty list of {from, value}")
    out = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise RowError(f"malformed conversations: turn {i} is not a {{from, value}} mapping")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise RowError(f"unknown ShareGPT speaker {turn['from']!r} in turn {i} "
                           f"(known: {', '.join(SHAREGPT_ROLES)})")
        out.append({"role": role, "content": turn["value"]})
    return out


def row_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Messages of an input row: `messages` (OpenAI), else `conversations` (ShareGPT), else `prompt` as one user
    message. Checked here, once, for every format (`check_conversation`)."""
    if row.get(schema.MESSAGES) is not None:
        messages = _from_json(row[schema.MESSAGES], "messages")
    elif row.get(schema.CONVERSATIONS) is not None:
        messages = _sharegpt_messages(row[schema.CONVERSATIONS])
    else:
        prompt = row.get(schema.PROMPT)
        if prompt is None:
            raise RowError("empty prompt: `prompt` is null and there are no `messages`")
        if not isinstance(prompt, str):
            raise RowError(f"malformed prompt: expected a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise RowError("empty prompt")
        return [{"role": "user", "content": prompt}]
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
        if isinstance(message.get("tool_calls"), str):
            message["tool_calls"] = _from_json(message["tool_calls"], "tool_calls")
        out.append(message)
    if not any(m["content"].strip() for m in out):
        raise RowError("empty prompt: every message content is empty")
    check_conversation(out)
    return out


def check_conversation(messages: list[dict[str, Any]]) -> None:
    """Refuse conversations a chat template would render wrongly or a model never sees: system messages after the
    start, turns that do not alternate (user → assistant → user ...; an assistant that calls tools is followed by
    their results, then by an assistant), a tool result without its call, an empty user or assistant turn (a
    trailing empty assistant message, a placeholder for the answer, is allowed)."""
    prev, calls = None, set()
    for i, m in enumerate(messages):
        role = m["role"]
        if role in ("system", "developer"):
            if prev not in (None, "system", "developer"):
                raise RowError(f"bad conversation: a {role} message at position {i}, after the conversation started "
                               "(only the first messages may be system messages)")
            prev = role
            continue
        expected = {None: ("user",), "system": ("user",), "developer": ("user",), "user": ("assistant",),
                    "assistant": ("user", "tool"), "tool": ("tool", "assistant")}[prev]
        if role not in expected:
            raise RowError(f"bad conversation: roles do not alternate: message {i} is {role!r} after "
                           f"{prev or 'the start'!r} (expected {' or '.join(expected)})")
        if role == "tool":
            if not calls:
                raise RowError(f"bad conversation: tool message {i} answers no call (the assistant message before "
                               "it has no tool_calls)")
            call_id = m.get("tool_call_id")
            ids = {c for c in calls if c}
            if call_id and ids and call_id not in ids:
                raise RowError(f"bad conversation: tool message {i} answers call {call_id!r}, which the assistant "
                               f"did not make (its calls: {', '.join(sorted(ids))})")
        elif role == "assistant":
            tool_calls = m.get("tool_calls") or []
            calls = {(c.get("id") if isinstance(c, dict) else None) or "" for c in tool_calls}
            if not tool_calls and not m["content"].strip() and not m.get("reasoning_content") \
                    and i != len(messages) - 1:
                raise RowError(f"bad conversation: empty turn: assistant message {i} has no content")
        else:  # user
            calls = set()
            if not m["content"].strip():
                raise RowError(f"bad conversation: empty turn: user message {i} has no content")
        prev = role
    if prev in (None, "system", "developer"):
        raise RowError("bad conversation: no user turn (only system messages)")


def row_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The row's `tools` (a list of tool definitions, or its JSON text), for the chat template; None if absent."""
    tools = _from_json(row.get(schema.TOOLS), "tools")
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise RowError("malformed tools: expected a list of tool definitions")
    return [_drop_nulls(t) for t in tools]


def _drop_nulls(value):
    """A parquet or Arrow struct gives every tool every field of every other tool, absent ones as None."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_nulls(v) for v in value]
    return value


@dataclass(frozen=True)
class Target:
    """One completion to generate from a conversation: the assistant turn `turn` (0-based count of assistant
    messages before it), on `history`; `original` is the data's own text of that turn, if it has one."""
    id: str
    turn: int
    history: list[dict[str, Any]]
    original: dict[str, Any] | None


def regeneration_targets(row_id: str, messages: list[dict[str, Any]], mode: str) -> list[Target]:
    """The completions a conversation yields under `generate.regenerate` (see GenerateConfig.regenerate)."""
    if mode in (LAST_TURN, NONE):  # `none` keeps the very turn `last_turn` would regenerate
        if messages[-1]["role"] == "assistant":
            history, original = messages[:-1], messages[-1]
        else:
            history, original = messages, None
        return [Target(row_id, sum(m["role"] == "assistant" for m in history), history, original)]
    if mode not in PER_TURN_MODES:  # `conversation` has every_assistant_turn's targets, histories made own later
        raise ValueError(f"unknown regenerate mode {mode!r}")
    targets, turn = [], 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            targets.append(Target(f"{row_id}#{turn}", turn, messages[:i], m))
            turn += 1
    if messages[-1]["role"] != "assistant":  # the conversation waits for an answer: generate it too
        targets.append(Target(f"{row_id}#{turn}", turn, messages, None))
    return targets


# ---------------------------------------------------------------------------------------------------------------
# `generate.regenerate: conversation`: each turn on the model's own earlier answers
# ---------------------------------------------------------------------------------------------------------------
#
# Why one output row per turn (ids "<id>#<turn>", as every_assistant_turn) and not one row per conversation:
# - Thinking mode (the production mode) keeps every turn's reasoning. Qwen's templates drop the reasoning of the
#   assistant turns before the last user message, so in a single conversation row (the last turn's prompt) every
#   earlier turn would appear without its reasoning, most of the tokens the target generated, and without the
#   context it was generated in. A row per turn is exactly what the served target sees and produces at that turn:
#   the template's rendering of the conversation so far (its own earlier answers, as the template keeps them), then
#   its answer with its reasoning.
# - Stage 2, the exports and both trainers already read such rows (every_assistant_turn makes them): stage 2's
#   loss mask is the generated turn; `--loss-turns last_turn` trains on each turn once (speculators' own multi-turn
#   rows, `_render_boundary_rows`); `every_assistant_turn` adds the history's assistant spans, here the model's own.
# - Exactly once holds at the same unit as every mode: all rows of a conversation are in the shard of its input
#   row, written at once when its last turn is done; a crash before leaves no row of it, a retry regenerates it
#   from turn 0 (a later turn depends on the earlier ones, which are only in memory until the commit).
# What it costs: stage 2 runs each turn's prefix again (prefix caching spares stage 1's prefill of it).


def own_answer(reasoning: str | None, answer: str | None) -> dict[str, Any]:
    """The model's own assistant message for a generated turn, as a client of the served model sends it back: the
    answer as content and the reasoning apart (vLLM's reasoning parser returns them so). The chat template decides
    whether the reasoning is rendered (Qwen's keep it only after the last user message): never built by hand."""
    message = {"role": "assistant", "content": answer or ""}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def with_own_answers(history: list[dict[str, Any]], answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`history` (a Target's: the data's messages before one assistant turn) with its assistant messages replaced,
    in order, by the model's own `answers` (own_answer). System prompts, user turns, tool results and the data's
    tool calls are kept: a replaced message that called tools keeps the data's calls, which the tool results after
    it answer. Every assistant message of the history needs its answer."""
    num_turns = sum(m["role"] == "assistant" for m in history)
    assert num_turns == len(answers), f"{len(answers)} answers for a history of {num_turns} assistant turns"
    out, own = [], iter(answers)
    for m in history:
        if m["role"] != "assistant":
            out.append(m)
            continue
        answer = dict(next(own))
        if m.get("tool_calls"):
            answer["tool_calls"] = m["tool_calls"]
        out.append(answer)
    return out


def history_of_turn(messages: list[dict[str, Any]], turn: int | None) -> list[dict[str, Any]]:
    """The history a completion row of assistant turn `turn` was generated on (both `generate.regenerate` modes):
    the messages before the conversation's assistant message number `turn` (0-based), or all of them when it has
    no such message. `turn` None (a run written before turns were recorded): the last-turn rule."""
    if turn is None:
        return regeneration_targets("", messages, LAST_TURN)[0].history
    seen = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            if seen == turn:
                return messages[:i]
            seen += 1
    return messages


def original_turn_text(message: dict[str, Any]) -> str:
    """The text of an assistant turn whose length `original_turn_tokens` records: its reasoning (if the data has
    it apart) and its content; tool calls are not counted."""
    reasoning = message.get("reasoning_content") or ""
    return f"{reasoning}\n{message['content']}" if reasoning else message["content"]


def render_prompt_ids(tokenizer, messages: list[dict], *, chat_template: str | None, enable_thinking: bool,
                      chat_template_kwargs: dict, tools: list[dict] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
        **chat_template_kwargs,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def data_turn_ids(tokenizer, target: Target, *, chat_template: str | None, enable_thinking: bool,
                  chat_template_kwargs: dict, tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """`generate.regenerate: none`: (prompt ids, output ids) of the data's OWN last assistant turn, as a team that
    trains on its data without regenerating renders it: the whole conversation through the chat template. The
    prompt is the longest token prefix that this rendering shares with the history's generation prompt (the role
    header `<|im_start|>assistant\n`, and `<think>\n` too if the turn starts with it); the output is the rest,
    up to the turn's last special token (the template's trailing newline is not part of the turn)."""
    if target.original is None:
        raise RowError(f"generate.regenerate: none keeps the data's own last assistant turn, and this conversation "
                       f"ends with a {target.history[-1]['role']} message: there is no answer to keep")
    common = dict(tools=tools, chat_template=chat_template, tokenize=False, enable_thinking=enable_thinking,
                  **chat_template_kwargs)
    full = tokenizer(tokenizer.apply_chat_template(target.history + [target.original], add_generation_prompt=False,
                                                   **common), add_special_tokens=False)["input_ids"]
    prompt = render_prompt_ids(tokenizer, target.history, chat_template=chat_template, enable_thinking=enable_thinking,
                               chat_template_kwargs=chat_template_kwargs, tools=tools)
    n = 0
    while n < min(len(full), len(prompt)) and full[n] == prompt[n]:
        n += 1
    output = full[n:]
    while output and not tokenizer.decode(output[-1:]).strip():  # the newline the template puts after a turn
        output.pop()
    if not output:
        raise RowError("generate.regenerate: none: the chat template renders nothing after the prompt for the "
                       "data's last assistant turn (an empty answer)")
    return full[:n], output


def row_seed(run_seed: int, row_id: str) -> int:
    """A stable per-row seed from (run seed, id): the same row gets the same seed on every rerun."""
    digest = hashlib.blake2b(f"{run_seed}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def variant_index(run_seed: int, row_id: str, num_variants: int) -> int:
    """Which of `generate.sampling_variants` an input row (all turns of a conversation) is sampled with: drawn from
    (run seed, id), so the same on every rerun and independent of batching, and about evenly mixed."""
    digest = hashlib.blake2b(f"{run_seed}\x00variant\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_variants


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
