"""One sample, our record → the trainer's tensors (shared by files and the stream): which stored layers go where
(`Plan`), which samples a trainer drops, the vocabulary statistics exactly as the trainers compute them, and the
bookkeeping every export writes beside the trainer's files (samples.jsonl, dropped.jsonl, export.json)."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

from job import schema, storage
from job.config import ConfigError
from job.drafters import default_aux_layers

TARGETS = {"specforge": ("dflash", "eagle3", "conversations"), "speculators": ("dflash", "eagle3")}
LAST_TURN, EVERY_ASSISTANT_TURN = "last_turn", "every_assistant_turn"
# Where each trainer puts the loss of a multi-turn sample when it builds its own data: SpecForge on every assistant
# span of the conversation (data/preprocessing.py, `_apply_loss_mask_from_chat_template`); speculators makes one row
# per assistant turn with the loss on that turn alone (data_generation/preprocessing.py, `_render_boundary_rows`).
DEFAULT_LOSS_TURNS = {"specforge": EVERY_ASSISTANT_TURN, "speculators": LAST_TURN}
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
    norm_slot: int | None = None
    """Slot the export passes through the target's final norm: the run stored the last layer before it and this
    trainer reads it after (job/export/norm.py). None: every layer goes out as stored."""
    model: str | None = None
    dtype: str | None = None
    """The target's directory and the run's compute dtype: where the final norm comes from, and in what dtype."""
    loss_turns: str = LAST_TURN
    """last_turn: the loss on the turn stage 1 generated (stage 2's mask); every_assistant_turn: also on the
    assistant turns of the history in the prompt (the data's own answers), as SpecForge does."""
    notes: dict = field(default_factory=dict)
    final_norm: object = field(default=None, repr=False, compare=False)
    """The target's final norm (export/norm.py `load_final_norm`), set by the caller when `norm_slot` is not None."""
    _markers: tuple | None = field(default=None, repr=False, compare=False)

    def loss_mask(self, input_ids, loss_mask):
        """Stage 2's mask (the generated turn), widened to the history's assistant turns under every_assistant_turn."""
        if self.loss_turns == LAST_TURN:
            return loss_mask
        if self._markers is None:
            self._markers = chatml_markers(self.model)
        return with_history_turns(input_ids, loss_mask, *self._markers)

    def layer(self, hidden, slot: int):
        """Slot `slot` of one sample's features [num_tokens, num_layers, hidden], after the final norm if the trainer
        wants it there."""
        if slot != self.norm_slot:
            return hidden[:, slot]
        assert self.final_norm is not None, "load the target's final norm into the plan first (export/norm.py)"
        import torch  # heavy: imported on use

        with torch.no_grad():
            return self.final_norm(hidden[:, slot])

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
                out["hidden_state"] = f"layer {self.num_model_layers - 1} after the final norm" + (
                    " (the run stored it before; the export applied the target's final norm)"
                    if self.norm_slot is not None else "")
            elif self.norm_slot is not None:
                out["norm"] = (f"layer {self.num_model_layers - 1} after the final norm (the run stored it before; "
                               "the export applied the target's final norm)")
        else:
            out.update({"trainer_layer_ids": [k + 1 for k in ours], "trainer_config_key": "--target-layer-ids",
                        "trainer_convention": "vLLM/speculators id = ours + 1 (residual stream after id layers)",
                        "last_slot": f"vLLM id {self.num_model_layers}: decoder layer {self.num_model_layers - 1} "
                                     "before the final norm"})
        return out


def make_plan(to: str, format: str, run_layer_ids: list[int], num_model_layers: int, last_before_norm: bool,
              layers: list[int] | None = None, *, model: str | None = None, dtype: str | None = None,
              loss_turns: str | None = None) -> Plan:
    """Check the run's layers against what the trainer needs and map them to slots. `layers`: the aux / context
    layers to export, in our (= SpecForge's) convention, in the trainer's order; default: the trainer's own default
    layers for this target (job/drafters.py) when the run holds them all, else the run's layers but the last.
    Raises ExportError naming the fix."""

    if to not in TARGETS or format not in TARGETS[to]:
        raise ExportError(f"export: --to {to} --format {format} is not a known pair "
                          f"(known: {', '.join(f'{t}: {sorted(f)}' for t, f in TARGETS.items())})")
    last = num_model_layers - 1
    slot = {k: i for i, k in enumerate(run_layer_ids)}
    preferred = default_aux_layers(to, format, num_model_layers)
    if layers:
        wanted = [k + num_model_layers if k < 0 else k for k in layers]
    elif all(k in slot for k in preferred):
        wanted = preferred
    else:  # a run made for one trainer with layers of its own choosing
        wanted = [k for k in run_layer_ids if k != last]
    missing = [k for k in wanted if k not in slot]
    if missing:
        raise ExportError(f"export: layer(s) {missing} are not in this run (it holds {run_layer_ids}); rerun stage 2 "
                          "with them in hidden_states.layer_ids")
    if not wanted:
        raise ExportError(f"export: no aux/context layer to export (the run holds {run_layer_ids})")
    where = f"this run stores layer {last} (the model's last) " + ("before" if last_before_norm else "after") + \
        " the final norm"
    last_slot = norm_slot = None
    if format == "eagle3" or to == "speculators":
        if last in wanted:
            raise ExportError(f"export: layer {last} is the model's last layer; {to} {format} takes it separately, "
                              "not among the aux layers: leave it out of --layers")
        if last not in slot:
            raise ExportError(f"export: {to} {format} needs the model's last layer ({last}, or -1) in "
                              f"hidden_states.layer_ids; this run holds {run_layer_ids}")
        if to == "speculators" and not last_before_norm:
            raise ExportError(
                f"export: {where}, but {to} {format} needs it before the norm (speculators' last slot is vLLM's "
                "pre-norm residual stream), and a norm cannot be undone. Rerun stage 2 into a new output with "
                "hidden_states.last_layer_before_norm: true (the default), which serves both trainers")
        last_slot = slot[last]
        if to == "specforge" and last_before_norm:
            norm_slot = last_slot  # SpecForge feeds `hidden_state` to the target's LM head: after the norm
    elif last in wanted and last_before_norm:
        norm_slot = slot[last]  # SpecForge DFlash reads output_hidden_states[last + 1]: after the norm
    if format == "eagle3" and len(wanted) != 3:
        raise ExportError(f"export: EAGLE-3 takes exactly 3 aux layers (low, mid, high); got {wanted}: pass "
                          "--layers with three of the run's layers")
    if norm_slot is not None and model is None:
        raise ExportError("export: applying the target's final norm needs the target model's directory")
    loss_turns = loss_turns or DEFAULT_LOSS_TURNS[to]
    if loss_turns not in (LAST_TURN, EVERY_ASSISTANT_TURN):
        raise ExportError(f"export: --loss-turns must be {LAST_TURN} or {EVERY_ASSISTANT_TURN}, got {loss_turns!r}")
    if loss_turns == EVERY_ASSISTANT_TURN and model is None:
        raise ExportError("export: --loss-turns every_assistant_turn needs the target's tokenizer (its directory)")
    return Plan(to=to, format=format, run_layer_ids=list(run_layer_ids), num_model_layers=num_model_layers,
                last_before_norm=last_before_norm, aux_slots=[slot[k] for k in wanted], last_slot=last_slot,
                norm_slot=norm_slot, model=model, dtype=dtype, loss_turns=loss_turns)


# ---------------------------------------------------------------------------------------------------------------
# Multi-turn samples: the loss on the history's assistant turns too
# ---------------------------------------------------------------------------------------------------------------


def chatml_markers(model_dir: str) -> tuple[list[int], int]:
    """(token ids of the assistant header "<|im_start|>assistant\n", id of "<|im_end|>") of the target's tokenizer:
    the markers SpecForge's Qwen templates find assistant spans by (`assistant_header`, `end_of_turn_token`)."""
    from transformers import AutoTokenizer  # heavy: imported on use

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    if start in (None, tokenizer.unk_token_id) or end in (None, tokenizer.unk_token_id):
        raise ExportError(f"export: --loss-turns every_assistant_turn finds assistant turns by ChatML's "
                          f"<|im_start|>/<|im_end|> tokens, which the tokenizer of {model_dir} lacks: use last_turn")
    return tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False), end


def with_history_turns(input_ids, loss_mask, header: list[int], end: int):
    """`loss_mask` with 1 on every assistant turn of the prompt that the prompt closes: the tokens after each
    assistant header up to and including its <|im_end|> (SpecForge's span: its regex takes the text after the
    header, and its offset test keeps the end-of-turn token). The generation prompt's open header at the end of the
    prompt is left as stage 2 masked it."""
    import torch  # heavy: imported on use

    ids = input_ids.tolist()
    mask = loss_mask.clone()
    prompt_end = next((i for i, m in enumerate(loss_mask.tolist()) if m), len(ids))
    n, i = len(header), 0
    while i + n <= prompt_end:
        if ids[i:i + n] != header:
            i += 1
            continue
        close = next((j for j in range(i + n, prompt_end) if ids[j] == end), None)
        if close is None:
            break  # the generation prompt: the turn stage 1 generated
        mask[i + n:close + 1] = 1
        i = close + 1
    return mask.to(loss_mask.dtype) if isinstance(mask, torch.Tensor) else mask


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
    import torch  # heavy: imported on use

    ids = input_ids.to(torch.int64).clone()
    mask = loss_mask.to(torch.int64).clone()
    aux = torch.cat([plan.layer(hidden, s) for s in plan.aux_slots], -1)  # a new tensor, layers side by side
    if plan.to == "specforge" and plan.format == "dflash":
        return {"input_ids": ids, "loss_mask": mask, "hidden_states": aux[None]}
    if plan.to == "specforge":
        return {"input_ids": ids, "loss_mask": mask, "aux_hidden_state": aux[None],
                "hidden_state": plan.layer(hidden, plan.last_slot).clone()[None]}
    return {"token_ids": ids, "hidden_states": hidden[:, plan.aux_slots + [plan.last_slot]].contiguous()}


# ---------------------------------------------------------------------------------------------------------------
# Vocabulary statistics, exactly as the trainers compute them
# ---------------------------------------------------------------------------------------------------------------


def count_tokens(counter: Counter, input_ids, loss_mask) -> None:
    """One sample's loss-masked tokens into `counter`, in the trainers' order (unique ids ascending), so ties in
    SpecForge's `most_common` break as they would there."""
    import torch  # heavy: imported on use

    masked = input_ids.to(torch.int64)[loss_mask.to(torch.bool)]
    unique, counts = masked.unique(return_counts=True)
    counter.update(dict(zip(unique.tolist(), counts.tolist())))


def specforge_vocab_mapping(token_dict: Counter, draft_vocab_size: int, target_vocab_size: int):
    """(d2t, t2d) as SpecForge's `process_token_dict_to_mappings` builds them (data/preprocessing.py)."""
    import torch  # heavy: imported on use

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
# The bookkeeping beside every export: samples.jsonl (trainer index → our id), dropped.jsonl, export.json
# ---------------------------------------------------------------------------------------------------------------


def finish_export(run: str, output: str, to: str, format: str, kept: list[str], dropped: list[dict], fence,
                  extra: dict) -> dict:
    """samples.jsonl (trainer index → our id), dropped.jsonl, then export.json, each through the fence."""
    fence.write_bytes(storage.join(output, SAMPLES_JSONL),
                      "".join(json.dumps({"index": i, "id": sid}) + "\n" for i, sid in enumerate(kept)).encode())
    fence.write_bytes(storage.join(output, DROPPED_JSONL),
                      "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in dropped).encode())
    summary = {"run": run, "output": output, "to": to, "format": format, "num_samples": len(kept),
               "num_dropped": len(dropped), "dropped_by_reason": dict(Counter(d["reason"] for d in dropped)), **extra}
    fence.write_json(storage.join(output, EXPORT_JSON), summary)
    return summary
