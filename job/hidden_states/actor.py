"""Stage 2's Ray Data actor: one per GPU, one unit (completion shard) per call; writes the unit's parts and its
marker, or streams its records."""


from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict

import numpy as np
import pyarrow as pa

from job import layout, pipeline, schema, shard_reads, storage
from job.cluster import model_missing_here, report_arrival, report_ready
from job.config import ConfigError, from_dict
from job.hidden_states import fp8
from job.hidden_states.checks import (
    FeatureStats,
    HiddenStateCheckError,
    compare,
    pick_samples,
    reference_features,
    split_features,
    tolerance_for,
    verdict,
)
from job.hidden_states.samples import RunStats, plan_parts, samples_from_completions
from job.hidden_states.shards import BackgroundWriter, part_table
from job.hidden_states.transformers_backend import TransformersExtractor, load_model
from job.hidden_states.vllm_backend import VllmExtractor
from job.layout import HiddenStateUnit

# ---------------------------------------------------------------------------------------------------------------
# The Ray Data stage: one actor per GPU, one unit per call
# ---------------------------------------------------------------------------------------------------------------


class HiddenStateExtractor:
    """`map_batches` callable. mode='write': writes the unit's missing parts and its marker, yields one summary
    row per unit. mode='stream': yields the records themselves (numpy; features as raw bits, uint16 for bf16)."""

    def __init__(self, config: dict, layer_ids: list[int], mode: str = "write", check_source: dict | None = None,
                 fence=None, skip_ids: frozenset[str] = frozenset(), census=None):
        """`check_source`: the completion shard (`uri`, `row_limit`) whose samples the exactness self-check uses;
        None skips the check. `fence`: the driver's writer lock (job/lock.py), through which every write and delete
        of this actor commits (mode 'write' needs one; a stream writes nothing). `skip_ids` (stream mode): samples
        left out before extraction (those an online trainer's checkpoint already covers: job/train/).
        `census`: the stage's census book (job/cluster.py), told once the worker has started."""
        if skip_ids and mode != "stream":
            raise ValueError("skip_ids: stream mode only (written parts must hold every kept row)")
        self.skip_ids = frozenset(skip_ids)
        # First: the secrets among env_vars (never in Ray's runtime_env), in this process only; output redacted.
        pipeline.apply_secrets(config)
        report_arrival(census)  # the stage can count and stop this actor from now on
        import torch  # heavy: imported on use

        self.config = from_dict(config)
        missing = model_missing_here(self.config.model)
        if missing:
            raise ConfigError(missing)
        if mode == "write" and fence is None:
            raise ValueError("mode 'write' needs the stage's fence: every part is committed through it")
        self.mode, self.fence = mode, fence
        hs = self.config.hidden_states
        check = self._check_samples(check_source) if check_source and hs.check_samples else []
        reference = None
        if hs.backend == "vllm":
            reason = vllm_unavailable_reason()
            if reason:
                raise ConfigError(reason)

            if check:  # the reference forward runs first and is freed: vLLM then takes its share of the GPU
                model = load_model(self.config.model, dtype=hs.compute_dtype)
                reference = reference_features(model, check, layer_ids, hs.last_layer_before_norm)
                del model
                torch.cuda.empty_cache()
            self.extractor = VllmExtractor(self.config.model, layer_ids=layer_ids, dtype=hs.compute_dtype,
                                           max_length=hs.max_length, engine_kwargs=hs.engine_kwargs,
                                           min_rms=hs.min_rms, max_rms=hs.max_rms,
                                           last_layer_before_norm=hs.last_layer_before_norm)
        else:
            if not torch.cuda.is_available():
                torch.set_num_threads(max(1, os.cpu_count() or 1))  # Ray gives a CPU actor 1 thread by default
            model = load_model(self.config.model, dtype=hs.compute_dtype)
            try:
                self.extractor = TransformersExtractor(model, layer_ids=layer_ids, batch_tokens=hs.batch_tokens,
                                                       min_rms=hs.min_rms, max_rms=hs.max_rms,
                                                       attention=hs.attention, fuse=hs.fuse,
                                                       last_layer_before_norm=hs.last_layer_before_norm)
            except ValueError as e:  # attention: packed on a model packing cannot keep exact
                raise ConfigError(f"config: {e}") from None
            if check:
                reference = reference_features(model, check, self.extractor.layer_ids, hs.last_layer_before_norm)
        self.schema = schema.hidden_states_schema(model=self.config.model, layer_ids=self.extractor.layer_ids,
                                           hidden_size=self.extractor.hidden_size, dtype=hs.dtype,
                                           num_model_layers=self.extractor.num_model_layers,
                                           last_layer_before_norm=hs.last_layer_before_norm)
        self.self_check = self._self_check(check, reference) if check else {}
        self.warnings = list(getattr(self.extractor, "warnings", []))
        report_ready(census)

    def _check_samples(self, source: dict) -> list:
        hs = self.config.hidden_states
        table = storage.read_shard(source["uri"], self.config.storage)
        samples, _ = samples_from_completions(table, max_length=hs.max_length, keep_flagged=hs.keep_flagged,
                                              row_limit=source.get("row_limit"))
        return pick_samples(samples, hs.check_samples, hs.batch_tokens)

    def _self_check(self, samples: list, reference: list) -> dict:
        """The check samples through this worker's batched path together, against `reference` (each alone through
        a plain transformers forward). Raises HiddenStateCheckError beyond the tolerance; else a summary."""

        ex, hs = self.extractor, self.config.hidden_states
        (part,) = list(ex.run([(0, samples)], pooled=False))
        batched = split_features(part.samples, part.features, len(ex.layer_ids), ex.hidden_size, hs.compute_dtype)
        where = f"{hs.backend} backend" + (f", {ex.attention} batches" if hasattr(ex, "attention") else "")
        summary = verdict(compare(part.samples, batched, reference, ex.layer_ids),
                          tolerance_for(hs.compute_dtype, hs.check_tolerance), where)
        ex.stats, ex.feature_stats = RunStats(), FeatureStats(ex.layer_ids, ex.hidden_size)  # not the run's work
        if fp8.is_fp8(hs.dtype):  # what is stored: the same features through FP8 and back, layer by layer
            errors = [fp8.relative_l2(x, fp8.dequantize(*fp8.quantize(x))) for x in batched]
            worst = np.max(errors, axis=0)
            if worst.max() > fp8.ROUND_TRIP_TOLERANCE:
                raise HiddenStateCheckError(
                    f"FP8 storage self-check failed: layer {ex.layer_ids[int(worst.argmax())]} loses "
                    f"{worst.max():.2%} (relative L2) through float8_e4m3fn and back, above "
                    f"{fp8.ROUND_TRIP_TOLERANCE:.0%}: its features do not suit FP8 storage; use bfloat16. Nothing "
                    "was written.")
            summary["fp8_round_trip_by_layer"] = {str(k): float(e) for k, e in zip(ex.layer_ids, worst)}
        return {**summary, "where": where}

    def __call__(self, batch: dict):
        for i in range(len(batch["uri"])):
            unit = HiddenStateUnit.from_row({k: batch[k][i] for k in batch})
            yield from (self._write(unit) if self.mode == "write" else self._stream(unit))

    def _samples(self, unit: HiddenStateUnit):
        """(parts, skipped counts, source): `source` is what the unit's marker records of the completion shard it
        read — size, content id, sha256, rows and ids — so a regenerated shard is known not to be covered."""
        hs, cfg = self.config.hidden_states, self.config
        data = storage.read_bytes(unit.uri, cfg.storage)
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        meta = table.schema.metadata or {}
        ids = "\n".join(map(str, table.column(schema.ID).to_pylist())).encode()
        source = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "num_rows": table.num_rows,
                  "ids_sha256": hashlib.sha256(ids).hexdigest()[:16],
                  "shard_id": meta[schema.META_SHARD_ID].decode() if schema.META_SHARD_ID in meta else None}
        samples, skipped = samples_from_completions(table, max_length=hs.max_length, keep_flagged=hs.keep_flagged,
                                                    row_limit=unit.row_limit)
        if self.skip_ids:
            samples = [s for s in samples if s.id not in self.skip_ids]
        return plan_parts(samples, hs.rows_per_shard), skipped, source

    def _made_from(self, uri: str) -> str | None:
        """The completion shard content id a part already there was made from (None: a part from before ids)."""
        meta = shard_reads.read_shard_schema(uri, self.config.storage).metadata or {}
        return meta[schema.META_SOURCE_SHARD_ID].decode() if schema.META_SOURCE_SHARD_ID in meta else None

    def _write(self, unit: HiddenStateUnit):
        cfg, out = self.config, storage.join(self.config.output, layout.HIDDEN_STATES_DIR)
        started = time.monotonic()
        parts, skipped, source = self._samples(unit)
        read_s = time.monotonic() - started
        names = [unit.part_name(j) for j in range(len(parts))]
        # Files of this shard from a run with another --limit: markers first, so a crash here leaves the unit
        # not-done (it is redone), never done-but-incomplete.
        stale = sorted(set(unit.existing) - set(names), key=lambda n: not n.startswith(layout.DONE_DIR))
        for name in stale:
            self.fence.delete(storage.join(out, name))
        # A part already there (an interrupted run) is kept only if it was made from this content of the shard.
        kept = {n for n in set(unit.existing) & set(names)
                if (self._made_from(storage.join(out, n)) or None) == source["shard_id"]}
        todo = [(j, p) for j, p in enumerate(parts) if names[j] not in kept]
        part_schema = self.schema.with_metadata({**self.schema.metadata,
                                                 schema.META_SOURCE_SHARD_ID: source["shard_id"] or ""})
        stats_before = asdict(self.extractor.stats)
        self.extractor.feature_stats = FeatureStats(self.extractor.layer_ids, self.extractor.hidden_size)  # per unit
        writer, written = BackgroundWriter(max_pending=2), []

        stored_fp8 = fp8.is_fp8(cfg.hidden_states.dtype)
        L, H = len(self.extractor.layer_ids), self.extractor.hidden_size
        self.extractor.fp8_records = stored_fp8  # quantized on the device, before the copy (after the self-check)

        def write(part):
            if stored_fp8:  # computed in bf16, stored as FP8 + a scale per token and layer
                tokens = sum(s.num_tokens for s in part.samples)
                features, scales = fp8.split_records(part.features, tokens, L, H)
                table = part_table(part.samples, features, part_schema, scales)
            else:
                table = part_table(part.samples, part.features, part_schema)
            uri = storage.join(out, names[part.index])
            size = self.fence.write_ipc(uri, table)  # streamed from the pooled buffer: it goes back once written
            part.release()
            return uri, size

        try:
            for part in self.extractor.run(todo):
                writer.submit(write, part)
        finally:
            written = writer.close()
        stats = {k: v - stats_before[k] for k, v in asdict(self.extractor.stats).items()}
        samples = [s for p in parts for s in p]
        summary = {
            "unit": unit.tag, "num_rows": unit.num_rows, "num_samples": len(samples),
            "num_errors": skipped["error"], "num_skipped_flagged": skipped["flagged"],
            "num_skipped_empty": skipped["empty"], "num_clipped": sum(s.clipped for s in samples),
            "num_tokens": sum(s.num_tokens for s in samples), "num_tokens_extracted": stats["num_tokens"],
            "num_padded_tokens": stats["num_padded_tokens"], "num_batches": stats["num_batches"],
            "num_parts": len(parts), "num_parts_written": len(written),
            "bytes_written": sum(b for _, b in written), "extract_seconds": stats["seconds"],
            # Where a unit's time went, for a slow stage 2 to name its cause: reading the completion shard, the
            # host waiting on the GPU (high = GPU-bound, as it should be), sorting features into part buffers, and
            # the extraction waiting on writes (high = storage-bound). The rest of extract_seconds is the host's
            # own work: launching the forward.
            "read_s": read_s, "wait_gpu_s": stats["wait_gpu_s"], "host_copy_s": stats["host_copy_s"],
            "writer_blocked_s": writer.blocked_s,
            "seconds": time.monotonic() - started,
            "feature_stats": self.extractor.feature_stats.to_dict(),
            # This worker's exactness self-check and slow-path warnings, reported with its first unit only.
            "self_check": self.self_check,
            "warnings": {"lines": self.warnings},
            "source": source,  # what this marker covers: scan.marker_matches compares it with the shard now
        }
        self.self_check, self.warnings = {}, []
        # The unit is marked done by the runner (stage 2's ledger, run.py `_Markers`) writing this marker, after every
        # part above is committed.
        row = {k: [json.dumps(v) if isinstance(v, dict) else v] for k, v in summary.items()}
        yield {**row, "marker_name": [unit.marker_name], "marker": [json.dumps(summary)]}

    def _stream(self, unit: HiddenStateUnit):
        parts, _, _ = self._samples(unit)
        view = STREAM_DTYPES[self.config.hidden_states.compute_dtype]  # streams are never FP8
        L, H = len(self.extractor.layer_ids), self.extractor.hidden_size
        for part in self.extractor.run(list(enumerate(parts)), pooled=False):
            feats = part.features.view(view)
            hidden, input_ids, loss_mask, pos = [], [], [], 0
            for s in part.samples:
                n = s.num_tokens * L * H
                hidden.append(feats[pos:pos + n].reshape(s.num_tokens, L, H))
                input_ids.append(s.input_ids)
                loss_mask.append(s.loss_mask())
                pos += n
            yield {
                schema.ID: np.array([s.id for s in part.samples], dtype=object),
                schema.INPUT_IDS: ragged(input_ids),
                schema.LOSS_MASK: ragged(loss_mask),
                schema.NUM_TOKENS: np.array([s.num_tokens for s in part.samples], dtype=np.int32),
                schema.ORIGINAL_NUM_TOKENS: np.array([s.original_num_tokens for s in part.samples], dtype=np.int32),
                schema.CLIPPED: np.array([s.clipped for s in part.samples]),
                schema.HIDDEN_STATES: ragged(hidden),
            }


# numpy has no bfloat16: the stream carries its bits as uint16 (float16 and float32 travel as themselves).
STREAM_DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}


# Per-sample columns of the streams: ours (`dataset`) and the trainers' layouts (job/export/stream.py). No token column
# is uint16, so a uint16 array in one of them is bfloat16 features.
PER_SAMPLE_COLUMNS = (schema.INPUT_IDS, schema.LOSS_MASK, schema.HIDDEN_STATES, "token_ids", "hidden_state",
                      "aux_hidden_state")


def collate(batch: dict) -> dict:
    """`collate_fn` for `iter_torch_batches` over `dataset(config)` or `job.export.stream(...)`, any batch size:
    samples differ in length, so each per-sample column becomes a list with one tensor per sample (features as
    torch.bfloat16 again), `id` a list of str, the scalar columns tensors."""
    import torch  # heavy: imported on use

    out = {}
    for name, column in batch.items():
        if name == schema.ID:
            out[name] = [str(x) for x in column]
        elif name in PER_SAMPLE_COLUMNS:
            tensors = [torch.from_numpy(np.ascontiguousarray(x)) for x in column]
            out[name] = [t.view(torch.bfloat16) if t.dtype == torch.uint16 else t for t in tensors]
        else:
            out[name] = torch.from_numpy(np.asarray(column))
    return out


def ragged(arrays: list[np.ndarray]) -> np.ndarray:
    """An object array of per-row ndarrays: Ray Data stores it as a variable-shaped tensor column."""
    out = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


def vllm_unavailable_reason() -> str | None:
    """Why the vllm backend cannot run here, or None. On the CPU build of vLLM the `extract_hidden_states`
    speculative method starts, but its hidden-state KV connector (ExampleHiddenStatesConnector) copies features
    to the host with `torch.empty_like(..., pin_memory=True)`, which fails without CUDA ("pin_memory=True
    requires a CUDA ... backend")."""
    import torch  # heavy: imported on use

    if not torch.cuda.is_available():
        return ("hidden_states.backend 'vllm' needs a CUDA GPU: vLLM's hidden-state connector pins host memory "
                "(pin_memory=True), which the CPU build cannot do. Use backend: transformers on CPU.")
    return None


