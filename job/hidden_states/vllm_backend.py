"""The vLLM backend (CUDA only): hidden states from vLLM's prefill through `extract_hidden_states`."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from job import schema, target
from job.config import resolve_layer_ids
from job.generate.engine_start import text_only_engine_kwargs
from job.hidden_states.checks import FeatureStats, check_features
from job.hidden_states.samples import BufferPool, PartFeatures, RunStats, Sample

# ---------------------------------------------------------------------------------------------------------------
# The vLLM backend (CUDA only)
# ---------------------------------------------------------------------------------------------------------------


class VllmExtractor:
    """Hidden states from vLLM's prefill: speculative method `extract_hidden_states` stores the chosen layers of
    every prompt token in a cache-only layer, and its `ExampleHiddenStatesConnector` writes each finished request's
    [tokens, layers, hidden] to a safetensors file (under `shm_dir`), which this reads back and deletes. Each
    sample is one request of `max_tokens=1`; a part's requests go to the engine together, so it batches them.

    vLLM's aux layer id j is the residual stream after j decoder layers (before the final norm), so our layer k is
    vLLM id k + 1; the last layer (after the final norm in transformers' convention) has no vLLM equivalent and is
    refused. Needs CUDA: the connector pins host memory, which the CPU build of vLLM cannot do.
    """

    def __init__(self, model: str, *, layer_ids: list[int], dtype: str = "bfloat16", max_length: int = 4096,
                 engine_kwargs: dict | None = None, shm_dir: str = "/dev/shm/datagen-hidden-states",
                 min_rms: float = 1e-5, max_rms: float = 1e4, check: bool = True,
                 last_layer_before_norm: bool = False, prefetch: int = 1):
        from vllm import LLM  # heavy: imported on use

        shape = target.shape(model)
        num_layers = shape.num_layers
        self.num_model_layers = num_layers
        self.layer_ids = resolve_layer_ids(layer_ids, num_layers)
        self.last_layer_before_norm = last_layer_before_norm
        if num_layers - 1 in self.layer_ids and not last_layer_before_norm:
            raise ValueError(f"hidden_states.backend 'vllm' cannot capture the last layer ({num_layers - 1}): in "
                             "the transformers convention it is taken after the final norm, and vLLM exposes only "
                             "the residual stream before it. Use the transformers backend, a lower layer, or "
                             "hidden_states.last_layer_before_norm: true (vLLM id N, what speculators stores).")
        self.hidden_size, self.dtype = shape.hidden_size, dtype
        self.width = len(self.layer_ids) * self.hidden_size * schema.ITEMSIZE[dtype]
        self.min_rms, self.max_rms, self.check = min_rms, max_rms, check
        self.prefetch = prefetch  # parts the engine works on ahead of the read-back (0: in line)
        self.readers = ThreadPoolExecutor(8, thread_name_prefix="vllm-read-back")
        self.stats, self.feature_stats, self.pool = RunStats(), FeatureStats(self.layer_ids, self.hidden_size), \
            BufferPool()
        args = dict(model=model, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
                    max_model_len=max_length + 8, enable_chunked_prefill=False,
                    max_num_batched_tokens=max(16384, max_length + 8))

        args.update(text_only_engine_kwargs(model, engine_kwargs or {})[0])  # text in: no vision tower
        self.llm = LLM(**args, speculative_config={
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [k + 1 for k in self.layer_ids]}},
        }, kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": shm_dir},
        })

    def run(self, parts: list[tuple[int, list[Sample]]], *, pooled: bool = True) -> Iterator[PartFeatures]:
        """Features per part, in order. While this reads one part's files back (safetensors from `shm_dir`, the
        checks, the copy into one buffer; 8 reader threads), a thread has the engine already working on the next
        part. Read back in line on one thread, the GPU idled for the whole read: 0.60x of the engine's own rate on
        the 8B shape; overlapped with 8 readers, 0.946x (docs/BENCHMARKS.md, 4b). At most `self.prefetch` parts
        are generated ahead, so /dev/shm holds at most that many parts' files beyond the one being read."""
        import torch  # heavy: imported on use
        from vllm import SamplingParams  # heavy: imported on use
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )  # heavy: imported on use

        params = SamplingParams(max_tokens=1, detokenize=False)

        def generate(samples):
            return self.llm.generate([{"prompt_token_ids": s.input_ids.tolist()} for s in samples], params,
                                     use_tqdm=False)

        def drop(outputs):  # a part made ahead that nobody will read: its files go
            for out in outputs:
                cleanup_hidden_states(out.kv_transfer_params["hidden_states_path"])

        generated = ahead(generate, [samples for _, samples in parts], self.prefetch, on_drop=drop)
        try:
            for index, samples in parts:
                started = time.perf_counter()
                outputs = next(generated)  # waits while the engine is still on this part
                nbytes = sum(s.num_tokens for s in samples) * self.width
                buf = self.pool.get(nbytes) if pooled else np.empty(nbytes, dtype=np.uint8)
                sumsq = np.zeros((len(samples), len(self.layer_ids)))
                nonfinite = np.zeros_like(sumsq)
                offsets = np.cumsum([0] + [s.num_tokens * self.width for s in samples])
                target = torch.from_numpy(buf)

                def read_back(r):  # one sample's file into its slice of buf; torch and file reads drop the GIL
                    s, path = samples[r], outputs[r].kv_transfer_params["hidden_states_path"]
                    data = load_hidden_states(path)
                    cleanup_hidden_states(path)
                    hidden, token_ids = data["hidden_states"], data["token_ids"]
                    if token_ids.tolist() != s.input_ids.tolist() or tuple(hidden.shape[1:]) != (
                            len(self.layer_ids), self.hidden_size):
                        raise RuntimeError(f"vllm backend: sample {s.id!r} came back with {len(token_ids)} tokens "
                                           f"and features {tuple(hidden.shape)}; expected {s.num_tokens} tokens")
                    norms = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32)
                    sumsq[r] = norms.square().sum(0).numpy()
                    nonfinite[r] = (~torch.isfinite(norms)).sum(0).numpy()
                    target[offsets[r]:offsets[r + 1]].copy_(hidden.contiguous().view(-1).view(torch.uint8))

                list(self.readers.map(read_back, range(len(samples))))
                if self.check:
                    rms = check_features(samples, sumsq, nonfinite, layer_ids=self.layer_ids,
                                         hidden_size=self.hidden_size, min_rms=self.min_rms, max_rms=self.max_rms)
                    self.feature_stats.update(sumsq, rms, np.array([s.num_tokens for s in samples]))
                tokens = sum(s.num_tokens for s in samples)
                self.stats.num_tokens += tokens
                self.stats.num_padded_tokens += tokens
                self.stats.feature_bytes += nbytes
                self.stats.seconds += time.perf_counter() - started  # waiting for the engine + the read-back
                yield PartFeatures(index=index, samples=samples, features=buf,
                                   release=(lambda b=buf: self.pool.put(b)) if pooled else (lambda: None))
        finally:
            generated.close()


def ahead(fn, items: list, depth: int, on_drop=lambda result: None) -> Iterator:
    """fn(item) for each item in order, computed by one background thread up to `depth` items ahead of the
    consumer (depth 0: in line, no thread). An exception in fn is raised to the consumer at that item. Closing
    the iterator early stops the thread after the call it is in; results made but never taken go to on_drop."""

    if depth <= 0:
        for item in items:
            yield fn(item)
        return
    results: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work():
        for item in items:
            if stop.is_set():
                return
            try:
                out = (True, fn(item))
            except BaseException as e:  # handed to the consumer, which raises it there
                out = (False, e)
            while True:
                if stop.is_set():
                    if out[0]:
                        on_drop(out[1])
                    return
                try:
                    results.put(out, timeout=0.2)
                    break
                except queue.Full:
                    continue
            if not out[0]:
                return

    thread = threading.Thread(target=work, name="vllm-prefetch", daemon=True)
    thread.start()
    try:
        for _ in items:
            ok, value = results.get()
            if not ok:
                raise value
            yield value
    finally:
        stop.set()
        thread.join()
        while not results.empty():
            ok, value = results.get_nowait()
            if ok:
                on_drop(value)
