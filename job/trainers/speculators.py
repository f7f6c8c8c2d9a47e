"""Train a tiny vLLM speculators 0.9 draft (EAGLE-3 or DFlash) from one of our exports, on CPU.

The point is to prove that an export in speculators' offline format trains with speculators' OWN
code: its TrainConfig, its vocabulary mapping, its draft model class built by its trainer's
``build_draft_model``, its ArrowDataset / CollateFn / multipack sampler, and its ``Trainer.train_epoch``
(forward, loss, backward, clipping, optimizer and scheduler steps, metric logging). Only what cannot
run without a GPU or a launcher is bypassed; each such workaround names the error it avoids.

This module must not import anything from the rest of the ``job`` package (the trainer's virtualenv
lacks its dependencies). ``draft_config`` uses only the standard library; ``train`` imports torch and
speculators inside the function. The library is imported as the top-level ``speculators`` package,
never this file (Python 3 imports are absolute; ``_import_speculators`` guards against a sys.path
entry pointing at this directory).
"""

from __future__ import absolute_import

import argparse
import importlib
import json
import logging
import os
import shutil
import sys

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
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    # Multimodal / hybrid targets (e.g. Qwen3_5ForConditionalGeneration) nest the decoder config;
    # speculators does the same unwrapping (models.utils.get_verifier_config).
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


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
    "target_layer_ids"), as ``TrainConfig.from_sources(cli=...)`` takes them. "derived" holds facts read from the target (hidden size, vocab, layer count) that
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


def _flat_config(config: dict) -> dict:
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
    ids = _flat_config(config).get("target_layer_ids")
    if ids is None:
        key = "aux_hidden_state_layer_ids" if fmt == "dflash" else "eagle_aux_hidden_state_layer_ids"
        ids = config.get(key)
    return None if ids is None else [int(i) for i in ids]


def _import_speculators():
    """Import the installed speculators library, never this file."""

    here = os.path.dirname(os.path.abspath(__file__))
    mod = sys.modules.get("speculators")
    if mod is not None and os.path.abspath(getattr(mod, "__file__", "") or "") == os.path.abspath(__file__):
        del sys.modules["speculators"]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
    try:
        mod = importlib.import_module("speculators")
    finally:
        sys.path[:] = saved
    if not hasattr(mod, "SpeculatorModel"):
        raise ImportError(f"'speculators' resolved to {mod.__file__}, not the speculators library")
    return mod


class _RepeatedBatch:
    """`steps` fresh copies of one collated batch (the trainer pops keys and moves tensors)."""

    def __init__(self, batch, steps):
        self.batch = batch
        self.steps = steps

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        if i >= self.steps:
            raise IndexError(i)
        return {k: (v.clone() if hasattr(v, "clone") else v) for k, v in self.batch.items()}


def _identity(x):
    return x


def train(export_dir: str, manifest: dict, config: dict, steps: int, workdir: str) -> list:
    """Run `steps` optimizer steps of speculators' own training code on ONE repeated batch.

    Returns one dict per step: {"step", "loss", "grad_norm", "accuracy"}:
      loss      the trainer's logged loss (its loss_sum / loss_total: the tensor it backpropagates;
                for EAGLE-3 the sum over its TTT steps);
      grad_norm the total gradient norm over trainable parameters after backward and before
                clipping (the value the trainer's own clip_grad_norm_(params, 1.0) call computes);
      accuracy  the trainer's accuracy for the FIRST drafted position: EAGLE-3 "full_acc_0" (TTT
                step 0), DFlash "position_1_acc" (block slot 1, the first token after the anchor).
    """

    import torch  # heavy: imported on use

    _import_speculators()
    from hs_connectors import HiddenStatesBackend  # the trainers' environment only
    from speculators.model import SpeculatorModel  # the trainers' environment only
    from speculators.models.eagle3.data import shift_batch  # the trainers' environment only
    from speculators.train import cli as sp_cli  # the trainers' environment only
    from speculators.train import trainer as sp_trainer  # the trainers' environment only
    from speculators.train.config import TrainConfig  # the trainers' environment only
    from speculators.train.config.resolution import _BACKEND_DESTS  # the trainers' environment only
    from speculators.train.config.schema import CONFIG_DESTS  # the trainers' environment only
    from speculators.train.data import ArrowDataset  # the trainers' environment only
    from speculators.train.dataloader import _setup_dataloader  # the trainers' environment only
    from torch.utils.data import DataLoader  # heavy: imported on use

    flat = _flat_config(config)
    fmt = flat.setdefault("speculator_type", manifest["format"])
    if fmt != manifest["format"]:
        raise ValueError(f"config trains {fmt!r} but the export is {manifest['format']!r}")
    flat.setdefault("verifier_name_or_path", manifest["model"])
    work = os.path.abspath(os.path.join(workdir, f"speculators-{fmt}"))
    data_dir = os.path.join(work, "data")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(data_dir)
    # speculators' parse_vocab_mappings caches d2t-<N>.npy / t2d-<N>.npy in --data-path; point it at
    # a directory of links to the export so that nothing is written into the export itself.
    for name in os.listdir(export_dir):
        os.symlink(os.path.join(os.path.abspath(export_dir), name), os.path.join(data_dir, name))

    flat.update(
        data_path=data_dir,
        save_path=os.path.join(work, "checkpoints"),
        log_dir=os.path.join(work, "logs"),
        logger="",
        epochs=1,
        max_steps=steps,
        no_resume_from_checkpoint=True,
        # CPU: "FlexAttention does not support backward on CPU" with the default
        # 'simple_flex_attention'.
        draft_attn_impl="sdpa",
        # CPU: the default 'fused' loss is a Triton GPU kernel; on CPU Triton fails with
        # "0 active drivers ([]). There should only be one."
        loss_implementation="eager",
        # CPU: the trainer's autocast is hard-wired to CUDA (device_type falls back to "cuda" when
        # there is no accelerator) and is disabled on CPU, so bf16 hidden states meet the fp32
        # master weights: DFlash's fc fails with "expected m1 and m2 to have the same dtype, but
        # got: c10::BFloat16 != float" (EAGLE-3 survives only because its input_norm upcasts).
        hidden_states_dtype="float32",
        # A missing sample must fail, not be generated through a vLLM server.
        on_missing="raise",
        # One process: no spawned DataLoader workers.
        num_workers=0,
    )
    unknown = sorted(set(flat) - CONFIG_DESTS - _BACKEND_DESTS)
    if unknown:
        raise ValueError(f"not speculators TrainConfig fields: {unknown}")
    # The trainer's own resolution (flag > default, backend defaults backfilled, validation), as
    # TrainConfig.resolve does for `speculators train` flags.
    cfg = TrainConfig.from_sources(
        cli={k: v for k, v in flat.items() if k in CONFIG_DESTS},
        backend_cli={k: v for k, v in flat.items() if k in _BACKEND_DESTS},
        argv=["speculators", "train", "(job.trainers.speculators)"],
    )
    args = argparse.Namespace(**cfg.flatten())  # exactly what speculators.train.cli.main does
    sp_cli.set_seed(args.seed)

    # --- draft model: the trainer's own vocab mapping + build_draft_model ---------------------
    d2t, t2d, draft_vocab_size = sp_cli.parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry[args.speculator_type]
    model = sp_cli.build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)
    hidden_size = model.config.transformer_layer_config.hidden_size
    num_target_layers = len(model.target_layer_ids)
    hs_dtype = getattr(torch, args.hidden_states_dtype)

    # --- data: the trainer's ArrowDataset, file transfer, multipack sampler and CollateFn ------
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(
        args, args.data_path
    )
    # train_ratio=1.0 (all rows, no validation split); the CLI's create_train_val_loaders would
    # also build a validation loader, which requires train_data_ratio < 1.
    dataset = ArrowDataset(
        max_len=args.total_seq_len,
        datapath=args.data_path,
        transfer=transfer,
        on_missing=args.on_missing,
        train_ratio=1.0,
        split="train",
        hidden_states_dtype=hs_dtype,
        model=args.verifier_name_or_path,
    )
    preprocess = {"eagle3": shift_batch}.get(args.speculator_type)  # as cli.main's preprocess_fns
    loader = _setup_dataloader(
        dataset,
        args.total_seq_len,
        hidden_size,
        num_workers=args.num_workers,
        num_target_layers=num_target_layers,
        prefetch_factor=args.prefetch_factor,
        preprocess=preprocess,
        seed=args.seed,
    )
    batch = next(iter(loader))
    repeated = DataLoader(_RepeatedBatch(batch, steps), batch_size=None, collate_fn=_identity)

    train_call_kwargs, val_call_kwargs = model_class.get_trainer_kwargs(**vars(args))
    trainer_config = sp_trainer.TrainerConfig(
        num_epochs=args.epochs,
        save_path=args.save_path,
        lr=args.lr,
        resume_from_checkpoint=not args.no_resume_from_checkpoint,
        train_call_kwargs=train_call_kwargs,
        val_call_kwargs=val_call_kwargs,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        muon_lr=args.muon_lr,
        muon_momentum=args.muon_momentum,
        muon_weight_decay=args.muon_weight_decay,
        muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr_fn=args.muon_adjust_lr_fn,
        scheduler_type=args.scheduler_type,
        scheduler_warmup_steps=args.scheduler_warmup_steps,
        scheduler_warmup_ratio=args.scheduler_warmup_ratio,
        scheduler_total_steps=args.scheduler_total_steps,
        scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
        checkpoint_freq=args.checkpoint_freq,
        save_best=args.save_best,
        hidden_states_dtype=hs_dtype,
        log_freq=1,
        fsdp_shard=args.fsdp_shard,
        gradient_checkpointing=args.gradient_checkpointing,
        max_steps=args.max_steps,
    )

    # --- capture what the trainer logs and the norm its clipping computes ---------------------
    logged = []

    class _Capture(logging.Handler):
        def emit(self, record):
            if isinstance(record.msg, dict) and "train" in record.msg:
                logged.append(dict(record.msg["train"]))

    norms = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def _recording_clip(parameters, *a, **kw):
        # Not a workaround: records the pre-clipping total norm that the trainer's own call
        # computes and discards, then returns it unchanged.
        total = real_clip(parameters, *a, **kw)
        norms.append(float(total))
        return total

    metric_logger = logging.getLogger("speculators.metrics")
    handler = _Capture(level=logging.INFO)
    saved_logger = (metric_logger.level, metric_logger.propagate)
    saved_sync = torch.accelerator.synchronize
    saved_get_local_rank = sp_trainer.get_local_rank

    metric_logger.setLevel(logging.INFO)  # its metric logger is only configured by cli.main
    metric_logger.propagate = False
    metric_logger.addHandler(handler)
    torch.nn.utils.clip_grad_norm_ = _recording_clip
    if not torch.accelerator.is_available():
        # CPU: the trainer's step timer calls torch.accelerator.synchronize() at every logged
        # step: "Cannot access accelerator device when none is available".
        torch.accelerator.synchronize = lambda *a, **kw: None
        # CPU: without torchrun, get_local_rank() is 0 and Trainer.setup_model does
        # model.to(0) (and every step batch.to(0)), an accelerator device index: "Cannot access
        # accelerator device when none is available" (trainer.py, self.model.to(self.local_rank)).
        sp_trainer.get_local_rank = lambda: "cpu"
    # DFlash draws its anchor positions inside forward (models.dflash.utils.select_anchors,
    # torch.randperm). Re-seeding before every forward makes each step see the same anchors, so
    # the batch is repeated exactly; EAGLE-3's forward draws no random numbers.
    def _reseed(module, inputs):
        torch.manual_seed(args.seed)  # returns None: the forward's inputs are left unchanged

    seed_hook = model.register_forward_pre_hook(_reseed)
    try:
        trainer = sp_trainer.Trainer(model, trainer_config, repeated, None)
        trainer.train_epoch(0)
    finally:
        seed_hook.remove()
        sp_trainer.get_local_rank = saved_get_local_rank
        torch.accelerator.synchronize = saved_sync
        torch.nn.utils.clip_grad_norm_ = real_clip
        metric_logger.removeHandler(handler)
        metric_logger.setLevel(saved_logger[0])
        metric_logger.propagate = saved_logger[1]

    if len(logged) != steps or len(norms) != steps:
        raise RuntimeError(f"expected {steps} logged steps, got {len(logged)} metrics, {len(norms)} norms")
    acc_key = "full_acc_0" if fmt == "eagle3" else "position_1_acc"
    return [
        {
            "step": i,
            "loss": float(m["loss"]),
            "grad_norm": norms[i],
            "accuracy": float(m[acc_key]),
        }
        for i, m in enumerate(logged)
    ]
