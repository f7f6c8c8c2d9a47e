#!/usr/bin/env bash
# On one H200 (after .gpu-wheels/install.sh; carries .cache/tiny-hybrid and .cache/dummy-hybrid-27b).
# Each part is one device call; logs and JSON go to $OUT.
#   bash bench/gpu_hybrid_stages.sh stage2   # GDN varlen vs once-per-sequence: exactness, speed, kernel profile
#   bash bench/gpu_hybrid_stages.sh warm     # first engine start on the machine (compile cache), no limit
#   bash bench/gpu_hybrid_stages.sh stage1   # plain vLLM vs `python -m job generate` vs ray.data.llm, 27B hybrid shape
#   bash bench/gpu_hybrid_stages.sh sweep    # stage 1 at max_num_seqs 64/128/256 and with prefix caching
#   bash bench/gpu_hybrid_stages.sh vllm2    # stage 2's vllm backend: read-back in line vs overlapped vs the engine alone
# Runs not yet made (the device time ran out on 2026-12-03), each one call after `warm`:
#   PROMPTS=1000 CT=190 ONLY="plain+generate.sampling.max_tokens=1024 stage1+generate.sampling.max_tokens=1024 raydata+generate.sampling.max_tokens=1024" bash bench/gpu_hybrid_stages.sh stage1
#   PROMPTS=256 CT=185 SWEEP="stage1+generate.sampling.max_tokens=1024 stage1+generate.sampling.max_tokens=1024+generate.per_request_seed=false stage1+generate.sampling.max_tokens=1024+engine_kwargs.max_num_seqs=64" bash bench/gpu_hybrid_stages.sh sweep
#   HYBRID=1 SKIP_8B=1 bash bench/gpu_hybrid_stages.sh vllm2   # the 27B hybrid shape alone
set -u
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
case "$1" in
stage2)
  timeout 150 python3 bench/gpu_hybrid_exactness.py --skip-vllm --out $OUT/exactness.json 2>&1 \
    | grep -v "Warning\|warn" | tee $OUT/exactness.log | grep "^{" | cut -c1-400
  timeout 400 python3 bench/bench_hybrid_stage2.py --out $OUT/hybrid_stage2.json \
    --layouts packed:per_sequence packed:varlen --profile $OUT/kernels.txt 2>&1 | grep -v "Warning\|warn" \
    | tee $OUT/hybrid_stage2.log | grep -v "^ " | tail -8
  ;;
warm)
  # The engine's first start on a machine compiles (torch.compile, Triton autotuning; 313.9 s for this shape on an
  # H200): do it once with no limit, so every measured contender after it starts warm. Stage 1 too: the compile
  # cache is keyed per engine config, and an AsyncLLM gets max_num_batched_tokens 2048 where LLM gets 16384 (stage 1
  # then compiled ~46 s in its measured run), and only stage 1's per-request seeds use vLLM's Triton top-k/top-p
  # kernel (its first compile stalled the 128-prompt run ~9 s, docs/BENCHMARKS.md). 64 tokens: past one decode step.
  export VLLM_LOGGING_LEVEL=INFO
  timeout 560 python3 bench/bench_generate.py --config bench/gpu_stage1.yaml --prompts 32 \
    --only "plain+generate.sampling.max_tokens=16" "stage1+generate.sampling.max_tokens=64" --logs $OUT/logs 2>&1 \
    | tee $OUT/warm.log | grep -v "^INFO\|^(\|^\[" | tail -12
  ;;
stage1)
  # The three contenders in one call, each in its own process on the warm compile cache (run `warm` first).
  # BENCH_ENGINE_STATS=1: stage 1's AsyncLLM logs "Running: N reqs" too (an AsyncLLM logs stats only when its
  # owner calls do_log_stats(); bench_generate.py's worker hook does), so bench/plot_in_flight.py draws both:
  #   python3 bench/plot_in_flight.py plain=$OUT/logs/0-plain.log stage1=$OUT/logs/1-stage1.log --out in_flight.png
  export VLLM_LOGGING_LEVEL=INFO VLLM_LOG_STATS_INTERVAL=2 BENCH_ENGINE_STATS=1
  timeout 580 python3 bench/bench_generate.py --config bench/gpu_stage1.yaml --prompts ${PROMPTS:-256} \
    --only ${ONLY:-plain stage1 raydata} --timeout ${CT:-185} --logs $OUT/logs 2>&1 \
    | tee $OUT/stage1.log | grep -v "^INFO\|^(\|^\[" | tail -20
  ;;
sweep)
  export VLLM_LOGGING_LEVEL=INFO VLLM_LOG_STATS_INTERVAL=2 BENCH_ENGINE_STATS=1
  timeout 580 python3 bench/bench_generate.py --config bench/gpu_stage1.yaml --prompts ${PROMPTS:-256} \
    --only ${SWEEP:-"stage1+engine_kwargs.max_num_seqs=256" "stage1+engine_kwargs.max_num_seqs=64" "stage1+engine_kwargs.enable_prefix_caching=true"} \
    --timeout ${CT:-185} --logs $OUT/logs 2>&1 | tee $OUT/sweep.log | grep -v "^INFO\|^(\|^\[" | tail -20
  ;;
vllm2)
  # One engine per shape: vLLM's own extraction into /dev/shm files (all samples in one generate call, nothing read
  # back) against the backend with the read-back in line (prefetch 0) and overlapped with the next part (1).
  if [ -z "${SKIP_8B:-}" ]; then
    timeout ${T8:-280} python3 bench/bench_hidden_states.py --vllm --vllm-eager --rows-per-shard 64 --vllm-prefetch ${PREFETCH:-0,1} \
      --json-out $OUT/vllm2_8b.json 2>&1 | grep -v "Warning\|warn" | tee $OUT/vllm2_8b.log | grep "^{" | cut -c1-600
  fi
  if [ -n "${HYBRID:-}" ]; then
    timeout ${T27:-280} python3 bench/bench_hidden_states.py --vllm --vllm-eager --rows-per-shard 32 \
      --num-samples 128 --layers 1,16,31,46,61 --dummy-dir .cache/dummy-hybrid-27b --json-out $OUT/vllm2_27b.json \
      2>&1 | grep -v "Warning\|warn" | tee $OUT/vllm2_27b.log | grep "^{" | cut -c1-600
  fi
  ;;
esac
