"""Hand-off to the trainers: a run's hidden states and completions in the formats SpecForge and vLLM speculators read.

    python -m job export RUN --to specforge --format dflash --output DIR [--layers 1 2]
    python -m job export RUN --to specforge --format eagle3 --output DIR [--draft-vocab-size 32000]
    python -m job export RUN --to speculators --format eagle3 --output DIR      # needs last_layer_before_norm
    python -m job export RUN --to specforge --format conversations --output DIR

    from job.export import export, stream
    export("run", to="specforge", format="eagle3", output="out")     # files, as above
    ds = stream(config, to="speculators", format="dflash")          # ray.data, never written (see `collate`)

Formats matched, read from the projects' own code (neither installs here: SpecForge 0.2.0 pins torch 2.11 and
sglang; speculators 0.9.0 needs `datasets`, which the shared venv lacks):
- SpecForge 0.2.0 (PyPI wheel; repository sgl-project/SpecForge at a6b6b023, version.txt 0.2.0). Writer:
  scripts/prepare_hidden_states.py (`HiddenStatesGenerator`: `rows_{g}-{g+2000}/data_{i}.ckpt`, one `torch.save`
  dict per sample; vocab mapping at `vocab_mapping/vocab_mapping.pt`). Keys: `OfflineCaptureLayout` of
  specforge/algorithms/{dflash,eagle3}/providers.py. Reader: runtime/data_plane/offline_reader.py
  (`list_feature_files`) + feature_store.py (`load_feature_file`) + the normalizers in
  algorithms/common/dflash_family_data.py and algorithms/eagle3/data.py. Vocab mapping:
  data/preprocessing.py (`generate_vocab_mapping_file`, `process_token_dict_to_mappings`). Conversations:
  scripts/regenerate_train_data.py (row shape) and scripts/validate_regenerated_data.py +
  conversation_validation.py (the rules applied here).
- speculators 0.9.0 (PyPI wheel) with hs-connectors 0.9.0: train/data.py (`ArrowDataset`: `load_from_disk`,
  `hs_{i}.safetensors` through hs_connectors' `FileTransfer`, token ids checked against `input_ids`, last layer
  split off as `verifier_last_hidden_states`), data_generation/preprocessing.py (columns input_ids, loss_mask,
  seq_len; `set_format("torch")` before `save_to_disk`), train/vocab_mapping.py (`token_freq.pt`).

Layer conventions (DESIGN.md): ours, k = output of decoder layer k = transformers output_hidden_states[k + 1], is
SpecForge's too (DFlash `extract_context_feature` reads hidden_states[layer_id + 1]; EAGLE-3 captures the input of
layer id + 1 in SGLang). vLLM and speculators count one higher (id = ours + 1; speculators' dflash converter
maps `i + 1`), and their last slot is the final decoder layer BEFORE the final norm: a run meant for speculators
sets `hidden_states.last_layer_before_norm: true`. SpecForge's EAGLE-3 `hidden_state` is the last layer AFTER the
norm (its trainer feeds it to the target's LM head): the default. An export whose run holds the other one stops.

Every export writes `export.json` (conventions, layer ids in the trainer's terms, counts, dropped by reason),
`samples.jsonl` (trainer index → our id) and `dropped.jsonl` (id, reason) beside the trainer's files.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pyarrow as pa

from job import layout, schema, storage
from job.config import ConfigError

TARGETS = {"specforge": ("dflash", "eagle3", "conversations"), "speculators": ("dflash", "eagle3")}
FILE_GROUP_SIZE = 2000  # SpecForge's --file-group-size default: data_{i}.ckpt in rows_{g}-{g+2000}/
SHARDS_PER_ARROW_FILE = 256  # speculators' dataset: one Arrow file per 256 of our shards (~8K samples, ~100 MB)
SPECFORGE_DEFAULT_DRAFT_VOCAB = 32000  # SpecForge's EAGLE-3 draft default (TargetDerivedDraftDefaults)
EXPORT_JSON, SAMPLES_JSONL, DROPPED_JSONL = "export.json", "samples.jsonl", "dropped.jsonl"
# The files a trainer reads as samples: SpecForge's feature files, speculators' features and dataset files.
TRAINER_FILE = re.compile(r"rows_\d+-\d+/data_\d+\.ckpt(\.gz)?|hidden_states/hs_\d+\.safetensors|"
                          r"data-\d{5}-of-\d{5}\.arrow")


class ExportError(ConfigError):
    """The run cannot be exported as asked (wrong layer convention, missing layer, ...); nothing is written."""


# ---------------------------------------------------------------------------------------------------------------
# The plan: which of the run's stored layers go where
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    to: str
    format: str
    run_layer_ids: list[int]
    """Our ids of the run's stored layers, in slot order."""
    num_model_layers: int
    last_before_norm: bool
    aux_slots: list[int]
    """Slots of the run's features that become the trainer's aux / context layers, in the trainer's order."""
    last_slot: int | None
    """Slot of the model's last layer (EAGLE-3's `hidden_state`, speculators' last slot), or None (DFlash)."""
    notes: dict = field(default_factory=dict)

    @property
    def aux_layer_ids(self) -> list[int]:
        return [self.run_layer_ids[s] for s in self.aux_slots]

    def conventions(self) -> dict:
        """What the trainer must be told, in its own terms."""
        ours = self.aux_layer_ids
        out = {"our_layer_ids": ours, "our_convention": schema.LAYER_CONVENTION.split(";")[0]}
        if self.to == "specforge":
            key = "dflash_config.target_layer_ids" if self.format == "dflash" else \
                "eagle_config.eagle_aux_hidden_state_layer_ids"
            out.update({"trainer_layer_ids": ours, "trainer_config_key": key,
                        "trainer_convention": "SpecForge id = ours (output_hidden_states[id + 1])"})
            if self.last_slot is not None:
                out["hidden_state"] = f"layer {self.num_model_layers - 1} after the final norm"
        else:
            out.update({"trainer_layer_ids": [k + 1 for k in ours], "trainer_config_key": "--target-layer-ids",
                        "trainer_convention": "vLLM/speculators id = ours + 1 (residual stream after id layers)",
                        "last_slot": f"vLLM id {self.num_model_layers}: decoder layer {self.num_model_layers - 1} "
                                     "before the final norm"})
        return out


def make_plan(to: str, format: str, run_layer_ids: list[int], num_model_layers: int, last_before_norm: bool,
              layers: list[int] | None = None) -> Plan:
    """Check the run's layers against what the trainer needs and map them to slots. `layers`: the aux / context
    layers to export, in our (= SpecForge's) convention, in the trainer's order; default: the run's layers but the
    last. Raises ExportError naming the fix."""
    if to not in TARGETS or format not in TARGETS[to]:
        raise ExportError(f"export: --to {to} --format {format} is not a known pair "
                          f"(known: {', '.join(f'{t}: {sorted(f)}' for t, f in TARGETS.items())})")
    last = num_model_layers - 1
    slot = {k: i for i, k in enumerate(run_layer_ids)}
    wanted = [k + num_model_layers if k < 0 else k for k in layers] if layers else \
        [k for k in run_layer_ids if k != last]
    missing = [k for k in wanted if k not in slot]
    if missing:
        raise ExportError(f"export: layer(s) {missing} are not in this run (it holds {run_layer_ids}); rerun stage 2 "
                          "with them in hidden_states.layer_ids")
    if not wanted:
        raise ExportError(f"export: no aux/context layer to export (the run holds {run_layer_ids})")
    where = f"this run stores layer {last} (the model's last) " + ("before" if last_before_norm else "after") + \
        " the final norm"
    last_slot = None
    if format == "eagle3" or to == "speculators":
        if last in wanted:
            raise ExportError(f"export: layer {last} is the model's last layer; {to} {format} takes it separately, "
                              "not among the aux layers: leave it out of --layers")
        if last not in slot:
            raise ExportError(f"export: {to} {format} needs the model's last layer ({last}, or -1) in "
                              f"hidden_states.layer_ids; this run holds {run_layer_ids}")
        needs_before = to == "speculators"
        if last_before_norm != needs_before:
            raise ExportError(
                f"export: {where}, but {to} {format} needs it " + ("before" if needs_before else "after") +
                " the norm (" + ("speculators' last slot is vLLM's pre-norm residual stream"
                                 if needs_before else "SpecForge feeds `hidden_state` to the target's LM head") +
                "). Rerun stage 2 into a new output with hidden_states.last_layer_before_norm: " +
                ("true" if needs_before else "false"))
        last_slot = slot[last]
    elif last in wanted and last_before_norm:
        raise ExportError(f"export: {where}; SpecForge DFlash reads output_hidden_states[{last + 1}], after the norm")
    if format == "eagle3" and len(wanted) != 3:
        raise ExportError(f"export: EAGLE-3 takes exactly 3 aux layers (low, mid, high); got {wanted}: pass "
                          "--layers with three of the run's layers")
    return Plan(to=to, format=format, run_layer_ids=list(run_layer_ids), num_model_layers=num_model_layers,
                last_before_norm=last_before_norm, aux_slots=[slot[k] for k in wanted], last_slot=last_slot)


# ---------------------------------------------------------------------------------------------------------------
# One sample: our record → the trainer's tensors (shared by files and the stream)
# ---------------------------------------------------------------------------------------------------------------


def has_consecutive_supervised_tokens(loss_mask) -> bool:
    """SpecForge's DFlash eligibility (specforge/data/loss_mask.py): two adjacent loss-mask tokens."""
    values = loss_mask.tolist()
    return any(bool(a) and bool(b) for a, b in zip(values, values[1:]))


def drop_reason(loss_mask, plan: Plan) -> str | None:
    """Why the trainer cannot use this sample, or None."""
    if not int(loss_mask.sum()):
        return "no loss-mask token: an empty completion, nothing to train on"
    if plan.to == "specforge" and plan.format == "dflash" and not has_consecutive_supervised_tokens(loss_mask):
        return ("no two consecutive loss-mask tokens: SpecForge's DFlash drops such samples when it builds its "
                "dataset (loss_mask_filter) and its loader refuses them")
    return None


def trainer_sample(input_ids, loss_mask, hidden, plan: Plan) -> dict:
    """The tensors one trainer file holds, from our record (`hidden`: [num_tokens, num_layers, hidden] torch).
    Every tensor is its own compact copy: `torch.save` of a view would write the whole underlying buffer."""
    import torch

    n = hidden.shape[0]
    ids = input_ids.to(torch.int64).clone()
    mask = loss_mask.to(torch.int64).clone()
    aux = hidden[:, plan.aux_slots].reshape(n, -1)  # index → a new contiguous tensor, layers side by side
    if plan.to == "specforge" and plan.format == "dflash":
        return {"input_ids": ids, "loss_mask": mask, "hidden_states": aux[None]}
    if plan.to == "specforge":
        return {"input_ids": ids, "loss_mask": mask, "aux_hidden_state": aux[None],
                "hidden_state": hidden[:, plan.last_slot].clone()[None]}
    return {"token_ids": ids, "hidden_states": hidden[:, plan.aux_slots + [plan.last_slot]].contiguous()}


# ---------------------------------------------------------------------------------------------------------------
# Vocabulary statistics, exactly as the trainers compute them
# ---------------------------------------------------------------------------------------------------------------


def count_tokens(counter: Counter, input_ids, loss_mask) -> None:
    """One sample's loss-masked tokens into `counter`, in the trainers' order (unique ids ascending), so ties in
    SpecForge's `most_common` break as they would there."""
    import torch

    masked = input_ids.to(torch.int64)[loss_mask.to(torch.bool)]
    unique, counts = masked.unique(return_counts=True)
    counter.update(dict(zip(unique.tolist(), counts.tolist())))


def specforge_vocab_mapping(token_dict: Counter, draft_vocab_size: int, target_vocab_size: int):
    """(d2t, t2d) as SpecForge's `process_token_dict_to_mappings` builds them (data/preprocessing.py)."""
    import torch

    token_dict = Counter(token_dict)
    if len(token_dict) < draft_vocab_size:
        # The same expression as theirs: which zero-count tokens fill up depends on this set's iteration order.
        missing_tokens = set(range(draft_vocab_size)) - set(token_dict.keys())
        for token in missing_tokens:
            token_dict[token] = 0
            if len(token_dict) >= draft_vocab_size:
                break
    used = sorted(key for key, _ in token_dict.most_common(draft_vocab_size))
    used_set = set(used)
    d2t = torch.tensor([used[i] - i for i in range(len(used))])
    t2d = torch.tensor([i in used_set for i in range(target_vocab_size)])
    return d2t, t2d


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


def specforge_file_name(index: int, group: int = FILE_GROUP_SIZE) -> str:
    start = index // group * group
    return f"rows_{start}-{start + group}/data_{index}.ckpt"


def _torch_bytes(obj) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_lines(uri: str, lines: Iterator[str], storage_config) -> int:
    """Stream text lines to `uri` (local: a temp file renamed at the end; S3: a multipart upload completed on
    close), so a large JSONL never sits in memory. Returns the number of lines."""
    fs, path = storage.resolve(uri, storage_config)
    local = not storage.is_s3(uri)
    target = path
    if local:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        target = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    n = 0
    with fs.open_output_stream(target) as out:
        for line in lines:
            out.write(line.encode() + b"\n")
            n += 1
    if local:
        os.replace(target, path)
    return n


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


def _run_layout(shard_uris: list[str], storage_config) -> tuple[list[int], int, bool, str]:
    """(layer ids, model layers, last layer before norm, model) from the first shard's metadata; every shard must
    agree (one run, one way of extracting)."""
    from job.hidden_states import model_shape

    seen = None
    for uri in shard_uris[:1] + shard_uris[-1:]:
        meta = _shard_schema(uri, storage_config).metadata
        layout = (json.loads(meta[schema.META_LAYER_IDS]), meta.get(schema.META_NUM_MODEL_LAYERS),
                  meta.get(schema.META_LAST_LAYER_NORM, schema.LAST_AFTER_NORM.encode()).decode(),
                  meta[schema.META_MODEL].decode())
        if seen is not None and layout != seen:
            raise ExportError(f"export: shards of one run disagree on their layers ({seen} vs {layout}): stage 2 "
                              "was redone with other settings into the same output")
        seen = layout
    layer_ids, num_layers, norm, model = seen
    # Shards written before `num_model_layers` was recorded: ask the model's config.
    num_layers = int(num_layers) if num_layers is not None else model_shape(model)[0]
    return layer_ids, num_layers, norm == schema.LAST_BEFORE_NORM, model


def _shard_schema(uri: str, storage_config) -> pa.Schema:
    """A shard's schema from its footer alone (a shard holds gigabytes of features)."""
    fs, path = storage.resolve(uri, storage_config)

    def read():
        with fs.open_input_file(path) as f:
            return pa.ipc.open_file(f).schema

    return storage.with_retries(read, what=f"read {uri}", storage=storage_config)


def _records(shard_uris: list[str], storage_config) -> Iterator[dict]:
    from job.hidden_states.shards import iter_records

    for uri in shard_uris:
        yield from iter_records(storage.read_shard(uri, storage_config, memory_map=not storage.is_s3(uri)))


# ---------------------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------------------


def export(run: str, *, to: str, format: str, output: str, layers: list[int] | None = None,
           draft_vocab_size: int | None = None, target_vocab_size: int | None = None,
           storage_config: storage.StorageConfig | None = None) -> dict:
    """Write a run in a trainer's format under `output` (local or s3://); returns the summary also written to
    `output/export.json`. File names are deterministic and each is written atomically: a rerun rewrites the same
    files, never a second copy."""
    inside = [a for a, b in ((output, run), (run, output)) if a.rstrip("/").startswith(b.rstrip("/") + "/")]
    if output.rstrip("/") == run.rstrip("/") or inside:
        raise ExportError(f"export: --output {output} must lie outside the run directory {run} (and not hold it)")
    if to == "specforge" and format == "conversations":
        return export_conversations(run, output=output, storage_config=storage_config)
    shard_uris = storage.list_files(storage.join(run, layout.HIDDEN_STATES_DIR), layout.SHARD_SUFFIX, storage_config)
    if not shard_uris:
        raise ExportError(f"export: no hidden-state shards under {storage.join(run, layout.HIDDEN_STATES_DIR)}: run "
                          "stage 2 first (`python -m job hidden-states ...`)")
    layer_ids, num_layers, before_norm, model = _run_layout(shard_uris, storage_config)
    plan = make_plan(to, format, layer_ids, num_layers, before_norm, layers)
    if to == "specforge" and format == "eagle3":
        target_vocab_size = target_vocab_size or _vocab_size(model)
        draft_vocab_size = draft_vocab_size or min(SPECFORGE_DEFAULT_DRAFT_VOCAB, target_vocab_size)
        if draft_vocab_size > target_vocab_size:
            raise ExportError(f"export: --draft-vocab-size {draft_vocab_size} exceeds the target's vocabulary "
                              f"({target_vocab_size})")

    from job.hidden_states.shards import BackgroundWriter

    written: set[str] = set()  # names relative to `output`; anything else of the trainer's is removed at the end
    writer = BackgroundWriter(max_pending=8)
    counter: Counter = Counter()
    kept: list[str] = []
    dropped: list[dict] = []
    arrow_files: list[str] = []
    groups = [shard_uris[i:i + SHARDS_PER_ARROW_FILE] for i in range(0, len(shard_uris), SHARDS_PER_ARROW_FILE)]
    num_tokens = 0
    try:
        for g, group in enumerate(groups):
            rows = []
            for rec in _records(group, storage_config):
                reason = drop_reason(rec[schema.LOSS_MASK], plan)
                if reason:
                    dropped.append({"id": rec[schema.ID], "reason": reason})
                    continue
                index = len(kept)
                kept.append(rec[schema.ID])
                sample = trainer_sample(rec[schema.INPUT_IDS], rec[schema.LOSS_MASK], rec[schema.HIDDEN_STATES], plan)
                count_tokens(counter, rec[schema.INPUT_IDS], rec[schema.LOSS_MASK])
                num_tokens += len(rec[schema.INPUT_IDS])
                if to == "specforge":
                    name = specforge_file_name(index)
                    data = _torch_bytes(sample)
                else:
                    from safetensors.torch import save

                    name, data = f"hidden_states/hs_{index}.safetensors", save(sample)
                written.add(name)
                writer.submit(storage.write_bytes_atomic, storage.join(output, name), data, storage_config)
                if to == "speculators":
                    rows.append((rec[schema.INPUT_IDS].numpy(), rec[schema.LOSS_MASK].numpy().astype(np.int64),
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
        plan.notes.update(draft_vocab_size=draft_vocab_size, target_vocab_size=target_vocab_size)
    if to == "speculators":
        storage.write_bytes_atomic(storage.join(output, "token_freq.pt"), _torch_bytes(dict(counter)),
                                   storage_config)
        _write_speculators_dataset(output, arrow_files, _fingerprint(kept), storage_config)
    return _finish(run, output, plan.to, plan.format, kept, dropped, storage_config,
                   {"num_tokens": num_tokens, "layers": plan.conventions(), "model": model, **plan.notes})


def _fingerprint(ids: list[str]) -> str:
    import hashlib

    return hashlib.blake2b("\n".join(ids).encode(), digest_size=8).hexdigest()


def _vocab_size(model: str) -> int:
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(model).get_text_config().vocab_size)
    except (OSError, ValueError) as e:
        raise ExportError(f"export: cannot read the vocabulary size of {model!r} ({e}); pass --target-vocab-size") \
            from None


def _finish(run: str, output: str, to: str, format: str, kept: list[str], dropped: list[dict], storage_config,
            extra: dict) -> dict:
    _write_lines(storage.join(output, SAMPLES_JSONL),
                 (json.dumps({"index": i, "id": sid}) for i, sid in enumerate(kept)), storage_config)
    _write_lines(storage.join(output, DROPPED_JSONL), (json.dumps(d, ensure_ascii=False) for d in dropped),
                 storage_config)
    summary = {"run": run, "output": output, "to": to, "format": format, "num_samples": len(kept),
               "num_dropped": len(dropped), "dropped_by_reason": dict(Counter(d["reason"] for d in dropped)), **extra}
    storage.write_json(storage.join(output, EXPORT_JSON), summary, storage_config)
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Completions → SpecForge training conversations
# ---------------------------------------------------------------------------------------------------------------


def has_think_marker(content: str) -> bool:
    """scripts/conversation_validation.py."""
    lowered = content.lower()
    return "<think>" in lowered or "</think>" in lowered


def validate_conversation(messages) -> str | None:
    """SpecForge's `validate_conversation` (scripts/conversation_validation.py, 'validation' error style): non-empty
    string contents, system messages only before the first user, then user/assistant alternating from a user."""
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    expected_role, saw_user = "user", False
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} must be an object"
        role, content = message.get("role"), message.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"message {index} content must be a non-empty string"
        if role == "system" and not saw_user:
            continue
        if role not in {"user", "assistant"}:
            return f"message {index} has unsupported role {role!r}"
        if role != expected_role:
            return f"message {index} expected role {expected_role!r}, got {role!r}"
        saw_user = True
        expected_role = "assistant" if role == "user" else "user"
    if not saw_user:
        return "conversation has no user message"
    return None


def validate_row(row: dict, *, expect_reasoning: bool, expect_non_reasoning: bool) -> str | None:
    """SpecForge's `validate_row` (scripts/validate_regenerated_data.py) with --strict-think-markers and
    --expect-reasoning (a thinking run) or --expect-non-reasoning; the reason it fails, or None. One difference:
    the reasoning expectation holds for the last assistant message only, the turn stage 1 regenerated. SpecForge's
    own script regenerates every turn of a conversation, so all of them have reasoning; ours regenerates one turn
    per row (generate.regenerate) on a history of the data's own turns, which rarely carry reasoning, and the
    Qwen3.5/3.6 template does not render reasoning before the last user message anyway."""
    if not isinstance(row.get("id"), str) or not row["id"].strip():
        return "id must be a non-empty string"
    if row.get("status") != "success":
        return "status must be 'success'"
    messages = row.get("conversations")
    error = validate_conversation(messages)
    if error is not None:
        return error
    assistants = 0
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        assistants += 1
        content, reasoning = message["content"], message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return f"assistant message {index} reasoning_content must be a string or null"
        regenerated = index == len(messages) - 1
        if regenerated and expect_non_reasoning and reasoning and reasoning.strip():
            return f"assistant message {index} has non-empty reasoning_content"
        if regenerated and expect_reasoning and (not isinstance(reasoning, str) or not reasoning.strip()):
            return f"assistant message {index} has empty reasoning_content"
        if has_think_marker(content):
            return f"assistant message {index} contains a thinking marker"
        if isinstance(reasoning, str) and has_think_marker(reasoning):
            return f"assistant message {index} reasoning_content contains a thinking marker"
    if assistants == 0:
        return "conversation has no assistant message"
    if messages[-1].get("role") != "assistant":
        return "conversation must end with an assistant message"
    return None


def conversation_row(row: dict, thinking: bool) -> tuple[dict | None, str | None]:
    """(SpecForge training row, None) for one completion row, or (None, why it is dropped). The row is what
    regenerate_train_data.py writes: the prompt's messages, then the regenerated assistant turn with its reasoning in
    `reasoning_content` (the Qwen3.5/3.6 template renders it inside <think>...</think>; `content` holds the answer
    alone)."""
    from job.generate.prompts import RowError, history_of_turn, row_messages

    if row.get(schema.ERROR) is not None:
        return None, f"stage-1 error: {row[schema.ERROR]}"
    if row.get(schema.FLAG_TRUNCATED):
        return None, ("truncated (finish_reason length): the template would close an assistant turn the model "
                      "never finished")
    try:
        # The history this turn was generated on: a trailing assistant turn of the data (last_turn), or the turns
        # after it (every_assistant_turn), are not part of it.
        messages = history_of_turn(row_messages(row), row.get(schema.TURN))
    except RowError as e:
        return None, f"prompt: {e}"
    assistant = {"role": "assistant", "content": row.get(schema.ANSWER) or ""}
    if thinking:
        assistant["reasoning_content"] = row.get(schema.REASONING) or ""
    out = {"id": row[schema.ID], "conversations": messages + [assistant], "status": "success"}
    reason = validate_row(out, expect_reasoning=thinking, expect_non_reasoning=not thinking)
    return (None, reason) if reason else (out, None)


def export_conversations(run: str, *, output: str, storage_config: storage.StorageConfig | None = None) -> dict:
    """Every completion row of the run either becomes one line of `output/conversations.jsonl` or one line of
    `output/dropped.jsonl` with the reason; `export.json` counts both and checks they add up to the input."""
    from job import runs

    completions = storage.join(run, layout.COMPLETIONS_DIR)
    uris = storage.list_files(completions, layout.SHARD_SUFFIX, storage_config)
    if not uris:
        raise ExportError(f"export: no completion shards under {completions}")
    config = (runs.read_run_json(run, storage_config) or {}).get("config", {})
    thinking = bool(config.get("generate", {}).get("enable_thinking", True))
    kept, dropped, num_rows = [], [], 0

    def lines():
        nonlocal num_rows
        for uri in uris:
            for row in storage.read_shard(uri, storage_config).to_pylist():
                num_rows += 1
                out, reason = conversation_row(row, thinking)
                if out is None:
                    dropped.append({"id": row[schema.ID], "reason": reason})
                    continue
                kept.append(row[schema.ID])
                yield json.dumps(out, ensure_ascii=False)

    _write_lines(storage.join(output, "conversations.jsonl"), lines(), storage_config)
    assert len(kept) + len(dropped) == num_rows, (len(kept), len(dropped), num_rows)
    summary = _finish(run, output, "specforge", "conversations", kept, dropped, storage_config,
                      {"num_input_rows": num_rows, "thinking": thinking,
                       "validation": "scripts/validate_regenerated_data.py --strict-think-markers "
                                     + ("--expect-reasoning" if thinking else "--expect-non-reasoning")})
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Streaming: the same mapping as a ray.data transform over job.hidden_states.dataset(...)
# ---------------------------------------------------------------------------------------------------------------


class TrainerLayout:
    """`map_batches` callable: batches of `job.hidden_states.dataset(config)` → batches in the trainer's layout, one
    row per kept sample: `id` plus the keys of the trainer's file (SpecForge's .ckpt dict, or speculators'
    safetensors keys plus `loss_mask`). bfloat16 travels as its uint16 bits (numpy has no bfloat16); `collate`
    views them as torch.bfloat16 again. Samples the trainer cannot use are left out (see `drop_reason`)."""

    def __init__(self, plan: Plan, dtype: str):
        self.plan, self.dtype = plan, dtype

    def __call__(self, batch: dict) -> dict:
        import torch

        from job.hidden_states.shards import _torch_dtype

        out: dict[str, list] = {}
        for i, sid in enumerate(batch[schema.ID]):
            ids = torch.from_numpy(np.asarray(batch[schema.INPUT_IDS][i]))
            mask = torch.from_numpy(np.asarray(batch[schema.LOSS_MASK][i]))
            if drop_reason(mask, self.plan):
                continue
            hidden = torch.from_numpy(np.ascontiguousarray(batch[schema.HIDDEN_STATES][i]))
            if self.dtype == "bfloat16":
                hidden = hidden.view(torch.bfloat16)
            assert hidden.dtype == _torch_dtype(self.dtype)
            sample = trainer_sample(ids, mask, hidden, self.plan)
            if self.plan.to == "speculators":
                sample["loss_mask"] = mask.to(torch.int64)
            out.setdefault(schema.ID, []).append(str(sid))
            for key, t in sample.items():
                out.setdefault(key, []).append((t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy())
        if not out:
            return {schema.ID: np.array([], dtype=object)}
        from job.hidden_states.actor import _ragged

        return {k: np.array(v, dtype=object) if k == schema.ID else _ragged(v) for k, v in out.items()}


def stream(config, *, to: str, format: str, layers: list[int] | None = None):
    """`job.hidden_states.dataset(config)` mapped to a trainer's layout, never written: a `ray.data.Dataset` for an
    online trainer (`ds.iter_torch_batches(batch_size=N, collate_fn=collate)`)."""
    from job.hidden_states.samples import resolve_layer_ids
    from job.hidden_states import dataset, model_shape

    num_layers, _ = model_shape(config.model)
    hs = config.hidden_states
    plan = make_plan(to, format, resolve_layer_ids(hs.layer_ids, num_layers), num_layers, hs.last_layer_before_norm,
                     layers)
    return dataset(config).map_batches(TrainerLayout, fn_constructor_kwargs={"plan": plan, "dtype": hs.dtype},
                                       batch_size=None, concurrency=1)


FEATURE_KEYS = ("hidden_states", "hidden_state", "aux_hidden_state")


def collate(batch: dict) -> dict:
    """`collate_fn` for `stream(...)`: one tensor per sample (features as torch.bfloat16 again), `id` as str."""
    import torch

    out = {}
    for name, column in batch.items():
        if name == schema.ID:
            out[name] = [str(x) for x in column]
            continue
        tensors = [torch.from_numpy(np.ascontiguousarray(x)) for x in column]
        out[name] = [t.view(torch.bfloat16) if t.dtype == torch.uint16 and name in FEATURE_KEYS else t
                     for t in tensors]
    return out
