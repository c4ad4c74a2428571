#!/bin/bash
# The GPU entry of the vLLM-beside-hylora throughput run (docs/PEER.md), from the repo root, with .vllm
# and .peerwhl carried (bench/peer/build_bundle.sh builds them):
#   TPUT_STEPS="ckpt:bf16 hylora:bf16:8192,2048 vllm:bf16:2048" bash bench/peer/throughput_gpu.sh
# Installs the carried wheels into /tmp/site and unpacks the slim vLLM 0.20.2 there (both kept while the
# machine stays warm), then runs bench/peer/throughput_peer.py run $TPUT_STEPS in what is left of
# $TPUT_BUDGET seconds for the whole script (default 565, for a device call of 600). Writes $OUT/throughput.log (everything), $OUT/throughput_peer.md (the table so far),
# $OUT/throughput_peer.json and $OUT/results/<engine>-<weights>-<mnbt>.json.
# TPUT_ARGS passes more flags to the driver (e.g. "--reuse" to keep a checkpoint already in the work dir).
OUT=${OUT:-/tmp/tput_out}
mkdir -p "$OUT"
set -o pipefail
{
  t0=$(date +%s)
  [ -n "${TPUT_STEPS:-}" ] || { echo "set TPUT_STEPS, e.g. TPUT_STEPS='ckpt:bf16 vllm:bf16:2048'"; exit 2; }
  . bench/peer/install.sh
  df -h /dev/shm /tmp | tail -2
  (nice python3 -m compileall -q -j 8 /tmp/site/vllm > /dev/null 2>&1 &)  # .pyc ahead of vLLM's imports
  # shellcheck disable=SC2086  # the steps and flags are words
  budget=$(( ${TPUT_BUDGET:-565} - ($(date +%s) - t0) ))
  python3 bench/peer/throughput_peer.py run $TPUT_STEPS --out "$OUT" --budget "$budget" ${TPUT_ARGS:-}
} 2>&1 | tee "$OUT/throughput.log"
