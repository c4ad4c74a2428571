#!/bin/bash
# Builds what the GPU run of bench/peer/doctor_gpu.sh carries (both folders git-ignored):
#   .vllm/     a slim vLLM 0.20.2 tree (xz; sm_90 only, no FA2 / MoE / FlashMLA) and the
#              py3.12 wheels that only vLLM imports and the GPU machine's image lacks;
#   .peerwhl/  the wheels hylora serve / doctor need there (the API stack vLLM shares with it, one
#              version of each), and fla-core.
# Run from the repo root on the CPU machine (package registries reachable):
#   bash bench/peer/build_bundle.sh                 # downloads vllm==0.20.2 (244 MB) into a temp dir
#   VLLM_WHL=/tmp/vw/vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl bash bench/peer/build_bundle.sh
set -euo pipefail
ROOT=$(pwd)
[ -f "$ROOT/bench/peer/prune_fatbin.py" ] || { echo "run from the repo root"; exit 2; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
if [ -z "${VLLM_WHL:-}" ]; then
  python3 -m pip download -q --no-deps -d "$T/dl" vllm==0.20.2
  VLLM_WHL=$(ls "$T"/dl/vllm-0.20.2-*.whl)
fi
rm -rf .vllm .peerwhl
mkdir -p .vllm .peerwhl
grep -qx '/.vllm/' .git/info/exclude || echo '/.vllm/' >> .git/info/exclude
grep -qx '/.peerwhl/' .git/info/exclude || echo '/.peerwhl/' >> .git/info/exclude

# the slim tree: what one H200 with this model never loads goes; the two extension libraries that
# are imported unconditionally keep sm_90 code only
unzip -q "$VLLM_WHL" -d "$T/tree"
(
  cd "$T/tree"
  # DeepGEMM stays: stock vLLM serves block-FP8 linears with it on Hopper (DeepGemmFp8BlockScaledMMKernel
  # heads _POSSIBLE_FP8_BLOCK_KERNELS); without it vLLM fell back to CUTLASS in the FP8 peer runs up to
  # run 56 (docs/PEER.md). 1.3 MB of host code and 27 MB of headers for its JIT, 1.8 MB more with xz
  rm -rf vllm/entrypoints/serve/instrumentator/static
  rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C.abi3.so vllm/_flashmla_C.abi3.so \
    vllm/_flashmla_extension_C.abi3.so
  for so in _C.abi3.so _C_stable_libtorch.abi3.so; do
    python3 "$ROOT/bench/peer/prune_fatbin.py" "vllm/$so" "vllm/$so.pruned" && mv "vllm/$so.pruned" "vllm/$so"
  done
  # byte-identical from one build to the next (sorted, no dates or owners, one xz thread): 287 MB -> 33 MB
  tar cf - --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner vllm vllm-0.20.2.dist-info \
    | xz -9 -T1 > "$ROOT/.vllm/vllm-0.20.2-slim.tar.xz"
)

download() {  # DIR NAME==VERSION...: py3.12 manylinux / pure wheels, no dependencies (each is named)
  local dir=$1
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dir" "$@"
}
# imported by vLLM (its engine: the peer harness's list; its OpenAI server: the rest) and absent from the image
download .vllm \
  apache-tvm-ffi==0.1.11 cachetools==7.2.0 cbor2==6.1.4 distro==1.9.0 gguf==0.19.0 msgspec==0.22.0 \
  openai==2.54.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 \
  pybase64==1.5.1 pyzmq==27.2.0 sniffio==1.3.1 xgrammar==0.2.9 depyf==0.20.0 astor==0.8.1 dill==0.4.1 \
  watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 \
  prometheus-fastapi-instrumentator==8.1.0
# multimodal inputs (bench/peer/video_peer.py): vLLM hashes them with blake3 (VLLM_MM_HASHER_ALGORITHM's default)
download .vllm blake3==1.0.11
# FP8 checkpoints (bench/peer/throughput_peer.py): vLLM's quantization registry imports compressed_tensors
# (pinned by vLLM 0.20.2) whichever method it looks up, and compressed_tensors imports loguru
download .vllm compressed-tensors==0.15.0.1 loguru==0.7.3
# hylora serve / doctor (pyproject: fastapi>=0.110, pydantic>=2.6, uvicorn>=0.29, llguidance>=1.9.1,<2,
# fla-core==0.6.0), at the versions vLLM 0.20.2 ran with in the peer harness (fastapi[standard]>=0.115,
# pydantic>=2.12): one version of each for both engines
download .peerwhl \
  fastapi==0.142.2 starlette==1.7.0 pydantic==2.13.5 pydantic-core==2.46.5 annotated-types==0.8.0 \
  typing-inspection==0.4.4 uvicorn==0.54.0 llguidance==1.9.1 fla-core==0.6.0

# one version of each distribution across both folders (two stop pip install)
dupes=$(ls .vllm/*.whl .peerwhl/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z.' 'a-z_' | sort | uniq -d)
[ -z "$dupes" ] || { echo "two versions of: $dupes"; exit 1; }
du -sh .vllm .peerwhl
du -cb .vllm .peerwhl | tail -1 | awk '{printf "carried: %.1f MiB\n", $1 / 1048576}'
