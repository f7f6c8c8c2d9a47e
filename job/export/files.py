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

from job import scan, schema, shard_reads, storage, target
from job.config import ConfigError
from job.export.manifest import draft_config as checked_draft_config
from job.export.manifest import manifest_fields
from job.export.norm import with_final_norm
from job.export.trainer_format import (
    FILE_GROUP_SIZE,
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


def _write_speculators_dataset(output: str, files: list[str], fingerprint: str, fence) -> None:
    """The rest of a `Dataset.save_to_disk` directory: state.json (with the torch format speculators sets before
    saving) and dataset_info.json. The Arrow files were written already."""
    state = {"_data_files": [{"filename": name} for name in files], "_fingerprint": fingerprint,
             "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False,
             "_split": None}
    info = {"citation": "", "description": "", "features": _hf_features(SPECULATORS_COLUMNS), "homepage": "",
            "license": ""}
    fence.write_bytes(storage.join(output, "dataset_info.json"), json.dumps(info, indent=2).encode())
    fence.write_bytes(storage.join(output, "state.json"), json.dumps(state, indent=2).encode())


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


def plan_export(run: str, to: str, format: str, layers, draft_vocab_size, target_vocab_size, loss_turns,
                draft_config, model, storage_config, shard_uris: list[str]):
    """(the plan, the manifest's fields, (draft, target) vocabulary sizes) for the run's done parts `shard_uris`,
    every refusal made before anything is written. The final norm is not loaded here: the writers load it where they
    run (`GroupWriter`)."""
    layer_ids, num_layers, before_norm, stored_model, stored_dtype = run_layout(shard_uris, storage_config)
    dtype = record_dtype(stored_dtype)  # FP8 shards are read back, and exported, as bfloat16 (no trainer reads FP8)
    model = model or stored_model
    if not os.path.isdir(model):
        raise ExportError(f"export: the run's target model {model!r} is not a directory on this machine; the export "
                          "reads its config (the draft config), its tokenizer (the loss on every assistant turn) and "
                          "its final norm weight: pass --model DIR (the same model, where it is here)")
    plan = make_plan(to, format, layer_ids, num_layers, before_norm, layers, model=model, dtype=dtype,
                     loss_turns=loss_turns)
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

    return plan, fields, (draft_vocab_size, target_vocab_size)



def _fingerprint(ids: list[str]) -> str:
    return hashlib.blake2b("\n".join(ids).encode(), digest_size=8).hexdigest()


def _vocab_size(model: str) -> int:
    try:
        return target.shape(model).vocab_size
    except ConfigError as e:
        raise ExportError(f"export: cannot read the vocabulary size ({e}); pass --target-vocab-size") from None


# ---------------------------------------------------------------------------------------------------------------
# The stage's parts (job/export/stage.py): count on the workers, index on the driver, write on the workers, finish
# ---------------------------------------------------------------------------------------------------------------


def in_sample(sample_id: str, fraction: float | None) -> bool:
    """Whether `--sample fraction` picks this id: a hash of the id against the fraction (the same ids every time, and
    a larger fraction picks a superset)."""
    if fraction is None:
        return True
    h = int.from_bytes(hashlib.blake2b(str(sample_id).encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


def count_group(parts: list[str], plan, storage_config, fraction: float | None) -> dict:
    """One group's samples from the parts' small columns (token ids and loss masks, never the features): the ids
    the trainer keeps (in the run's order), those it drops and why. A Ray task (on a worker)."""
    import torch  # heavy: imported on use

    kept, dropped = [], []
    for uri in parts:
        table = shard_reads.read_shard_columns(uri, [schema.ID, schema.INPUT_IDS, schema.LOSS_MASK], storage_config)
        for sid, ids, mask in zip(table.column(schema.ID).to_pylist(), table.column(schema.INPUT_IDS).to_pylist(),
                                  table.column(schema.LOSS_MASK).to_pylist()):
            if not in_sample(sid, fraction):
                continue
            reason = drop_reason(plan.loss_mask(torch.tensor(ids), torch.tensor(mask)), plan)
            if reason:
                dropped.append({"id": sid, "reason": reason})
            else:
                kept.append(str(sid))
    return {"kept": kept, "dropped": dropped}


def count_groups(groups: list, plan, config, fraction: float | None) -> list[dict]:
    """`count_group` of every group as Ray tasks (the cluster's CPUs), in group order."""
    import ray  # heavy: imported on use

    from job.pipeline import runtime_env

    task = ray.remote(num_cpus=1, max_retries=3)(count_group).options(runtime_env=runtime_env(config))
    return ray.get([task.remote([u for u, _ in g.parts], plan, config.storage, fraction) for g in groups])


def assign_indices(groups: list, counts: list[dict], limit: int | None) -> None:
    """Each group's kept ids (cut so that the export holds the first `limit` in the run's order) and the trainer
    index of its first: what the file names say, whichever worker writes first."""
    offset = 0
    for g, count in zip(groups, counts):
        ids = count["kept"] if limit is None else count["kept"][:max(0, limit - offset)]
        g.ids, g.offset = ids, offset
        offset += len(ids)


def trainer_file_names(plan, group) -> list[str]:
    """The trainer's files one group holds: a file per sample (by its trainer index) and, for speculators, the
    group's dataset file."""
    if plan.to == "specforge":
        return [specforge_file_name(group.offset + j) for j in range(len(group.ids))]
    return [f"hidden_states/hs_{group.offset + j}.safetensors" for j in range(len(group.ids))] + \
        [speculators_data_file(group)]


def speculators_data_file(group) -> str:
    """The group's dataset file (one per group; `state.json` lists them in order)."""
    return f"data-{group.index:05d}-of-{group.num_groups:05d}.arrow"


def write_group(config: dict, plan, output: str, fence, identity: dict, row: dict) -> dict:
    """One group's trainer files: each kept sample's file (by its trainer index) and, for speculators, the group's
    dataset file, every write through the fence; returns the group's marker (its parts, indices and settings, and the
    vocabulary counts of what it wrote) for the runner to commit after them. A Ray task on a worker: the features
    are read there, and the target's final norm loaded there where the trainer wants it."""
    import time

    from job import pipeline
    from job.config import from_dict
    from job.export.stage import ExportGroup

    pipeline.apply_secrets(config)
    started, storage_config = time.monotonic(), from_dict(config).storage
    plan = with_final_norm(plan)
    group = ExportGroup(int(row["index"]), [tuple(p) for p in json.loads(row["parts"])], json.loads(row["ids"]),
                        int(row["offset"]), num_groups=int(row["num_groups"]))
    position = {sid: j for j, sid in enumerate(group.ids)}
    counter: Counter = Counter()
    rows, written, tokens, loss_tokens = [None] * len(group.ids), 0, 0, 0
    writer = BackgroundWriter(max_pending=8)
    try:
        for rec in records([u for u, _ in group.parts], storage_config):
            j = position.get(str(rec[schema.ID]))
            if j is None:
                continue
            mask = plan.loss_mask(rec[schema.INPUT_IDS], rec[schema.LOSS_MASK])
            sample = trainer_sample(rec[schema.INPUT_IDS], mask, rec[schema.HIDDEN_STATES], plan)
            count_tokens(counter, rec[schema.INPUT_IDS], mask)
            tokens += len(rec[schema.INPUT_IDS])
            loss_tokens += int(mask.sum())
            if plan.to == "specforge":
                name, data = specforge_file_name(group.offset + j), _torch_bytes(sample)
            else:
                from safetensors.torch import save  # heavy: imported on use

                name, data = f"hidden_states/hs_{group.offset + j}.safetensors", save(sample)
                rows[j] = (rec[schema.INPUT_IDS].numpy(), mask.numpy().astype(np.int64), len(rec[schema.INPUT_IDS]))
            written += len(data)
            writer.submit(fence.write_bytes, storage.join(output, name), data)
        if plan.to == "speculators":
            data = _arrow_stream_bytes(_speculators_table(rows))
            written += len(data)
            writer.submit(fence.write_bytes, storage.join(output, speculators_data_file(group)), data)
    finally:
        writer.close()
    marker = {"expected": group.marker(identity), "token_counts": {str(k): v for k, v in counter.items()},
              "num_tokens": tokens, "num_loss_tokens": loss_tokens}
    return {"group": group.index, "num_rows": len(group.ids), "num_tokens": tokens, "bytes_written": written,
            "seconds": time.monotonic() - started, "marker": json.dumps(marker)}


def finish(config, request: dict, plan, fields: dict, vocab: tuple, groups: list, counts: list[dict], fence) -> dict:
    """After every group is done: the trainer's files an earlier export into this output left deleted, the small
    files written from the groups' markers, `export.json` last (what a reader takes as "the export is whole")."""
    from job.export.stage import marker_uri

    output, storage_config = request["output"], config.storage
    markers = [storage.read_json(marker_uri(output, g.index), storage_config) if g.ids else None for g in groups]
    expected = {name for g in groups if g.ids for name in trainer_file_names(plan, g)}
    for name, _, _ in storage.list_file_infos(output, (".ckpt", ".ckpt.gz", ".safetensors", ".arrow"), storage_config):
        if name not in expected and TRAINER_FILE.fullmatch(name):
            fence.delete(storage.join(output, name))
    counter: Counter = Counter()
    for m in markers:
        if m is not None:
            counter.update({int(k): v for k, v in m["token_counts"].items()})
    if plan.to == "specforge" and plan.format == "eagle3":
        d2t, t2d = specforge_vocab_mapping(counter, *vocab)
        fence.write_bytes(storage.join(output, "vocab_mapping", "vocab_mapping.pt"), _torch_bytes({"d2t": d2t,
                                                                                                   "t2d": t2d}))
    kept = [sid for g in groups for sid in g.ids]
    if plan.to == "speculators":
        fence.write_bytes(storage.join(output, "token_freq.pt"), _torch_bytes(dict(counter)))
        _write_speculators_dataset(output, [speculators_data_file(g) for g in groups if g.ids],
                                   _fingerprint(kept), fence)
    dropped = [d for c in counts for d in c["dropped"]]
    fields = {**fields, "num_tokens": sum(m["num_tokens"] for m in markers if m),
              "num_loss_tokens": sum(m["num_loss_tokens"] for m in markers if m),
              "limit": request["limit"], "sample": request["sample"]}
    return finish_export(config.output, output, plan.to, plan.format, kept, dropped, fence, fields)
