"""The notebook's hidden-state views: the layout of a run's hidden-state shards, shapes and per-layer statistics
of the first samples with what a trainer would choke on named, token alignment with the completions, and the
storage projection for the whole input. Plain functions, as in job/runview/notebook.py (`jh.<name>` in the
notebook's cells); the reading is job/scan/'s and job/hidden_states.load's.

    from job.runview import hidden as jh
    print(jh.format_hidden_summary(jh.summarize_hidden_states("demo-run")))
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from job import scan, schema, shard_reads
from job.formatting import format_bytes
from job.hidden_states import load
from job.hidden_states.plan import storage_layout
from job.runview.notebook import fetch_rows, run_overview
from job.schema import BYTES_PER_TOKEN_EXTRA
from job.storage import StorageConfig

# ---------------------------------------------------------------------------------------------------------------
# Hidden states: shapes, norms, zero/NaN checks
# ---------------------------------------------------------------------------------------------------------------


def hidden_state_shards(run_uri: str, storage_config: StorageConfig | None = None) -> list[str]:
    return [uri for uri, _ in scan.done_hidden_state_parts(run_uri, storage_config)]


def hidden_state_layout(run_uri: str, storage_config: StorageConfig | None = None) -> dict | None:
    """From the first shard's schema metadata: model, layer ids, convention, dtype, hidden size; None if no shard."""
    shards = hidden_state_shards(run_uri, storage_config)
    if not shards:
        return None
    m = scan.hidden_state_meta(shard_reads.read_shard_schema(shards[0], storage_config).metadata)
    return {"model": m.model, "layer_ids": m.layer_ids, "dtype": m.dtype, "hidden_size": m.hidden_size,
            "layer_convention": m.layer_convention, "num_shards": len(shards), "bytes_per_token": m.bytes_per_token}


def summarize_hidden_states(run_uri: str, max_samples: int = 64, num_traces: int = 2,
                            storage_config: StorageConfig | None = None) -> dict | None:
    """Shapes, dtype and per-layer statistics of the first `max_samples` samples (via job.hidden_states.load),
    with the problems a trainer would choke on named: NaN/inf, all-zero token vectors, a loss mask that is not
    0…0 1…1, input_ids and features of different lengths. Keeps per-token norms of `num_traces` samples for
    `plot_layer_norms`. None when the run has no hidden-state shards."""

    if not hidden_state_shards(run_uri, storage_config):
        return None
    layer_ids, hidden, dtype = None, None, None
    samples, traces, problems = [], [], []
    per_layer_rms, zero_tokens, nonfinite_tokens, num_tokens = [], None, None, 0
    for i, rec in enumerate(load(run_uri, storage_config)):
        if i >= max_samples:
            break
        hs = rec[schema.HIDDEN_STATES]
        n, num_layers, hidden = hs.shape
        layer_ids, dtype = rec["layer_ids"], str(hs.dtype).replace("torch.", "")
        x = hs.float()
        finite = x.isfinite().all(dim=-1)                       # [n, L]
        norms = x.nan_to_num(0.0, 0.0, 0.0).norm(dim=-1)        # [n, L]
        rms = (norms / hidden ** 0.5).numpy()
        zeros = (norms == 0).numpy()
        if zero_tokens is None:
            zero_tokens, nonfinite_tokens = np.zeros(num_layers, np.int64), np.zeros(num_layers, np.int64)
        zero_tokens += zeros.sum(0)
        nonfinite_tokens += (~finite).numpy().sum(0)
        num_tokens += n
        per_layer_rms.append(rms.mean(0))
        mask = rec[schema.LOSS_MASK].numpy()
        input_ids = rec[schema.INPUT_IDS]
        if len(input_ids) != n or len(mask) != n:
            problems.append(f"{rec[schema.ID]}: {len(input_ids)} input_ids, {len(mask)} loss_mask, {n} feature rows")
        if len(mask) and (np.any(np.diff(mask.astype(np.int8)) < 0) or not mask.any()):
            problems.append(f"{rec[schema.ID]}: loss_mask is not 0 over the prompt then 1 over the completion")
        samples.append({"id": rec[schema.ID], "shape": tuple(hs.shape), "num_tokens": n,
                        "num_prompt_tokens": int((mask == 0).sum()), "clipped": bool(rec.get(schema.CLIPPED))})
        if len(traces) < num_traces:
            traces.append({"id": rec[schema.ID], "rms": rms, "loss_mask": mask})
    if not samples:
        return None
    per_layer_rms = np.stack(per_layer_rms)  # [samples, L]
    layers = {}
    for j, k in enumerate(layer_ids):
        layers[k] = {"mean_rms": float(per_layer_rms[:, j].mean()), "min_sample_rms": float(per_layer_rms[:, j].min()),
                     "max_sample_rms": float(per_layer_rms[:, j].max()), "zero_tokens": int(zero_tokens[j]),
                     "nonfinite_tokens": int(nonfinite_tokens[j])}
        if nonfinite_tokens[j]:
            problems.append(f"layer {k}: {nonfinite_tokens[j]:,} of {num_tokens:,} tokens hold NaN/inf")
        if zero_tokens[j]:
            problems.append(f"layer {k}: {zero_tokens[j]:,} of {num_tokens:,} tokens are all zero")
    for a in range(len(layer_ids)):
        for b in range(a + 1, len(layer_ids)):
            if np.allclose(per_layer_rms[:, a], per_layer_rms[:, b], rtol=1e-6, atol=0):
                problems.append(f"layers {layer_ids[a]} and {layer_ids[b]} have identical norms: the same layer "
                                "stored twice?")
    return {"layer_ids": layer_ids, "hidden_size": hidden, "dtype": dtype, "num_samples": len(samples),
            "num_tokens": num_tokens, "samples": samples, "layers": layers, "sample_rms": per_layer_rms,
            "traces": traces, "problems": problems}


def format_hidden_summary(summary: dict) -> str:
    lines = [f"{summary['num_samples']} samples read, {summary['num_tokens']:,} tokens; hidden_states per sample: "
             f"[num_tokens, {len(summary['layer_ids'])}, {summary['hidden_size']}] {summary['dtype']}; "
             f"layers {summary['layer_ids']}"]
    lines += [f"  {s['id']}: shape {list(s['shape'])}, prompt {s['num_prompt_tokens']} tokens (loss_mask 0), "
              f"completion {s['num_tokens'] - s['num_prompt_tokens']}" + (", clipped" if s["clipped"] else "")
              for s in summary["samples"][:3]]
    lines.append("layer   RMS (mean of samples)  sample RMS min..max   zero tokens   NaN/inf tokens")
    lines += [f"  {k:<5} {v['mean_rms']:21.4f}  {v['min_sample_rms']:9.4f}..{v['max_sample_rms']:<9.4f}"
              f"   {v['zero_tokens']:>11,}   {v['nonfinite_tokens']:>14,}" for k, v in summary["layers"].items()]
    lines.append("checks: " + ("all passed (no NaN/inf, no all-zero vectors, loss masks 0…0 1…1, lengths agree)"
                               if not summary["problems"] else "PROBLEMS\n  " + "\n  ".join(summary["problems"])))
    return "\n".join(lines)


def check_token_alignment(run_uri: str, rows: pa.Table, max_samples: int = 8,
                          storage_config: StorageConfig | None = None) -> list[str]:
    """Stage 2 must run over exactly stage 1's token ids (never a re-applied template): compare the first
    samples' input_ids and loss masks with prompt_token_ids + output_token_ids of the same completion rows.
    Returns mismatches (empty: aligned)."""

    records = []
    for i, rec in enumerate(load(run_uri, storage_config)):
        if i >= max_samples:
            break
        records.append((rec[schema.ID], rec[schema.INPUT_IDS].numpy().copy(), rec[schema.LOSS_MASK].numpy().copy(),
                        bool(rec.get(schema.CLIPPED))))
    completions = {r[schema.ID]: r for r in fetch_rows(run_uri, rows, [r[0] for r in records], storage_config)}
    problems = []
    for row_id, input_ids, mask, clipped in records:
        row = completions[row_id]
        prompt, output = row[schema.PROMPT_TOKEN_IDS] or [], row[schema.OUTPUT_TOKEN_IDS] or []
        expected = np.array(prompt + output, dtype=np.int64)[:len(input_ids)]
        if (len(expected) != len(input_ids) or (not clipped and len(input_ids) != len(prompt) + len(output))
                or not np.array_equal(expected, input_ids)):
            problems.append(f"{row_id}: input_ids differ from stage 1's prompt_token_ids + output_token_ids")
        elif int((mask == 0).sum()) != min(len(prompt), len(input_ids)):
            problems.append(f"{row_id}: loss_mask has {(mask == 0).sum()} zeros, the prompt has {len(prompt)} tokens")
    return problems


def plot_layer_norms(summary: dict):
    """Left: per-layer RMS of the hidden vectors (mean over samples, bar from the lowest to the highest sample).
    Right: per-token RMS along the first sample, one line per layer, prompt tokens shaded (loss_mask 0)."""
    from matplotlib.figure import Figure  # heavy: imported on use

    fig = Figure(figsize=(12, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 2])
    ids = [str(k) for k in summary["layer_ids"]]
    sample_rms = summary["sample_rms"]
    mean = sample_rms.mean(0)
    err = np.stack([mean - sample_rms.min(0), sample_rms.max(0) - mean])
    left.bar(ids, mean, yerr=err, color="#2e86c1", capsize=4)
    left.set_xlabel("layer id (output of decoder layer k)")
    left.set_ylabel("RMS of hidden vector")
    left.set_title(f"per-layer RMS over {summary['num_samples']} samples", fontsize=10)
    if summary["traces"]:
        trace = summary["traces"][0]
        positions = np.arange(len(trace["loss_mask"]))
        prompt_len = int((trace["loss_mask"] == 0).sum())
        right.axvspan(-0.5, prompt_len - 0.5, color="#d5d8dc", label="prompt (loss_mask 0)")
        for j, k in enumerate(summary["layer_ids"]):
            right.plot(positions, trace["rms"][:, j], linewidth=0.9, label=f"layer {k}")
        right.set_yscale("log")
        right.set_xlabel("token position")
        right.set_ylabel("RMS (log)")
        right.set_title(f"per-token RMS, sample {trace['id']}", fontsize=10)
        right.legend(fontsize=8, loc="upper right")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# Storage: bytes per token, projected total for the whole input
# ---------------------------------------------------------------------------------------------------------------


def storage_projection(run_uri: str, rows: pa.Table, layout: dict | None = None,
                       storage_config: StorageConfig | None = None) -> dict:
    """Bytes per token and the hidden-state bytes projected for the whole input.

    Tokens per row are measured on the completions so far (prompt + output, clipped at hidden_states.max_length,
    error rows and, unless keep_flagged, flagged rows left out) and scaled to all input rows of run.json. Bytes
    per token come from `layout` (hidden_state_layout: what the shards hold), else from the model's config and
    the run's layer ids (before stage 2 has run). When shards exist, their size on disk per stored token is
    measured too (Arrow overhead included)."""
    ov = run_overview(run_uri, storage_config)
    hs_config = ov["hidden_states_config"]
    if layout is None:
        layout = hidden_state_layout(run_uri, storage_config)
    if layout is None and ov["model"]:
        try:
            layout = storage_layout(ov["model"], hs_config.get("layer_ids", []), hs_config.get("dtype", "bfloat16"))
        except Exception:  # the model's config.json is not readable from here
            layout = None
    rows_done, rows_total = rows.num_rows, ov["rows_total"] or rows.num_rows
    rows_kept, kept_tokens = scan.kept_tokens(rows, hs_config.get("keep_flagged", True),
                                              hs_config.get("max_length") or None)
    tokens_per_row = kept_tokens / rows_done if rows_done else 0.0  # per input row: skipped rows count as 0
    out = {"rows_done": rows_done, "rows_total": rows_total, "rows_kept": rows_kept,
           "tokens_kept_so_far": kept_tokens, "tokens_per_input_row": tokens_per_row,
           "projected_tokens": int(round(tokens_per_row * rows_total)), "layout": layout,
           "bytes_per_token": layout["bytes_per_token"] if layout else None,
           "projected_bytes": int(round(tokens_per_row * rows_total * layout["bytes_per_token"])) if layout else None,
           "stored_bytes": None, "stored_tokens": None, "stored_bytes_per_token": None,
           "stage2_estimate": ov["hidden_states_estimate"]}
    parts = scan.done_hidden_state_parts(run_uri, storage_config)
    if parts:
        counts = scan.read_shard_tables([uri for uri, _ in parts], [schema.NUM_TOKENS], storage_config)
        out["stored_bytes"] = sum(size for _, size in parts)
        out["stored_tokens"] = int(sum(pc.sum(t.column(schema.NUM_TOKENS)).as_py() or 0 for t in counts))
        if out["stored_tokens"]:
            out["stored_bytes_per_token"] = out["stored_bytes"] / out["stored_tokens"]
    return out


def format_projection(p: dict) -> str:
    lay = p["layout"]
    if lay:
        per = (f"{len(lay['layer_ids'])} layers × {lay['hidden_size']} × {lay['dtype']} + {BYTES_PER_TOKEN_EXTRA} B "
               f"(input_ids, loss_mask) = {p['bytes_per_token']:,} B per token")
    else:
        per = "bytes per token unknown: no hidden-state shards, and the model's config.json is not readable here"
    lines = [per]
    if p["rows_done"]:
        lines += [f"tokens   {p['tokens_kept_so_far']:,} kept in {p['rows_done']:,} rows done "
                  f"({p['tokens_per_input_row']:,.0f} per input row) → ~{p['projected_tokens']:,} for all "
                  f"{p['rows_total']:,} input rows",
                  f"total    ~{format_bytes(p['projected_bytes'])} of hidden states for the whole input"]
    else:
        lines.append("tokens   no completion rows yet: nothing to project from")
    if p["stored_bytes"] is not None:
        per_token = f"{p['stored_bytes_per_token']:,.0f} B per token" if p["stored_bytes_per_token"] else "-"
        lines.append(f"on disk  {format_bytes(p['stored_bytes'])} in the shards so far for {p['stored_tokens']:,} "
                     f"tokens ({per_token}, Arrow overhead included)")
    if p["stage2_estimate"]:
        e = p["stage2_estimate"]
        lines.append(f"stage 2  its own estimate at start (run.json): {format_bytes(e['total_bytes'])} for "
                     f"{e['num_tokens']:,} tokens of the completions it saw")
    return "\n".join(lines)
