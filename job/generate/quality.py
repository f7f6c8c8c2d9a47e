"""Quality flags per row.

A real dataset was lost because 87% of its samples held 6 tokens of content (wrong chat template): these flags
exist so that such a run is caught while it runs, not afterwards.
"""

from __future__ import annotations

from collections import Counter

from job import schema
from job.config import QualityConfig


def generation_prompt_ids(tokenizer, *, enable_thinking: bool, chat_template_kwargs: dict) -> list[int]:
    """The token ids the model's OWN chat template appends for the generation prompt (e.g. Qwen's
    `<|im_start|>assistant\\n<think>\\n`). Every prompt we send must end with exactly these ids."""
    messages = [{"role": "user", "content": "x"}]
    common = dict(tokenize=False, enable_thinking=enable_thinking, **chat_template_kwargs)
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **common)
    with_gen = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **common)
    assert with_gen.startswith(without), "the model's chat template does not append its generation prompt"
    return tokenizer(with_gen[len(without):], add_special_tokens=False)["input_ids"]


def is_repetitive(ids: list[int], config: QualityConfig) -> bool:
    """True when one n-gram, repeated, covers at least `repetition_min_coverage` of the last tokens."""
    n = config.repetition_ngram
    tail = ids[-config.repetition_tail_tokens:]
    if len(tail) < 4 * n:  # too short to call a loop
        return False
    counts = Counter(tuple(tail[i:i + n]) for i in range(len(tail) - n + 1))
    _, top = counts.most_common(1)[0]
    # Non-overlapping occurrences of an n-gram cover at most top * n tokens; a loop of period p <= n repeats
    # every n-gram inside it about len/p times, so either way this estimates the looped fraction.
    return min(1.0, top * n / len(tail)) >= config.repetition_min_coverage if top > 1 else False


def row_flags(*, prompt_ids: list[int], output_ids: list[int], finish_reason: str | None, think_closed: bool,
              answer: str, thinking: bool, expected_generation_prompt: list[int], special_ids: set[int],
              config: QualityConfig) -> dict[str, bool]:
    content_tokens = sum(1 for t in output_ids if t not in special_ids)
    k = len(expected_generation_prompt)
    return {
        schema.FLAG_TOO_SHORT: content_tokens < config.min_content_tokens,
        schema.FLAG_UNCLOSED_THINK: thinking and not think_closed,
        schema.FLAG_EMPTY_ANSWER: not answer.strip(),
        schema.FLAG_TRUNCATED: finish_reason == "length",
        schema.FLAG_REPETITION: is_repetitive(output_ids, config),
        schema.FLAG_TEMPLATE_MISMATCH: k > 0 and list(prompt_ids[-k:]) != list(expected_generation_prompt),
    }


# ---------------------------------------------------------------------------------------------------------------
# Canary: the first rows decide whether the run goes on
# ---------------------------------------------------------------------------------------------------------------


def canary_verdict(totals: dict[str, int], config: QualityConfig) -> str | None:
    """None when the first rows look healthy; else a message saying what is wrong and what to check."""
    rows = totals.get("num_outputs", totals.get("num_rows", 0))  # output rows: several per conversation
    errors = totals.get("num_errors", 0)
    ok = max(1, rows - errors)

    def rate(flag: str) -> float:
        return totals.get(f"num_{flag}", 0) / ok

    problems = []
    if errors / max(1, rows) > config.canary_max_error:
        problems.append(f"{errors / max(1, rows):.0%} of rows are errors (> {config.canary_max_error:.0%}): look at "
                        "the `error` column of the first shards; the input format is probably wrong")
    if rate(schema.FLAG_TEMPLATE_MISMATCH) > config.canary_max_template_mismatch:
        problems.append(f"{rate(schema.FLAG_TEMPLATE_MISMATCH):.0%} of prompts do not end with the generation prompt "
                        "of the model's own chat template: check --chat-template / chat_template_kwargs and that the "
                        "model version matches the template")
    if rate(schema.FLAG_TOO_SHORT) > config.canary_max_too_short:
        problems.append(f"{rate(schema.FLAG_TOO_SHORT):.0%} of completions are shorter than "
                        f"{config.min_content_tokens} tokens: check the chat template, the model version and "
                        "max_tokens")
    if rate(schema.FLAG_UNCLOSED_THINK) > config.canary_max_unclosed_think:
        problems.append(f"{rate(schema.FLAG_UNCLOSED_THINK):.0%} of thinking blocks are never closed: check "
                        "max_tokens (too small for the reasoning?), enable_thinking and the model version")
    if not problems:
        return None
    return (f"canary failed on the first {rows} rows, the run was stopped before wasting more GPU time:\n  - "
            + "\n  - ".join(problems) + "\n(thresholds: `quality.canary_*` in the config; --no-canary skips the check)")
