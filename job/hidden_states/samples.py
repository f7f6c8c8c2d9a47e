"""Stage 2's work in memory: completion rows → samples (token ids, loss mask, clipping) → parts (rows sorted by
length, cut every `rows_per_shard`) → batches; and the host buffers a part's features are gathered into."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from job import scan, schema

# ---------------------------------------------------------------------------------------------------------------
# Samples: completion rows → token ids, loss mask, clipping
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    id: str
    input_ids: np.ndarray
    """int32 prompt_token_ids + output_token_ids, clipped to max_length."""
    num_prompt_tokens: int
    """Prompt tokens inside input_ids (loss_mask is 0 over them)."""
    original_num_tokens: int
    row: int
    """Row index in its completion shard (ties in the length sort break on it: the plan is deterministic)."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def clipped(self) -> bool:
        return self.original_num_tokens > self.num_tokens

    def loss_mask(self) -> np.ndarray:
        mask = np.ones(self.num_tokens, dtype=np.uint8)
        mask[: self.num_prompt_tokens] = 0
        return mask


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list<int> column, as numpy, for slicing rows without Python lists."""
    arr = table.column(name).combine_chunks()
    if isinstance(arr, pa.ChunkedArray):  # an empty table
        arr = pa.array([], type=arr.type)
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    return offsets, values


def samples_from_completions(table: pa.Table, *, max_length: int, keep_flagged: bool,
                             row_limit: int | None = None) -> tuple[list[Sample], dict[str, int]]:
    """Samples of one completion shard, and counts of the rows skipped (error, flagged, empty).

    No re-templating: input_ids = prompt_token_ids + output_token_ids exactly as stage 1 stored them.
    """
    missing = [c for c in (schema.ID, schema.PROMPT_TOKEN_IDS, schema.OUTPUT_TOKEN_IDS, schema.ERROR)
               if c not in table.column_names]
    if missing:
        raise ValueError(f"completion shard lacks column(s) {missing}: stage 2 needs the exact token ids of "
                         "stage 1 (prompt_token_ids, output_token_ids) and its error column")
    if row_limit is not None:
        table = table.slice(0, row_limit)
    ids = table.column(schema.ID).to_pylist()
    # Which rows are kept is scan's one rule (the estimate and `status` count the same rows); why the others are not
    # is counted here.
    errors, kept = ~scan.ok_rows(table), scan.kept_rows(table, keep_flagged)
    flagged = ~errors & scan.flagged_rows(table)
    p_off, p_val = _list_column(table, schema.PROMPT_TOKEN_IDS)
    o_off, o_val = _list_column(table, schema.OUTPUT_TOKEN_IDS)
    p_valid = table.column(schema.PROMPT_TOKEN_IDS).is_valid().to_numpy(zero_copy_only=False)
    o_valid = table.column(schema.OUTPUT_TOKEN_IDS).is_valid().to_numpy(zero_copy_only=False)

    samples, skipped = [], {"error": 0, "flagged": 0, "empty": 0}
    for i in range(table.num_rows):
        if not kept[i]:
            skipped["error" if errors[i] else "flagged" if flagged[i] and not keep_flagged else "empty"] += 1
            continue
        prompt = p_val[p_off[i]:p_off[i + 1]] if p_valid[i] else p_val[:0]
        output = o_val[o_off[i]:o_off[i + 1]] if o_valid[i] else o_val[:0]
        n = len(prompt) + len(output)
        if n == 0:  # counts that disagree with the token lists: the lists are what would be extracted
            skipped["empty"] += 1
            continue
        input_ids = np.concatenate([prompt, output])[:max_length].astype(np.int32)
        samples.append(Sample(id=ids[i], input_ids=input_ids, num_prompt_tokens=min(len(prompt), max_length),
                              original_num_tokens=n, row=i))
    return samples, skipped


def plan_parts(samples: list[Sample], rows_per_part: int) -> list[list[Sample]]:
    """Sort longest first (ties by row) and cut into parts of `rows_per_part` rows: one output shard each.

    Deterministic for the same shard and settings, so a rerun names and skips the same parts. Rows of similar
    length share a part, which is what lets batches stay nearly free of padding.
    """
    ordered = sorted(samples, key=lambda s: (-s.num_tokens, s.row))
    return [ordered[i:i + rows_per_part] for i in range(0, len(ordered), rows_per_part)]


def plan_batches(lengths: list[int], batch_tokens: int, packed: bool = False) -> list[tuple[int, int]]:
    """[start, stop) ranges over longest-first `lengths`. Padded: each batch's rows × its longest ≤ batch_tokens;
    packed (sequences concatenated, no padding): the sum of lengths ≤ batch_tokens. Either way one batch's memory
    is bounded whatever the lengths (a single longer sequence gets a batch of its own)."""
    batches, start = [], 0
    while start < len(lengths):
        stop, total = start + 1, lengths[start]
        while stop < len(lengths):
            cost = total + lengths[stop] if packed else (stop - start + 1) * lengths[start]
            if cost > batch_tokens:
                break
            total, stop = total + lengths[stop], stop + 1
        batches.append((start, stop))
        start = stop
    return batches


@dataclass
class PartFeatures:
    """One finished part: its samples (part order) and their features back to back, uint8 [total × width]."""
    index: int
    samples: list[Sample]
    features: np.ndarray
    release: Callable[[], None] = lambda: None
    """Return `features` to the extractor's buffer pool once the table is serialized (never for streaming)."""


@dataclass
class RunStats:
    num_tokens: int = 0
    num_padded_tokens: int = 0
    num_batches: int = 0
    seconds: float = 0.0
    feature_bytes: int = 0
    wait_gpu_s: float = 0.0
    """Host time spent waiting for the GPU (high = GPU-bound, as it should be)."""
    host_copy_s: float = 0.0
    """Host time spent sorting features into part buffers."""

    @property
    def padding_waste(self) -> float:
        return 1 - self.num_tokens / self.num_padded_tokens if self.num_padded_tokens else 0.0

    def to_dict(self) -> dict:
        return {"num_tokens": self.num_tokens, "num_padded_tokens": self.num_padded_tokens,
                "num_batches": self.num_batches, "padding_waste": self.padding_waste,
                "feature_bytes": self.feature_bytes, "seconds": self.seconds, "wait_gpu_s": self.wait_gpu_s,
                "host_copy_s": self.host_copy_s}


class BufferPool:
    """Reused host buffers: fresh memory costs a page fault per 4 KB (~0.3 GB/s first touch on a small VM)."""

    def __init__(self, max_free: int = 4):
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()
        self.max_free = max_free

    def get(self, nbytes: int) -> np.ndarray:
        with self.lock:
            fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
            if fits:
                return self.free.pop(min(fits, key=lambda i: self.free[i].nbytes))[:nbytes]
        return np.empty(int(nbytes * 1.25) + 1, dtype=np.uint8)[:nbytes]

    def put(self, buf: np.ndarray) -> None:
        with self.lock:
            self.free.append(buf.base if buf.base is not None else buf)
            if len(self.free) > self.max_free:  # keep the largest buffers
                self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].nbytes))
