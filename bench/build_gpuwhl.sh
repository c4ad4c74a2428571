#!/bin/bash
# Builds .gpuwhl/ (ignored, ~41 MB): the wheels the device image lacks for the engine and its server
# (pydantic, llguidance, fastapi and its opentelemetry import, uvicorn, pybase64, PyAV for video), for its
# Python 3.12. Needs .peerwhl/ and .vllm/ (bench/peer/build_bundle.sh) and the package registry.
#   bash bench/build_gpuwhl.sh
set -euo pipefail
mkdir -p .gpuwhl
cp .peerwhl/*.whl .vllm/opentelemetry_api-*.whl .vllm/pybase64-*.whl .gpuwhl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .gpuwhl "av==19.0.2"
ls .gpuwhl
