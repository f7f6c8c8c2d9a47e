"""The target model as its config.json says it is: the one place its shape is read (no weights are loaded).

Qwen3.5/3.6 checkpoints are multimodal wrappers (`*ForConditionalGeneration`) with the decoder's settings under
`text_config`; a dense Qwen3 has them at the top. Everything here reads through that difference once.
(job/trainers/ reads config.json itself: it runs in the trainers' environment and imports nothing of the job.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from job.config import ConfigError


@dataclass(frozen=True)
class TargetShape:
    num_layers: int
    hidden_size: int
    vocab_size: int
    architecture: str
    hybrid: bool
    """Gated DeltaNet (or other linear-attention) layers beside attention: Qwen3.5/3.6, Qwen3-Next."""


def config_json(model: str) -> dict:
    """The model directory's config.json as it is, or {} (a hub name, or no such file)."""
    path = os.path.join(model, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def text_config(config: dict) -> dict:
    """The decoder's settings: `text_config` of a multimodal wrapper, else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def is_hybrid(config: dict) -> bool:
    return "linear_attention" in (text_config(config).get("layer_types") or [])


def mtp_layers(config: dict) -> int:
    """The layers of the model's own multi-token-prediction head (Qwen3.5/3.6 `mtp_num_hidden_layers`, DeepSeek's
    `num_nextn_predict_layers`); 0: it has none. vLLM serves it as a draft with `{"method": "mtp"}`."""
    text = text_config(config)
    return int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0)


def is_multimodal(config: dict) -> bool:
    """A `*ForConditionalGeneration` checkpoint (a vision tower beside the language model)."""
    architectures = config.get("architectures") or []
    return bool(architectures) and all(a.endswith("ForConditionalGeneration") for a in architectures)


def shape(model: str) -> TargetShape:
    """Layers, hidden and vocabulary size, architecture of `model` (a directory, or a name transformers resolves)."""
    from transformers import AutoConfig  # keeps `python -m job --help` fast

    try:
        cfg = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {model!r}: cannot read its config ({e})") from None
    text = cfg.get_text_config()
    return TargetShape(num_layers=int(text.num_hidden_layers), hidden_size=int(text.hidden_size),
                       vocab_size=int(text.vocab_size), architecture=(cfg.architectures or ["?"])[0],
                       hybrid="linear_attention" in (getattr(text, "layer_types", None) or []))


def facts(model: str) -> dict:
    """The target as an export's manifest names it."""
    config = config_json(model)
    if not config:
        return {"model": model}
    text = text_config(config)
    return {"model": model, "architecture": (config.get("architectures") or ["?"])[0],
            "num_layers": text.get("num_hidden_layers"), "hidden_size": text.get("hidden_size"),
            "vocab_size": text.get("vocab_size"), "hybrid": is_hybrid(config),
            # The project's own fixtures (job/builtin/tiny_model.py writes build_info.json): a tiny draft fits them.
            "tiny": os.path.exists(os.path.join(model, "build_info.json"))}
