"""What `notebooks/inspect_outputs.ipynb` shows, as plain functions: load a run, compute, plot.

    RUN_DIR=demo-run jupyter notebook notebooks/inspect_outputs.ipynb      # or s3://bucket/runs/x

    from job.runview import notebook as ji
    rows = ji.read_rows("demo-run")              # small per-row columns of every completion shard
    ji.plot_length_histograms(ji.token_lengths(rows))
    for row in ji.fetch_rows("demo-run", rows, ji.worst_rows(rows, "repetition", 3)):
        print(ji.render_sample(row))

Compute functions return plain data (dicts, lists, numpy arrays, pyarrow tables); `plot_*` functions take that
data and return a matplotlib `Figure` built with the object API (no pyplot, no GUI backend: they render with Agg,
headless, and a notebook displays them inline).

Cost on a real run: `read_rows` fetches only the small columns of each shard (job/scan/: ranged reads, token
lists and texts stay in the bucket), ~16 columns × 4 bytes per row. Texts are read only for the handful of rows
shown (`fetch_rows` opens just their shards), and hidden states only for the first `max_samples` samples.

Each section is a compute function next to its `format_*`/`plot_*`; the hidden-state views are in
job/runview/hidden.py (`jh.<name>`), the reading in job/scan/, the number formats in job/formatting.py.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections import Counter

import numpy as np
import pyarrow as pa

from job import scan, schema, storage
from job.generate import prompts
from job.generate.report import error_kind
from job.storage import StorageConfig

SHARD = "shard"
"""Column `read_rows` adds: the URI of the completion shard a row lives in (so its text can be fetched)."""

ROW_COLUMNS = scan.SMALL_COLUMNS

LENGTHS = {"prompt": schema.NUM_PROMPT_TOKENS, "reasoning": schema.NUM_REASONING_TOKENS,
           "answer": schema.NUM_ANSWER_TOKENS, "output": schema.NUM_OUTPUT_TOKENS}

# How to rank the rows of one flag, worst first: (column, largest first?, what the ranking means).
SEVERITY = {
    schema.FLAG_TOO_SHORT: (schema.NUM_OUTPUT_TOKENS, False, "fewest output tokens"),
    schema.FLAG_UNCLOSED_THINK: (schema.NUM_OUTPUT_TOKENS, True, "longest output that never closed </think>"),
    schema.FLAG_EMPTY_ANSWER: (schema.NUM_REASONING_TOKENS, True, "most reasoning tokens for no answer"),
    schema.FLAG_TRUNCATED: (schema.NUM_OUTPUT_TOKENS, True, "longest output cut at max_tokens"),
    schema.FLAG_REPETITION: (schema.NUM_OUTPUT_TOKENS, True, "longest repetitive output"),
    schema.FLAG_TEMPLATE_MISMATCH: (schema.NUM_OUTPUT_TOKENS, False, "fewest output tokens (what a wrong template "
                                                                    "does to a model)"),
}
assert set(SEVERITY) == set(schema.QUALITY_FLAGS)


# ---------------------------------------------------------------------------------------------------------------
# The run: where it is, what it was made with
# ---------------------------------------------------------------------------------------------------------------


def resolve_run_dir(run_dir: str, repo_root: str | None = None) -> str:
    """`RUN_DIR` as given when it is an s3:// URI or exists from the current directory; else relative to the repo
    root (so `RUN_DIR=demo-run` works from the repo root and from notebooks/ alike)."""
    if storage.is_s3(run_dir) or os.path.isabs(run_dir) or os.path.exists(run_dir):
        return run_dir if storage.is_s3(run_dir) else os.path.abspath(run_dir)
    root = repo_root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidate = os.path.join(root, run_dir)
    return candidate if os.path.exists(candidate) else os.path.abspath(run_dir)


def run_overview(run_uri: str, storage_config: StorageConfig | None = None) -> dict:
    """run.json, condensed: model, sampling, stage statuses, versions, git sha, and the full config."""
    run = scan.require_run(run_uri, storage_config, hint="Set RUN_DIR to the --output of a `python -m job "
                                                         "generate` run (local path or s3:// URI)")
    gen, hs = run.generate, run.hidden_states
    return {
        "run": run_uri,
        "created_at": run.created_at,
        "git_sha": run.git_sha,
        "versions": run.versions,
        "model": run.setting("model"),
        "input": {k: v for k, v in dataclasses.asdict(gen.input).items() if k != "extra"} if gen else {},
        "rows_total": run.rows_total,
        "sampling": (gen.sampling if gen else {}) or run.setting("generate.sampling", {}),
        "enable_thinking": run.setting("generate.enable_thinking"),
        "engine_kwargs": run.setting("engine_kwargs", {}),
        "generate_status": run.status("generate", "not started"),
        "canary_passed": gen.canary_passed if gen else None,
        "hidden_states_status": run.status("hidden_states", "not started"),
        "hidden_states_config": run.setting("hidden_states", {}),
        "hidden_states_estimate": hs.estimate if hs else None,
        "config": run.config,
    }


def format_overview(ov: dict) -> str:
    sampling = ", ".join(f"{k}={v}" for k, v in sorted(ov["sampling"].items())) or "?"
    versions = ", ".join(f"{k} {v}" for k, v in sorted(ov["versions"].items())) or "?"
    rows = f"{ov['rows_total']:,}" if ov["rows_total"] is not None else "?"
    return "\n".join([
        f"run        {ov['run']}",
        f"created    {ov['created_at'] or '?'}   git {(ov['git_sha'] or '?')[:12]}",
        f"model      {ov['model']}",
        f"input      {ov['input'].get('uri', '?')}: {rows} rows in {ov['input'].get('num_files', '?')} files",
        f"sampling   {sampling}; thinking {'on' if ov['enable_thinking'] else 'off'}",
        "engine     " + (", ".join(f"{k}={v}" for k, v in sorted(ov["engine_kwargs"].items())) or "defaults"),
        f"stage 1    {ov['generate_status']}" + ("" if ov["canary_passed"] is None else
                                                 f" (canary {'passed' if ov['canary_passed'] else 'not passed'})"),
        f"stage 2    {ov['hidden_states_status']}; layers {ov['hidden_states_config'].get('layer_ids', '?')}, "
        f"{ov['hidden_states_config'].get('dtype', '?')}",
        f"versions   {versions}",
    ])


# ---------------------------------------------------------------------------------------------------------------
# Per-row small columns
# ---------------------------------------------------------------------------------------------------------------


DAMAGED_SHARDS_NOTE = ("left out here (`python -m job status` names them too); the next `generate` on this output "
                       "moves them aside to quarantine/ and generates their rows again")


def judge_completion_shards(run_uri: str, storage_config: StorageConfig | None = None) -> scan.CompletionShards:
    """The run's completion shards, listed and judged once (scan.judge_completion_shards), for the cells that
    follow: `status.build_status(..., found=)` and `read_rows(..., found=)` then list nothing again (at 20,000 shards
    on S3 a listing of completions/ is 20 LISTs). Run the cell again to see shards written since."""
    return scan.judge_completion_shards(run_uri, storage_config)


def read_rows(run_uri: str, columns: list[str] | None = None, storage_config: StorageConfig | None = None,
              num_threads: int = 16, unreadable: dict[str, str] | None = None,
              found: scan.CompletionShards | None = None) -> pa.Table:
    """The small columns of every trusted completion shard (default ROW_COLUMNS), plus `shard`: its URI. A shard
    that cannot be trusted (truncated, zero bytes: scan.judge_completion_shards, the rule `status` and both stages
    follow) is left out, and one line printed names it; `unreadable` receives {name: problem}. `found`: the shards
    as `judge_completion_shards` gave them (else listed now)."""
    problems: dict[str, str] = {}
    rows = scan.read_columns(run_uri, columns or ROW_COLUMNS, storage_config, shard_column=SHARD,
                             unreadable=problems, num_threads=num_threads, found=found)
    if problems:
        print(scan.unreadable_line(problems, DAMAGED_SHARDS_NOTE), flush=True)
    if unreadable is not None:
        unreadable.update(problems)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Quality: flag rates, finish reasons, error kinds
# ---------------------------------------------------------------------------------------------------------------


def flag_rates(report: dict) -> list[tuple[str, int, float]]:
    """(name, count, rate) per quality flag (share of non-error rows), then `error` (share of all rows), from
    `job.generate.report.build_report`: the notebook and `python -m job report` show the same numbers."""
    out = [(flag, v["count"], v["rate"]) for flag, v in report["flags"].items()]
    done = report["rows_done"]
    out.append(("error", report["rows_error"], report["rows_error"] / done if done else 0.0))
    return out


def plot_flag_rates(report: dict):
    from matplotlib.figure import Figure  # heavy: imported on use

    rates = flag_rates(report)
    fig = Figure(figsize=(8, 0.45 * len(rates) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    names = [n for n, _, _ in rates][::-1]
    values = [100 * r for _, _, r in rates][::-1]
    colors = ["#c0392b" if n == "error" else "#2e86c1" for n in names]
    bars = ax.barh(names, values, color=colors)
    for bar, (_, count, rate) in zip(bars, rates[::-1]):
        ax.text(bar.get_width() + 0.5, bar.get_y() + bar.get_height() / 2, f"{rate:.1%}  ({count:,})",
                va="center", fontsize=9)
    ax.set_xlim(0, max(100.0, max(values, default=0) * 1.25))
    ax.set_xlabel("% of rows (flags: of non-error rows; error: of all rows)")
    ax.set_title(f"quality flags over {report['rows_done']:,} rows")
    return fig


def error_examples(rows: pa.Table) -> dict[str, dict]:
    """{error kind: {count, id, error}} with the first row of each kind as its example, most common first."""
    errors = rows.column(schema.ERROR).to_pylist()
    ids = rows.column(schema.ID).to_pylist()
    counts, first = Counter(), {}
    for row_id, message in zip(ids, errors):
        if message is None:
            continue
        kind = error_kind(message)
        counts[kind] += 1
        first.setdefault(kind, (row_id, message))
    return {kind: {"count": n, "id": first[kind][0], "error": first[kind][1]} for kind, n in counts.most_common()}


def format_counts(counts: dict, total: int | None = None) -> str:
    if not counts:
        return "  none"
    total = total or sum(counts.values())
    return "\n".join(f"  {k:<24} {v:>10,}  {v / total:6.1%}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------------------------------------------
# Length distributions
# ---------------------------------------------------------------------------------------------------------------


def token_lengths(rows: pa.Table) -> dict[str, np.ndarray]:
    """Tokens per non-error row: prompt, reasoning, answer, output."""
    ok = scan.ok_rows(rows)
    return {name: scan.ints(rows, column)[ok] for name, column in LENGTHS.items()}


def turn_lengths(rows: pa.Table) -> list[dict]:
    """Per assistant turn (`turn`, generate.regenerate): non-error rows, mean prompt and output tokens, mean tokens
    of the data's own text of that turn where it had one (`original_turn_tokens`), and each flag's rate. Rows
    without a turn (error rows, runs made before turns were recorded) are left out."""
    if schema.TURN not in rows.column_names:
        return []
    ok = scan.ok_rows(rows) & rows.column(schema.TURN).is_valid().to_numpy(zero_copy_only=False)
    turns = scan.ints(rows, schema.TURN)
    original = rows.column(schema.ORIGINAL_TURN_TOKENS)
    has_original = original.is_valid().to_numpy(zero_copy_only=False)
    original = scan.ints(rows, schema.ORIGINAL_TURN_TOKENS)
    out = []
    for turn in sorted(set(turns[ok].tolist())):
        sel = ok & (turns == turn)
        with_original = sel & has_original
        out.append({"turn": turn, "rows": int(sel.sum()),
                    "prompt_tokens": float(scan.ints(rows, schema.NUM_PROMPT_TOKENS)[sel].mean()),
                    "output_tokens": float(scan.ints(rows, schema.NUM_OUTPUT_TOKENS)[sel].mean()),
                    "rows_with_original": int(with_original.sum()),
                    "original_tokens": float(original[with_original].mean()) if with_original.any() else None,
                    "flags": {flag: float(scan.bools(rows, flag)[sel].mean()) for flag in schema.QUALITY_FLAGS
                              if flag in rows.column_names}})
    return out


def format_turn_lengths(per_turn: list[dict]) -> str:
    if not per_turn:
        return "no turns recorded (error rows only, or a run made before turns were recorded)"
    flags = list(per_turn[0]["flags"])
    head = (f"{'turn':>4} {'rows':>7} {'prompt':>8} {'output':>8} {'original':>9}  " +
            " ".join(f"{f[:10]:>10}" for f in flags))
    lines = [head, "-" * len(head)]
    for t in per_turn:
        original = f"{t['original_tokens']:9.1f}" if t["original_tokens"] is not None else f"{'-':>9}"
        lines.append(f"{t['turn']:>4} {t['rows']:>7,} {t['prompt_tokens']:8.1f} {t['output_tokens']:8.1f} {original}  "
                     + " ".join(f"{t['flags'][f]:10.1%}" for f in flags))
    return "\n".join(lines)


def histogram(values: np.ndarray, num_bins: int = 40) -> dict:
    """Bins for one length distribution. Log-spaced when the positive values span more than a factor of 20
    (prompt and output lengths usually do); zeros cannot sit on a log axis and are counted apart."""
    values = np.asarray(values)
    positive = values[values > 0]
    num_zero = int((values == 0).sum())
    if len(positive) == 0:
        return {"edges": np.array([0.0, 1.0]), "counts": np.array([0]), "log_x": False, "num_zero": num_zero,
                "num_values": len(values)}
    lo, hi = float(positive.min()), float(positive.max())
    log_x = hi / lo > 20
    if log_x:
        edges = np.geomspace(lo, hi * 1.0001, num_bins + 1)
    else:
        edges = np.linspace(lo - 0.5, hi + 0.5, min(num_bins, int(hi - lo) + 1) + 1)
    counts, _ = np.histogram(positive, bins=edges)
    return {"edges": edges, "counts": counts, "log_x": log_x, "num_zero": num_zero, "num_values": len(values)}


def plot_length_histograms(lengths: dict[str, np.ndarray], max_tokens: int | None = None, num_bins: int = 40):
    """One panel per length; a dashed line at `max_tokens` on the output panel (rows there were cut)."""
    from matplotlib.figure import Figure  # heavy: imported on use

    fig = Figure(figsize=(12, 2.6 * -(-len(lengths) // 2)), layout="constrained")
    axes = fig.subplots(-(-len(lengths) // 2), 2, squeeze=False).ravel()
    for ax, (name, values) in zip(axes, lengths.items()):
        h = histogram(values, num_bins)
        ax.stairs(h["counts"], h["edges"], fill=True, color="#5d6d7e")
        if h["log_x"]:
            from matplotlib.ticker import FuncFormatter, NullFormatter  # heavy: imported on use

            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        nonzero = h["counts"][h["counts"] > 0]
        if len(nonzero) and nonzero.max() > 50 * np.median(nonzero):
            ax.set_yscale("log")  # a long tail next to a tall peak
        p50 = float(np.median(values)) if len(values) else 0.0
        zeros = f", {h['num_zero']:,} at 0" if h["num_zero"] else ""
        ax.set_title(f"{name} tokens: {len(values):,} rows, median {p50:,.0f}{zeros}", fontsize=10)
        if name == "output" and max_tokens:
            ax.axvline(max_tokens, color="#c0392b", linestyle="--", linewidth=1)
            ax.text(max_tokens, ax.get_ylim()[1] * 0.9, " max_tokens", color="#c0392b", fontsize=8, ha="right")
        ax.set_xlabel("tokens" + (" (log)" if h["log_x"] else ""))
        ax.set_ylabel("rows")
    for ax in axes[len(lengths):]:
        ax.set_visible(False)
    return fig


# ---------------------------------------------------------------------------------------------------------------
# Samples: pick rows, fetch their text, render them readably
# ---------------------------------------------------------------------------------------------------------------


def pick_rows(rows: pa.Table, n: int = 3, seed: int = 0) -> list[str]:
    """`n` non-error row ids at random (the same ones for the same run and seed)."""
    ids = np.array(rows.column(schema.ID).to_pylist(), dtype=object)[scan.ok_rows(rows)]
    if len(ids) <= n:
        return list(ids)
    return [str(ids[i]) for i in sorted(np.random.default_rng(seed).choice(len(ids), n, replace=False))]


def worst_rows(rows: pa.Table, flag: str, n: int = 3) -> list[str]:
    """Ids of up to `n` non-error rows carrying `flag`, worst first by SEVERITY[flag] (ties: input order)."""
    column, largest_first, _ = SEVERITY[flag]
    mask = scan.ok_rows(rows) & scan.bools(rows, flag)
    idx = np.flatnonzero(mask)
    keys = scan.ints(rows, column)[idx]
    order = np.argsort(-keys if largest_first else keys, kind="stable")
    ids = rows.column(schema.ID).to_pylist()
    return [ids[i] for i in idx[order][:n]]


def fetch_rows(run_uri: str, rows: pa.Table, ids: list[str], storage_config: StorageConfig | None = None) -> list[dict]:
    """Full completion rows (texts, token ids, carried input columns) for `ids`, in that order; reads only the
    shards that hold them."""
    shard_of = dict(zip(rows.column(schema.ID).to_pylist(), rows.column(SHARD).to_pylist()))
    missing = [i for i in ids if i not in shard_of]
    if missing:
        raise KeyError(f"ids not in this run: {missing[:5]}")
    found = {}
    for uri in dict.fromkeys(shard_of[i] for i in ids):
        table = storage.read_shard(uri, storage_config)
        wanted = set(ids)
        for row in table.to_pylist():
            if row[schema.ID] in wanted:
                found[row[schema.ID]] = row
    return [found[i] for i in ids]


def load_tokenizer(model: str | None):
    """The run's tokenizer when it is on this machine (local dir or HF cache), else None: never downloads."""
    if not model:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tqdm's "IProgress not found" when transformers loads in a notebook
            from transformers import AutoTokenizer  # heavy: imported on use

            return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception:  # not cached here, gated, no network: samples render without the exact prompt text
        return None


def clip_text(text: str | None, max_chars: int) -> str:
    """`text` cut in the middle to at most ~max_chars, saying how much was left out."""
    if text is None:
        return "(null)"
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n  … [{len(text) - 2 * half:,} chars not shown] …\n{text[-half:]}"


def _input_text(row: dict) -> str:
    if all(row.get(c) is None for c in schema.CONVERSATION_COLUMNS):
        return "(the input's prompt/messages columns were not carried into this shard)"

    try:  # messages, ShareGPT conversations (mapped) or a prompt; JSON text as JSONL inputs carry them
        messages = prompts.row_messages(row)
    except prompts.RowError as e:
        return f"({e}) {row.get(schema.MESSAGES) or row.get(schema.CONVERSATIONS) or row.get(schema.PROMPT)}"
    return "\n".join(f"[{m['role']}] {m['content']}" for m in messages)


def render_sample(row: dict, tokenizer=None, max_chars: int = 1200) -> str:
    """A completion row as readable text: a header line (id, tokens, finish reason, flags set), then PROMPT,
    REASONING, ANSWER. With the run's tokenizer the prompt is shown exactly as the engine saw it (chat template
    and special tokens included: the place to spot a wrong template), else the input text."""
    flags = [f for f in schema.QUALITY_FLAGS if row.get(f)]
    head = (f"── {row[schema.ID]} ── prompt {row.get(schema.NUM_PROMPT_TOKENS)} tok · reasoning "
            f"{row.get(schema.NUM_REASONING_TOKENS)} · answer {row.get(schema.NUM_ANSWER_TOKENS)} · finish "
            f"{row.get(schema.FINISH_REASON)} · flags: {', '.join(flags) or 'none'}")
    if row.get(schema.ERROR) is not None:
        return f"{head}\nERROR      {row[schema.ERROR]}\nINPUT\n{clip_text(_input_text(row), max_chars)}"
    if tokenizer is not None and row.get(schema.PROMPT_TOKEN_IDS):
        prompt = ("PROMPT (token ids decoded, as the engine saw them)\n"
                  + tokenizer.decode(row[schema.PROMPT_TOKEN_IDS], skip_special_tokens=False))
    else:
        prompt = "PROMPT (input text)\n" + _input_text(row)
    return "\n".join([head, clip_text(prompt, max_chars), "REASONING", clip_text(row.get(schema.REASONING),
                     max_chars), "ANSWER", clip_text(row.get(schema.ANSWER), max_chars)])
