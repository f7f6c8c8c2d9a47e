#!/usr/bin/env bash
# On one H200: stage 2's elementwise work fused (job/hidden_states/fusion.py), torch.compile vs
# flash-linear-attention's fused norms vs unfused, on the 27B hybrid shape. Needs only flash-linear-attention on the
# image (torch 2.11, transformers 5.17): three wheels carried from ../shared/gpu's download, no vLLM or Ray.
#   bash bench/gpu_stage2_fusion.sh a          exactness of each (small Qwen3.5 shape + tiny hybrid), then the three timed
#                                        in one process (packed, varlen GDN; 120 samples, 2 passes each)
#   bash bench/gpu_stage2_fusion.sh b KIND     the kept one (fuse KIND) with and without FP8 records, its profile, the
#                                        unfused FP8 path, and the plain 64-layer forward, in one process
# carry: .gpu-wheels/whl/{fla_core-0.6.0,flash_linear_attention-0.6.0}-py3-none-any.whl,
#        .gpu-wheels/whl/einops-0.8.2-py3-none-any.whl, .cache/tiny-hybrid. Logs and JSON go to $OUT.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/whl/fla_core-0.6.0-py3-none-any.whl \
    .gpu-wheels/whl/flash_linear_attention-0.6.0-py3-none-any.whl .gpu-wheels/whl/einops-0.8.2-py3-none-any.whl \
    && touch /tmp/site/.done
fi
python3 -c "import torch, transformers, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1 | tee $OUT/versions.txt
case "${1:-a}" in
a)
  timeout 220 python3 bench/gpu_hybrid_exactness.py --fused --skip-vllm --out $OUT/exactness.json 2>&1 \
    | grep -v "Warning\|warn" | tee $OUT/exactness.log | grep "^{" | cut -c1-400
  timeout 330 python3 bench/bench_hybrid_stage2.py --out $OUT/fused.json --no-plain \
    --layouts packed:varlen packed:varlen:fuse-compile packed:varlen:fuse-fla 2>&1 | grep -v "Warning\|warn" \
    | tee $OUT/fused.log | tail -8 | cut -c1-400
  ;;
b)
  kind=${2:?fuse kind: compile or fla}
  timeout 560 python3 bench/bench_hybrid_stage2.py --out $OUT/kept.json --profile $OUT/kernels.txt \
    --layouts packed:varlen:fp8 packed:varlen:fuse-$kind:fp8 packed:varlen packed:varlen:fuse-$kind 2>&1 \
    | grep -v "Warning\|warn" | tee $OUT/kept.log | grep -v "^ \|^-\|^Name\|^Self" | tail -8 | cut -c1-400
  ;;
esac
