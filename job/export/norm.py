"""The target's final norm, applied by the export to a run that stored the last layer before it.

A run stores the model's last decoder layer before the final norm (what vLLM and speculators read); SpecForge's
EAGLE-3 `hidden_state` (and a DFlash context layer that is the last one) is the same layer after the norm. The norm
is one weight vector of the target, so the export applies it instead of a second stage-2 run.

Exact, not approximated: the norm module is the model's own class (built on the meta device from the target's
config, so no weight but this one is read), its weight cast to the dtype the run computed in, as stage 2 loaded it.
Qwen3's RMSNorm multiplies by `weight` in the model dtype, Qwen3.5's by `1 + weight` in float32: using the model's own
module keeps each right. tests/test_export.py checks the result equals a run that stored the layer after the norm.
"""

from __future__ import annotations

import json
import os

from job.export.trainer_format import ExportError, Plan
from job.hidden_states.packing import decoder_stack
from job.hidden_states.shards import torch_dtype


def _checkpoint_tensor(model_dir: str, keys: list[str]):
    """The first of `keys` found in the model's safetensors (single file, or sharded with an index)."""
    from safetensors import safe_open  # heavy: imported on use

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = json.load(open(index))["weight_map"]
        files = {key: weight_map[key] for key in keys if key in weight_map}
    else:
        files = {key: "model.safetensors" for key in keys}
    for key in keys:
        if key not in files:
            continue
        with safe_open(os.path.join(model_dir, files[key]), "pt") as f:
            if key in f.keys():
                return f.get_tensor(key)
    raise ExportError(f"export: the target's final norm weight is not in {model_dir} (looked for {keys}): the export "
                      "needs it to give SpecForge the last layer after the norm")


def with_final_norm(plan: Plan) -> Plan:
    """`plan` with the target's final norm loaded when it has a layer to pass through it."""
    if plan.norm_slot is not None and plan.final_norm is None:
        plan.final_norm = load_final_norm(plan.model, plan.dtype)
    return plan


def load_final_norm(model_dir: str, dtype: str):
    """The target's final norm as a torch module on the CPU, weight in `dtype` (the run's compute dtype)."""
    import torch  # heavy: imported on use
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: imported on use

    if not os.path.isdir(model_dir):
        raise ExportError(f"export: the run's target model {model_dir!r} is not a local directory; the export needs "
                          "its config and final norm weight (copy the model there, or pass the run's model path)")
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    norm = decoder_stack(model).norm
    name = next(n for n, m in model.named_modules() if m is norm)
    # The checkpoint's key is the module's name, or (Qwen3.5 saved as a ForConditionalGeneration with the text model
    # under language_model) one of the two usual spellings.
    weight = _checkpoint_tensor(model_dir, [f"{name}.weight", "model.norm.weight", "model.language_model.norm.weight"])
    norm = norm.to_empty(device="cpu").to(torch_dtype(dtype))
    with torch.no_grad():
        norm.weight.copy_(weight.to(torch_dtype(dtype)))
    return norm.eval()
