#!/usr/bin/env bash
# The training-only wheel set for bench/gpu_train.sh with SERVE=0: Ray, speculators, flash-linear-attention and their
# modules, without vLLM and what only vLLM needs (~90 MB: two device calls of 48 MiB parts, not nine). Made from the
# full set ../shared/gpu/fetch-wheels.sh leaves in .gpu-wheels/whl. Then, on the device, one call per part:
#   carry [".gpu-wheels/small/part-aX", ".gpu-wheels/small/install.sh", ".gpu-wheels/small/count"],
#   command `bash .gpu-wheels/small/install.sh` (the last part installs into /root/site).
set -eu
cd "$(dirname "$0")/.."
VLLM_ONLY='^(vllm|flashinfer|mistral_common|pycountry|llguidance|xgrammar|outlines_core|openai_harmony|apache_tvm_ffi|openai-|nvtx|lm_format|compressed_tensors|gguf|partial_json|prometheus_fastapi|fastapi|uvicorn|starlette|tiktoken|sentencepiece|depyf|astor|cupy|numba|llvmlite|opencv|lark|interegular|diskcache|cloudpickle|msgspec|einops)'
rm -rf .gpu-wheels/small && mkdir -p .gpu-wheels/small
(cd .gpu-wheels/whl && ls | grep -viE "$VLLM_ONLY" | xargs tar cf ../small/all.tar)
(cd .gpu-wheels/small && split -b 50331648 all.tar part- && rm all.tar && ls part-* | wc -l > count)
cat > .gpu-wheels/small/install.sh <<'SH'
#!/usr/bin/env bash
set -eu
mkdir -p /root/carry-small
cp -n .gpu-wheels/small/part-* /root/carry-small/ 2>/dev/null || true
if [ -f /root/site/.done ]; then echo "installed"; exit 0; fi
want=$(cat .gpu-wheels/small/count); have=$(ls /root/carry-small/part-* | wc -l)
if [ "$have" -lt "$want" ]; then echo "have $have of $want parts"; exit 0; fi
cd /root/carry-small && cat part-* > all.tar && mkdir -p w && tar xf all.tar -C w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site w/*.whl
touch /root/site/.done; echo "installed"
SH
echo "$(cat .gpu-wheels/small/count) parts in .gpu-wheels/small ($(du -sh .gpu-wheels/small | cut -f1))"
