"""`make demo`: both stages end to end on the embedded default — local Ray, CPU vLLM, the project's tiny model,
a few hundred demo prompts written as parquet shards, plus one shard of multi-turn conversations — leaving the
run directory at `demo-run/`.
"""

from __future__ import annotations

import os
import random
from importlib import resources

import pyarrow as pa
import pyarrow.parquet as pq

from job.builtin.tiny_model import ensure_tiny_model
from job.config import DEFAULT_CONFIG, load_config
from job.generate import print_summary, run_generate
from job.hidden_states import run_hidden_states

TINY_MODEL_DIR = ".cache/tiny-model"
DEMO_PROMPTS_DIR = ".cache/demo-prompts"
NUM_DEMO_PROMPTS = 384
NUM_DEMO_SHARDS = 4
NUM_DEMO_CONVERSATIONS = 32  # one more shard: 2-4 question/answer turns each; the last answer is regenerated

# Ways of asking that vary the prompt length and, through the trained model, the output length.
_STYLES = ["{q}", "Answer briefly: {q}", "Think it through, then answer: {q}", "{q} Explain in detail.",
           "A friend asked me this and I was not sure. {q} What would you say, and why?"]


def demo_questions() -> list[str]:
    text = resources.files("job.builtin").joinpath("data/corpus.txt").read_text()
    return [line[2:].strip() for line in text.splitlines() if line.startswith("Q:")]


def demo_pairs() -> list[tuple[str, str]]:
    """(question, answer) pairs of the corpus the tiny model was trained on."""
    lines = resources.files("job.builtin").joinpath("data/corpus.txt").read_text().splitlines()
    return [(q[2:].strip(), a[2:].strip()) for q, a in zip(lines, lines[1:])
            if q.startswith("Q:") and a.startswith("A:")]


DEMO_SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string()),
                         ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                         ("source", pa.string())])


def write_demo_prompts(output_dir: str = DEMO_PROMPTS_DIR, num_prompts: int = NUM_DEMO_PROMPTS,
                       num_shards: int = NUM_DEMO_SHARDS, num_conversations: int = NUM_DEMO_CONVERSATIONS) -> str:
    """Deterministic prompt shards: `id`, `prompt` or `messages`, and a carried `source` column. The last shard
    holds `num_conversations` multi-turn chats (system prompt, 2-4 question/answer turns, ending in an answer that
    `generate.regenerate: last_turn` regenerates: turn 1-3, with the data's own answer length beside it)."""
    questions, rng = demo_questions(), random.Random(0)
    rows = [{"id": f"demo-{i:05d}", "prompt": rng.choice(_STYLES).format(q=rng.choice(questions)),
             "messages": None, "source": "demo"} for i in range(num_prompts)]
    os.makedirs(output_dir, exist_ok=True)
    per = -(-num_prompts // num_shards)
    for s in range(num_shards):
        pq.write_table(pa.Table.from_pylist(rows[s * per:(s + 1) * per], schema=DEMO_SCHEMA),
                       os.path.join(output_dir, f"prompts-{s:05d}.parquet"))
    if num_conversations:
        pairs, chats = demo_pairs(), []
        for i in range(num_conversations):
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            for q, a in rng.sample(pairs, 2 + i % 3):
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            chats.append({"id": f"chat-{i:05d}", "prompt": None, "messages": messages, "source": "demo-chat"})
        pq.write_table(pa.Table.from_pylist(chats, schema=DEMO_SCHEMA),
                       os.path.join(output_dir, f"prompts-{num_shards:05d}.parquet"))
    return output_dir


def run_demo(output: str) -> int:
    print(f"demo: tiny model in {TINY_MODEL_DIR} (built once, ~1-2 min)", flush=True)
    ensure_tiny_model(TINY_MODEL_DIR)
    write_demo_prompts()
    config = load_config(DEFAULT_CONFIG, output=output)
    print_summary(config, run_generate(config))
    run_hidden_states(config)
    return 0
