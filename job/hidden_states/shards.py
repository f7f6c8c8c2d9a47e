"""Hidden-state shards: a part's features → Arrow table → IPC bytes (written on a background thread), and back,
zero-copy, for the loader."""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from job import scan, schema, storage
from job.hidden_states import fp8
from job.hidden_states.samples import Sample
from job.target_weights import torch_dtype

# ---------------------------------------------------------------------------------------------------------------
# Arrow: the hidden-state shard schema, features → table → IPC bytes, and back (zero-copy)
# ---------------------------------------------------------------------------------------------------------------


def part_table(samples: list[Sample], features: np.ndarray, hs_schema: pa.Schema,
               scales: np.ndarray | None = None) -> pa.Table:
    """Arrow table of one part. `features` (uint8, the samples' [n, L, H] blocks back to back) is wrapped, not
    copied: keep it alive and unchanged until the table is serialized. `scales` (float32 [tokens, L]): FP8 storage's
    per-token, per-layer scales (job/hidden_states/fp8.py), for a schema with that column."""
    counts = np.array([s.num_tokens for s in samples], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    total = int(counts.sum())
    hs_type = hs_schema.field(schema.HIDDEN_STATES).type
    width = hs_type.value_type.byte_width
    assert features.nbytes >= total * width, (features.nbytes, total, width)
    child = pa.FixedSizeBinaryArray.from_buffers(hs_type.value_type, total,
                                                 [None, pa.py_buffer(features[:total * width])])
    columns = [
        pa.array([s.id for s in samples], pa.string()),
        pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([s.input_ids for s in samples]), pa.int32())),
        pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([s.loss_mask() for s in samples]), pa.uint8())),
        pa.array(counts.astype(np.int32)),
        pa.array(np.array([s.original_num_tokens for s in samples], dtype=np.int32)),
        pa.array([s.clipped for s in samples], pa.bool_()),
        pa.ListArray.from_arrays(offsets, child, type=hs_type),
    ]
    if schema.HIDDEN_STATE_SCALES in hs_schema.names:
        scale_type = hs_schema.field(schema.HIDDEN_STATE_SCALES).type
        raw = np.ascontiguousarray(scales[:total], dtype=np.float32).view(np.uint8).reshape(-1)
        scale_child = pa.FixedSizeBinaryArray.from_buffers(scale_type.value_type, total, [None, pa.py_buffer(raw)])
        columns.append(pa.ListArray.from_arrays(offsets, scale_child, type=scale_type))
    return pa.Table.from_arrays(columns, schema=hs_schema)


def table_to_ipc(table: pa.Table) -> pa.Buffer:
    """Uncompressed Arrow IPC file bytes (memory-mappable), written into one buffer sized up front: one copy of
    the features instead of the 2-3 a growing BytesIO makes (1.2 → 9 GB/s measured)."""
    sizer = pa.MockOutputStream()
    with ipc.new_file(sizer, table.schema) as w:
        w.write_table(table)
    buf = pa.allocate_buffer(sizer.size())
    with ipc.new_file(pa.FixedSizeBufferWriter(buf), table.schema) as w:
        w.write_table(table)
    return buf


def record_dtype(stored: str) -> str:
    """The dtype `iter_records` gives features in for shards stored in `stored`: FP8 is read back as bfloat16."""
    return "bfloat16" if stored == schema.FP8 else stored


def iter_records(table: pa.Table) -> Iterator[dict]:
    """One dict per sample; `hidden_states` is a torch tensor [num_tokens, num_layers, hidden] that views the
    table's buffer (no copy: with a memory-mapped file nothing is read until used). Treat the tensors as
    read-only (`.clone()` to modify): they share memory with the file mapping. FP8 shards are dequantized into a
    new bfloat16 tensor per sample (a copy: `record_dtype`)."""
    import torch  # heavy: imported on use

    meta = scan.hidden_state_meta(table.schema.metadata)
    layer_ids, dtype, hidden = meta.layer_ids, meta.dtype, meta.hidden_size
    tdtype = torch_dtype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": a read-only mapping, documented above
        for batch in table.to_batches():
            hs = batch.column(schema.HIDDEN_STATES)
            child = hs.values
            data = np.frombuffer(child.buffers()[1], dtype=np.uint8)
            width = child.type.byte_width
            hs_off = hs.offsets.to_numpy()
            ids = batch.column(schema.ID).to_pylist()
            in_ids, mask = batch.column(schema.INPUT_IDS), batch.column(schema.LOSS_MASK)
            in_off, in_val = in_ids.offsets.to_numpy(), in_ids.values.to_numpy()
            m_off, m_val = mask.offsets.to_numpy(), mask.values.to_numpy()
            clipped = batch.column(schema.CLIPPED).to_pylist()
            original = batch.column(schema.ORIGINAL_NUM_TOKENS).to_pylist()
            if dtype == schema.FP8:
                sc = batch.column(schema.HIDDEN_STATE_SCALES).values
                sc_data = np.frombuffer(sc.buffers()[1], dtype=np.float32)[sc.offset * len(layer_ids):]
            for i in range(batch.num_rows):
                n = int(hs_off[i + 1] - hs_off[i])
                start = (child.offset + int(hs_off[i])) * width
                features = torch.from_numpy(data[start:start + n * width]).view(tdtype).view(n, len(layer_ids),
                                                                                              hidden)
                if dtype == schema.FP8:
                    at = int(hs_off[i]) * len(layer_ids)
                    scale = torch.from_numpy(sc_data[at:at + n * len(layer_ids)]).view(n, len(layer_ids))
                    features = fp8.dequantize(features, scale)
                yield {
                    schema.ID: ids[i],
                    schema.INPUT_IDS: torch.from_numpy(in_val[in_off[i]:in_off[i + 1]]),
                    schema.LOSS_MASK: torch.from_numpy(m_val[m_off[i]:m_off[i + 1]]),
                    "layer_ids": layer_ids,
                    schema.HIDDEN_STATES: features,
                    schema.CLIPPED: clipped[i],
                    schema.ORIGINAL_NUM_TOKENS: original[i],
                }



# ---------------------------------------------------------------------------------------------------------------
# Writing parts in the background
# ---------------------------------------------------------------------------------------------------------------


class BackgroundWriter:
    """Serialize + write parts on one thread while the GPU works on the next batches. At most `max_pending`
    parts wait (bounded memory); the first failure is re-raised in the caller at the next submit or close."""

    def __init__(self, max_pending: int = 2):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hs-writer")
        self.pending: deque[Future] = deque()
        self.results: list = []
        self.max_pending = max_pending
        self.blocked_s = 0.0
        """Caller time spent waiting for the writer (high = writing is the bottleneck)."""

    def submit(self, fn, *args) -> None:
        while len(self.pending) >= self.max_pending:
            started = time.perf_counter()
            self.results.append(self.pending.popleft().result())
            self.blocked_s += time.perf_counter() - started
        self.pending.append(self.pool.submit(fn, *args))

    def close(self) -> list:
        """Wait for every write; return their results in submission order."""
        try:
            while self.pending:
                self.results.append(self.pending.popleft().result())
            return self.results
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


def load(run_uri: str, storage_config: storage.StorageConfig | None = None):
    """Yield one dict per sample of a run's hidden-state shards: `id`, `input_ids` (int32), `loss_mask` (uint8),
    `layer_ids`, `hidden_states` ([num_tokens, num_layers, hidden] torch tensor in the stored dtype, a view of
    the memory-mapped file for local runs: no copy; read-only), `clipped`, `original_num_tokens`."""
    for uri, _ in scan.done_hidden_state_parts(run_uri, storage_config):  # stage 2's "done" rule
        yield from iter_records(storage.read_shard(uri, storage_config, memory_map=True))

