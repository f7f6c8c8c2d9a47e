"""The pieces of the target model's weights that the job and the trainers both need, read from its directory:
its decoder stack (the module every forward here runs) and its final norm (applied to the last stored layer for a
trainer that reads it after the norm: SpecForge's EAGLE-3 `hidden_state`, speculators' verifier norm).

Exact, not approximated: the norm module is the model's own class (built on the meta device from the target's
config, so no weight but this one is read), its weight cast to the dtype asked for. Qwen3's RMSNorm multiplies by
`weight` in the model dtype, Qwen3.5's by `1 + weight` in float32: using the model's own module keeps each right.
torch and transformers are imported on use; nothing here needs Ray (the trainers' environment imports it too).
"""

from __future__ import annotations

import json
import os

from job.config import ConfigError


def torch_dtypes() -> dict:
    import torch  # heavy: imported on use

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "float8_e4m3fn": torch.float8_e4m3fn}


def torch_dtype(name: str):
    return torch_dtypes()[name]


def decoder_stack(model):
    """The module holding `embed_tokens`, `layers` and `norm` (Qwen3Model inside Qwen3ForCausalLM, a
    multimodal model's language model, ...): calling it runs embeddings + decoder layers, never the LM head."""
    import torch  # heavy: imported on use

    for _, module in model.named_modules():
        if (isinstance(getattr(module, "layers", None), torch.nn.ModuleList) and hasattr(module, "norm")
                and hasattr(module, "embed_tokens")):
            return module
    raise ValueError(f"{type(model).__name__}: no decoder stack (a module with embed_tokens, layers, norm) found; "
                     "the transformers backend supports Llama/Qwen-style decoder models")


def checkpoint_tensor(model_dir: str, keys: list[str]):
    """The first of `keys` found in the model's safetensors (single file, or sharded with an index); None if none."""
    from safetensors import safe_open  # heavy: imported on use

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {key: weight_map[key] for key in keys if key in weight_map}
    else:
        files = {key: "model.safetensors" for key in keys}
    for key in keys:
        path = os.path.join(model_dir, files[key]) if key in files else None
        if path is None or not os.path.exists(path):
            continue
        with safe_open(path, "pt") as f:
            if key in f.keys():
                return f.get_tensor(key)
    return None


def load_final_norm(model_dir: str, dtype: str):
    """The target's final norm as a torch module on the CPU, weight in `dtype`. Refused with the job's own message
    when the model is not a local directory or its weights are not there (a node staged with config and tokenizer
    only: cluster.yaml's head gets no `*.safetensors`)."""
    import torch  # heavy: imported on use
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: imported on use

    if not os.path.isdir(model_dir):
        raise ConfigError(f"the target model {model_dir!r} is not a local directory here; its config and final norm "
                          "weight are needed to apply the norm to the last stored layer (copy the model there, or "
                          "pass its path)")
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    norm = decoder_stack(model).norm
    name = next(n for n, m in model.named_modules() if m is norm)
    # The checkpoint's key is the module's name, or (Qwen3.5 saved as a ForConditionalGeneration with the text model
    # under language_model) one of the two usual spellings.
    keys = [f"{name}.weight", "model.norm.weight", "model.language_model.norm.weight"]
    weight = checkpoint_tensor(model_dir, keys)
    if weight is None:
        raise ConfigError(f"the target's final norm weight is not in {model_dir} (looked for {keys} in its "
                          "*.safetensors): this machine's copy of the model has no weights (cluster.yaml syncs the "
                          "head's copy without them). Run where the weights are (a worker), or copy the model's "
                          "*.safetensors there")
    norm = norm.to_empty(device="cpu").to(torch_dtype(dtype))
    with torch.no_grad():
        norm.weight.copy_(weight.to(torch_dtype(dtype)))
    return norm.eval()
