#!/bin/bash
# The GPU entry of a one-result-per-engine peer bench (bench/peer/<BENCH>_peer.py: speculative, video, video_server),
# from the repo root, with .vllm and .peerwhl carried (bench/peer/build_bundle.sh builds them):
#   bash bench/peer/peer_gpu.sh BENCH
# Installs the carried wheels into /tmp/site and unpacks the slim vLLM 0.20.2 there, then runs
# bench/peer/BENCH_peer.py run $STEPS (default: ckpt vllm hylora) in what is left of $BUDGET seconds
# (default 565, for a device call of 600), with $ARGS as more flags. Writes $OUT/BENCH.log, the table
# $OUT/BENCH_peer.md and each engine's result JSON. speculative_gpu.sh and video_gpu.sh call it.
BENCH=${1:?which bench: speculative, video or video_server}
OUT=${OUT:-/tmp/${BENCH}peer_out}
mkdir -p "$OUT"
set -o pipefail
{
  t0=$(date +%s)
  . bench/peer/install.sh
  (nice python3 -m compileall -q -j 8 /tmp/site/vllm > /dev/null 2>&1 &)  # .pyc ahead of vLLM's imports
  budget=$(( ${BUDGET:-565} - ($(date +%s) - t0) ))
  # shellcheck disable=SC2086  # the steps and flags are words
  python3 "bench/peer/${BENCH}_peer.py" run ${STEPS:-ckpt vllm hylora} --out "$OUT" --budget "$budget" ${ARGS:-}
} 2>&1 | tee "$OUT/$BENCH.log"
