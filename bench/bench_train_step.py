"""One training step of `python -m job train` on the Qwen3.6-27B shape: its time and GPU memory by sequence length,
the figures `plan` sizes the training GPUs with.

    python bench/bench_train_step.py --format eagle3 --seq-lens 4096,8192,16384 [--draft-vocab 32000] --out F.json

The step is the job's own (job/train/step.py `OnlineDraftStep`: speculators' draft model, its collate and loss,
clipping, the optimizer), built from the config `train` builds for the run's target (job/train/run.py
`draft_config_of`, the trainer's default layers). The target is bench/dummy_model.py's 27B-shaped directory with
the three tensors training reads from it written as random bf16 safetensors (the input embedding and the LM head,
248,320 × 5,120 each, and the final norm): ~5 GB, written once. Each sample is one sequence of random hidden
states (aux layers + last, bf16) filling the pack (`total_seq_len` = the sequence length); the loss mask is all
ones. Per length: 2 warm-up steps (torch.compile), then the median of `--steps` timed steps, with
`torch.cuda.max_memory_allocated` over the whole (weights, optimizer state, activations).

The draft's output vocabulary is what `train` picks (job/train/vocab.py): speculators' 32,000 ids, the most frequent
of the run's tokens (here of random counts); `--draft-vocab 0` gives it the target's whole vocabulary (248,320 ids:
what speculators trains when no token counts reach it), `--draft-vocab N` N ids. Meant for a GPU; on CPU it runs
too, slowly (a smoke test on a small target: `--model .cache/tiny-hybrid`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def ensure_weights(model_dir: str) -> None:
    """model.safetensors with what training reads from the target: embedding, LM head, final norm (random)."""
    import torch
    from safetensors.torch import save_file

    path = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(path):
        return
    text = json.load(open(os.path.join(model_dir, "config.json")))["text_config"]
    vocab, hidden = text["vocab_size"], text["hidden_size"]
    g = torch.Generator().manual_seed(0)
    tensors = {"model.language_model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02),
               "lm_head.weight": (torch.randn(vocab, hidden, generator=g) * 0.02),
               # Qwen3.5's norm is (1 + weight) * x̂: a weight near 0
               "model.language_model.norm.weight": torch.randn(hidden, generator=g) * 0.02}
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def draft_config(model_dir: str, fmt: str) -> dict:
    """The config `train` builds for a run of this target (job/train/run.py draft_config_of)."""
    from job.config import from_dict
    from job.train.options import TrainOptions
    from job.train.run import draft_config_of

    config = from_dict({"model": model_dir, "output": "/tmp/unused-run"})
    return draft_config_of(config, TrainOptions(format=fmt, stream=True))  # stream: no stored parts needed


def token_counts(target_vocab: int) -> dict[int, int]:
    """Stand-in counts of the run's output tokens (`train` counts the real ones, job/train/vocab.py): random, so the
    draft's ids are an arbitrary 32,000 of the target's. The step's cost does not depend on which."""
    import torch

    counts = torch.randint(1, 1000, (target_vocab,), generator=torch.Generator().manual_seed(1))
    return {i: int(c) for i, c in enumerate(counts)}


def sample_of(step, seq_len: int, aux: int, hidden: int, vocab: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seq_len)
    hs = torch.randn(seq_len, aux + 1, hidden, generator=g).to(step.hidden_dtype)
    ids = torch.randint(0, vocab, (seq_len,), generator=g)
    return step.sample(ids, hs, torch.ones(seq_len, dtype=torch.long))


def measure(model_dir: str, fmt: str, seq_len: int, draft_vocab: int | None, steps: int, warmup: int) -> dict:
    import torch

    from job.train.step import OnlineDraftStep
    from job.train.vocab import needs_mapping

    cuda = torch.cuda.is_available()
    cfg = draft_config(model_dir, fmt)
    derived = cfg["derived"]
    with tempfile.TemporaryDirectory() as work:
        target_vocab = derived["target_vocab_size"]
        if draft_vocab is not None:
            cfg["draft_vocab_size"] = draft_vocab or target_vocab
        # As `train` (job/train/run.py): the run's token counts where the draft's vocabulary is the smaller.
        token_freq = token_counts(target_vocab) if needs_mapping(cfg) else None
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        step = OnlineDraftStep(cfg, fmt, model_dir, work, token_freq=token_freq, total_seq_len=seq_len)
        built_s = time.perf_counter() - started
        params = sum(p.numel() for p in step.model.parameters())
        trainable = sum(p.numel() for p in step.model.parameters() if p.requires_grad)
        sample = sample_of(step, seq_len, derived["num_aux_hidden_states"], derived["target_hidden_size"],
                           derived["target_vocab_size"])
        times, result = [], {}
        for i in range(warmup + steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = step.step([sample])
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        draft_vocab_size = int(step.model.config.draft_vocab_size)
        del step
    median = statistics.median(times)
    return {"format": fmt, "seq_len": seq_len, "draft_vocab": draft_vocab_size, "num_layers": cfg.get("num_layers"),
            "target_layer_ids": cfg["target_layer_ids"], "params": params, "trainable_params": trainable,
            "build_s": round(built_s, 1), "step_s_median": round(median, 4), "step_s_all": [round(t, 4) for t in times],
            "tokens_per_s": round(seq_len / median, 1), "peak_gb": round(peak / 1e9, 2) if peak else None,
            "loss": result.get("loss") if result else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a target directory to use as it is (default: bench/dummy_model.py's 27B shape "
                                    "with its training tensors, made at --dummy-dir)")
    ap.add_argument("--dummy-dir", default=os.path.join(ROOT, ".cache/dummy-hybrid-27b"))
    ap.add_argument("--tokenizer-from", default=os.path.join(ROOT, ".cache/tiny-hybrid"),
                    help="the tiny hybrid, whose tokenizer the 27B-shaped directory borrows")
    ap.add_argument("--format", default="eagle3", choices=("eagle3", "dflash"))
    ap.add_argument("--seq-lens", default="4096,8192,16384", help="comma-separated tokens per step")
    ap.add_argument("--draft-vocab", type=int, help="the draft's output vocabulary (default: what `train` picks, "
                                                    "speculators' 32,000; 0: the target's whole one)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", help="append one JSON line per length here")
    args = ap.parse_args(argv)
    import torch

    model = args.model
    if model is None:
        from dummy_model import ensure_dummy_hybrid_27b

        model = ensure_dummy_hybrid_27b(args.dummy_dir, args.tokenizer_from)
        ensure_weights(model)
    model = os.path.abspath(model)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        try:
            row = measure(model, args.format, seq_len, args.draft_vocab, args.steps, args.warmup)
        except torch.OutOfMemoryError as e:
            row = {"format": args.format, "seq_len": seq_len, "draft_vocab": args.draft_vocab,
                   "out_of_memory": str(e).split("\n")[0][:200]}
            torch.cuda.empty_cache()
        row.update(device=device, model=os.path.basename(model))
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
