"""How many drafted tokens the target accepts: mean accepted length τ for k = 1..K draft tokens, and the acceptance
at each draft position, for a speculators EAGLE-3 draft on a held-out export (bench/bench_acceptance.py).

The drafting is the trainer's own: one no-grad forward of speculators' Eagle3DraftModel with `ttt_steps = K`, on
batches from its own loader. In that forward, draft step j at position i takes the draft's own hidden state of
step j-1 and the data's token i+j, and predicts the token after it; its logits are compared with the target's
logits at position i+j (speculators' `align_for_step`). When the data is the target's own greedy continuation and
the chain is still alive, the data's token IS the draft's previous token, so this is the chain a serving engine
runs (EAGLE-3's test-time training was built to match it).

- Greedy (temperature 0): slot j is accepted when the draft's argmax equals the target's argmax; a block of k
  drafts is accepted up to its first miss, plus the target's own token (vLLM's convention). Counted with
  speculators' `compute_accepted_length_counts`. τ_k = 1 + E[leading run of accepted slots among the first k].
- Sampled (the target's temperature / top-k / top-p on both distributions): slot j is accepted with probability
  α = Σ_x min(p(x), q(x)) (speculative sampling's acceptance); τ_k = 1 + E[Σ_{m=1..k} Π_{j<m} α_j], along a
  sequence the target sampled. An estimate: the accepted prefix is the data's, where a real chain's would be
  the draft's accepted sample.

Only chains that start inside the completion (the loss mask) and draft within the same sample count; a slot past
the sample's end is never accepted. The same code scores the target as its own drafter (q = p: every slot that
exists is accepted), which is how the benchmark proves the loop before trusting it (`known_answer`).

Runs in the trainers' environment; torch is its only import until `evaluate` is called.
"""

from __future__ import annotations

import torch


# ---------------------------------------------------------------------------------------------------------------
# The counting (pure torch: tests call it from the job's environment too)
# ---------------------------------------------------------------------------------------------------------------
def chain_valid(loss_mask: torch.Tensor, document_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] bool: draft slot j of the chain starting at i exists, i.e. the token it drafts (the one after
    position i + j) is a completion token of the same sample; and the chain starts inside the completion."""
    T = loss_mask.shape[0]
    valid = torch.zeros(T, k, dtype=torch.bool)
    for j in range(k):
        n = T - j - 1  # start positions whose slot j has a next token inside the batch
        if n <= 0:
            break
        valid[:n, j] = loss_mask[j:j + n].bool() & (document_ids[j + 1:j + 1 + n] == document_ids[:n]) & (
            document_ids[:n] >= 0)
    return valid & valid[:, :1]


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The distribution a sampler draws from: logits / temperature, the top_k largest, then the smallest set of
    them whose probability reaches top_p (vLLM's order), renormalised. [..., V] → [..., V]."""
    logits = logits.float() / temperature
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # the mass before a token already reaches top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Counts:
    """Running sums over blocks (chain starts) for k = 1..K, greedy and sampled."""

    def __init__(self, k: int):
        self.k = k
        self.blocks = 0.0
        self.greedy_len = torch.zeros(k)  # Σ accepted-length (with the bonus token) for k = 1..K
        self.greedy_alive = torch.zeros(k + 1)  # Σ over blocks of [leading run ≥ m], m = 0..K
        self.sampled_alive = torch.zeros(k + 1)  # Σ over blocks of Π_{j<m} α_j, m = 0..K
        # The same with the draft's argmax proposed (vLLM's default `draft_sample_method: greedy`): the rejection
        # sampler then takes the draft's probability as 1, so slot j is accepted with p(argmax q_j), not Σ min(p, q).
        self.sampled_alive_greedy_draft = torch.zeros(k + 1)
        self.walk_blocks = torch.zeros(k)  # the serving walk (`served_walk`), for k = 1..K: blocks drafted
        self.walk_accepted = torch.zeros(k)  # ... and draft tokens accepted

    def add(self, step_logits: list[torch.Tensor], target_logits: torch.Tensor, valid: torch.Tensor,
            sampling: dict | None, document_ids: torch.Tensor | None = None) -> None:
        """step_logits: K tensors [T, V], the draft's logits of step j at each start i; target_logits [T, V];
        document_ids [T] (the packed batch's samples): also walk each sample as a serving engine would."""
        from speculators.models.metrics import compute_accepted_length_counts  # the trainers' environment only

        K, T = self.k, target_logits.shape[0]
        target_ids = target_logits.argmax(-1)
        correct = torch.zeros(T, K, dtype=torch.bool)
        alpha = torch.zeros(T, K)
        alpha_greedy_draft = torch.zeros(T, K)
        p = sampling_probs(target_logits, **sampling) if sampling else None
        for j in range(K):
            n = T - j
            correct[:n, j] = step_logits[j][:n].argmax(-1) == target_ids[j:]
            if p is not None:
                q = sampling_probs(step_logits[j][:n], **sampling)
                alpha[:n, j] = torch.minimum(p[j:], q).sum(-1)
                alpha_greedy_draft[:n, j] = p[j:].gather(-1, step_logits[j][:n].argmax(-1, keepdim=True))[:, 0]
        blocks = valid[:, 0]
        self.blocks += float(blocks.sum())
        for m in range(1, K + 1):
            total, _ = compute_accepted_length_counts(correct[:, :m], valid[:, :m])
            self.greedy_len[m - 1] += float(total)
        run = (correct & valid).to(torch.float32).cumprod(-1)[blocks]
        self.greedy_alive[0] += float(blocks.sum())
        self.greedy_alive[1:] += run.sum(0)
        for sums, rates in ((self.sampled_alive, alpha), (self.sampled_alive_greedy_draft, alpha_greedy_draft)):
            sums[0] += float(blocks.sum())
            sums[1:] += (rates * valid).cumprod(-1)[blocks].sum(0)
        if document_ids is not None:
            lead = (correct & valid).to(torch.int64).cumprod(-1).sum(-1)
            for m in range(1, K + 1):
                walked, accepted = served_walk(lead, blocks, document_ids, m)
                self.walk_blocks[m - 1] += walked
                self.walk_accepted[m - 1] += accepted

    def result(self) -> dict:
        """τ for k = 1..K and the acceptance at each draft position (given the earlier ones were accepted)."""
        b = max(self.blocks, 1.0)
        per_pos = lambda alive: [round(float(alive[m] / alive[m - 1]), 4) if alive[m - 1] else 0.0  # noqa: E731
                                 for m in range(1, self.k + 1)]
        # τ_k = 1 + Σ_{m ≤ k} E[Π_{j<m} α_j] over the blocks
        expected_tau = lambda alive: [round(1 + float(alive[1:m + 1].sum() / b), 4)  # noqa: E731
                                      for m in range(1, self.k + 1)]
        return {"blocks": int(self.blocks),
                "greedy_tau": [round(float(x / b), 4) for x in self.greedy_len],
                "greedy_accept_per_position": per_pos(self.greedy_alive),
                "sampled_tau": expected_tau(self.sampled_alive),
                "sampled_accept_per_position": per_pos(self.sampled_alive),
                "sampled_tau_greedy_draft": expected_tau(self.sampled_alive_greedy_draft),
                "greedy_tau_served_walk": [round(1 + float(a / b), 4) if b else None
                                           for a, b in zip(self.walk_accepted, self.walk_blocks)],
                "served_walk_blocks": [int(b) for b in self.walk_blocks]}


def served_walk(lead: torch.Tensor, starts: torch.Tensor, document_ids: torch.Tensor, k: int) -> tuple[int, int]:
    """(blocks, accepted draft tokens) of the chains a serving engine would draft along each sample, greedy, k draft
    tokens: the first block starts at the sample's first chain start; a block at i whose leading run of correct
    slots is r accepts min(r, k) drafts plus the target's own token, so the next block starts min(r, k) + 1 later.
    The all-positions τ above averages over every start; an engine drafts only at these, which follow a rejection
    more often than a random position does. lead [T]: leading run of correct, existing slots at each start
    (≤ K); starts [T] bool; document_ids [T]."""
    blocks = accepted = 0
    lead, starts, docs = lead.tolist(), starts.tolist(), document_ids.tolist()
    i, T = 0, len(starts)
    while i < T:
        if not starts[i]:
            i += 1
            continue
        doc = docs[i]
        while i < T and starts[i] and docs[i] == doc:  # one sample's walk: its starts are contiguous
            r = min(lead[i], k)
            blocks += 1
            accepted += r
            i += r + 1
        while i < T and docs[i] == doc:  # the rest of this sample (past its completion's last start)
            i += 1
    return blocks, accepted


def known_answer(valid: torch.Tensor) -> list[float]:
    """τ_k of a drafter that is always right: 1 + the mean over blocks of min(k, slots that exist)."""
    blocks = valid[:, 0]
    exist = valid.to(torch.float32).cumprod(-1)[blocks]
    return [round(1 + float(exist[:, :m].sum(-1).mean()), 4) if len(exist) else 1.0
            for m in range(1, valid.shape[1] + 1)]


# ---------------------------------------------------------------------------------------------------------------
# The drafting: speculators' own forward, its logits captured
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, loader, k: int, sampling: dict | None, call_kwargs: dict, max_batches: int | None = None) -> dict:
    """Score `model` (a speculators Eagle3DraftModel) on every batch of `loader` (its own loader over a held-out
    export), called with the trainer's validation kwargs `call_kwargs` (its loss config) and `ttt_steps = k`: τ for the
    draft, for the target as its own drafter, and how often the data's next token is the
    target's argmax (1.0 on greedy data made by the same numerics; on sampled data, how predictable the target is)."""
    captured = {"draft": [], "target": []}
    hooks = [model.lm_head.register_forward_hook(lambda m, i, o: captured["draft"].append(o.detach())),
             model.verifier_lm_head.register_forward_hook(lambda m, i, o: captured["target"].append(o.detach()))]
    draft, itself = Counts(k), Counts(k)
    agree = [0.0, 0.0]
    own_metrics: dict[str, float] = {}
    known = []
    model.eval()
    try:
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            captured["draft"].clear()
            captured["target"].clear()
            batch = {key: v for key, v in batch.items() if key != "error_records"}
            _, _, metrics = model(**batch, **{**call_kwargs, "ttt_steps": k})
            for name, value in metrics.items():  # the trainer's own accuracies, summed as its validation does
                own_metrics[name] = own_metrics.get(name, 0.0) + float(value)
            steps = [x[0].float() for x in captured["draft"]]
            target = captured["target"][0][0].float()
            valid = chain_valid(batch["loss_mask"][0], batch["document_ids"][0], k)
            draft.add(steps, target, valid, sampling, batch["document_ids"][0])
            itself.add([target[j:] for j in range(k)], target, valid, sampling)
            known.append((valid[:, 0].sum().item(), known_answer(valid)))
            starts = valid[:, 0]
            agree[0] += float((batch["input_ids"][0][1:] == target.argmax(-1)[:-1])[starts[:-1]].sum())
            agree[1] += float(starts[:-1].sum())
    finally:
        for h in hooks:
            h.remove()
    blocks = sum(n for n, _ in known) or 1
    expected = [round(sum(n * taus[m] for n, taus in known) / blocks, 4) for m in range(k)]
    # The trainer's own greedy estimate: 1 + Σ_m Π_{j<m} cond_acc_j (its conditional accuracy per TTT step).
    cond = [own_metrics.get(f"cond_acc_{j}_sum", 0.0) / max(own_metrics.get(f"cond_acc_{j}_total", 0.0), 1.0)
            for j in range(k)]
    trainer_tau, prod = [], 1.0
    for j in range(k):
        prod *= cond[j]
        trainer_tau.append(round((trainer_tau[-1] if trainer_tau else 1.0) + prod, 4))
    return {"draft": draft.result(), "target_as_drafter": itself.result(), "always_right": expected,
            "trainer_cond_acc_tau": trainer_tau,
            "data_is_target_argmax": round(agree[0] / max(agree[1], 1.0), 4)}


# ---------------------------------------------------------------------------------------------------------------
# The benchmark's trainer side: train one draft per training set, score each on the held-out sets
# ---------------------------------------------------------------------------------------------------------------
def target_sampling(model_dir: str) -> dict:
    """The target's own sampling settings (generation_config.json), as the served model would sample."""
    import json
    import os

    path = os.path.join(model_dir, "generation_config.json")
    gen = json.load(open(path)) if os.path.exists(path) else {}
    return {"temperature": float(gen.get("temperature", 1.0)), "top_k": gen.get("top_k"), "top_p": gen.get("top_p")}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os
    import tempfile
    import time

    from job.trainers import speculators_train

    parser = argparse.ArgumentParser(prog="python -m job.trainers.acceptance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", nargs="+", required=True, metavar="NAME=EXPORT",
                        help="speculators eagle3 (or dflash: trained and saved only) exports to train on, one draft "
                             "each (NAME=untrained: no training, the draft as built, on the first export's vocabulary)")
    parser.add_argument("--eval-greedy", required=True, help="held-out export of the target's greedy completions")
    parser.add_argument("--eval-sampled", required=True, help="held-out export of the target's sampled completions")
    parser.add_argument("--k", type=int, default=5, help="draft tokens (default 5); also the training TTT steps")
    parser.add_argument("--steps", type=int, default=800,
                        help="optimizer steps per draft, the same on every training set (default 800)")
    parser.add_argument("--total-seq-len", type=int, default=512,
                        help="tokens per packed batch; longer samples are cut there by speculators' sampler (the "
                             "tiny target's long tail: ~5%% of samples)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="JSON file for the results")
    parser.add_argument("--save-drafts", metavar="DIR",
                        help="save each draft to DIR/NAME as the trainer's checkpointer does (a directory vLLM serves)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    results = {"k": args.k, "steps": args.steps, "lr": args.lr, "seed": args.seed,
               "total_seq_len": args.total_seq_len, "sets": {}}
    for spec in args.train:
        name, _, export_dir = spec.partition("=")
        manifest = json.load(open(os.path.join(export_dir, "export.json")))
        fmt = manifest["format"]
        if manifest["to"] != "speculators" or fmt not in ("eagle3", "dflash"):
            parser.error(f"{export_dir}: a speculators eagle3 or dflash export is needed, this one is "
                         f"{manifest['to']} {fmt}")
        if fmt == "dflash" and not args.save_drafts:
            parser.error("a DFlash draft is only trained and saved (vLLM counts it): --save-drafts is needed")
        sampling = target_sampling(manifest["model"])
        started = time.monotonic()
        # DFlash drafts a block of block_size - 1 tokens after its anchor (the bonus token): k + 1 for k drafts.
        steps_of = dict(ttt_steps=args.k) if fmt == "eagle3" else dict(block_size=args.k + 1)
        overrides = dict(steps_of, seed=args.seed, lr=args.lr, total_seq_len=args.total_seq_len)
        work = tempfile.mkdtemp(prefix=f"acceptance-{name}-")
        if name == "untrained":
            sp_args = speculators_train.resolve_args(export_dir, manifest, manifest["draft_config"], work, **overrides)
            _, model = speculators_train.build_model(sp_args)
            logged, epochs = [], 0
        else:
            sp_args, model, logged, epochs = speculators_train.train_steps(
                export_dir, manifest, manifest["draft_config"], work, args.steps, **overrides)
        trained_s = time.monotonic() - started
        saved = (speculators_train.save_draft(model, sp_args, os.path.join(args.save_drafts, name), args.k)
                 if args.save_drafts else None)
        entry = {"format": fmt, "draft_dir": saved, "export": export_dir, "samples": manifest.get("num_samples"),
                 "tokens": manifest.get("num_tokens"),
                 "loss_tokens": manifest.get("num_loss_tokens"), "steps": len(logged), "epochs": epochs,
                 "train_seconds": round(trained_s, 1),
                 "first_loss": logged[0]["loss"] if logged else None,
                 "last_loss": sum(m["loss"] for m in logged[-20:]) / len(logged[-20:]) if logged else None}
        if fmt == "dflash":  # not counted here: speculators' forward has no EAGLE-3 chain to emulate
            results["sets"][name] = entry
            print(f"{name}: DFlash, {entry['steps']} steps ({epochs} epochs) in {trained_s:.0f} s, saved to {saved}",
                  flush=True)
            continue
        model_class = type(model)
        _, val_kwargs = model_class.get_trainer_kwargs(**vars(sp_args))
        for kind, eval_dir in (("greedy", args.eval_greedy), ("sampled", args.eval_sampled)):
            loader = speculators_train.data_loader(sp_args, model, eval_dir)
            entry[kind] = evaluate(model, loader, args.k, sampling if kind == "sampled" else None, val_kwargs)
        entry["eval_seconds"] = round(time.monotonic() - started - trained_s, 1)
        results["sets"][name] = entry
        g, s = entry["greedy"], entry["sampled"]
        print(f"{name}: {entry['steps']} steps ({epochs} epochs) in {trained_s:.0f} s; "
              f"greedy τ {g['draft']['greedy_tau']}, "
              f"sampled τ {s['draft']['sampled_tau']} (always right: {g['always_right']})", flush=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
