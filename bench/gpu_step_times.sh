#!/usr/bin/env bash
# On one H100 or H200 (after .gpu-wheels/install.sh): the per-step figures bench/sim_concurrency.py runs on, and a
# real run of a short length mix at four max_num_seqs to check the simulation against (bench/gpu_step_times.py says
# how), production engine settings (bench/gpu_stage1_production.yaml: MTP on) on bench/dummy_model.py's 27B hybrid
# shape. carry: .cache/dummy-hybrid-27b (config and tokenizer only: `python bench/dummy_model.py`). Logs, JSON to $OUT.
#   bash bench/gpu_step_times.sh grid     # first call on a machine: the cold engine start (~5 min) + the step grid
#                                         (MIX set: then that mix at LEVELS from the same engine, in steps.json)
#   bash bench/gpu_step_times.sh mix      # next call, warm compile cache: the short mix at 17, 24, 30, 34 sequences
# MAXSEQS (default 34: the most an H100's pool holds) is the engine's max_num_seqs, or `auto` (stage 1's value on this
# device: its engines then start warm from the same compile cache); the same value in every call keeps the cache
# warm. NAME names the mix's JSON and log (default mix). GRID, MIX, LEVELS, WARM, MEASURE and CT override the rest
# (docs/BENCHMARKS.md).
set -u
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VLLM_CACHE_ROOT=/root/vllm-cache VLLM_LOGGING_LEVEL=INFO
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
case "${1:-grid}" in
grid)
  timeout ${CT:-570} python3 bench/gpu_step_times.py --max-num-seqs ${MAXSEQS:-34} \
    --grid "${GRID:-256:8,16,24,32;4096:8,16,22;12288:6,12}" --measure-s ${MEASURE:-5} --mix "${MIX:-}" \
    --mix-levels ${LEVELS:-17} --mix-prompt 256 --mix-warm-s ${WARM:-30} --mix-measure-s ${MIXMEASURE:-60} \
    --out $OUT/steps.json 2>&1 \
    | tee $OUT/steps.log | grep -v "^INFO\|^(\|^\[\|Warning\|warn" | tail -30 | cut -c1-400
  ;;
mix)
  timeout ${CT:-570} python3 bench/gpu_step_times.py --max-num-seqs ${MAXSEQS:-34} --grid "" \
    --mix ${MIX:-800:6000:8192} --mix-levels ${LEVELS:-17,24,30,34} --mix-prompt 256 --mix-warm-s ${WARM:-30} \
    --mix-measure-s ${MEASURE:-60} \
    --out $OUT/${NAME:-mix}.json 2>&1 | tee $OUT/${NAME:-mix}.log | grep -v "^INFO\|^(\|^\[\|Warning\|warn" | tail -30 | cut -c1-400
  ;;
esac
grep -h "Available KV cache\|attention block size\|Maximum concurrency\|torch.compile\|init engine\|Graph capturing" \
  $OUT/*.log 2>/dev/null | cut -c1-300 | sort -u | tail -10
