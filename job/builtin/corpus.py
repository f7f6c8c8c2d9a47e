"""The corpus shipped in `data/corpus.txt` and the synthetic chats made from it: each chat a prompt (system and
user turns, sometimes history) and a completion in the target's format (`reasoning\n</think>\n\nanswer<|im_end|>`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from job.builtin.tokenizer import IM_END, THINK_END

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"


# ---------------------------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Corpus:
    """The three kinds of line in corpus.txt (sections `# questions`, `# facts`, `# thoughts`)."""

    qa_pairs: list[tuple[str, str]]
    """(question, answer) from `Q:` / `A:` line pairs."""
    facts: list[str]
    """Plain sentences: filler for the reasoning."""
    thoughts: list[str]
    """Reasoning-style sentences ("Let me check whether the numbers add up.")."""


def load_corpus(path: Path = CORPUS_PATH) -> Corpus:
    qa_pairs: list[tuple[str, str]] = []
    sections: dict[str, list[str]] = {"facts": [], "thoughts": []}
    section = None
    question = None
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("# "):
            section = line[2:]
        elif line.startswith("Q: "):
            question = line[3:]
        elif line.startswith("A: "):
            assert question is not None, f"answer without a question in {path}: {line!r}"
            qa_pairs.append((question, line[3:]))
            question = None
        else:
            sections[section].append(line)
    return Corpus(qa_pairs=qa_pairs, facts=sections["facts"], thoughts=sections["thoughts"])


def _split_sentences(text: str) -> list[str]:
    sentences, start = [], 0
    for i, char in enumerate(text):
        if char in ".?!" and (i + 1 == len(text) or text[i + 1] == " "):
            sentences.append(text[start : i + 1].strip())
            start = i + 1
    return [s for s in sentences if s]


# ---------------------------------------------------------------------------------------------------------------
# Synthetic chats
# ---------------------------------------------------------------------------------------------------------------
# Each training example is a rendered prompt (system/user turns, sometimes history) plus a completion in the
# target's format. Output lengths must have a long tail (the benchmarks measure how an engine copes with it), so
# a chat is "long" with probability LONG_FRACTION or when the user asks for steps. A long chat opens its
# reasoning with one of LONG_OPENERS: the model picks the opener itself when sampling, and then keeps going for
# ~20 sentences instead of ~3, so the sampled lengths are a mixture: most 50-150 tokens, a tenth 300-800.
LONG_FRACTION = 0.15
LONG_OPENERS = (
    "Let me think about this step by step.",
    "There are two parts to this question, and I will take them one at a time.",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly tutor who explains things clearly.",
    "Answer the user's questions accurately and concisely.",
)


def _geometric(rng: random.Random, p: float) -> int:
    """Number of failures before the first success: mean (1 - p) / p, a long tail."""
    count = 0
    while rng.random() > p:
        count += 1
    return count


def _user_turn(rng: random.Random, question: str, corpus: Corpus) -> tuple[str, bool | None]:
    """A user message for `question`, and whether it asks for a long (True) / short (False) answer."""
    roll = rng.random()
    if roll < 0.10:
        return f"Explain step by step: {question}", True
    if roll < 0.20:
        return f"Briefly, {question[0].lower()}{question[1:]}", False
    if roll < 0.30:
        return f"{rng.choice(corpus.facts)} {question}", None
    return question, None


def _reasoning(rng: random.Random, corpus: Corpus, question: str, long: bool) -> str:
    """Thoughts and facts. Answers are made of other sentences (the corpus answers), so the sentence just written
    tells the model which side of </think> it is on; with facts on both sides a 4-layer model stopped inside
    the think block in ~1 of 3 samples."""
    thoughts = [t for t in corpus.thoughts if t not in LONG_OPENERS]
    # Short: 2 + Geometric(0.4) sentences (mean 3.5, ~50 tokens). Long: 10 + Geometric(0.1), capped at 40
    # (mean ~19, ~300 tokens).
    num_sentences = 10 + min(_geometric(rng, 0.1), 30) if long else 2 + _geometric(rng, 0.4)
    sentences = [rng.choice(LONG_OPENERS if long else thoughts)]
    if rng.random() < 0.3:
        sentences.append(f"The question is: {question}")
    while len(sentences) < num_sentences:
        candidate = rng.choice(thoughts) if rng.random() < 0.45 else rng.choice(corpus.facts)
        if candidate not in sentences:  # no repeated sentence: the quality checks flag repetition
            sentences.append(candidate)
    # Paragraph breaks now and then, as real reasoning has them.
    text = sentences[0]
    for sentence in sentences[1:]:
        text += ("\n\n" if rng.random() < 0.2 else " ") + sentence
    return text


def _answer(rng: random.Random, corpus: Corpus, answer: str, long: bool) -> str:
    """The corpus answer, plus a few sentences of other answers (2 + Geometric(0.35) when long, one 30% of
    the time otherwise), sometimes as a list."""
    num_extra = 2 + _geometric(rng, 0.35) if long else (1 if rng.random() < 0.3 else 0)
    extra = [rng.choice(_split_sentences(other)) for _, other in rng.sample(corpus.qa_pairs, num_extra)]
    extra = [sentence for sentence in extra if sentence not in answer]
    if not extra:
        return answer
    if long and rng.random() < 0.5:
        return answer + "\n\n" + "\n".join(f"- {sentence}" for sentence in extra)
    return answer + " " + " ".join(extra)


def synthesize_chat(rng: random.Random, corpus: Corpus) -> tuple[list[dict], str]:
    """One (messages, completion) pair; completion is what follows the thinking generation prompt."""
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(1 if rng.random() < 0.15 else 0):  # some chats carry one earlier exchange
        question, answer = rng.choice(corpus.qa_pairs)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    question, answer = rng.choice(corpus.qa_pairs)
    user_text, asks_long = _user_turn(rng, question, corpus)
    messages.append({"role": "user", "content": user_text})
    long = asks_long if asks_long is not None else rng.random() < LONG_FRACTION
    reasoning = _reasoning(rng, corpus, question, long)
    completion = f"{reasoning}\n{THINK_END}\n\n{_answer(rng, corpus, answer, long)}{IM_END}"
    return messages, completion
