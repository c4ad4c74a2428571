#!/bin/bash
# The GPU entry of vLLM beside hylora with MTP speculative decoding (docs/PEER.md), from the repo root,
# with .vllm and .peerwhl carried (bench/peer/build_bundle.sh builds them):
#   bash bench/peer/speculative_gpu.sh
# Installs the carried wheels into /tmp/site and unpacks the slim vLLM 0.20.2 there, then runs
# bench/peer/speculative_peer.py run $SPEC_STEPS (default: ckpt vllm hylora) in what is left of
# $SPEC_BUDGET seconds (default 565, for a device call of 600). Writes $OUT/speculative.log,
# $OUT/speculative_peer.md and $OUT/spec-<engine>.json. SPEC_ARGS passes more flags (e.g. "--k 3").
OUT=${OUT:-/tmp/specpeer_out}
mkdir -p "$OUT"
set -o pipefail
{
  t0=$(date +%s)
  . bench/peer/install.sh
  (nice python3 -m compileall -q -j 8 /tmp/site/vllm > /dev/null 2>&1 &)  # .pyc ahead of vLLM's imports
  budget=$(( ${SPEC_BUDGET:-565} - ($(date +%s) - t0) ))
  # shellcheck disable=SC2086  # the steps and flags are words
  python3 bench/peer/speculative_peer.py run ${SPEC_STEPS:-ckpt vllm hylora} --out "$OUT" --budget "$budget" ${SPEC_ARGS:-}
} 2>&1 | tee "$OUT/speculative.log"
