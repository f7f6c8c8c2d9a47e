#!/usr/bin/env bash
# `python -m job train` on one GPU, through the CLI, and its drafts served by vLLM on the same GPU:
#   stage 2 of a tiny-hybrid run (python -m job hidden-states: transformers backend, fla kernels, self-check on);
#   EAGLE-3 and DFlash drafts trained on its stored hidden states (one Ray Train worker holding the GPU): samples/s
#   and tokens/s from the job's own last line, the GPU memory of every process each second (nvidia-smi);
#   each draft served beside the target by vLLM (job/train/serve.py): tau from vLLM's spec-decode counters on the
#   held-out prompts, greedy and at the target's sampling, and decode tokens/s with and without it.
# Made on this machine first (CPU, ~4 min; the GPU machine reaches no hub): the tiny hybrid and two stage-1 runs of
# its demo prompts, one to train on and one held out (bench/gpu_train_inputs.sh).
# On the GPU machine, from the repository root, wheels installed (../shared/gpu/README.md; bench/gpu_train_wheels.txt
# adds speculators' training code):
#   OUT=$OUT bash bench/gpu_train.sh gpu-train-run gpu-heldout-run
# FORMATS=eagle3 trains one format only; SERVE=0 stops after the training (a machine
# given Ray and speculators without vLLM: a 90 MB wheel set, not 440 MB, made by bench/gpu_train_wheels_small.sh).
set -u
export PYTHONPATH=/root/site:$PWD
RUN=$1
HELDOUT=$2
OUT=${OUT:-bench/results/gpu_train}
mkdir -p "$OUT"
CONFIG=bench/gpu_train.yaml
log="$OUT/log.txt"
say() { echo "== $(date +%H:%M:%S) $*" | tee -a "$log"; }
quiet() { grep -v "Reporting training result\|Checkpoint successfully\|PlacementGroupCleaner\|^\s*$"; }

nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$log"
nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv -l 1 > "$OUT/gpu_processes.csv" &
SMI=$!
say "stage 2"
timeout 150 python -m job hidden-states --config "$CONFIG" --output "$RUN" 2>&1 | tee "$OUT/stage2.log" | quiet | tail -n 12 | tee -a "$log"
for fmt in ${FORMATS:-eagle3 dflash}; do
  say "train $fmt"
  timeout 200 python -m job train "$RUN" --format "$fmt" --gpus-per-worker 1 --cpus-per-worker 4 \
    --checkpoint-every 100 2>&1 | tee "$OUT/train-$fmt.log" | quiet | tail -n 8 | tee -a "$log"
  cp "$RUN/drafts/$fmt/manifest.json" "$OUT/manifest-$fmt.json" 2>/dev/null
done
kill $SMI
if [ "${SERVE:-1}" = 0 ]; then say "done (SERVE=0: no vLLM on this machine)"; exit 0; fi
say "serve"
timeout 240 python bench/gpu_serve_drafts.py --run "$RUN" --heldout "$HELDOUT" --config "$CONFIG" --out "$OUT" \
  2>&1 | grep "^RESULT\|Error\|error" | tail -n 20 | tee -a "$log"
say "done"
