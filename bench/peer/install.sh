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
export PYTHONPATH=/tmp/site:$(pwd)${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
echo "install took $(( $(date +%s) - t0 ))s; $(python3 -V 2>&1); $(nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader)"
