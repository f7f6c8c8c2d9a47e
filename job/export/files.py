"""Export to files: read a run's hidden-state shards, write SpecForge's or speculators' files beside `export.json`,
`samples.jsonl` and `dropped.jsonl`."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from job import layout, scan, schema, shard_reads, storage, target
from job.config import ConfigError
from job.export.conversations import export_conversations
from job.export.manifest import draft_config as checked_draft_config
from job.export.manifest import manifest_fields
from job.export.norm import with_final_norm
from job.export.trainer_format import (
    FILE_GROUP_SIZE,
    SHARDS_PER_ARROW_FILE,
    SPECFORGE_DEFAULT_DRAFT_VOCAB,
    TRAINER_FILE,
    ExportError,
    count_tokens,
    drop_reason,
    finish_export,
    make_plan,
    specforge_vocab_mapping,
    trainer_sample,
)
from job.hidden_states.shards import BackgroundWriter, iter_records, record_dtype

# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


def specforge_file_name(index: int, group: int = FILE_GROUP_SIZE) -> str:
    start = index // group * group
    return f"rows_{start}-{start + group}/data_{index}.ckpt"


def _torch_bytes(obj) -> bytes:
    import torch  # heavy: imported on use

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _hf_features(columns: dict[str, str]) -> dict:
    """`datasets` Features JSON for list<int> (dtype given) and int64 scalar columns."""
    out = {}
    for name, dtype in columns.items():
        value = {"dtype": dtype.removeprefix("list:"), "_type": "Value"}
        out[name] = {"feature": value, "_type": "List"} if dtype.startswith("list:") else value
    return out


# What `datasets` 5.x writes for speculators' columns: it stores `input_ids` as int32 (its OptimizedTypedSequence:
# "typical vocab size"), the other two as the int64 speculators gives it.
SPECULATORS_COLUMNS = {"input_ids": "list:int32", "loss_mask": "list:int64", "seq_len": "int64"}


def _speculators_table(rows: list[tuple]) -> pa.Table:
    features = _hf_features(SPECULATORS_COLUMNS)
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    pa_schema = pa.schema([pa.field("input_ids", pa.list_(pa.int32())), pa.field("loss_mask", pa.list_(pa.int64())),
                           pa.field("seq_len", pa.int64())], metadata=meta)
    return pa.Table.from_arrays([pa.array([r[0] for r in rows], pa.list_(pa.int32())),
                                 pa.array([r[1] for r in rows], pa.list_(pa.int64())),
                                 pa.array([r[2] for r in rows], pa.int64())], schema=pa_schema)


def _arrow_stream_bytes(table: pa.Table) -> bytes:
    """`datasets` stores its Arrow files in the IPC *stream* format (ArrowWriter), uncompressed."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _write_speculators_dataset(output: str, files: list[str], fingerprint: str, storage_config) -> None:
    """The rest of a `Dataset.save_to_disk` directory: state.json (with the torch format speculators sets before
    saving) and dataset_info.json. The Arrow files were written already."""
    state = {"_data_files": [{"filename": name} for name in files], "_fingerprint": fingerprint,
             "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False,
             "_split": None}
    info = {"citation": "", "description": "", "features": _hf_features(SPECULATORS_COLUMNS), "homepage": "",
            "license": ""}
    storage.write_bytes_atomic(storage.join(output, "dataset_info.json"), json.dumps(info, indent=2).encode(),
                               storage_config)
    storage.write_bytes_atomic(storage.join(output, "state.json"), json.dumps(state, indent=2).encode(),
                               storage_config)


# ---------------------------------------------------------------------------------------------------------------
# Reading our run
# ---------------------------------------------------------------------------------------------------------------


def run_layout(shard_uris: list[str], storage_config) -> tuple[list[int], int, bool, str, str]:
    """(layer ids, model layers, last layer before norm, model, dtype) from the first and last shard's metadata;
    they must agree (one run, one way of extracting)."""
    seen = None
    for uri in shard_uris[:1] + shard_uris[-1:]:
        m = scan.hidden_state_meta(shard_reads.read_shard_schema(uri, storage_config).metadata)
        layout = (m.layer_ids, m.num_model_layers, m.last_layer_norm, m.model, m.dtype)
        if seen is not None and layout != seen:
            raise ExportError(f"export: shards of one run disagree on their layers ({seen} vs {layout}): stage 2 "
                              "was redone with other settings into the same output")
        seen = layout
    layer_ids, num_layers, norm, model, dtype = seen
    # Shards written before `num_model_layers` was recorded: ask the model's config.
    num_layers = num_layers if num_layers is not None else target.shape(model).num_layers
    return layer_ids, num_layers, norm == schema.LAST_BEFORE_NORM, model, dtype


def records(shard_uris: list[str], storage_config) -> Iterator[dict]:
    for uri in shard_uris:
        yield from iter_records(storage.read_shard(uri, storage_config, memory_map=not storage.is_s3(uri)))


# ---------------------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------------------


def _plan_export(run: str, to: str, format: str, layers, draft_vocab_size, target_vocab_size, loss_turns,
                 draft_config, model, storage_config):
    """(the done hidden-state parts, the plan, the manifest's fields, (draft, target) vocabulary sizes), every
    refusal made before anything is written."""
    shard_uris = [uri for uri, _ in scan.done_hidden_state_parts(run, storage_config)]  # stage 2's "done" rule
    if not shard_uris:
        raise ExportError(f"export: no hidden-state shards under {storage.join(run, layout.HIDDEN_STATES_DIR)}: run "
                          "stage 2 first (`python -m job hidden-states ...`)")
    layer_ids, num_layers, before_norm, stored_model, stored_dtype = run_layout(shard_uris, storage_config)
    dtype = record_dtype(stored_dtype)  # FP8 shards are read back, and exported, as bfloat16 (no trainer reads FP8)
    model = model or stored_model
    if not os.path.isdir(model):
        raise ExportError(f"export: the run's target model {model!r} is not a directory on this machine; the export "
                          "reads its config (the draft config), its tokenizer (the loss on every assistant turn) and "
                          "its final norm weight: pass --model DIR (the same model, where it is here)")
    plan = with_final_norm(make_plan(to, format, layer_ids, num_layers, before_norm, layers, model=model,
                                     dtype=dtype, loss_turns=loss_turns))
    if to == "specforge" and format == "eagle3":
        target_vocab_size = target_vocab_size or _vocab_size(model)
        draft_vocab_size = draft_vocab_size or min(SPECFORGE_DEFAULT_DRAFT_VOCAB, target_vocab_size)
        if draft_vocab_size > target_vocab_size:
            raise ExportError(f"export: --draft-vocab-size {draft_vocab_size} exceeds the target's vocabulary "
                              f"({target_vocab_size})")
        plan.notes.update(draft_vocab_size=draft_vocab_size, target_vocab_size=target_vocab_size)
    fields = manifest_fields(plan, dtype)
    if stored_dtype != dtype:
        fields["stored_dtype"] = stored_dtype
    fields["draft_config"] = checked_draft_config(plan, fields, draft_config)  # before anything is written

    return shard_uris, plan, fields, (draft_vocab_size, target_vocab_size)


def export(run: str, *, to: str, format: str, output: str, layers: list[int] | None = None,
           draft_vocab_size: int | None = None, target_vocab_size: int | None = None, loss_turns: str | None = None,
           draft_config: dict | None = None, model: str | None = None,
           storage_config: storage.StorageConfig | None = None) -> dict:
    """Write a run in a trainer's format under `output` (local or s3://); returns the manifest also written to
    `output/export.json` (job/export/manifest.py: the target, layer ids in both conventions, norm, dtype, counts and
    a ready draft-model config). File names are deterministic and each is written atomically: a rerun rewrites the
    same files, never a second copy. `draft_config`: the user's own draft-model config, refused (before anything is
    written) when its layer ids disagree with the export's; default: one made for this export. `model`: the target's
    directory on this machine (default: the path the run recorded).

    One pass: the plan and its refusals before anything is written (`_plan_export`), then every shard's samples
    through both trainers' writers sharing one set of counters (the vocabulary counts, kept and dropped ids,
    tokens), then each trainer's side files from those counters."""
    inside = [a for a, b in ((output, run), (run, output)) if a.rstrip("/").startswith(b.rstrip("/") + "/")]
    if output.rstrip("/") == run.rstrip("/") or inside:
        raise ExportError(f"export: --output {output} must lie outside the run directory {run} (and not hold it)")
    if to == "specforge" and format == "conversations":
        return export_conversations(run, output=output, storage_config=storage_config)
    shard_uris, plan, fields, vocab = _plan_export(run, to, format, layers, draft_vocab_size, target_vocab_size,
                                                   loss_turns, draft_config, model, storage_config)
    draft_vocab_size, target_vocab_size = vocab

    written: set[str] = set()  # names relative to `output`; anything else of the trainer's is removed at the end
    writer = BackgroundWriter(max_pending=8)
    counter: Counter = Counter()
    kept: list[str] = []
    dropped: list[dict] = []
    arrow_files: list[str] = []
    groups = [shard_uris[i:i + SHARDS_PER_ARROW_FILE] for i in range(0, len(shard_uris), SHARDS_PER_ARROW_FILE)]
    num_tokens = num_loss_tokens = 0
    try:
        for g, group in enumerate(groups):
            rows = []
            for rec in records(group, storage_config):
                mask = plan.loss_mask(rec[schema.INPUT_IDS], rec[schema.LOSS_MASK])
                reason = drop_reason(mask, plan)
                if reason:
                    dropped.append({"id": rec[schema.ID], "reason": reason})
                    continue
                index = len(kept)
                kept.append(rec[schema.ID])
                sample = trainer_sample(rec[schema.INPUT_IDS], mask, rec[schema.HIDDEN_STATES], plan)
                count_tokens(counter, rec[schema.INPUT_IDS], mask)
                num_tokens += len(rec[schema.INPUT_IDS])
                num_loss_tokens += int(mask.sum())
                if to == "specforge":
                    name = specforge_file_name(index)
                    data = _torch_bytes(sample)
                else:
                    from safetensors.torch import save  # heavy: imported on use

                    name, data = f"hidden_states/hs_{index}.safetensors", save(sample)
                written.add(name)
                writer.submit(storage.write_bytes_atomic, storage.join(output, name), data, storage_config)
                if to == "speculators":
                    rows.append((rec[schema.INPUT_IDS].numpy(), mask.numpy().astype(np.int64),
                                 len(rec[schema.INPUT_IDS])))
            if to == "speculators":
                name = f"data-{g:05d}-of-{len(groups):05d}.arrow"
                data = _arrow_stream_bytes(_speculators_table(rows))
                writer.submit(storage.write_bytes_atomic, storage.join(output, name), data, storage_config)
                arrow_files.append(name)
                written.add(name)
    finally:
        writer.close()
    # A trainer reads every file of its kind under the directory: files an earlier export into the same output left
    # (more samples then, another format) would be read as samples of this one.
    for name, _, _ in storage.list_file_infos(output, (".ckpt", ".ckpt.gz", ".safetensors", ".arrow"), storage_config):
        if name not in written and TRAINER_FILE.fullmatch(name):
            storage.delete(storage.join(output, name), storage_config)

    if to == "specforge" and format == "eagle3":
        d2t, t2d = specforge_vocab_mapping(counter, draft_vocab_size, target_vocab_size)
        storage.write_bytes_atomic(storage.join(output, "vocab_mapping", "vocab_mapping.pt"),
                                   _torch_bytes({"d2t": d2t, "t2d": t2d}), storage_config)
    if to == "speculators":
        storage.write_bytes_atomic(storage.join(output, "token_freq.pt"), _torch_bytes(dict(counter)),
                                   storage_config)
        _write_speculators_dataset(output, arrow_files, _fingerprint(kept), storage_config)
    fields.update(num_tokens=num_tokens, num_loss_tokens=num_loss_tokens)
    return finish_export(run, output, plan.to, plan.format, kept, dropped, storage_config, fields)


def _fingerprint(ids: list[str]) -> str:
    return hashlib.blake2b("\n".join(ids).encode(), digest_size=8).hexdigest()


def _vocab_size(model: str) -> int:
    try:
        return target.shape(model).vocab_size
    except ConfigError as e:
        raise ExportError(f"export: cannot read the vocabulary size ({e}); pass --target-vocab-size") from None
