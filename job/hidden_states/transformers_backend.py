"""The transformers backend: forward passes over length-sorted batches with hooks on the chosen layers.

    from job.hidden_states.transformers_backend import TransformersExtractor, load_model
    extractor = TransformersExtractor(load_model(path, dtype="bfloat16", device="cuda"), layer_ids=[1, 17, 32])
    for part in extractor.run(list(enumerate(plan_parts(samples, 32)))):
        table = part_table(part.samples, part.features, schema)

Layer convention (docs/ARCHITECTURE.md, "One run, every trainer"; job/drafters.py): layer k is transformers'
`output_hidden_states[k + 1]`, the output of decoder layer k. One wrinkle, measured on transformers 5.19 Qwen3: for the
LAST decoder layer transformers returns the output
*after* the model's final norm (`hidden_states[-1] == norm(layer_out)`), so that is what layer N-1 stores here too.
vLLM's aux hidden states (`eagle_aux_hidden_state_layer_ids`) count differently: vLLM id j is the residual stream
after j layers, before any final norm, so our layer k is vLLM id k + 1 and our last layer has no vLLM equivalent.

Throughput decisions (measured in bench/bench_hidden_states.py; figures in docs/BENCHMARKS.md):
- Rows are sorted by length (longest first) and cut into batches of at most `batch_tokens` padded tokens, so
  padding stays at a few percent and the longest (most memory-hungry) batch runs first.
- A forward hook on each captured layer gathers the non-pad tokens straight into one [tokens, layers, hidden]
  buffer; the hook of the last captured layer raises `_StopForward`, so later layers, the final norm and the LM
  head never run, and all layers are never materialized.
- Feature checks reduce on the GPU to a [rows, layers] table (sum of squared per-token norms, non-finite count);
  only that small table and the features cross to the host.
- Device→host copies run on a side stream into two pinned staging buffers, so batch i+1's forward is queued
  before the host waits for batch i: the GPU never idles while the host sorts features into parts.
- Host memory is first-touched at ~0.3 GB/s on small VMs: part buffers are reused from a pool, and a part is
  streamed from its buffer into its file (storage.write_ipc_atomic), with no file-sized buffer in between.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from collections import deque
from collections.abc import Iterator

import numpy as np

from job import schema
from job.config import ATTENTION_MODES, FUSE_MODES, check_choice, resolve_layer_ids
from job.hidden_states import fp8
from job.hidden_states.checks import FeatureStats, check_features
from job.hidden_states.fusion import fused_attention_forward, fused_layer_forward, fusion_problem, kernels
from job.hidden_states.packing import (
    PACKABLE_LAYERS,
    PACKED_ATTENTION,
    packed_attention_available,
    packing_problem,
    register_packed_attention,
    slow_path_warnings,
    varlen_gated_deltanet,
    varlen_gdn_problem,
)
from job.hidden_states.samples import BufferPool, PartFeatures, RunStats, Sample, plan_batches
from job.target_weights import decoder_stack, torch_dtype, torch_dtypes

# ---------------------------------------------------------------------------------------------------------------
# The transformers backend
# ---------------------------------------------------------------------------------------------------------------

FUSE_AUTO = "compile"
"""What `fuse: auto` picks on a CUDA GPU (the CPU path stays eager). Measured on one H200 in one process, the 27B
hybrid shape packed with varlen GDN (docs/BENCHMARKS.md): unfused 10,336 tokens/s, 'fla' 12,157,
'compile' 12,318; against a plain per-sequence forward on the small Qwen3.5 shape the max relative difference is
3.32 % unfused, 3.32 % with 'compile' (the same) and 3.38 % with 'fla'. So 'compile'."""


def load_model(path: str, *, dtype: str = "bfloat16", device: str | None = None):
    """The target model for a forward over token ids, in `dtype` on `device` (default: cuda if present)."""
    import torch  # heavy: imported on use
    from transformers import AutoModelForCausalLM  # heavy: imported on use
    from transformers.utils import logging as hf_logging  # heavy: imported on use

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per actor adds nothing to a run's log
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # No device_map: that needs `accelerate`, which the CPU install does not have; .to() does the same here.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), attn_implementation="sdpa")
    return model.to(device).eval()



def describe_kernel_path(*, cuda: bool, attention: str, gdn: str, fuse: str, hybrid: bool, fla: bool) -> str:
    """Which kernels a worker's forwards run, in one line (after `auto` is resolved). On a CUDA GPU a hybrid target
    without flash-linear-attention runs Gated DeltaNet on transformers' torch reference, >10x slower (the line says
    so, beside slow_path_warnings' WARNING). Given an unresolved 'auto' it refuses: the line exists to name the path
    a worker runs, and 'auto' names none (an H100's worker once said "padded" while it packed)."""
    unresolved = [name for name, value in (("attention", attention), ("gdn", gdn), ("fuse", fuse)) if value == "auto"]
    if unresolved:
        raise ValueError(f"describe_kernel_path: {', '.join(unresolved)} still 'auto': pass the modes chosen")
    parts = ["attention packed (varlen flash attention)" if attention == "packed" else
             "attention padded (SDPA over right-padded rows)"]
    if hybrid:
        if gdn == "varlen" and attention == "packed":
            gdn_path = "flash-linear-attention's varlen kernels, once per packed batch"
        elif cuda and fla:
            gdn_path = "transformers' layer on flash-linear-attention" + (", once per sequence" if attention == "packed"
                                                                          else "")
        elif cuda:
            gdn_path = ("transformers' torch reference, >10x slower: flash-linear-attention is not installed "
                        "(`pip install '.[gpu]'`)")
        else:
            gdn_path = "transformers' torch reference (CPU)"
        parts.append(f"Gated DeltaNet {gdn_path}")
    parts.append("elementwise ops eager (fuse off)" if fuse == "off" else f"fused elementwise ops ({fuse})")
    return "; ".join(parts)


class _StopForward(Exception):
    """Raised by the hook of the last captured layer: nothing after it is needed."""


class TransformersExtractor:
    """Forward passes over length-sorted batches, capturing exactly `layer_ids` (resolved) with hooks."""

    def __init__(self, model, *, layer_ids: list[int], batch_tokens: int = 16384, min_rms: float = 1e-5,
                 max_rms: float = 1e4, check: bool = True, attention: str = "auto", gdn: str = "auto",
                 last_layer_before_norm: bool = False, fuse: str = "auto"):
        """`attention`: 'padded' (transformers' SDPA over right-padded rows with a mask), 'packed' (rows
        concatenated with no padding: varlen flash attention, see _packed_attention; recurrent layers once per
        sequence, see PACKABLE_LAYERS) or 'auto' (packed where torch has varlen attention, a GPU, and every
        sequence mixer of the model can be kept exact; else padded). `gdn`, for the Gated DeltaNet layers of a
        packed batch: 'varlen' (one flash-linear-attention call per layer over the whole batch, told the sequence
        bounds: see varlen_gated_deltanet), 'per_sequence' (transformers' own layer once per sequence) or 'auto'
        (varlen on a GPU with flash-linear-attention). `last_layer_before_norm`: the last layer is the final
        decoder layer's output before the final norm (vLLM's convention) instead of after it. `fuse`: the
        elementwise work of Qwen3.5/3.6 layers as fused kernels (job/hidden_states/fusion.py): 'compile', 'fla',
        'reference' (the same rewrite, eager: for tests), 'off', or 'auto' (FUSE_AUTO on a CUDA GPU for a model
        whose layers fusion.py writes out, else off)."""
        import torch  # heavy: imported on use

        self.torch = torch
        self.stack = decoder_stack(model)
        # Features are stored in the dtype the model computes in (load_model's `dtype`).
        dtype = {v: k for k, v in torch_dtypes().items()}[self.stack.embed_tokens.weight.dtype]
        num_layers = len(self.stack.layers)
        self.num_model_layers = num_layers
        self.layer_ids = resolve_layer_ids(layer_ids, num_layers)
        self.last_layer_before_norm = last_layer_before_norm
        self.hidden_size = int(self.stack.embed_tokens.weight.shape[1])
        self.dtype, self.batch_tokens = dtype, batch_tokens
        self.min_rms, self.max_rms, self.check = min_rms, max_rms, check
        self.device = self.stack.embed_tokens.weight.device
        self.cuda = self.device.type == "cuda"
        self._segments: list[tuple[int, int]] | None = None  # host [start, stop) of each sequence of a packed batch
        self._cu_seqlens = None  # (device int64, host int64) sequence bounds of a packed batch, for varlen GDN kernels
        self._choose_modes(attention, gdn, fuse)
        fuse = self.fuse
        self._kernels = None if fuse == "off" else kernels(fuse)
        self._wrapped = []
        if self.packed:
            register_packed_attention()
            for layer in self.stack.layers:
                mixer = getattr(layer, PACKABLE_LAYERS["linear_attention"], None)
                if mixer is not None:
                    mixer.forward = self.per_sequence(mixer, mixer.forward)
                    self._wrapped.append(mixer)
        if self._kernels is not None:  # after the mixers: a fused layer calls them as modules
            def active() -> bool:  # only in this extractor's forwards: a reference forward runs transformers' code
                return self._out is not None

            for layer in self.stack.layers:
                layer.forward = fused_layer_forward(layer, self._kernels, active)
                self._wrapped.append(layer)
                if getattr(layer, "self_attn", None) is not None:
                    layer.self_attn.forward = fused_attention_forward(layer.self_attn, self._kernels, active)
                    self._wrapped.append(layer.self_attn)
        self.value_width = len(self.layer_ids) * self.hidden_size * schema.ITEMSIZE[dtype]
        self.fp8_records = False
        """True: each token comes back as FP8 storage's record, [fp8 values (L x H) | float32 scales (L)], quantized
        on the device before the copy (half the bytes to copy; fp8.split_records splits a part). The actor turns it
        on after its self-check, which compares the features as computed."""
        self.stats = RunStats()
        self.feature_stats = FeatureStats(self.layer_ids, self.hidden_size)
        self.pool = BufferPool()
        self.warnings = slow_path_warnings(self.stack) if self.cuda else []
        for warning in self.warnings:
            warnings.warn(warning, stacklevel=2)
        hybrid = "linear_attention" in (getattr(self.stack.config, "layer_types", None) or [])
        self.kernel_path = describe_kernel_path(cuda=self.cuda, attention=self.attention, gdn=self.gdn, fuse=self.fuse,
                                                hybrid=hybrid, fla=importlib.util.find_spec("fla") is not None)
        # Into the job's log (Ray forwards a worker's stdout): a slow stage 2 names the path it runs.
        print(f"stage 2 worker on {self.device}: {self.kernel_path}", flush=True)

        # Hooks: layer k < N-1 → output of decoder layer k; k = N-1 → output of the final norm (transformers'
        # hidden_states[N]), or of decoder layer N-1 itself with last_layer_before_norm. The hook of the deepest
        # captured layer stops the forward.
        self._out = self._gather = None
        last = max(self.layer_ids)
        self._hooks = []
        for slot, k in enumerate(self.layer_ids):
            after_norm = k == num_layers - 1 and not last_layer_before_norm
            module = self.stack.norm if after_norm else self.stack.layers[k]
            self._hooks.append(module.register_forward_hook(self._make_hook(slot, stop=(k == last))))
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            per_buffer = batch_tokens * self.value_width  # an FP8 record (L x (H + 4) bytes) is smaller
            self.staging = [torch.empty(per_buffer, dtype=torch.uint8).pin_memory() for _ in range(2)]

    def _choose_modes(self, attention: str, gdn: str, fuse: str) -> None:
        """`attention`, `gdn` and `fuse` checked (config.py's allowed values, for direct callers too) and resolved
        for this model and device: 'auto' picks what is exact and available here; an explicit choice that is not
        is refused, naming why."""
        check_choice("hidden_states.attention", attention, ATTENTION_MODES)  # config.py's check, for direct callers
        check_choice("hidden_states.fuse", fuse, (*FUSE_MODES, "reference"))
        problem = packing_problem(self.stack)
        if attention == "auto":  # packing saves padding and takes the varlen flash kernel; only where it is exact
            attention = "packed" if self.cuda and packed_attention_available() and problem is None else "padded"
        if attention == "packed" and problem:
            raise ValueError(f"hidden_states.attention 'packed' is not exact for this model: {problem}. Use "
                             "'padded' (or 'auto', which packs only models it can keep exact).")
        self.attention = attention
        self.packed = attention == "packed"
        if gdn not in ("auto", "varlen", "per_sequence"):
            raise ValueError(f"gdn must be auto, varlen or per_sequence, got {gdn!r}")
        if gdn == "auto":
            gdn = "varlen" if self.packed and self.cuda and varlen_gdn_problem(self.stack) is None else "per_sequence"
        elif gdn == "varlen" and self.packed and varlen_gdn_problem(self.stack):
            raise ValueError(f"gdn 'varlen' is not available: {varlen_gdn_problem(self.stack)}")
        self.gdn = gdn
        problem = fusion_problem(self.stack)
        if fuse == "auto":
            fuse = FUSE_AUTO if self.cuda and problem is None and importlib.util.find_spec("fla") else "off"
        elif fuse != "off" and problem:
            raise ValueError(f"fuse {fuse!r} is not available for this model: {problem}")
        self.fuse = fuse

    @property
    def width(self) -> int:
        """Bytes per token of what `run` yields: the features in the compute dtype, or FP8 records."""
        L, H = len(self.layer_ids), self.hidden_size
        return fp8.record_width(L, H) if self.fp8_records else self.value_width

    def _make_hook(self, slot: int, stop: bool):
        def hook(module, args, output):
            if self._out is None:  # a forward not started by this extractor (e.g. a reference run)
                return
            hidden = output[0] if isinstance(output, tuple) else output
            flat = hidden.reshape(-1, hidden.shape[-1])
            self._out[:, slot].copy_(flat if self._gather is None else flat.index_select(0, self._gather))
            if stop:
                raise _StopForward
        return hook

    def per_sequence(self, mixer, forward):
        """A packed batch's recurrent mixer runs once per sequence, each alone as in an unbatched forward (no cache,
        no mask, no packing arguments), so its conv and recurrent state start from zero at every sequence. The
        boundaries come from the host (`_segments`): reading them off a device tensor would stall the GPU at
        every such layer. Token-wise work around it (projections, MLPs, norms) stays packed. With `gdn` 'varlen'
        the layer runs once over the whole batch, its kernels told the bounds (`varlen_gated_deltanet`)."""
        torch = self.torch

        def per_sequence(hidden_states, *args, **kwargs):
            if self._segments is None:  # a forward this extractor did not start (e.g. a reference forward)
                return forward(hidden_states, *args, **kwargs)
            if self.gdn == "varlen":
                return varlen_gated_deltanet(mixer, hidden_states, *self._cu_seqlens, kernels=self._kernels)
            return torch.cat([forward(hidden_states[:, a:b]) for a, b in self._segments], dim=1)

        return per_sequence

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        for module in self._wrapped:
            del module.forward  # the class's forward again
        self._wrapped = []

    # -- one batch ------------------------------------------------------------------------------------------------

    def _launch(self, samples: list[Sample], slot: int) -> dict:
        """Queue batch forward + feature reductions + device→host copy; return without waiting for the GPU."""
        torch = self.torch
        counts = np.array([s.num_tokens for s in samples])
        rows, longest, total = len(samples), int(counts.max()), int(counts.sum())
        token_row = np.repeat(np.arange(rows), counts)

        def dev(a):
            t = torch.from_numpy(a)
            return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t

        config = self.stack.config
        if self.packed:  # one row of concatenated sequences; positions restart at each sequence
            cu = dev(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
            kwargs = dict(input_ids=dev(np.concatenate([s.input_ids for s in samples]).astype(np.int64)[None]),
                          position_ids=dev(np.concatenate([np.arange(n) for n in counts])[None]),
                          cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
            gather, padded_tokens = None, total
            bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
            self._segments = list(zip(bounds[:-1], bounds[1:]))
            if self.gdn == "varlen":
                cpu = torch.tensor(bounds, dtype=torch.int64)
                self._cu_seqlens = (cpu.pin_memory().to(self.device, non_blocking=True), cpu)
        else:
            ids = np.zeros((rows, longest), dtype=np.int64)
            mask = np.zeros((rows, longest), dtype=np.int64)
            for r, s in enumerate(samples):
                ids[r, :s.num_tokens] = s.input_ids
                mask[r, :s.num_tokens] = 1
            # No mask when no row is padded: SDPA then takes its causal fast path.
            kwargs = dict(input_ids=dev(ids), attention_mask=dev(mask) if total < rows * longest else None)
            gather = dev(np.concatenate([r * longest + np.arange(n) for r, n in enumerate(counts)]))
            padded_tokens = rows * longest

        L, H = len(self.layer_ids), self.hidden_size
        self._out = torch.empty((total, L, H), dtype=torch_dtype(self.dtype), device=self.device)
        self._gather = gather
        out = self._out
        implementation = config._attn_implementation
        try:
            with torch.inference_mode():
                try:
                    if self.packed:
                        config._attn_implementation = PACKED_ATTENTION
                    self.stack(use_cache=False, **kwargs)
                except _StopForward:
                    pass
                finally:
                    config._attn_implementation = implementation
                norms = torch.linalg.vector_norm(out, dim=-1, dtype=torch.float32)  # [tokens, L]
                reduced = torch.zeros((2, rows, L), dtype=torch.float32, device=self.device)
                tr = dev(token_row)
                reduced[0].index_add_(0, tr, norms.square())
                reduced[1].index_add_(0, tr, (~torch.isfinite(norms)).float())
        finally:
            self._out = self._gather = self._segments = self._cu_seqlens = None

        self.stats.num_tokens += total
        self.stats.num_padded_tokens += padded_tokens
        self.stats.num_batches += 1
        pending = {"samples": samples, "counts": counts, "total": total}
        if self.fp8_records:  # quantized where the features are (the GPU): what is copied is what is stored
            with torch.inference_mode():
                out = fp8.records(out)
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(done)
                host = self.staging[slot][:total * self.width]
                host.copy_(out.reshape(-1).view(torch.uint8), non_blocking=True)
                reduced_host = reduced.to("cpu", non_blocking=True)
                out.record_stream(self.copy_stream)
                reduced.record_stream(self.copy_stream)
                copied = torch.cuda.Event()
                copied.record(self.copy_stream)
            pending.update(host=host, reduced=reduced_host, event=copied)
        else:
            pending.update(host=out.reshape(-1).view(torch.uint8), reduced=reduced, event=None)
        return pending

    def _finish(self, pending: dict) -> tuple[list[Sample], np.ndarray]:
        """Wait for one batch's copy, check it, return its samples and host features (uint8, back to back)."""
        if pending["event"] is not None:
            waited = time.perf_counter()
            pending["event"].synchronize()
            self.stats.wait_gpu_s += time.perf_counter() - waited
        reduced = pending["reduced"].numpy()
        samples = pending["samples"]
        if self.check:
            rms = check_features(samples, reduced[0], reduced[1], layer_ids=self.layer_ids,
                                 hidden_size=self.hidden_size, min_rms=self.min_rms, max_rms=self.max_rms)
            self.feature_stats.update(reduced[0], rms, pending["counts"])
        return samples, pending["host"].numpy()

    # -- a list of parts ------------------------------------------------------------------------------------------

    def run(self, parts: list[tuple[int, list[Sample]]], *, pooled: bool = True) -> Iterator[PartFeatures]:
        """Extract the given (index, samples) parts; yield each as soon as its last row is done.

        Parts must be in plan order (longest first): batches are cut over their concatenation, so short parts
        share batches instead of running tiny ones. `pooled=False` gives every part its own memory (streaming
        hands it to Ray; the pool would reuse it too early).
        """
        order = [(p, s) for p, (_, samples) in enumerate(parts) for s in samples]
        if not order:
            return
        part_tokens = [sum(s.num_tokens for s in samples) for _, samples in parts]
        part_rows_left = [len(samples) for _, samples in parts]
        buffers: dict[int, np.ndarray] = {}
        filled = [0] * len(parts)  # bytes written into each part's buffer (rows arrive in part order)
        batches = plan_batches([s.num_tokens for _, s in order], self.batch_tokens, packed=self.packed)
        started = time.perf_counter()
        in_flight: deque = deque()

        def absorb(pending_batch, first: int):
            samples, host = self._finish(pending_batch)
            copy_started, pos = time.perf_counter(), 0
            for i, s in enumerate(samples):
                p = order[first + i][0]
                if p not in buffers:
                    nbytes = part_tokens[p] * self.width
                    buffers[p] = self.pool.get(nbytes) if pooled else np.empty(nbytes, dtype=np.uint8)
                n = s.num_tokens * self.width
                buffers[p][filled[p]:filled[p] + n] = host[pos:pos + n]
                filled[p] += n
                pos += n
                part_rows_left[p] -= 1
                if part_rows_left[p] == 0:
                    self.stats.host_copy_s += time.perf_counter() - copy_started
                    buf = buffers.pop(p)
                    self.stats.feature_bytes += buf.nbytes
                    yield PartFeatures(index=parts[p][0], samples=parts[p][1], features=buf,
                                       release=(lambda b=buf: self.pool.put(b)) if pooled else (lambda: None))
                    copy_started = time.perf_counter()
            self.stats.host_copy_s += time.perf_counter() - copy_started

        for b, (start, stop) in enumerate(batches):
            in_flight.append((self._launch([s for _, s in order[start:stop]], slot=b % 2), start))
            if len(in_flight) == 2:  # batch b is queued on the GPU: now finish batch b-1 on the host
                yield from absorb(*in_flight.popleft())
        while in_flight:
            yield from absorb(*in_flight.popleft())
        self.stats.seconds += time.perf_counter() - started
