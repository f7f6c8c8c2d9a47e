#!/usr/bin/env bash
# `python -m job worth` on one GPU, through the CLI: the verdict on the tiny hybrid target (Qwen3.5 layout, its MTP
# head trained at build time), EAGLE-3 and DFlash, each trained by `train` on the GPU with a held-out slice left
# out, then served by vLLM beside the target alone, the untrained draft and the target's own MTP head.
# Made on this machine first (CPU, ~4 min): bench/gpu_train_inputs.sh (the tiny hybrid and gpu-train-run, stage 1).
# On the GPU machine, from the repository root, wheels installed (../shared/gpu/README.md + bench/gpu_train_wheels.txt):
#   OUT=$OUT bash bench/gpu_worth.sh RUN [FORMAT ...]
# RUN is a copy of gpu-train-run somewhere that lasts between calls (/root/runs/...): stage 2 runs on it first
# unless done (a rerun of stage 2 or of `worth` redoes nothing that is done: each call may pick up where the last
# stopped), then `worth` per format (default: eagle3 dflash). The model is read from /root/tiny-hybrid when there.
set -u
export PYTHONPATH=/root/site:$PWD
RUN=$1
shift
FORMATS=${*:-eagle3 dflash}
OUT=${OUT:-bench/results/gpu_worth}
mkdir -p "$OUT"
MODEL=.cache/tiny-hybrid
[ -d /root/tiny-hybrid ] && MODEL=/root/tiny-hybrid
CONFIG="$OUT/gpu_worth.yaml"  # bench/gpu_train.yaml with the model's absolute path (Ray workers run elsewhere)
sed "s#^model: .*#model: $(cd "$MODEL" && pwd)#" bench/gpu_train.yaml > "$CONFIG"
log="$OUT/log.txt"
say() { echo "== $(date +%H:%M:%S) $*" | tee -a "$log"; }
quiet() { grep -v "Reporting training result\|Checkpoint successfully\|PlacementGroupCleaner\|^\s*$"; }

# A command cut off by its call's time limit leaves its local Ray (and engines) behind, holding GPU memory.
pkill -9 -f "raylet|gcs_server|ray::|engine_pass" 2>/dev/null; sleep 1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$log"
say "stage 2"
timeout 150 python -m job hidden-states --config "$CONFIG" --output "$RUN" 2>&1 | tee -a "$OUT/stage2.log" | quiet \
  | tail -n 4 | tee -a "$log"
for fmt in $FORMATS; do
  say "worth $fmt"
  timeout "${WORTH_TIMEOUT:-500}" python -m job worth "$RUN" --config "$CONFIG" --format "$fmt" --holdout 0.2 \
    --rows 64 --max-tokens 256 --gpus-per-worker 1 --cpus-per-worker 4 --checkpoint-every 100 2>&1 \
    | tee -a "$OUT/worth-$fmt.log" | quiet | grep -v "^\[\|INFO\|WARNING" | tail -n 24 | tee -a "$log"
  cp "$RUN/reports/worth.json" "$RUN"/reports/worth-*.png "$OUT/" 2>/dev/null
  mkdir -p "$OUT/worth" && cp "$RUN"/reports/worth/*.json "$OUT/worth/" 2>/dev/null
done
say "done"
