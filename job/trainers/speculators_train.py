"""speculators 0.9's own training code, driven on CPU from one of our exports: its TrainConfig resolution, vocabulary
mapping, `build_draft_model`, ArrowDataset / multipack sampler / CollateFn, and `Trainer.train_epoch` (forward,
loss, backward, clipping, optimizer and scheduler steps, metric logging). Only what cannot run without a GPU or a
launcher is bypassed; each such workaround names the error it avoids (`cpu_trainer`).

Two users: train-check (`train` = `train_repeated_batch`: N steps on one batch, proving an export trains) and the
acceptance
benchmark (`train_steps` then `data_loader` over a held-out export: job/trainers/acceptance.py).

Runs in the trainers' environment (.venv-trainers) only; imports nothing from `job` but its own directory. The
library is imported as the top-level ``speculators`` package, never speculators.py beside this file.
"""


import argparse
import contextlib
import importlib
import json
import logging
import os
import shutil
import sys

from job.trainers import speculators
from job.trainers.speculators import flat_config


def import_speculators():
    """Import the installed speculators library, never this directory's speculators.py."""

    here = os.path.dirname(os.path.abspath(__file__))
    mod = sys.modules.get("speculators")
    if mod is not None and os.path.dirname(os.path.abspath(getattr(mod, "__file__", "") or "")) == here:
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


def _linked_data_dir(export_dir: str, data_dir: str) -> str:
    """A directory of links to the export: speculators' parse_vocab_mappings caches d2t-<N>.npy / t2d-<N>.npy in
    --data-path, and nothing may be written into the export itself."""
    shutil.rmtree(data_dir, ignore_errors=True)
    os.makedirs(data_dir)
    for name in os.listdir(export_dir):
        os.symlink(os.path.join(os.path.abspath(export_dir), name), os.path.join(data_dir, name))
    return data_dir


def resolve_args(export_dir: str | None, manifest: dict, config: dict, workdir: str, cpu: bool = True,
                 **overrides) -> argparse.Namespace:
    """speculators' resolved training arguments for this export: the draft config, then `overrides` (TrainConfig
    field names: lr, epochs, ttt_steps, seed, ...), then the CPU settings (`cpu`), through the trainer's own
    TrainConfig.from_sources (flag > default, backend defaults backfilled, validation), as `speculators train`
    resolves its flags. `export_dir` None (training on a stream, job/train/): an empty data directory, so the
    draft vocabulary is the target's whole one unless `overrides` name a token_freq_path."""
    import_speculators()
    from speculators.train.config import TrainConfig  # the trainers' environment only
    from speculators.train.config.resolution import _BACKEND_DESTS  # the trainers' environment only
    from speculators.train.config.schema import CONFIG_DESTS  # the trainers' environment only

    flat = flat_config(config)
    fmt = flat.setdefault("speculator_type", manifest["format"])
    if fmt != manifest["format"]:
        raise ValueError(f"config trains {fmt!r} but the export is {manifest['format']!r}")
    flat.setdefault("verifier_name_or_path", manifest["model"])
    work = os.path.abspath(os.path.join(workdir, f"speculators-{fmt}"))
    shutil.rmtree(work, ignore_errors=True)
    flat.update(overrides)
    data_dir = os.path.join(work, "data")
    if export_dir is None:
        os.makedirs(data_dir)
    flat.update(
        data_path=_linked_data_dir(export_dir, data_dir) if export_dir is not None else data_dir,
        save_path=os.path.join(work, "checkpoints"),
        log_dir=os.path.join(work, "logs"),
        logger="",
        no_resume_from_checkpoint=True,
        # A missing sample must fail, not be generated through a vLLM server.
        on_missing="raise",
        # One process: no spawned DataLoader workers.
        num_workers=0,
    )
    # The 'eager' loss (the same sums in plain torch ops) unless the config names one, on every device: the default
    # 'fused' loss is a Triton kernel that fails on CPU ("0 active drivers ([]). There should only be one.") and, on
    # CUDA, inside the draft's torch.compile'd forward with torch 2.11 (dynamo: "ListVariable(length=21) is already
    # tracked for mutation", the kernel's autotune configs; seen on an H100 with speculators 0.9.0).
    flat.setdefault("loss_implementation", "eager")
    if cpu:
        flat.update(
            # CPU: "FlexAttention does not support backward on CPU" with the default
            # 'simple_flex_attention'.
            draft_attn_impl="sdpa",
            # CPU: the trainer's autocast is hard-wired to CUDA (device_type falls back to "cuda" when
            # there is no accelerator) and is disabled on CPU, so bf16 hidden states meet the fp32
            # master weights: DFlash's fc fails with "expected m1 and m2 to have the same dtype, but
            # got: c10::BFloat16 != float" (EAGLE-3 survives only because its input_norm upcasts).
            hidden_states_dtype="float32",
        )
    unknown = sorted(set(flat) - CONFIG_DESTS - _BACKEND_DESTS)
    if unknown:
        raise ValueError(f"not speculators TrainConfig fields: {unknown}")
    cfg = TrainConfig.from_sources(
        cli={k: v for k, v in flat.items() if k in CONFIG_DESTS},
        backend_cli={k: v for k, v in flat.items() if k in _BACKEND_DESTS},
        argv=["speculators", "train", "(job.trainers.speculators_train)"],
    )
    return argparse.Namespace(**cfg.flatten())  # exactly what speculators.train.cli.main does


def build_model(args):
    """(model class, draft model): the trainer's own vocab mapping and build_draft_model, after its set_seed; its
    verifier norm replaced by the target's own where the two disagree (`with_the_target_s_final_norm`)."""
    from speculators.model import SpeculatorModel  # the trainers' environment only
    from speculators.train import cli as sp_cli  # the trainers' environment only

    sp_cli.set_seed(args.seed)
    d2t, t2d, draft_vocab_size = sp_cli.parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry[args.speculator_type]
    model = sp_cli.build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)
    with_the_target_s_final_norm(model, args.verifier_name_or_path)
    return model_class, model


def target_final_norm(model_dir: str):
    """The target's own final norm module (its class, built on the meta device from its config) with the
    checkpoint's weight, in float32, on the CPU (job/target_weights.py: the export's and this one lookup of it)."""
    from job.target_weights import load_final_norm  # heavy (torch, transformers): imported on use

    return load_final_norm(model_dir, "float32").requires_grad_(False)


def with_the_target_s_final_norm(model, model_dir: str) -> bool:
    """Workaround (speculators 0.9, Qwen3.5/3.6 targets): speculators builds the verifier's final norm as a
    LlamaRMSNorm (weight * x̂) and loads the target's weight into it; Qwen3.5's norm computes (1 + weight) * x̂, with a
    weight near 0. The draft's targets (verifier_lm_head(verifier_norm(last hidden state))) are then noise: on the
    tiny hybrid's greedy completions their argmax is the target's own next token at 0 % of positions, and at 100 %
    with the target's own norm (bench/bench_acceptance.py's `data_is_target_argmax`). Where the two norms disagree
    on a probe, the target's own module replaces speculators'; returns whether it did (the dense Qwen3 agrees)."""
    import torch  # heavy: imported on use

    own = target_final_norm(model_dir)
    theirs = model.verifier_norm
    probe = torch.randn(8, own.weight.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        agree = torch.allclose(theirs(probe.to(theirs.weight.dtype)).float(), own(probe), rtol=1e-2, atol=1e-2)
    if not agree:
        print(f"note: speculators' verifier norm ({type(theirs).__name__}) disagrees with the target's own final "
              f"norm ({type(own).__name__}): the target's is used, or the draft would learn from wrong targets",
              file=sys.stderr, flush=True)
        model.verifier_norm = own.to(theirs.weight.dtype)
    return not agree


def data_loader(args, model, export_dir: str | None = None):
    """The trainer's ArrowDataset (all rows: train_ratio 1.0), file transfer, multipack sampler and CollateFn over
    the export of `args` or, given `export_dir`, over another export (a held-out set), batched as training is."""
    import torch  # heavy: imported on use
    from hs_connectors import HiddenStatesBackend  # the trainers' environment only
    from speculators.models.eagle3.data import shift_batch  # the trainers' environment only
    from speculators.train.data import ArrowDataset  # the trainers' environment only
    from speculators.train.dataloader import _setup_dataloader  # the trainers' environment only

    data_path = args.data_path
    if export_dir is not None:
        data_path = _linked_data_dir(export_dir, os.path.join(os.path.dirname(args.data_path),
                                                              "eval-" + os.path.basename(os.path.abspath(export_dir))))
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, data_path)
    # train_ratio=1.0 (all rows, no validation split); the CLI's create_train_val_loaders would
    # also build a validation loader, which requires train_data_ratio < 1.
    dataset = ArrowDataset(max_len=args.total_seq_len, datapath=data_path, transfer=transfer,
                           on_missing=args.on_missing, train_ratio=1.0, split="train",
                           hidden_states_dtype=getattr(torch, args.hidden_states_dtype),
                           model=args.verifier_name_or_path)
    return _setup_dataloader(dataset, args.total_seq_len, model.config.transformer_layer_config.hidden_size,
                             num_workers=args.num_workers, num_target_layers=len(model.target_layer_ids),
                             prefetch_factor=args.prefetch_factor,
                             preprocess={"eagle3": shift_batch}.get(args.speculator_type),  # as cli.main's
                             seed=args.seed)


def trainer_config(args, model_class, max_steps):
    import torch  # heavy: imported on use
    from speculators.train import trainer as sp_trainer  # the trainers' environment only

    train_call_kwargs, val_call_kwargs = model_class.get_trainer_kwargs(**vars(args))
    return sp_trainer.TrainerConfig(
        num_epochs=args.epochs, save_path=args.save_path, lr=args.lr,
        resume_from_checkpoint=not args.no_resume_from_checkpoint,
        train_call_kwargs=train_call_kwargs, val_call_kwargs=val_call_kwargs,
        optimizer=args.optimizer, weight_decay=args.weight_decay, muon_lr=args.muon_lr,
        muon_momentum=args.muon_momentum, muon_weight_decay=args.muon_weight_decay,
        muon_ns_steps=args.muon_ns_steps, muon_adjust_lr_fn=args.muon_adjust_lr_fn,
        scheduler_type=args.scheduler_type, scheduler_warmup_steps=args.scheduler_warmup_steps,
        scheduler_warmup_ratio=args.scheduler_warmup_ratio, scheduler_total_steps=args.scheduler_total_steps,
        scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles, checkpoint_freq=args.checkpoint_freq,
        save_best=args.save_best, hidden_states_dtype=getattr(torch, args.hidden_states_dtype), log_freq=1,
        fsdp_shard=args.fsdp_shard, gradient_checkpointing=args.gradient_checkpointing, max_steps=max_steps,
    )


@contextlib.contextmanager
def cpu_trainer(model, seed: int | None):
    """speculators' Trainer on CPU, recording what it logs. Yields (logged, norms): the trainer's per-step "train"
    metrics and the gradient norm its own clipping computes. `seed`: re-seed before every forward (DFlash draws its
    anchors inside forward, so a repeated batch sees the same anchors); None leaves the random stream alone."""
    import torch  # heavy: imported on use
    from speculators.train import trainer as sp_trainer  # the trainers' environment only

    logged, norms = [], []

    class _Capture(logging.Handler):
        def emit(self, record):
            if isinstance(record.msg, dict) and "train" in record.msg:
                logged.append(dict(record.msg["train"]))

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
    hook = None
    if seed is not None:
        def _reseed(module, inputs):
            torch.manual_seed(seed)  # returns None: the forward's inputs are left unchanged

        hook = model.register_forward_pre_hook(_reseed)
    try:
        yield logged, norms
    finally:
        if hook is not None:
            hook.remove()
        sp_trainer.get_local_rank = saved_get_local_rank
        torch.accelerator.synchronize = saved_sync
        torch.nn.utils.clip_grad_norm_ = real_clip
        metric_logger.removeHandler(handler)
        metric_logger.setLevel(saved_logger[0])
        metric_logger.propagate = saved_logger[1]


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


def train_repeated_batch(export_dir: str, manifest: dict, config: dict, steps: int, workdir: str) -> list:
    """Run `steps` optimizer steps of speculators' own training code on ONE repeated batch.

    Returns one dict per step: {"step", "loss", "grad_norm", "accuracy"}:
      loss      the trainer's logged loss (its loss_sum / loss_total: the tensor it backpropagates;
                for EAGLE-3 the sum over its TTT steps);
      grad_norm the total gradient norm over trainable parameters after backward and before
                clipping (the value the trainer's own clip_grad_norm_(params, 1.0) call computes);
      accuracy  the trainer's accuracy for the FIRST drafted position: EAGLE-3 "full_acc_0" (TTT
                step 0), DFlash "position_1_acc" (block slot 1, the first token after the anchor).
    """
    from speculators.train import trainer as sp_trainer  # the trainers' environment only
    from torch.utils.data import DataLoader  # heavy: imported on use

    args = resolve_args(export_dir, manifest, config, workdir, epochs=1, max_steps=steps)
    model_class, model = build_model(args)
    batch = next(iter(data_loader(args, model)))
    repeated = DataLoader(_RepeatedBatch(batch, steps), batch_size=None, collate_fn=_identity)
    with cpu_trainer(model, seed=args.seed) as (logged, norms):
        sp_trainer.Trainer(model, trainer_config(args, model_class, args.max_steps), repeated, None).train_epoch(0)
    if len(logged) != steps or len(norms) != steps:
        raise RuntimeError(f"expected {steps} logged steps, got {len(logged)} metrics, {len(norms)} norms")
    acc_key = "full_acc_0" if args.speculator_type == "eagle3" else "position_1_acc"
    return [{"step": i, "loss": float(m["loss"]), "grad_norm": norms[i], "accuracy": float(m[acc_key])}
            for i, m in enumerate(logged)]


draft_config = speculators.draft_config  # train-check asks the trainer's module for both (check.py)


def train(export_dir: str, manifest: dict, config: dict, steps: int, workdir: str) -> list:
    """train-check's entry (check.py): the same signature as specforge.train."""
    return train_repeated_batch(export_dir, manifest, config, steps, workdir)


def train_steps(export_dir: str, manifest: dict, config: dict, workdir: str, steps: int, **overrides):
    """Train as `speculators train` would on the whole export, for exactly `steps` optimizer steps: as many passes
    (epochs) of the trainer's own shuffled multipack loader through Trainer.train_epoch as that takes, the last one
    cut at `steps` (its max_steps, over which its LR schedule decays). The same number of steps on every training
    set is the same compute, whatever their sizes. Returns (args, draft model, logged steps, epochs)."""
    from speculators.train import trainer as sp_trainer  # the trainers' environment only

    args = resolve_args(export_dir, manifest, config, workdir, **overrides)
    model_class, model = build_model(args)
    loader = data_loader(args, model)
    args.epochs = -(-steps // len(loader))
    args.max_steps = steps
    with cpu_trainer(model, seed=None) as (logged, norms):
        trainer = sp_trainer.Trainer(model, trainer_config(args, model_class, steps), loader, None)
        # Passes until `steps` steps are taken: the multipack loader's len() is its estimate, and a pass can give a
        # batch fewer (29 of 30 steps in a fresh-clone run, 2026-12-06), so ceil(steps / len) passes can fall short.
        # Bounded: a loader that gives no batch at all ends the loop and the check below names it.
        epoch = 0
        while trainer.global_step < steps and epoch < 2 * args.epochs + 2:  # train_epoch looks only after a step
            trainer.train_epoch(epoch)
            epoch += 1
    if len(logged) != steps:
        raise RuntimeError(f"expected {steps} steps, the trainer logged {len(logged)}")
    return args, model, [dict(m, grad_norm=n) for m, n in zip(logged, norms)], round(steps / len(loader), 2)


MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def served_rope(config: dict, model) -> None:
    """Make a saved draft's layer config (in place) name the rotary embedding the draft was trained with. A draft's
    layer config starts from the target's text config, and Qwen3.5/3.6 name two things there:
    - M-RoPE sections (`rope_parameters.mrope_section`, for vision inputs): vLLM refuses a DFlash draft that has them
      ("Speculative Decoding with draft models or parallel drafting does not support M-RoPE yet"; vLLM 0.26 on an
      H100, 0.32 has the same check), so a DFlash draft of Qwen3.6 would not load. On text they change nothing
      (every M-RoPE row is the token's position), and the draft trained with a 1-D rotary.
    - `partial_rotary_factor` 0.25: transformers' default rotary, which the draft's layers build, rotates the whole
      head whatever the factor, while vLLM's `get_rope` rotates a quarter of it. speculators rewrites it to 1.0 (its
      `mrope_full_head_hack`, on by default); the factor written here is the draft's own rotary module's (its inverse
      frequencies × 2 / head dim), so a draft built any other way is served as it trained too."""
    layer = config.get("transformer_layer_config") or {}
    params = layer.get("rope_parameters")
    if not isinstance(params, dict):
        return
    if config.get("speculators_model_type") == "dflash":  # EAGLE-3 drafts are served with them (same on text)
        for name in MROPE_KEYS:
            params.pop(name, None)
    rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rotary is not None and getattr(rotary, "inv_freq", None) is not None:
        head_dim = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
        trained = 2 * int(rotary.inv_freq.shape[-1]) / head_dim  # the share of each head the draft rotates
        if params.get("partial_rotary_factor", 1.0) != trained:
            params["partial_rotary_factor"] = trained
        if "partial_rotary_factor" in layer:  # older configs keep it beside rope_parameters; vLLM moves it in
            layer["partial_rotary_factor"] = trained


def save_draft(model, args, path: str, speculative_tokens: int | None = None) -> str:
    """Save a trained draft as the trainer's own checkpointer does at an epoch's end (Checkpointer.save_checkpoint:
    the state dict in bf16, `save_pretrained`, `patch_config_dtype`), a directory vLLM serves as it is
    (`speculative_config={"model": path, "method": "eagle3"}`, or `LLM(model=path)`, which finds the target in
    the config's `speculators_config.verifier.name_or_path`). The verifier path is written absolute (the export
    may name it relative to where the bench ran) and, given `speculative_tokens`, the proposal's draft length is
    the one the draft was scored at. Returns `path`."""
    from pathlib import Path

    import torch  # heavy: imported on use
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype  # the trainers' env only

    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    model.save_pretrained(path, state_dict=convert_float_dtype(model.state_dict(), torch.bfloat16))
    config_path = os.path.join(path, "config.json")
    patch_config_dtype(Path(config_path), torch.bfloat16)
    with open(config_path) as f:
        config = json.load(f)
    spec = config["speculators_config"]
    spec["verifier"]["name_or_path"] = os.path.abspath(args.verifier_name_or_path)
    if speculative_tokens is not None:
        for method in spec["proposal_methods"]:
            method["speculative_tokens"] = speculative_tokens
    served_rope(config, model)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return path
