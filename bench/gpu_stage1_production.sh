#!/usr/bin/env bash
# On one H200 (after .gpu-wheels/install.sh): stage 1 with the production engine settings (MTP on,
# max_num_seqs auto) on bench/dummy_model.py's 27B hybrid shape, against plain vLLM at the same concurrency.
# Each part is one device call, back to back (the compile cache lives on the machine); logs and JSON go to $OUT.
#   bash bench/gpu_stage1_production.sh warm     # first start on the machine: torch.compile + CUDA graphs for this config
#   bash bench/gpu_stage1_production.sh stage1   # plain vLLM vs `python -m job generate` (defaults), 800 prompts
#   bash bench/gpu_stage1_production.sh seeds    # stage 1 with per-request seeds vs without, 256 prompts
set -u
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
export VLLM_CACHE_ROOT=/root/vllm-cache
CONFIG=bench/gpu_stage1_production.yaml
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
case "$1" in
warm)
  # One short start of each kind (an LLM and stage 1's AsyncLLM): every measured start after it is warm. Stage 1's
  # start line 'engine ready in N s' and its `max_num_seqs auto` lines are in $OUT/logs/1-stage1.log.
  export VLLM_LOGGING_LEVEL=INFO
  timeout 580 python3 bench/bench_generate.py --config $CONFIG --prompts 32 \
    --only "plain+generate.sampling.max_tokens=16" "stage1+generate.sampling.max_tokens=64" --logs $OUT/logs 2>&1 \
    | tee $OUT/warm.log | grep -v "^INFO\|^(\|^\[" | tail -12
  ;;
stage1)
  export VLLM_LOGGING_LEVEL=INFO VLLM_LOG_STATS_INTERVAL=2 BENCH_ENGINE_STATS=1
  timeout 590 python3 bench/bench_generate.py --config $CONFIG --prompts ${PROMPTS:-800} \
    --only ${ONLY:-"plain+generate.sampling.max_tokens=512" "stage1+generate.sampling.max_tokens=512"} \
    --timeout ${CT:-285} --logs $OUT/logs 2>&1 | tee $OUT/stage1.log | grep -v "^INFO\|^(\|^\[" | tail -14
  ;;
seeds)
  export VLLM_LOGGING_LEVEL=INFO VLLM_LOG_STATS_INTERVAL=2 BENCH_ENGINE_STATS=1
  timeout 590 python3 bench/bench_generate.py --config $CONFIG --prompts ${PROMPTS:-256} \
    --only ${ONLY:-"stage1+generate.sampling.max_tokens=512" "stage1+generate.sampling.max_tokens=512+generate.per_request_seed=true"} \
    --timeout ${CT:-285} --logs $OUT/logs 2>&1 | tee $OUT/seeds.log | grep -v "^INFO\|^(\|^\[" | tail -14
  ;;
esac
grep -h "max_num_seqs auto\|engine ready in\|engines on\|Maximum concurrency\|Available KV cache\|attention block size" \
  $OUT/logs/*.log 2>/dev/null | cut -c1-420 | sort -u | tail -12
