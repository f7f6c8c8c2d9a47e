#!/usr/bin/env bash
# What bench/gpu_train.sh needs, made on this machine (CPU, ~4 min): the tiny hybrid target and two stage-1 runs of
# its demo prompts (vLLM's CPU build), gpu-train-run (the 320 rows to train on: 3 plain shards + the multi-turn one)
# and gpu-heldout-run (96 other prompts, whose prompt ids the drafts are served on). Both directories travel to the
# GPU machine with the working tree; .cache/tiny-hybrid is carried.
set -eu
PY=.venv/bin/python
$PY -c "from job.builtin.tiny_model import ensure_tiny_model; ensure_tiny_model('.cache/tiny-hybrid', architecture='hybrid')"
$PY -c "from job.builtin.demo import write_demo_prompts; write_demo_prompts('.cache/demo-prompts')"
rm -rf .cache/gpu-prompts && mkdir -p .cache/gpu-prompts/train .cache/gpu-prompts/heldout
cp .cache/demo-prompts/prompts-00000.parquet .cache/demo-prompts/prompts-00001.parquet \
   .cache/demo-prompts/prompts-00002.parquet .cache/demo-prompts/prompts-00004.parquet .cache/gpu-prompts/train/
cp .cache/demo-prompts/prompts-00003.parquet .cache/gpu-prompts/heldout/
for part in train heldout; do
  $PY -m job generate --config configs/demo.yaml --model .cache/tiny-hybrid --input .cache/gpu-prompts/$part \
    --output gpu-$part-run --no-canary | grep -v "^\s*$" | tail -n 3
done
