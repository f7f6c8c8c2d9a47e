#!/usr/bin/env bash
# One training step of `python -m job train` on the Qwen3.6-27B shape (bench/bench_train_step.py), on one GPU:
# EAGLE-3 and DFlash, by tokens per step, with the draft vocabulary `train` picks (32,000 ids) and with the target's
# whole one (248,320: what speculators trains when no token counts reach it). The 27B-shaped directory (config, tokenizer, the ~5 GB of tensors training reads) is made once
# under /root when the GPU machine has one (it lasts between calls there).
# On the GPU machine, from the repository root, wheels installed:
#   OUT=$OUT bash bench/gpu_train_step.sh
set -u
export PYTHONPATH=/root/site:$PWD
OUT=${OUT:-bench/results/gpu_train_step}
mkdir -p "$OUT"
TOKENIZER=.cache/tiny-hybrid
[ -d /root/tiny-hybrid ] && TOKENIZER=/root/tiny-hybrid
DUMMY=.cache/dummy-hybrid-27b
[ -d /root ] && [ -w /root ] && DUMMY=/root/dummy-hybrid-27b
log="$OUT/log.txt"
say() { echo "== $(date +%H:%M:%S) $*" | tee -a "$log"; }
pkill -9 -f "raylet|gcs_server|ray::|engine_pass" 2>/dev/null; sleep 1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$log"
say "the 27B-shaped directory (once: ~1 min to write its 5 GB)"
python -c "import sys; sys.path.insert(0, 'bench'); from dummy_model import ensure_dummy_hybrid_27b; \
from bench_train_step import ensure_weights; ensure_weights(ensure_dummy_hybrid_27b('$DUMMY', '$TOKENIZER'))" \
  2>&1 | tail -n 2 | tee -a "$log"
# Each row: ~30 s to build (EAGLE-3; DFlash's 5 layers more), torch.compile on the first steps, then the steps. On an
# H100 (2026-12-07) the first rows, compiling cold, ran past a 135 s limit each; with the compile cache warm an
# EAGLE-3 row took 65 s.
step() {
  say "$*"
  timeout "${STEP_TIMEOUT:-300}" python bench/bench_train_step.py --dummy-dir "$DUMMY" --tokenizer-from "$TOKENIZER" \
    --out "$OUT/train_step.jsonl" "$@" 2>&1 | tee -a "$OUT/bench.log" | grep '^{' | tee -a "$log"
}
step --format eagle3 --seq-lens 8192,16384,32768 --steps 2 --warmup 1
step --format dflash --seq-lens 8192,16384 --steps 2 --warmup 1
step --format eagle3 --seq-lens 8192 --draft-vocab 0 --steps 2 --warmup 1
say "done"
