#!/bin/bash
# On the device, from the repo root: runs bench/fp8_deepgemm_gpu.py on DeepGEMM as stock vLLM 0.20.2
# serves it, the prebuilt copy its wheel vendors (vllm/third_party/deep_gemm, built against torch 2.11),
# taken from the carried .vllm bundle (bash bench/peer/build_bundle.sh). Without .vllm it builds
# DeepGEMM 54e2261 from the carried .deepgemm (bash bench/build_deepgemm.sh) against the device's torch
# with its nvcc (torch.utils.cpp_extension and ninja), laying out its JIT include tree as its setup.py
# does; run 56's build of that kind crashed in its first host call.
#   bash bench/fp8_deepgemm_gpu.sh [--tokens 8192,2048,512,128,32]
set -uo pipefail
t0=$(date +%s)
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deepgemm_jit} PYTHONUNBUFFERED=1
nvcc --version | tail -2 | head -1
SLIM=.vllm/vllm-0.20.2-slim.tar.xz
if [ -f "$SLIM" ]; then
  DG=/tmp/deepgemm_vllm
  rm -rf "$DG" && mkdir -p "$DG"
  tar xJf "$SLIM" -C "$DG" vllm/third_party/deep_gemm || { echo "no deep_gemm in $SLIM: rebuild it with bench/peer/build_bundle.sh"; exit 2; }
  mv "$DG/vllm/third_party/deep_gemm" "$DG/deep_gemm"
  echo "vLLM 0.20.2's vendored DeepGEMM unpacked in $(( $(date +%s) - t0 )) s"
else
  DG=/tmp/deepgemm
  rm -rf "$DG" && cp -r .deepgemm "$DG"
  mkdir -p "$DG/deep_gemm/include"
  cp -r "$DG/third-party/cutlass/include/cute" "$DG/third-party/cutlass/include/cutlass" "$DG/deep_gemm/include/"
  echo "persistent_envs = dict()" > "$DG/deep_gemm/envs.py"
  python3 - "$DG" <<'PY' || { echo "DeepGEMM's build failed after $(( $(date +%s) - t0 )) s"; exit 2; }
import os, shutil, sys, torch
from torch.utils.cpp_extension import CUDA_HOME, load
dg = sys.argv[1]
os.makedirs(f"{dg}/build", exist_ok=True)
# with_cuda: link c10_cuda / torch_cuda as DeepGEMM's setup.py (a CUDAExtension) does; session 38's build
# without it imported but crashed in its first host call (docs/BASELINE.md, run 56)
module = load(
    name="_C", sources=[f"{dg}/csrc/python_api.cpp"], build_directory=f"{dg}/build", verbose=False, with_cuda=True,
    extra_include_paths=[f"{CUDA_HOME}/include", f"{CUDA_HOME}/include/cccl", f"{dg}/deep_gemm/include",
                         f"{dg}/third-party/cutlass/include", f"{dg}/third-party/fmt/include"],
    extra_cflags=["-std=c++17", "-O3", "-Wno-psabi", "-Wno-deprecated-declarations"],
    extra_ldflags=[f"-L{CUDA_HOME}/lib64", "-lcudart", "-lnvrtc"],
)
shutil.copy(module.__file__, f"{dg}/deep_gemm/_C.so")
print(f"built {module.__file__} against torch {torch.__version__}, CUDA {torch.version.cuda} ({CUDA_HOME})")
PY
  echo "DeepGEMM built in $(( $(date +%s) - t0 )) s"
fi
PYTHONPATH="$DG:$(pwd)" python3 bench/fp8_deepgemm_gpu.py "$@"
rc=$?
echo "fp8_deepgemm_gpu: rc $rc, $(( $(date +%s) - t0 )) s in all"
exit $rc
