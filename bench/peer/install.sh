# Sourced by the peer harnesses' GPU entries (bench/peer/*_gpu.sh), from the repo root: installs the
# carried wheels (.vllm/, .peerwhl/) into /tmp/site and unpacks the slim vLLM 0.20.2 there (kept while
# the machine stays warm), puts /tmp/site and the repo on PYTHONPATH and prints what it found.
if [ -d /tmp/site/vllm ]; then
  echo "reusing /tmp/site"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .vllm/*.whl .peerwhl/*.whl || { echo "pip install failed"; exit 1; }
  if command -v xz > /dev/null; then
    tar xJf .vllm/vllm-0.20.2-slim.tar.xz -C /tmp/site
  else
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
      .vllm/vllm-0.20.2-slim.tar.xz /tmp/site
  fi || { echo "unpack failed"; exit 1; }
fi
# the DeepGEMM vLLM's wheel vendors, importable as `deep_gemm` too: hylora's fp8_deepgemm switch imports
# it by that name (vLLM prefers that name as well, the same code either way)
if [ -d /tmp/site/vllm/third_party/deep_gemm ]; then
  ln -sfn /tmp/site/vllm/third_party/deep_gemm /tmp/site/deep_gemm
fi
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deepgemm_jit}  # one JIT cache for every engine of the machine
export PYTHONPATH=/tmp/site:$(pwd)${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
echo "install took $(( $(date +%s) - t0 ))s; $(python3 -V 2>&1); $(nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader)"
