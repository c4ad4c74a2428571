#!/bin/bash
# The GPU entry of the peer doctor run (docs/PEER.md), from the repo root, with .vllm and .peerwhl
# carried (bench/peer/build_bundle.sh builds them):
#   PEER_BUDGET=500 bash bench/peer/doctor_gpu.sh
# Installs the carried wheels into /tmp/site, unpacks the slim vLLM 0.20.2 there, then runs
# bench/peer/doctor_peer.py (vllm serve and hylora serve, each checked by hylora doctor).
# Writes $OUT/peer.log (everything), $OUT/peer_doctor.md and $OUT/{vllm,hylora}/{doctor.json,doctor.html,server.log}.
OUT=${OUT:-/tmp/peer_out}
mkdir -p "$OUT"
set -o pipefail
{
  t0=$(date +%s)
  . bench/peer/install.sh
  (nice python3 -m compileall -q -j 8 /tmp/site/vllm > /dev/null 2>&1 &)  # .pyc ahead of vllm serve's imports
  python3 bench/peer/doctor_peer.py --out "$OUT" --budget "${PEER_BUDGET:-500}" ${PEER_ARGS:-}
} 2>&1 | tee "$OUT/peer.log"
