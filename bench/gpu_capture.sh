#!/usr/bin/env bash
# On one GPU (after .gpu-wheels/install.sh), one call: bench/bench_capture_in_vllm.py on vLLM's GPU kernels. The rows
# a decode step computes against vLLM's own prefill of prompt + completion and transformers' (stage 2's rows), on the
# tiny hybrid (flash-linear-attention's chunked prefill and fused recurrent decode, bf16), with MTP off and on (verify
# rows), and on the tiny dense target. Eager engines: the hook runs outside any CUDA graph.
# carry: .cache/tiny-hybrid, .cache/tiny-model, gpu-train-run (the hybrid's stage-1 run: bench/gpu_train_inputs.sh) and
# .cache/capture-dense-run, demo-run without its 846 MB of hidden states, made here after `make demo`:
#   mkdir -p .cache/capture-dense-run && cp -r demo-run/run.json demo-run/completions .cache/capture-dense-run/
# Logs and JSON go to $OUT.
set -u
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_ALLOW_INSECURE_SERIALIZATION=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
# vLLM 0.26's default FlashInfer GDN prefill kernel fails on Hopper (configs/qwen3.6-27b.yaml says so).
HYBRID='{"additional_config": {"gdn_prefill_backend": "triton"}, "gpu_memory_utilization": 0.5}'
common="--prompts ${PROMPTS:-64} --max-tokens ${MAXTOK:-128} --repeats ${REPEATS:-2} --compare ${COMPARE:-8} --hf-device cuda"
for case in hybrid hybrid_mtp dense; do
  case $case in
  hybrid) args="--run gpu-train-run --engine $(printf %q "$HYBRID")" ;;
  hybrid_mtp) args="--run gpu-train-run --mtp 2 --engine $(printf %q "$HYBRID")" ;;
  dense) args="--run .cache/capture-dense-run --engine '{\"gpu_memory_utilization\": 0.5}'" ;;
  esac
  eval timeout ${CT:-170} python3 bench/bench_capture_in_vllm.py $args $common --out $OUT/$case.json > $OUT/$case.log 2>&1
  echo "$case: rc=$?"; grep -A4 '"relative_l2_mean"' $OUT/$case.log; grep '"ratio_on_over_off"' $OUT/$case.log
  grep "Error\|error" $OUT/$case.log | grep -v "Warning" | tail -3 | cut -c1-300
done
