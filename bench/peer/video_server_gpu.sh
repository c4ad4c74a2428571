#!/bin/bash
# vLLM beside hylora on the video workload through their OpenAI servers (docs/PEER.md), from the repo root,
# with .vllm and .peerwhl carried: bash bench/peer/video_server_gpu.sh
# VIDEO_STEPS (default: ckpt vllm hylora), VIDEO_BUDGET (default 565 s) and VIDEO_ARGS (e.g. "--reuse") as
# bench/peer/peer_gpu.sh's STEPS, BUDGET and ARGS. Writes $OUT/video_server.log, $OUT/video_server_peer.md,
# $OUT/video_server-<engine>.json and each server's log.
OUT=${OUT:-/tmp/videoserverpeer_out} STEPS=${VIDEO_STEPS:-} BUDGET=${VIDEO_BUDGET:-} ARGS=${VIDEO_ARGS:-} \
  exec bash bench/peer/peer_gpu.sh video_server
