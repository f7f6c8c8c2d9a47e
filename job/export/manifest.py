"""What an export tells its trainer (`export.json`): the target, the layer ids in both conventions, the norm, the
dtype, the counts, the loss policy, and a ready draft-model config for that trainer, whose layer ids are the
export's. A user's own draft config is checked against them first: SpecForge's feature files carry no layer ids, so
a config naming other layers would train silently on the wrong ones.

The draft configs themselves are the trainers' business: job/trainers/specforge.py and speculators.py (`draft_config`,
`config_layer_ids`), stdlib-only at import so that both environments can read them.
"""

from __future__ import annotations

from job import target
from job.export.trainer_format import ExportError, Plan
from job.trainers import specforge, speculators


def manifest_fields(plan: Plan, dtype: str) -> dict:
    """Everything but the counts and the draft config."""
    last = plan.num_model_layers - 1
    aux = plan.aux_layer_ids
    layers = plan.conventions()
    layers.update(our_aux_layer_ids=aux, vllm_aux_layer_ids=[k + 1 for k in aux])
    if plan.last_slot is not None or plan.norm_slot is not None:
        after = plan.to == "specforge"
        layers["last_layer"] = {
            "our_id": last, "vllm_id": plan.num_model_layers,
            "stored": "before the final norm" if plan.last_before_norm else "after the final norm",
            "exported": "after the final norm" if after else "before the final norm",
            "norm_applied_by_export": plan.norm_slot is not None}
    facts = target.facts(plan.model) if plan.model else {}
    return {"model": plan.model, "target": facts, "dtype": dtype, "layers": layers, "loss_turns": plan.loss_turns,
            "tiny": bool(facts.get("tiny")), **plan.notes}


def _trainer(to: str):
    return {"specforge": specforge, "speculators": speculators}[to]


def draft_config(plan: Plan, fields: dict, given: dict | None) -> dict:
    """The user's draft config if its layer ids agree with the export's, else ExportError; without one, a ready
    config made for this export."""
    module = _trainer(plan.to)
    want = fields["layers"]["trainer_layer_ids"]
    if given is None:
        made = module.draft_config({"to": plan.to, "format": plan.format, **fields})
        assert module.config_layer_ids(made, plan.format) == want, (made, want)
        return made
    have = module.config_layer_ids(given, plan.format)
    if have is not None and list(have) != list(want):
        raise ExportError(
            f"export: the draft config names layers {list(have)} ({fields['layers']['trainer_config_key']}, "
            f"{plan.to}'s convention), but this export holds {want}: the trainer would train on the wrong layers "
            "without a word. Fix the config, or pass --layers with the ids in our convention "
            f"({fields['layers']['trainer_convention']})")
    if have is None:
        raise ExportError(f"export: the draft config names no layer ids ({fields['layers']['trainer_config_key']}); "
                          f"{plan.to} would fall back to its own defaults: add {want}")
    return given
