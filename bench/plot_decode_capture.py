"""The plot of docs/design/capture-during-generation.md: how far rows captured while generating are from stage 2's
prefill rows, by position in the completion and by layer, on both tiny targets, beside the scale bf16 storage already
moves a row (bf16 prefill against float32). Reads bench_decode_capture.py's JSON; writes a PNG.

    .venv/bin/python bench/plot_decode_capture.py bench/results/decode_capture_cpu.json \\
        docs/design/capture-during-generation.png
"""

from __future__ import annotations

import argparse
import json

SERIES = (("bfloat16", "decode vs prefill, bf16", "-o"), ("float32", "decode vs prefill, float32", "-s"),
          ("bf16_prefill_vs_fp32_prefill", "bf16 prefill vs float32 prefill (scale)", "--^"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="bench_decode_capture.py's --json output")
    p.add_argument("png", help="the plot to write")
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.load(open(args.results))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for target, color in zip(results, ("tab:blue", "tab:orange")):
        for key, label, style in SERIES:
            entry = results[target][key]
            positions = list(entry["by_position"])
            axes[0].plot(positions, [entry["by_position"][b]["mean"] for b in positions], style, color=color,
                         label=f"{target}: {label}")
            axes[1].plot(range(len(entry["per_layer"])), [v["mean"] for v in entry["per_layer"]], style,
                         color=color, label=f"{target}: {label}")
    for ax, title, xlabel in ((axes[0], "by position in the completion", "completion tokens"),
                              (axes[1], "by layer", "decoder layer")):
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean relative L2")
        ax.grid(alpha=0.3)
    axes[1].set_xticks(range(len(results[next(iter(results))]["float32"]["per_layer"])))
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Rows captured while generating against stage 2's prefill (tiny targets, CPU, transformers)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(args.png, dpi=90)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
