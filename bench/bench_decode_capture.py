"""Hidden states captured while generating, against stage 2's fresh prefill of the same tokens.

Stage 1 computes every hidden state a drafter trains on once already, one decode step per token; stage 2 computes them
again in one prefill of prompt + completion. They are not the same numbers: a decode step attends over a KV cache and,
on a hybrid target, updates each Gated DeltaNet layer's state recurrently where a prefill runs its chunked scan. This
measures how far apart they are, on the project's tiny targets (dense: 4 attention layers; hybrid: 3 Gated DeltaNet +
1 attention, Qwen3.5's layout), CPU, transformers' own kernels (its torch chunked and recurrent GDN rules: what vLLM
runs on a GPU is other kernels with the same split), in float32 and bfloat16:

  for each completion of a run: the prompt prefilled with a cache, then the completion's tokens fed one at a time
  (the decode steps generation ran: row i is computed by the step that feeds token i), every layer's output kept;
  then one forward over prompt + completion (stage 2). The difference per token and layer: ||decode - prefill|| /
  ||prefill||, over the completion's tokens, by layer and by position in the completion.

For scale, the same relative difference between a bf16 prefill and a float32 prefill (what storing bf16 already
costs). The last token of a completion is never fed during generation (sampled, then the request stops), so its row is
not captured at all: a capture must add one step or leave it out (no trainer uses it: it predicts nothing).

    .venv/bin/python bench/bench_decode_capture.py --run dense=demo-run --run hybrid=gpu-train-run [--samples 8]

What the difference costs a drafter: `--decode-run RUN COPY` copies a finished run (stage 2 done) to COPY with every
stored stage-2 row replaced by the row generation computes (the prompt's rows from a prefill of the prompt, each
completion token's from the decode step that feeds it; the run's own layers, dtype and convention), so that the same
`python -m job worth` trains and serves a draft on each:

    .venv/bin/python bench/bench_decode_capture.py --decode-run demo-run /tmp/capture-decode
    .venv/bin/python bench/bench_decode_capture.py --copy-run demo-run /tmp/capture-prefill
    .venv/bin/python -m job worth /tmp/capture-prefill; .venv/bin/python -m job worth /tmp/capture-decode
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUCKETS = ((0, 16), (16, 64), (64, 256), (256, 1 << 30))


def completions(run: str, n: int) -> list[tuple[list[int], list[int]]]:
    """The first `n` completions (by id) of a run without an error and with at least 2 output tokens."""
    import pyarrow.dataset as ds

    table = ds.dataset(os.path.join(run, "completions"), format="arrow").to_table(
        columns=["id", "prompt_token_ids", "output_token_ids", "error"])
    rows = sorted((r for r in table.to_pylist() if r["error"] is None and len(r["output_token_ids"]) >= 2),
                  key=lambda r: r["id"])
    return [(list(r["prompt_token_ids"]), list(r["output_token_ids"])) for r in rows[:n]]


def model_of_run(run: str) -> str:
    """The run's model directory, from its run.json."""
    record = json.load(open(os.path.join(run, "run.json")))
    return record["config"]["model"]


def prefill_states(model, ids: list[int]):
    """Every decoder layer's output over `ids` in one forward: [layers, T, H], float32."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return torch.stack([h[0].float() for h in out.hidden_states[1:]])


def decode_states(model, prompt: list[int], completion: list[int]):
    """The completion's rows as generation computes them: the prompt prefilled into a cache, then each completion
    token but the last fed alone (the step that computes its row). [layers, len(completion) - 1, H], float32."""
    import torch

    rows = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        for token in completion[:-1]:
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                        output_hidden_states=True)
            cache = out.past_key_values
            rows.append(torch.stack([h[0, -1].float() for h in out.hidden_states[1:]]))
    return torch.stack(rows, dim=1)


def decode_rows(model, ids: list[int], prompt_len: int, layer_ids: list[int]):
    """Rows [T, len(layer_ids), H] in the model's dtype as generation computes them: 0..prompt_len-1 from one
    prefill of the prompt, each later one from the decode step that feeds its token (its KV cache/recurrent state
    carried). Layer k is decoder layer k's output (stage 2's convention with `last_layer_norm: before_norm`)."""
    import torch

    got: dict[int, list] = {k: [] for k in layer_ids}
    hooks = [model.model.layers[k].register_forward_hook(
        lambda module, args, output, k=k: got[k].append((output[0] if isinstance(output, tuple) else output)[0]))
        for k in layer_ids]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids[:prompt_len]]), use_cache=True)
            cache = out.past_key_values
            for token in ids[prompt_len:]:
                cache = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).past_key_values
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([torch.cat(got[k], dim=0) for k in layer_ids], dim=1)


def copy_run(run: str, copy: str) -> None:
    """The run's directory without its drafts and `worth` results (a fresh start for `python -m job worth`)."""
    import shutil

    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy, ignore=lambda d, names: [n for n in names if n == "drafts" or n.startswith("worth")])


def decode_run(run: str, copy: str) -> dict:
    """`copy_run`, then every stored stage-2 row replaced by `decode_rows` (bench docstring). Returns, as a check
    that the rows land where stage 2 put them, the relative difference of the prompts' rows (a prefill both ways)
    and of the completions' rows (decode against prefill) to the stored ones."""
    import glob

    import pyarrow as pa
    import torch

    from job.hidden_states.transformers_backend import load_model

    copy_run(run, copy)
    parts = sorted(glob.glob(os.path.join(copy, "hidden_states", "*.arrow")))
    meta = pa.ipc.open_file(parts[0]).schema.metadata
    layer_ids, dtype = json.loads(meta[b"layer_ids"]), meta[b"dtype"].decode()
    if meta[b"last_layer_norm"] != b"before_norm":
        raise SystemExit(f"{run}: parts store the last layer after the final norm; this copy keeps before_norm only")
    model = load_model(model_of_run(run), dtype=dtype, device="cpu")
    H = int(meta[b"hidden_size"])
    diffs = {"prompt": [], "completion": []}
    t0, tokens = time.perf_counter(), 0
    for path in parts:
        table = pa.ipc.open_file(path).read_all()
        column = []
        for ids, mask, stored in zip(table["input_ids"].to_pylist(), table["loss_mask"].to_pylist(),
                                     table["hidden_states"].to_pylist()):
            old = torch.frombuffer(bytearray(b"".join(stored)), dtype=getattr(torch, dtype)).view(len(ids), -1, H)
            prompt_len = mask.index(1) if 1 in mask else len(ids)
            rows = decode_rows(model, ids, prompt_len, layer_ids).to(old.dtype)
            for name, sl in (("prompt", slice(0, prompt_len)), ("completion", slice(prompt_len, len(ids)))):
                if rows[sl].numel():
                    diffs[name].append(relative(rows[sl].float(), old[sl].float()).flatten())
            raw = rows.contiguous().view(torch.uint8).numpy().reshape(len(ids), -1)
            column.append([r.tobytes() for r in raw])
            tokens += len(ids)
        index = table.schema.get_field_index("hidden_states")
        field = table.schema.field(index)
        table = table.set_column(index, field, pa.array(column, type=field.type))
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table)
    check = {name: float(f"{float(torch.cat(d).mean()):.3e}") for name, d in diffs.items() if d}
    return {"parts": len(parts), "tokens": tokens, "seconds": round(time.perf_counter() - t0, 1),
            "relative_to_stored_mean": check}


def relative(a, b):
    """||a - b|| / ||b|| per layer and token: [layers, T]."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def summarize(diffs: list, num_layers: int) -> dict:
    """Per layer: mean, p99 and max of the per-token relative differences; by position bucket: the mean over layers."""
    import torch

    flat = torch.cat(diffs, dim=1)  # [layers, tokens]
    per_layer = [{"mean": float(f"{float(flat[k].mean()):.3e}"),
                  "p99": float(f"{float(flat[k].quantile(0.99)):.3e}"),
                  "max": float(f"{float(flat[k].max()):.3e}")} for k in range(num_layers)]
    by_position = {}
    for lo, hi in BUCKETS:
        parts = [d[:, lo:hi] for d in diffs if d.shape[1] > lo]
        if parts:
            cat = torch.cat(parts, dim=1)
            by_position[f"{lo}-{hi if hi < 1 << 30 else 'end'}"] = {"tokens": int(cat.shape[1]),
                                                                    "mean": float(f"{float(cat.mean()):.3e}"),
                                                                    "max": float(f"{float(cat.max()):.3e}")}
    return {"tokens": int(flat.shape[1]), "per_layer": per_layer, "by_position": by_position,
            "mean": float(f"{float(flat.mean()):.3e}"), "max": float(f"{float(flat.max()):.3e}")}


def measure(name: str, model_dir: str, samples: list[tuple[list[int], list[int]]]) -> dict:
    from job.hidden_states.transformers_backend import load_model

    result = {"model": model_dir, "samples": len(samples),
              "completion_tokens": sum(len(c) for _, c in samples)}
    prefills = {}
    for dtype in ("float32", "bfloat16"):
        model = load_model(model_dir, dtype=dtype, device="cpu")
        t0 = time.perf_counter()
        diffs, prefills[dtype] = [], []
        for prompt, completion in samples:
            full = prefill_states(model, prompt + completion)[:, len(prompt):len(prompt) + len(completion) - 1]
            prefills[dtype].append(full)
            diffs.append(relative(decode_states(model, prompt, completion), full))
        result[dtype] = summarize(diffs, full.shape[0])
        result[dtype]["seconds"] = round(time.perf_counter() - t0, 1)
        del model
    # For scale: what bf16 alone does to a prefill, against float32.
    result["bf16_prefill_vs_fp32_prefill"] = summarize(
        [relative(b, f) for b, f in zip(prefills["bfloat16"], prefills["float32"])], prefills["float32"][0].shape[0])
    print(f"{name}: {json.dumps({k: v for k, v in result.items() if k not in ('float32', 'bfloat16')})[:200]}",
          flush=True)
    return result


def table(results: dict) -> str:
    lines = ["| target | dtype | tokens | mean | max | per layer (mean) | by position in the completion (mean) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for key, label in (("float32", "float32: decode vs prefill"), ("bfloat16", "bf16: decode vs prefill"),
                           ("bf16_prefill_vs_fp32_prefill", "bf16 prefill vs fp32 prefill (scale)")):
            s = r[key]
            layers = " ".join(f"{x['mean']:.2e}" for x in s["per_layer"])
            pos = "; ".join(f"{b} {v['mean']:.2e}" for b, v in s["by_position"].items())
            lines.append(f"| {name} | {label} | {s['tokens']:,} | {s['mean']:.2e} | {s['max']:.2e} | {layers} "
                         f"| {pos} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode-run", nargs=2, metavar=("RUN", "COPY"),
                        help="copy RUN to COPY with its stage-2 rows as generation computes them, then stop")
    parser.add_argument("--copy-run", nargs=2, metavar=("RUN", "COPY"),
                        help="copy RUN to COPY as it is (the prefill side of the comparison), then stop")
    parser.add_argument("--run", action="append", metavar="NAME=RUN_DIR",
                        help="a finished stage-1 run (its completions and its run.json's model), e.g. dense=demo-run")
    parser.add_argument("--samples", type=int, default=8, help="completions per run (default 8)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.copy_run:
        copy_run(*args.copy_run)
        return
    if args.decode_run:
        print(json.dumps(decode_run(*args.decode_run)))
        return
    if not args.run:
        parser.error("--run NAME=RUN_DIR (or --decode-run / --copy-run)")
    results = {}
    for spec in args.run:
        name, run = spec.split("=", 1)
        results[name] = measure(name, model_of_run(run), completions(run, args.samples))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
