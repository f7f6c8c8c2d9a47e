"""The verdict of `python -m job worth`: what each drafter's served counts say, side by side, in words.

From vLLM's spec-decode counters of each pass (job/train/serve.py), per drafter and pass (greedy; the run's sampling):
    τ                   1 + accepted / drafts: tokens one target step emits (vLLM's "mean acceptance length")
    τ at draft length j 1 + (accepted at positions 1..j) / drafts, for j = 1..k, from the same engine at k: what the
                        draft's first j tokens give (an engine run at k = j would step differently after a draft it
                        accepts whole, so this reads the curve's shape, not a second measurement)
    acceptance per position  accepted at m / accepted at m - 1: how far into a draft the target follows it
    τ by prompt length  the same counts for each bucket of held-out prompts, served one bucket at a time
    tokens/s            decode tokens per second of the pass, and its ratio to the target alone on the same engine
                        settings (meaningful on a GPU; on a CPU the draft's own forward dominates)
    lossless            the greedy outputs that are exactly the target's alone (speculative decoding must not change
                        them; a difference is a wrong draft config or numerics, and is printed)

The verdict compares the trained draft at the run's sampling with the target's own MTP head where the model has one
(a draft that does not beat it is not worth training), else with the untrained draft (what the data taught it).
"""

from __future__ import annotations

PASSES = ("sampled", "greedy")
NAMES = {"target": "target alone", "untrained": "untrained {fmt}", "trained": "trained {fmt}",
         "mtp": "target's MTP head"}


def summarize(result: dict | None) -> dict:
    """One drafter's served counts reduced to the figures above (or its error)."""
    if result is None:
        return {"error": "not served"}
    if "error" in result:
        return {"error": result["error"]}
    out = {"k": result.get("k", 0), "engine_start_s": result.get("engine_start_s")}
    for name in PASSES:
        entry = result.get(name)
        if entry is None:
            continue
        if "error" in entry:
            out[name] = {"error": entry["error"]}
            continue
        got = {"tokens_per_s": entry["tokens_per_s"], "output_tokens": entry["output_tokens"],
               "seconds": entry["seconds"]}
        if entry.get("drafts"):
            per_pos, drafts = entry["accepted_per_pos"], entry["drafts"]
            got.update(tau=entry["tau"], accept_per_position=entry["accept_per_position"],
                       tau_at_draft_length=[round(1 + sum(per_pos[:j]) / drafts, 4)
                                            for j in range(1, len(per_pos) + 1)],
                       tau_by_prompt_length={b: entry["buckets"][b].get("tau") for b in by_length(entry["buckets"])},
                       drafts=drafts, accepted=entry["accepted"])
        out[name] = got
    return out


def by_length(buckets: dict) -> list[str]:
    """Bucket names ("23-37 tokens") shortest first (a JSON round trip may have sorted them as text)."""
    return sorted(buckets, key=lambda b: int(b.split("-")[0]))


def judge(results: dict[str, dict | None], *, fmt: str, k: int, sampling: dict, prompts: int, run: str, trained,
          holdout: float, max_tokens: int) -> dict:
    """The report: every drafter's figures, how each compares with the target alone, and the verdict."""
    drafters = {name: summarize(r) for name, r in results.items()}
    def greedy_outputs(result: dict | None) -> list:
        buckets = (result or {}).get("greedy", {}).get("buckets", {})
        return [buckets[b].get("greedy_outputs") for b in by_length(buckets)]

    reference = greedy_outputs(results.get("target"))
    for name, r in results.items():
        figures = drafters[name]
        base = drafters.get("target", {}).get("sampled", {}).get("tokens_per_s")
        own = figures.get("sampled", {}).get("tokens_per_s") if isinstance(figures.get("sampled"), dict) else None
        if name != "target" and base and own:
            figures["speedup_sampled"] = round(own / base, 3)
        if name != "target" and r and "error" not in r and "greedy" in r and reference:
            mine = greedy_outputs(r)
            pairs = [(a, b) for ma, mb in zip(mine, reference) for a, b in zip(ma or [], mb or [])]
            figures["lossless"] = {"same": sum(a == b for a, b in pairs), "of": len(pairs)}
    line, worth = decide(drafters, fmt, k)
    return {"format": fmt, "k": k, "sampling": sampling, "held_out_prompts": prompts, "holdout": holdout,
            "max_tokens": max_tokens, "run": run, "draft": trained.draft, "trained_samples": trained.samples,
            "trained_steps": trained.steps, "drafters": drafters, "verdict": line, "worth_training": worth}


def tau(figures: dict, name: str = "sampled") -> float | None:
    entry = figures.get(name)
    return entry.get("tau") if isinstance(entry, dict) else None


def decide(drafters: dict, fmt: str, k: int) -> tuple[str, bool | None]:
    """(one line, worth training?): the trained draft against the MTP head where there is one, else the untrained
    draft. None: no comparison could be made."""
    trained = tau(drafters.get("trained", {}))
    if trained is None:
        return f"no verdict: the trained {fmt} draft was not served ({drafters.get('trained', {}).get('error')})", None
    head = f"trained {fmt}: τ {trained:.2f} at k = {k} at the run's sampling"
    mtp = drafters.get("mtp")
    if mtp is not None and tau(mtp) is not None:
        gain = trained - tau(mtp)
        return (f"{head}, {gain:+.2f} over the target's own MTP head ({tau(mtp):.2f}): "
                + ("worth training" if gain > 0 else "not worth training: serve the MTP head"), gain > 0)
    untrained = tau(drafters.get("untrained", {}))
    gain = f", {trained - untrained:+.2f} over the untrained draft ({untrained:.2f})" if untrained is not None else ""
    why = ("the target has no MTP head to compare against" if mtp is None else
           f"its MTP head could not be served here ({mtp.get('error') or 'no counts'})")
    return f"{head}{gain}; {why}", None


def one_drafter_line(name: str, result: dict) -> str:
    figures = summarize(result)
    if "error" in figures:
        return f"{name}: not served: {figures['error']}"
    parts = []
    for p in PASSES:
        entry = figures.get(p, {})
        if "error" in entry:
            parts.append(f"{p}: {entry['error']}")
        elif entry:
            parts.append(f"{p}: " + (f"τ {entry['tau']:.2f}, " if entry.get("tau") else "")
                         + f"{entry['tokens_per_s']:,.1f} tokens/s")
    return f"{name}: " + "; ".join(parts)


def table(report: dict) -> str:
    """The report as a person reads it: one row per drafter, then the verdict."""
    fmt, k = report["format"], report["k"]
    lines = [f"worth: {fmt} on {report['held_out_prompts']} held-out prompts of {report['run']} (k = {k}, "
             f"{report['max_tokens']} tokens each; the run's sampling {report['sampling']}); the draft trained on "
             f"{report['trained_samples']:,} samples in {report['trained_steps']:,} steps",
             f"  {'drafter':<20} {'τ sampled':>9} {'τ greedy':>9}  {'τ at j = 1..k (sampled)':<26} "
             f"{'accept j | j-1 (sampled)':<24} {'tokens/s':>9} {'× target':>8}  greedy = target's"]
    for name, figures in report["drafters"].items():
        label = NAMES[name].format(fmt=fmt)
        if "error" in figures:
            lines.append(f"  {label:<20} not served: {figures['error'][:160]}")
            continue
        s, g = figures.get("sampled", {}), figures.get("greedy", {})
        err = s.get("error") or g.get("error")
        if err:
            lines.append(f"  {label:<20} failed: {err[:160]}")
            continue
        ladder = " ".join(f"{v:.2f}" for v in s.get("tau_at_draft_length", [])) or "-"
        accept = " ".join(f"{v:.2f}" for v in s.get("accept_per_position", [])) or "-"
        same = figures.get("lossless")
        lines.append(f"  {label:<20} {_f(s.get('tau')):>9} {_f(g.get('tau')):>9}  {ladder:<26} {accept:<24} "
                     f"{s.get('tokens_per_s', 0):>9,.1f} {_f(figures.get('speedup_sampled')):>8}  "
                     + (f"{same['same']}/{same['of']}" if same else "-"))
    by_length = {name: f.get("sampled", {}).get("tau_by_prompt_length") for name, f in report["drafters"].items()
                 if isinstance(f.get("sampled"), dict) and f["sampled"].get("tau_by_prompt_length")}
    if by_length:
        buckets = list(next(iter(by_length.values())))
        lines.append("  τ by prompt length (sampled): " + "; ".join(
            f"{NAMES[n].format(fmt=fmt)} " + ", ".join(f"{b} {_f(t.get(b))}" for b in buckets)
            for n, t in by_length.items()))
    lines.append(f"worth: {report['verdict']}")
    return "\n".join(lines)


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def plot(report: dict) -> bytes | None:
    """PNG: τ at each draft length, and τ by prompt length, one line per drafter (sampled). None without
    matplotlib (the notebook extra: `pip install -e .[notebook]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import io

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, figures in report["drafters"].items():
        s = figures.get("sampled")
        if not isinstance(s, dict) or not s.get("tau_at_draft_length"):
            continue
        label = NAMES[name].format(fmt=report["format"])
        ladder = s["tau_at_draft_length"]
        left.plot(range(1, len(ladder) + 1), ladder, marker="o", label=label)
        buckets = s["tau_by_prompt_length"]
        right.plot(list(buckets), [v if v is not None else float("nan") for v in buckets.values()], marker="o",
                   label=label)
    left.set(xlabel="draft length j", ylabel="τ (tokens per target step)", title="τ at each draft length",
             xticks=range(1, report["k"] + 1))
    right.set(xlabel="prompt length", ylabel="τ", title="τ by prompt length")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(report["verdict"], fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
