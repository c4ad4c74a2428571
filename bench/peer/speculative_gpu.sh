#!/bin/bash
# vLLM beside hylora with MTP speculative decoding (docs/PEER.md), from the repo root, with .vllm and
# .peerwhl carried: bash bench/peer/speculative_gpu.sh
# SPEC_STEPS (default: ckpt vllm hylora), SPEC_BUDGET (default 565 s) and SPEC_ARGS (e.g. "--k 3") as
# bench/peer/peer_gpu.sh's STEPS, BUDGET and ARGS. Writes $OUT/speculative.log, $OUT/speculative_peer.md
# and $OUT/spec-<engine>.json.
OUT=${OUT:-/tmp/specpeer_out} STEPS=${SPEC_STEPS:-} BUDGET=${SPEC_BUDGET:-} ARGS=${SPEC_ARGS:-} \
  exec bash bench/peer/peer_gpu.sh speculative
