#!/bin/bash
# Builds .deepgemm/ (ignored, ~30 MB): DeepGEMM's source with the CUTLASS and {fmt} headers its submodules
# pin, for bench/fp8_deepgemm_gpu.sh (the device has nvcc and builds it there; DeepGEMM has no usable
# wheel: PyPI's deep_gemm 1.0.0 is its Python without its CUDA headers).
#   bash bench/build_deepgemm.sh                       # clones from GitHub
#   DEEPGEMM_GIT=/path/DeepGEMM.git CUTLASS_GIT=/path/cutlass.git FMT_GIT=/path/fmt.git bash bench/build_deepgemm.sh
# (*_GIT: local clones or bare mirrors that hold the pinned commits)
set -euo pipefail
DEEPGEMM_COMMIT=${DEEPGEMM_COMMIT:-54e2261}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
repo() {  # name, url, env override -> a git dir
  local dir=${3:-}
  if [ -z "$dir" ]; then
    git clone -q --bare "$2" "$tmp/$1.git"
    dir="$tmp/$1.git"
  fi
  echo "$dir"
}
dg=$(repo DeepGEMM https://github.com/deepseek-ai/DeepGEMM.git "${DEEPGEMM_GIT:-}")
rm -rf .deepgemm
mkdir -p .deepgemm
git --git-dir "$dg" archive "$DEEPGEMM_COMMIT" | tar -x -C .deepgemm
for sub in cutlass fmt; do
  commit=$(git --git-dir "$dg" ls-tree "$DEEPGEMM_COMMIT" "third-party/$sub" | awk '{print $3}')
  case $sub in
    cutlass) src=$(repo cutlass https://github.com/NVIDIA/cutlass.git "${CUTLASS_GIT:-}") ;;
    fmt) src=$(repo fmt https://github.com/fmtlib/fmt.git "${FMT_GIT:-}") ;;
  esac
  mkdir -p ".deepgemm/third-party/$sub"
  git --git-dir "$src" archive "$commit" include | tar -x -C ".deepgemm/third-party/$sub"
  echo "$sub at $commit"
done
rm -rf .deepgemm/tests .deepgemm/third-party/tilelang_ops
du -sh .deepgemm
