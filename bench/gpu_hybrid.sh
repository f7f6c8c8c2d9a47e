#!/usr/bin/env bash
# On one H200 (vLLM 0.26, Ray 2.60, flash-linear-attention 0.6 from ../shared/gpu): stage 2 exactness of
# every batch layout and of the vLLM backend, then both stages of the job end to end on the tiny hybrid with the
# production engine settings (prefix caching, MTP, Triton GDN prefill). Logs and JSON go to $OUT.
#   bash bench/gpu_hybrid.sh      (after .gpu-wheels/install.sh; carries .cache/tiny-hybrid)
set -u
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
[ -n "${SKIP_EXACTNESS:-}" ] || python3 bench/gpu_hybrid_exactness.py --out $OUT/exactness.json 2>&1 | grep -v "Warning\|warn" | tee $OUT/exactness.log | grep "^{"
python3 - <<'PY'
from job.builtin.demo import write_demo_prompts
write_demo_prompts("/tmp/prompts", num_prompts=256)
PY
cat > /tmp/gpu.yaml <<'YAML'
model: .cache/tiny-hybrid
input: /tmp/prompts
output: /tmp/run
engine_kwargs: {max_model_len: 1024, max_num_seqs: 128, dtype: bfloat16, seed: 0, gpu_memory_utilization: 0.3, enforce_eager: true,
  language_model_only: true, enable_prefix_caching: true, speculative_config: {method: mtp, num_speculative_tokens: 2},
  additional_config: {gdn_prefill_backend: triton}}
generate: {sampling: {max_tokens: 512}, rows_per_shard: 32}
quality: {min_content_tokens: 4, canary_rows: 32}
hidden_states: {layer_ids: [0, 1, 3], max_length: 1024, batch_tokens: 8192, rows_per_shard: 64}
YAML
timeout 330 python3 -m job generate --config /tmp/gpu.yaml 2>&1 | grep -v "^\[36m\|^(" > $OUT/stage1_full.log; tail -25 $OUT/stage1_full.log | tee $OUT/stage1.log
timeout 200 python3 -m job hidden-states --config /tmp/gpu.yaml 2>&1 | grep -v "^\[36m\|^(\|Warn" | tail -8 | tee $OUT/stage2.log
# The vLLM backend (its own extraction engine; it cannot give the last layer after the norm) into a fresh output.
sed 's#^hidden_states: {layer_ids: \[0, 1, 3\]#hidden_states: {backend: vllm, engine_kwargs: {language_model_only: true, gpu_memory_utilization: 0.3, additional_config: {gdn_prefill_backend: triton}}, layer_ids: [0, 1, 2]#; s#output: /tmp/run#output: /tmp/run2#' /tmp/gpu.yaml > /tmp/gpu_vllm.yaml
mkdir -p /tmp/run2 && cp -r /tmp/run/completions /tmp/run2/
timeout 240 python3 -m job hidden-states --config /tmp/gpu_vllm.yaml 2>&1 | grep -v "^\[36m\|^(\|Warn" | tail -8 | tee $OUT/stage2_vllm.log
