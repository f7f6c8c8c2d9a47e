"""Train a draft on a SpecForge 0.2.0 export with SpecForge's own training code, on CPU.

    PYTHONPATH=. /tmp/tv/bin/python -c 'from job.trainers import specforge ...'

`draft_config(manifest)` returns the draft-model JSON a user hands to SpecForge (`model.draft_model_config`);
`train(...)` assembles the run exactly as `specforge train` does for an offline run (typed `Config` ->
`build_application_run` -> draft model, optimizer, DDP backend, the trainer's own feature loader), takes one
batch from that loader and runs `steps` optimizer steps of `TrainerCore.train_step` on it: the strategy's
forward and loss, the backend's backward, the BF16 optimizer's clip and AdamW step.

This module must import nothing from the rest of `job`: it runs in the trainer's virtualenv.
"""

import json
import os
from contextlib import contextmanager

from job.target import text_config

# SpecForge's own example drafts (configs/qwen3-*-dflash.json, qwen3.5-27b-dflash.json) have 5 layers and
# blocks of 16 tokens; every EAGLE-3 example (qwen3-4b-eagle3.json, qwen3.5-4b-eagle3.json) has 1 layer and
# a 32,000-token draft vocabulary.
DFLASH_LAYERS = 5
DFLASH_BLOCK_SIZE = 16
EAGLE3_DRAFT_VOCAB = 32000

# Architecture fields copied from the target's (text) config, as SpecForge's own generator does
# (specforge.training.model_loading._TARGET_ARCHITECTURE_FIELDS, less the rope and sliding-window ones set below).
_TARGET_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
    "attention_dropout", "head_dim", "bos_token_id", "eos_token_id", "pad_token_id",
)

# Samples in the one repeated batch: two, so that one sample without a loss token (EAGLE-3 drops the last
# position of every loss mask) cannot make the batch's loss 0, and no more because on CPU EAGLE-3's loss
# kernel runs in the Triton interpreter at ~4 ms per token per TTT position, forward and backward: a step
# costs ~30 ms per loss token.
BATCH_SIZE = 2
# 3x SpecForge's default 1e-4: with its cosine schedule over 5 steps, 1e-4 moves DFlash's loss by ~12%
# (34.8 -> 30.6 on the random-token export), 3e-4 by ~40%, both falling every step; at 1e-3 it rises again after step 2.
LEARNING_RATE = 3e-4
# EAGLE-3's training-time-test unroll in the check: 3 positions (speculators' default ttt_steps), not SpecForge's 7.
# The same loop and loss at any length >= 2; on CPU each position's loss runs in the Triton interpreter, so the
# check of the tiny demo export took 61.6 s at 7 and 29.3 s at 3 (this 2-core machine, alone, 2026-12-06).
CHECK_TTT_LENGTH = 3


def _text_config(model_dir: str) -> dict:
    """The target's decoder settings (job.target's one rule: a multimodal / hybrid target nests them)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return text_config(json.load(f))


def draft_config(manifest: dict) -> dict:
    """A ready SpecForge draft-model config (the JSON a user passes to SpecForge) for this export. PURE: imports
    only stdlib (json, os); reads the target's config.json from manifest["model"] (a local dir). Must include
    the layer ids (DFlash: dflash_config.target_layer_ids; EAGLE-3: eagle_config.eagle_aux_hidden_state_layer_ids),
    target vocab size, draft vocab size (EAGLE-3), hidden sizes, and be small (a tiny draft: 1 layer) when
    manifest['tiny'] is true, otherwise sized as SpecForge's own example configs for that target would be."""
    target = _text_config(manifest["model"])
    layer_ids = [int(i) for i in manifest["layers"]["trainer_layer_ids"]]
    config = {name: target[name] for name in _TARGET_FIELDS if target.get(name) is not None}
    # The draft's hidden size must be the target's: both drafts embed tokens with the target's embedding and
    # DFlash projects through the target's LM head. Only the depth shrinks for a tiny draft.
    config["vocab_size"] = int(manifest.get("target_vocab_size") or target["vocab_size"])
    config.setdefault("head_dim", target["hidden_size"] // target["num_attention_heads"])
    # The draft has its own plain RoPE: the examples for Qwen3.5 targets keep rope_theta and drop the target's
    # multimodal/partial rotary parameters (rope_scaling null).
    rope = target.get("rope_parameters") or {}
    config["rope_theta"] = rope.get("rope_theta", target.get("rope_theta", 10000.0))
    config["rope_scaling"] = None
    config.update(tie_word_embeddings=False, use_cache=True, torch_dtype="bfloat16")
    if config.get("pad_token_id") is None:
        config["pad_token_id"] = 0  # as SpecForge's generator does

    if manifest["format"] == "dflash":
        num_layers = 1 if manifest.get("tiny") else DFLASH_LAYERS
        config.update(
            architectures=["DFlashDraftModel"],
            auto_map={"AutoModel": "dflash.DFlashDraftModel"},
            model_type="qwen3",
            num_hidden_layers=num_layers,
            num_target_layers=int(target["num_hidden_layers"]),
            block_size=DFLASH_BLOCK_SIZE,
            layer_types=["full_attention"] * num_layers,
            max_window_layers=num_layers,
            sliding_window=None,
            use_sliding_window=False,
            # mask_token_id null: SpecForge resolves it from the target's tokenizer (an unused embedding slot).
            dflash_config={"mask_token_id": None, "target_layer_ids": layer_ids},
        )
    elif manifest["format"] == "eagle3":
        draft_vocab = int(manifest.get("draft_vocab_size") or min(EAGLE3_DRAFT_VOCAB, config["vocab_size"]))
        if draft_vocab > config["vocab_size"]:
            raise ValueError(f"draft vocabulary {draft_vocab} exceeds the target's {config['vocab_size']}")
        config.update(
            architectures=["LlamaForCausalLMEagle3"],
            model_type="llama",
            num_hidden_layers=1,  # SpecForge's EAGLE-3 fixes the draft at one layer, tiny or not
            draft_vocab_size=draft_vocab,
            target_hidden_size=int(target["hidden_size"]),
            eagle_config={"eagle_aux_hidden_state_layer_ids": layer_ids},
        )
    else:
        raise ValueError(f"unknown SpecForge format {manifest['format']!r}: expected 'dflash' or 'eagle3'")
    return config


def config_layer_ids(config: dict, fmt: str) -> list[int] | None:
    """The target layer ids a SpecForge draft config names (None: none, SpecForge would use its defaults)."""
    if fmt == "dflash":
        ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    else:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def _target_copy(model_dir: str, workdir: str) -> tuple[str, str, str]:
    """(target dir SpecForge can read, embedding key, LM-head key).

    Two gaps in SpecForge 0.2.0's EAGLE-3 TargetHead, bridged with a copy of the dir (symlinks) when needed:
    its load_weights reads only `*.index.json` ("No index.json file found in ..."), so a single-file checkpoint
    gets a generated index; and it reads `config.hidden_size` from the top level ("'Qwen3_5Config' object has
    no attribute 'hidden_size'"), so a target with a nested text_config gets a config.json with hidden_size and
    vocab_size copied up. A tied-embedding target has no `lm_head.weight`: its LM head is the embedding.
    """
    from safetensors import safe_open  # heavy: imported on use

    names = sorted(os.listdir(model_dir))
    weight_map = {}
    for name in names:
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                weight_map.update({key: name for key in f.keys()})
    embeddings = [k for k in weight_map if k.endswith("embed_tokens.weight") and "visual" not in k and "mtp" not in k]
    embedding_key = min(embeddings, key=len)  # model.embed_tokens / model.language_model.embed_tokens
    lm_head_key = "lm_head.weight" if "lm_head.weight" in weight_map else embedding_key

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    has_index = any(name.endswith(".index.json") for name in names)
    nested = "hidden_size" not in config
    if has_index and not nested:
        return model_dir, embedding_key, lm_head_key
    copy = os.path.join(workdir, "target")
    os.makedirs(copy, exist_ok=True)
    for name in names:
        link = os.path.join(copy, name)
        if name != "config.json" and not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(model_dir, name)), link)
    if nested:
        text = _text_config(model_dir)
        config.update(hidden_size=text["hidden_size"], vocab_size=text["vocab_size"])
    with open(os.path.join(copy, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if not has_index:
        with open(os.path.join(copy, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return copy, embedding_key, lm_head_key


@contextmanager
def cpu_training_settings():
    """What SpecForge needs to train on a CPU, set for the block and put back after it (the caller's process is left
    as it was; a specforge module imported inside keeps what it read at import). Set before specforge is imported:
    triton reads TRITON_INTERPRET when @triton.jit decorates, dynamo reads TORCHDYNAMO_DISABLE when its config is
    imported.
    - EAGLE-3's loss (specforge.core.loss.LogSoftmaxLoss) is a Triton kernel; launched compiled on CPU tensors:
      "RuntimeError: 0 active drivers ([]). There should only be one." The interpreter runs it on CPU.
    - No error avoided: the first EAGLE-3 step spends ~150 s in torch.compile (specforge.algorithms.eagle3.model has
      @torch.compile helpers); eager gives the same numbers. Set in dynamo's config too, for a torch imported (and
      its config read) before this block."""
    keys = ("TRITON_INTERPRET", "TORCHDYNAMO_DISABLE")
    saved_env = {key: os.environ.get(key) for key in keys}
    os.environ.update({key: "1" for key in keys})
    import torch  # heavy: imported on use

    dynamo_was = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        yield
    finally:
        torch._dynamo.config.disable = dynamo_was
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def train(export_dir: str, manifest: dict, config: dict, steps: int, workdir: str) -> list[dict]:
    """Run `steps` optimizer steps of SpecForge's own training code on ONE repeated batch from export_dir.
    Returns one dict per step: {"step": i, "loss": float, "grad_norm": float, "accuracy": float}.
    Imports specforge lazily (inside the function). workdir: scratch dir for e.g. a copy of the target dir."""
    with cpu_training_settings():
        return _train(export_dir, manifest, config, steps, workdir)


def _specforge_config(export_dir: str, manifest: dict, config: dict, steps: int, workdir: str):
    """SpecForge's Config of a check run over `export_dir`: a copy of the target, the draft config, the export's
    vocabulary map, and the settings a CPU needs."""
    from specforge.config import Config  # the trainers' environment only
    from specforge.runtime.data_plane.offline_reader import list_feature_files  # the trainers' environment only

    fmt = manifest["format"]
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    target_dir, embedding_key, lm_head_key = _target_copy(manifest["model"], workdir)
    config_path = os.path.join(workdir, "draft_config.json")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    mapping = os.path.join(export_dir, "vocab_mapping", "vocab_mapping.pt")
    use_mapping = (
        fmt == "eagle3" and config.get("draft_vocab_size", 0) < config["vocab_size"] and os.path.exists(mapping)
    )
    num_samples = len(list_feature_files(export_dir))
    if num_samples == 0:
        raise ValueError(f"{export_dir} holds no SpecForge feature file (*.ckpt)")

    return Config.model_validate(
        {
            "model": {
                "target_model_path": target_dir,
                "draft_model_config": config_path,
                "embedding_key": embedding_key,
                "lm_head_key": lm_head_key,
                # The export's d2t/t2d map, for a draft vocabulary smaller than the target's. Without the file
                # SpecForge derives the same map from the features (loss-masked input ids, most frequent first).
                "vocab_mapping_path": mapping if use_mapping else "",
            },
            "data": {
                "hidden_states_path": os.path.abspath(export_dir),
                "cache_dir": os.path.join(workdir, "cache"),
                # Workers fork with a copy of the store; in-process loading keeps a 2-core machine free.
                "dataloader_num_workers": 0,
            },
            "training": {
                "strategy": fmt,
                # FSDP: "FSDP needs a non-CPU accelerator device". NO_SHARD makes SpecForge's backend wrap the
                # model in DDP over gloo (specforge.distributed picks gloo for the cpu device) instead.
                "fsdp_sharding": "NO_SHARD",
                # The default flex_attention: "FlexAttention does not support backward on CPU".
                "attention_backend": "sdpa",
                "batch_size": min(BATCH_SIZE, num_samples),
                "max_steps": steps,
                **({"ttt_length": CHECK_TTT_LENGTH} if fmt == "eagle3" else {}),
                "learning_rate": LEARNING_RATE,
                "log_interval": 1,
                "seed": 0,
            },
            "run_id": f"xcheck-{fmt}",
            "output_dir": os.path.join(workdir, "output"),
        }
    )


def _train(export_dir: str, manifest: dict, config: dict, steps: int, workdir: str) -> list[dict]:
    """`train` inside `cpu_training_settings`: SpecForge's run assembled as `specforge train` assembles it, one
    batch, `steps` steps, following specforge.cli._train step by step."""
    import torch.distributed as dist  # heavy: imported on use
    from specforge.application import build_application_run  # the trainers' environment only
    from specforge.distributed import destroy_distributed, init_distributed  # the trainers' environment only
    from specforge.training.strategies.base import StepContext  # the trainers' environment only

    cfg = _specforge_config(export_dir, manifest, config, steps, os.path.abspath(workdir))

    # What `specforge train` does before assembly (specforge.cli._train): the sharding env, the seed, a
    # one-process env:// rendezvous, then SpecForge's own distributed init (gloo on CPU). The env is put back
    # afterwards so the caller's process is left as it was.
    env_keys = ("FSDP_SHARDING", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved_env = {key: os.environ.get(key) for key in env_keys}
    os.environ["FSDP_SHARDING"] = cfg.training.fsdp_sharding
    from accelerate.utils import set_seed  # heavy: imported on use

    set_seed(cfg.training.seed)
    own_group = not dist.is_initialized()
    if own_group:
        # The CLI's own helper: RANK=0, WORLD_SIZE=1, a free loopback MASTER_PORT.
        from specforge.cli import _bootstrap_single_process_env  # the trainers' environment only

        for key in env_keys[1:]:
            os.environ.pop(key, None)
        _bootstrap_single_process_env()
        init_distributed(timeout=cfg.training.dist_timeout)
    try:
        trainer = build_application_run(cfg).trainer
        # One batch from the trainer's own loader: SpecForge's offline reader, feature store, the algorithm's
        # normalizer (EAGLE-3 zeroes the last loss position; DFlash refuses a sample without two consecutive
        # loss tokens) and its collator.
        loader = trainer._loader
        try:
            batch = next(iter(loader))
        finally:
            loader.close()
        # What TrainerController.fit does around each step, without the epoch/data bookkeeping.
        trainer.core.strategy.trainable_module().train()
        results = []
        for step in range(steps):
            out = trainer.core.train_step(batch, ctx=StepContext(global_step=step, total_steps=steps))
            assert out.optimizer_stepped  # accumulation_steps is 1
            results.append(
                {
                    "step": step,
                    # The trainer's own reduced loss: DFlash's CE over its loss terms; EAGLE-3's per-TTT-position
                    # losses weighted 0.8**i. EAGLE-3 counts only positions whose target top-1 token is in the
                    # draft vocabulary (position_mask = loss_mask * t2d[argmax]): if none is, loss and gradient
                    # are exactly 0.
                    "loss": float(out.loss),
                    # BF16Optimizer.step's global L2 norm of the trainable draft parameters' gradients (EAGLE-3's
                    # frozen embedding excluded), taken before it clips them to max_grad_norm 0.5; for DFlash after
                    # TrainerCore divided them by the loss-token count.
                    "grad_norm": float(out.grad_norm),
                    # The trainer's own "acc": DFlash's top-1 hits over its weighted block positions; EAGLE-3's
                    # top-1 hits over loss-masked positions, pooled over the 7 TTT positions.
                    "accuracy": float(out.metrics["acc"]),
                }
            )
        return results
    finally:
        if own_group:
            destroy_distributed()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
