#!/usr/bin/env bash
# On one GPU (after .gpu-wheels/install.sh), one call: stage 2 through `python -m job hidden-states` on the 27B's
# widths at reduced depth, against the bench extractor on the same checkpoint and samples.
#   1. bench/reduced_checkpoint.py writes the checkpoint (8 layers, random bf16, ~11 GB) to $CKPT, once a machine;
#   2. the job, production's stage-2 settings (bench/gpu_stage2_cli.yaml: fuse auto, self-check on), over
#      stage2-cli-run (made on the CPU by bench/stage2_cli_inputs.py, carried) copied to $RUN_DIR;
#   3. bench/stage2_cli_figures.py: the report's tokens/s, the steady state, the time to the first committed part;
#   4. bench_hybrid_stage2.py on the same checkpoint and samples, in the path the job's worker said it ran.
# Results (one H100: 2026-12-07, and a rerun cut off on 2026-12-08) are in bench/results/h100_stage2_cli/ and
# docs/BENCHMARKS.md.
# LIMIT=N: the run's first N rows only (both). carry: stage2-cli-run, .cache/tiny-hybrid's tokenizer.json,
# tokenizer_config.json, chat_template.jinja and generation_config.json (all of it is over the 64 MiB with the last
# wheel part). Logs and JSON go to $OUT.
set -u
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
# The run (and its ~25 GB of parts) in memory where /dev/shm holds it: the bench extractor writes nothing, so the job
# is timed with writes as fast as the machine makes them; else on the disk (the log says which).
shm=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)
default_run=/root/stage2-cli-run; [ "${shm:-0}" -gt 40 ] && default_run=/dev/shm/stage2-cli-run
CKPT=${CKPT:-/root/reduced-27b} RUN_DIR=${RUN_DIR:-$default_run}
df -h /dev/shm /root | tee $OUT/disks.txt; echo "run in $RUN_DIR" | tee -a $OUT/disks.txt
if [ ! -f $CKPT/model.safetensors.index.json ] && [ ! -f $CKPT/model.safetensors ]; then
  timeout 200 python3 bench/reduced_checkpoint.py --layers ${LAYERS:-8} --out $CKPT 2>&1 | tee $OUT/checkpoint.log \
    | tail -1 | cut -c1-400
fi
rm -rf $RUN_DIR && cp -r stage2-cli-run $RUN_DIR
started=$(date +%s.%N)
# CT: a fresh machine took 3 min to its first unit (2026-12-08: Ray, 11 GB loaded, the self-check, compiles).
timeout ${CT:-420} python3 -m job hidden-states --config bench/gpu_stage2_cli.yaml --model $CKPT --output $RUN_DIR \
  --allow-drift ${LIMIT:+--limit $LIMIT} 2>&1 | tee $OUT/job.log | grep -v "^\[hidden\|Warning\|warn" | grep -i \
  "worker on\|self-check\|hidden states:\|note:\|error\|Traceback" | cut -c1-400
python3 bench/stage2_cli_figures.py $RUN_DIR --started $started --out $OUT/job_figures.json | cut -c1-600
tar czf $OUT/markers.tgz -C $RUN_DIR hidden_states/done 2>/dev/null   # each unit's summary, kept if the job is cut off
path=$(grep -o "attention packed\|attention padded" $OUT/job.log | head -1 | awk '{print $2}')
gdn=$(grep -q "varlen kernels" $OUT/job.log && echo varlen || echo per_sequence)
[ "$path" = padded ] && gdn=""
fuse=$(grep -o "fused elementwise ops ([a-z]*)" $OUT/job.log | head -1 | sed 's/.*(\(.*\))/\1/')
layout="${path:-packed}:$gdn:fuse-${fuse:-off}"
echo "bench layout: $layout"
timeout ${BT:-240} python3 bench/bench_hybrid_stage2.py --model $CKPT --run $RUN_DIR --layers 7 --rows-per-part 8 \
  --batch-tokens 65536 --layouts $layout --no-plain ${LIMIT:+--limit $LIMIT} --out $OUT/bench.json 2>&1 | grep -v "Warning\|warn" \
  | tee $OUT/bench.log | tail -3 | cut -c1-400
rm -rf $RUN_DIR/hidden_states   # tens of GB: the next call's disk
