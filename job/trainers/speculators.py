"""speculators 0.9 drafts (EAGLE-3 or DFlash) from one of our exports: the ready draft config a user hands to
speculators' trainer (`draft_config`) and the layer ids a config names (`config_layer_ids`).

Imported by the job (export/manifest.py) and by the trainers' side (speculators_train.py, which trains with
speculators' own code): standard library only, nothing else from `job`.
"""


import json
import os

from job.target import text_config

# Eagle3SpeculatorConfig.draft_vocab_size and DFlashSpeculatorConfig.draft_vocab_size default to
# 32000 (speculators/models/{eagle3,dflash}/config.py).
SPECULATORS_DEFAULT_DRAFT_VOCAB = 32000
# speculators' own per-type default number of draft layers (TrainConfig._resolve_derived_defaults).
_DEFAULT_NUM_LAYERS = {"eagle3": 1, "dflash": 5}
_DRAFT_ARCH = {"eagle3": "llama", "dflash": "qwen3"}

# Tiny (CPU smoke) settings. The collator pads every batch to total_seq_len and the CPU attention
# path ('sdpa') materialises dense masks of total_seq_len x (ttt_steps * total_seq_len) for EAGLE-3
# and (max_anchors * block_size) x (total_seq_len + max_anchors * block_size) for DFlash, so both
# are kept small. Samples longer than total_seq_len are truncated by speculators' own sampler.
_TINY_TOTAL_SEQ_LEN = 256
_TINY_MAX_ANCHORS = 128


def _target_text_config(model_dir):
    """The target's decoder settings (job.target's one rule; speculators unwraps the same way:
    models.utils.get_verifier_config)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return text_config(json.load(f))


def _trainer_layer_ids(manifest, num_layers):
    layers = manifest.get("layers") or {}
    ids = layers.get("trainer_layer_ids")
    if ids is None and layers.get("our_layer_ids") is not None:
        ids = [int(i) + 1 for i in layers["our_layer_ids"]]  # speculators id = ours + 1
    if not ids:
        raise ValueError("manifest['layers'] has neither 'trainer_layer_ids' nor 'our_layer_ids'")
    ids = [int(i) for i in ids]
    # Same check as speculators.models.utils.resolve_target_layer_ids: distinct, within [0, n].
    if min(ids) < 0 or max(ids) > num_layers or len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {ids} invalid for a {num_layers}-layer target")
    return ids


def _mask_token_id(model_dir, vocab_size):
    """The draft mask token speculators' `resolve_mask_token_id` (train/utils.py) would pick, worked out from
    tokenizer.json: `<|MASK|>` added at len(tokenizer) when the embedding has unused slots. Given explicitly, it
    spares speculators `AutoProcessor.from_pretrained(verifier)`, which for a multimodal target (Qwen3.5/3.6) builds
    the image processor too: "Can't load image processor for ..." without a preprocessor_config.json (the tiny
    hybrid fixture), and torchvision, which the trainers' environment leaves out, with one. None: let it resolve."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        tok = json.load(f)
    ids = set((tok.get("model") or {}).get("vocab", {}).values()) | {t["id"] for t in tok.get("added_tokens", [])}
    size = max(ids) + 1 if ids else 0
    return size if 0 < size < vocab_size else None


def draft_config(manifest: dict) -> dict:
    """A ready speculators draft config for this export: what a user passes to speculators' trainer.

    Returns a flat dict whose keys (except "derived") are speculators ``TrainConfig`` field names,
    i.e. the CLI flags of ``speculators train`` with '-' written '_' (``--target-layer-ids`` ->
    "target_layer_ids"), as ``TrainConfig.from_sources(cli=...)`` takes them. "derived" holds facts read from the
    target (hidden size, vocab, layer count) that
    speculators derives itself from the verifier and that are not trainer flags.
    PURE: standard library only; reads ``manifest["model"]/config.json``.
    """
    fmt = manifest["format"]
    if fmt not in _DRAFT_ARCH:
        raise ValueError(f"format {fmt!r}: speculators trainer supports 'eagle3' and 'dflash' here")
    model_dir = manifest["model"]
    text = _target_text_config(model_dir)
    num_target_layers = int(text["num_hidden_layers"])
    target_vocab = int(text["vocab_size"])
    hidden_size = int(text["hidden_size"])
    ids = _trainer_layer_ids(manifest, num_target_layers)
    tiny = bool(manifest.get("tiny"))

    cfg = {
        "speculator_type": fmt,
        "verifier_name_or_path": model_dir,
        "target_layer_ids": ids,
        # Never more than the target has (speculators' 32000 default exceeds a tiny target's vocab).
        "draft_vocab_size": min(SPECULATORS_DEFAULT_DRAFT_VOCAB, target_vocab),
        "num_layers": 1 if tiny else _DEFAULT_NUM_LAYERS[fmt],
        "draft_arch": _DRAFT_ARCH[fmt],
        "hidden_states_backend": "file",
        # The export holds every sample's hidden states; the default 'generate' would ask a vLLM
        # server for a missing one instead of failing.
        "on_missing": "raise",
        "seed": 0,
    }
    mask = _mask_token_id(model_dir, target_vocab)
    if mask is not None:
        cfg["mask_token_id"] = mask
    if manifest.get("output"):
        cfg["data_path"] = manifest["output"]
    if tiny:
        cfg["total_seq_len"] = _TINY_TOTAL_SEQ_LEN
        if fmt == "dflash":
            cfg["max_anchors"] = _TINY_MAX_ANCHORS
    cfg["derived"] = {
        "target_hidden_size": hidden_size,
        "draft_hidden_size": hidden_size,  # speculators requires draft hidden == verifier hidden
        "target_vocab_size": target_vocab,
        "target_num_hidden_layers": num_target_layers,
        "num_aux_hidden_states": len(ids),
        # Each hidden_states/hs_<i>.safetensors row holds the aux layers then the last slot
        # (last decoder layer, before the final norm): [seq, len(ids) + 1, hidden].
        "hidden_states_per_token": len(ids) + 1,
        "target_model_type": text.get("model_type"),
    }
    return cfg


# speculators' TrainConfig groups (speculators/train/config/schema.py _GROUPS): a run.yaml / --config file nests
# the flat fields under these (optionally inside a "train:" stage block).
_TRAIN_CONFIG_GROUPS = ("verifier", "draft", "data", "generation", "loss", "optimizer", "scheduler", "trainer",
                        "logging", "dflash", "dflash2", "dspark", "xpress", "peagle", "mtp", "backend")


def flat_config(config: dict) -> dict:
    """A speculators trainer config as flat TrainConfig fields: accepts this module's draft_config, a
    `speculators train` run.yaml / --config mapping (optionally under "train:", fields nested by group) and
    CLI-style dashed names. Drops "derived"."""
    cfg = config.get("train") if isinstance(config.get("train"), dict) else config
    flat = {}
    for key, value in cfg.items():
        if key == "derived":
            continue
        if key in _TRAIN_CONFIG_GROUPS and isinstance(value, dict):
            flat.update({k.lstrip("-").replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.lstrip("-").replace("-", "_")] = value
    return flat


def config_layer_ids(config: dict, fmt: str):
    """The target layer ids (speculators' convention) a speculators draft config names, or None when it names
    none (the trainer would fall back to its default [2, n // 2, n - 3]). Reads a training config (this module's
    draft_config, a run.yaml / --config mapping, CLI-style names) or a saved speculator config.json
    (eagle_aux_hidden_state_layer_ids for EAGLE-3, aux_hidden_state_layer_ids for DFlash). PURE (stdlib)."""
    ids = flat_config(config).get("target_layer_ids")
    if ids is None:
        key = "aux_hidden_state_layer_ids" if fmt == "dflash" else "eagle_aux_hidden_state_layer_ids"
        ids = config.get(key)
    return None if ids is None else [int(i) for i in ids]
