#!/bin/bash
# Builds .gpuwhl/ (ignored, ~41 MB): the wheels the device image lacks for the engine and its server
# (pydantic, llguidance, fastapi and its opentelemetry import, uvicorn, pybase64, PyAV for video), for its
# Python 3.12, and the DeepGEMM vLLM 0.20.2's wheel vendors (1.4 MB as .tar.xz, for --kernels
# fp8_deepgemm=1; bench/doctor_gpu.sh unpacks it). Needs .peerwhl/ and .vllm/ (bench/peer/build_bundle.sh)
# and the package registry.
#   bash bench/build_gpuwhl.sh
set -euo pipefail
mkdir -p .gpuwhl
cp .peerwhl/*.whl .vllm/opentelemetry_api-*.whl .vllm/pybase64-*.whl .gpuwhl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .gpuwhl "av==19.0.2"
tmp=$(mktemp -d)
tar xJf .vllm/vllm-0.20.2-slim.tar.xz -C "$tmp" vllm/third_party/deep_gemm
tar cJf .gpuwhl/deep_gemm-from-vllm-0.20.2.tar.xz -C "$tmp/vllm/third_party" deep_gemm
rm -rf "$tmp"
ls .gpuwhl
