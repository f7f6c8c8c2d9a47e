"""The draft's output vocabulary: the `draft_vocab_size` (speculators' 32,000) ids the run's completions use most, as
speculators' own pipeline picks them (its `token_freq.pt`, then `build_vocab_mappings_from_distribution`; the
export writes the same file for its launcher).

Without the frequencies speculators silently trains the draft over the target's whole vocabulary: for Qwen3.5/3.6's
248,320 ids an LM head of 1.27 B parameters (frozen, the target's) and logits of 248,320 per token and TTT step:
on an H100, 0.64 s and 66 GB for a step of 8,192 tokens against 0.36 s and 26 GB with 32,000 ids
(docs/BENCHMARKS.md, "One training step on the 27B shape"). A target
whose vocabulary is no larger than the draft's (the tiny test models) keeps its whole vocabulary: nothing is
counted.

Counted here: the output token ids of the rows stage 2 turns into samples (`kept_rows`), less the held-out ids, read
from the trusted completion shards one batch at a time on the driver (a 1M-row thinking-mode run: ~10 GB of int32
ids, summed into one array of the target's vocabulary size). A completion's output tokens are what the draft is
trained to predict; prompt tokens, masked out of the loss, are not counted.
"""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc

from job import schema
from job.export.files import in_sample
from job.scan.completions import judge_completion_shards, kept_rows, read_shard_tables

SHARDS_PER_READ = 64  # shards read (16 threads) before their counts are summed and the tables dropped


def needs_mapping(draft_config: dict) -> bool:
    """Whether the draft's vocabulary is smaller than the target's (speculators' draft config)."""
    return int(draft_config.get("draft_vocab_size") or 0) < int(draft_config["derived"]["target_vocab_size"])


def token_frequencies(run: str, storage_config, vocab_size: int, *, keep_flagged: bool = True,
                      holdout: float | None = None) -> dict[int, int]:
    """{token id: count} over the output tokens of the run's samples (the module docstring), held-out ids left out
    (`holdout`: the fraction `worth` serves on, `in_sample`'s rule)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    uris = [s.uri for s in judge_completion_shards(run, storage_config).trusted]
    columns = [schema.ID, schema.OUTPUT_TOKEN_IDS, schema.ERROR, schema.NUM_PROMPT_TOKENS, schema.NUM_OUTPUT_TOKENS,
               *schema.QUALITY_FLAGS]
    for start in range(0, len(uris), SHARDS_PER_READ):
        for table in read_shard_tables(uris[start:start + SHARDS_PER_READ], columns, storage_config):
            keep = kept_rows(table, keep_flagged)
            if holdout:
                keep &= np.array([not in_sample(i, holdout) for i in table.column(schema.ID).to_pylist()], dtype=bool)
            ids = pc.list_flatten(table.column(schema.OUTPUT_TOKEN_IDS).filter(keep)).to_numpy(zero_copy_only=False)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"train: the run's completions hold token ids outside the target's vocabulary of "
                                 f"{vocab_size:,} (seen {ids.min()}..{ids.max()}): was the run generated with "
                                 "another model?")
            counts += np.bincount(ids, minlength=vocab_size)
    used = np.flatnonzero(counts)
    return {int(i): int(counts[i]) for i in used}


def write_token_frequencies(freq: dict[int, int], path: str) -> str:
    """speculators' token_freq.pt ({id: count}, torch.save), which `resolve_args(token_freq_path=...)` reads."""
    import torch  # heavy: imported on use

    torch.save(freq, path)
    return path
