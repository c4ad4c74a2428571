#!/bin/bash
# vLLM beside hylora on the video workload (docs/PEER.md), from the repo root, with .vllm and .peerwhl
# carried: bash bench/peer/video_gpu.sh
# VIDEO_STEPS (default: ckpt vllm hylora), VIDEO_BUDGET (default 565 s) and VIDEO_ARGS (e.g. "--rate 1")
# as bench/peer/peer_gpu.sh's STEPS, BUDGET and ARGS. Writes $OUT/video.log, $OUT/video_peer.md and
# $OUT/video-<engine>.json.
OUT=${OUT:-/tmp/videopeer_out} STEPS=${VIDEO_STEPS:-} BUDGET=${VIDEO_BUDGET:-} ARGS=${VIDEO_ARGS:-} \
  exec bash bench/peer/peer_gpu.sh video
