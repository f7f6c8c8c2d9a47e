"""The completions bench/gpu_stage2_cli.sh runs stage 2 over, made on this machine: stage 1 (vLLM's CPU build, the
tiny hybrid) over prompts of stage 2's bench lengths (log-normal, median 1,400 tokens, clipped to [256, 3,400]) and
short completions, so the samples are as long as bench_hybrid_stage2.py's without hours of CPU decoding. Shards of
224 rows hold ~350K tokens, as production's 128 rows of ~2,750 do: stage 2's unit is a shard, so its batches are cut
the same way.

    .venv/bin/python bench/stage2_cli_inputs.py --out stage2-cli-run --prompts 1400      # ~2.1M tokens, ~8 min

The tiny hybrid shares its tokenizer with bench/reduced_checkpoint.py's checkpoint, so the token ids are valid
there; stage 2 on that checkpoint is another model than stage 1's, which `hidden-states --allow-drift` says is meant.
The prompt text is random tokens of the tokenizer, decoded: no prefix is shared.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# bench_hidden_states.make_samples' lengths, below the tiny hybrid's 4,096 (decoded random tokens tokenize ~10 %
# longer, and the chat template adds a few)
MEDIAN, LOW, HIGH = 1400, 256, 3400


def write_prompts(out_dir: str, num_prompts: int, tokenizer_dir: str, seed: int = 0) -> int:
    """One parquet file of `id`, `prompt` (so every completion shard but the last has 224 rows); returns the prompt
    tokens drawn (the template adds a few)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special and i < 3700]
    rng = random.Random(seed)
    rows, drawn = [], 0
    for i in range(num_prompts):
        n = int(min(HIGH, max(LOW, rng.lognormvariate(0, 0.6) * MEDIAN)))
        rows.append({"id": f"long-{i:05d}", "prompt": tok.decode([rng.choice(ids) for _ in range(n)])})
        drawn += n
    os.makedirs(out_dir, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(out_dir, "prompts-00000.parquet"))
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="stage2-cli-run")
    parser.add_argument("--prompts", type=int, default=1400)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=".cache/tiny-hybrid")
    args = parser.parse_args()

    from job.builtin.tiny_model import ensure_tiny_model
    from job.config import load_config
    from job.generate.report import print_summary
    from job.generate.run import run_generate

    ensure_tiny_model(args.model, architecture="hybrid")
    prompts = ".cache/stage2-cli-prompts"
    drawn = write_prompts(prompts, args.prompts, args.model)
    print(f"{args.prompts} prompts, {drawn:,} tokens drawn -> {prompts}", flush=True)
    config = load_config(os.path.join(REPO, "configs/demo.yaml"), model=args.model, input=prompts, output=args.out,
                         **{"engine_kwargs.max_model_len": 4096, "engine_kwargs.max_num_seqs": 32,
                            "generate.sampling.max_tokens": args.max_tokens, "quality.canary_rows": 0,
                            "generate.rows_per_shard": 224, "generate.units_in_flight_per_engine": 2,
                            "env_vars.VLLM_CPU_KVCACHE_SPACE": "4"})
    print_summary(config, run_generate(config))


if __name__ == "__main__":
    main()
