#!/usr/bin/env bash
# `python -m job train --stream` on one GPU: stage 2's extractor and the training worker share it (fractions: the
# extractor 0.6, the trainer 0.4), nothing stored. Its training worker is killed (SIGKILL) right after its first
# checkpoint, as a crashed node's would die; Ray Train restarts it from that checkpoint. Then the checkpoint's own
# record says which samples trained: each exactly once. GPU memory of every process each second (nvidia-smi).
# On the GPU machine, from the repository root, wheels installed, RUN a stage-1 run of the tiny hybrid
# (bench/gpu_train_inputs.sh) somewhere that lasts between calls:
#   OUT=$OUT bash bench/gpu_train_stream.sh RUN [FORMAT]
set -u
RUN=$1
FMT=${2:-eagle3}
NAME=stream-$FMT
OUT=${OUT:-bench/results/gpu_train_stream}
mkdir -p "$OUT"
MODEL=.cache/tiny-hybrid
[ -d /root/tiny-hybrid ] && MODEL=/root/tiny-hybrid
CONFIG="$OUT/gpu_stream.yaml"  # bench/gpu_train.yaml, the model's absolute path, the extractor on 0.6 of the GPU
sed "s#^model: .*#model: $(cd "$MODEL" && pwd)#" bench/gpu_train.yaml | sed "s#^hidden_states:#hidden_states:\n  gpus_per_worker: 0.6#" > "$CONFIG"
log="$OUT/log.txt"
say() { echo "== $(date +%H:%M:%S) $*" | tee -a "$log"; }
MARKER="$OUT/killed-once"
rm -f "$MARKER"

# A command cut off by its call's time limit leaves its local Ray (and engines) behind, holding GPU memory.
pkill -9 -f "raylet|gcs_server|ray::|engine_pass" 2>/dev/null; sleep 1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$log"
nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv -l 1 > "$OUT/gpu_processes.csv" &
SMI=$!
say "train --stream $FMT, rank 0 killed after its first checkpoint"
# The kill hook (tests/fault_injection/sitecustomize.py) reaches the training worker through the environment its
# local Ray inherits from this process.
PYTHONPATH=$PWD/tests/fault_injection:/root/site:$PWD DATAGEN_TEST_KILL_TRAIN_RANK="0:$MARKER" \
  timeout "${STREAM_TIMEOUT:-300}" python -m job train "$RUN" --stream --config "$CONFIG" --format "$FMT" \
  --name "$NAME" --gpus-per-worker 0.4 --cpus-per-worker 4 --checkpoint-every 50 --max-failures 1 2>&1 \
  | tee "$OUT/train-$NAME.log" | grep -v "Reporting training result\|Checkpoint successfully\|^\s*$" | tail -n 10 \
  | tee -a "$log"
kill $SMI
say "exactly once?"
PYTHONPATH=/root/site:$PWD python - "$RUN" "$NAME" "$MARKER" <<'EOF' 2>&1 | tee -a "$log"
import os, sys
from job import layout
from job.runview.notebook import read_rows
from job.train.checkpoint import latest_checkpoint, read_checkpoint
run, name, marker = sys.argv[1:]
final = read_checkpoint(latest_checkpoint(os.path.join(run, layout.draft_dir(name)), "checkpoints"))
rows = read_rows(run, ["id", "error"]).to_pylist()
kept = {r["id"] for r in rows if r["error"] is None}
state = final["state"]
print(f"killed once: {os.path.exists(marker)}; resumed from step {state.get('resumed_from_step')}; "
      f"epoch done: {state.get('epoch_done')}; steps {len(state.get('history', []))}")
print(f"trained {len(final['consumed'])} of {len(kept)} completion rows; duplicates {len(final['duplicates'])}; "
      f"missing {len(kept - final['consumed'])}; extra {len(final['consumed'] - kept)}")
EOF
say "done"
