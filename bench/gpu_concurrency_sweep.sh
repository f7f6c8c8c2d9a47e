#!/usr/bin/env bash
# On one H100 or H200 (after .gpu-wheels/install.sh): `max_num_seqs: auto` against fixed values, steady
# state, the production engine settings (bench/gpu_stage1_production.yaml: MTP on) on bench/dummy_model.py's 27B
# hybrid shape, one engine start (bench/gpu_concurrency_sweep.py says how). carry: .cache/dummy-hybrid-27b (config and
# tokenizer only, built here by `python bench/dummy_model.py`). Logs and JSON go to $OUT.
#   bash bench/gpu_concurrency_sweep.sh sweep    # the same command line twice: the first call on a machine compiles, the
#                                      # second starts from the compile cache and is the one to read
# From a helper's worktree (the device tool sends the session's checkout, not the worktree): the H100 sweep linked the
# worktree into it (`ln -s /work/wt/i49 /work/main/.cache/i49`), carried `.cache/i49/{bench,job,.cache/dummy-hybrid-27b}`
# and the wheel parts through the link, and ran `cd .cache/i49 && bash bench/gpu_concurrency_sweep.sh sweep`.
# Levels: the first version's choice (old), 8, 16, auto at 8,192 tokens a sequence (the config's kv_tokens_per_seq),
# auto at the run's mix (--kv-mix 512: ~60-token prompts + max_tokens 256), and 0.5, 0.75, 1.25 x that.
set -u
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VLLM_CACHE_ROOT=/root/vllm-cache VLLM_LOGGING_LEVEL=INFO
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
case "${1:-sweep}" in
sweep)
  timeout ${CT:-540} python3 bench/gpu_concurrency_sweep.py --config bench/gpu_stage1_production.yaml \
    --model .cache/dummy-hybrid-27b --levels ${LEVELS:-old,8,16,auto,mix,mix*0.5,mix*0.75,mix*1.25} --kv-mix 512 \
    --max-tokens 256 --warm-s ${WARM:-12} --measure-s ${MEASURE:-20} --out $OUT/sweep.json 2>&1 | tee $OUT/sweep.log \
    | grep -v "^INFO\|^(\|^\[\|Warning\|warn" | tail -30 | cut -c1-400
  ;;
esac
grep -h "max_num_seqs auto\|Available KV cache\|attention block size\|Maximum concurrency\|Model loading took\|torch.compile\|init engine\|Graph capturing\|falling back\|fallback" \
  $OUT/*.log 2>/dev/null | cut -c1-300 | sort -u | tail -16
