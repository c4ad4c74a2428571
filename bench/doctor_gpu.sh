#!/bin/bash
# `hylora doctor --demo` on a GPU in the deployments hylora serve runs, in one device call, from the
# repo root with .gpuwhl carried (bench/build_gpuwhl.sh):
#   DOCTOR_BUDGET=560 DOCTOR_ARGS="--dtype bfloat16" bash bench/doctor_gpu.sh [NAME ...]
# NAMEs (default: all, in this order): serve (serve's defaults: 8192-token steps, short-step graphs,
# prefix caching, the delta-first LoRA from 4096 tokens in the pollution burst), delta-first (the
# sweep's 4096-token prompts through the delta first: prefix caching off), shrink-expand (the same
# with the delta first off), mtp (MTP speculative decoding, 2 tokens), fp8 (the demo's projections
# quantised at load), fp8-weight-only (the same, activations unquantised), fp8-split (activations as two
# e4m3 terms), fp8-deepgemm (DeepGEMM's GEMM where cuBLAS's would serve: the demo's down projection, from
# 128 tokens; not in the default list). Each under what is left of the budget; writes $OUT/doctor-NAME.{log,json}
# and prints each run's check lines. DOCTOR_ARGS go to every run (the demo's default dtype is fp32).
OUT=${OUT:-/tmp/doctor_gpu_out}
mkdir -p "$OUT"
t0=$(date +%s)
if ! python3 -c "import pydantic, llguidance, fastapi, av" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpuwhl/*.whl > /dev/null 2>&1 \
    || { echo "pip install of .gpuwhl failed"; exit 1; }
fi
# DeepGEMM (vLLM's vendored copy, for DOCTOR_ARGS="--kernels fp8_deepgemm=1" or the fp8-deepgemm run)
if [ ! -d /tmp/site/deep_gemm ] && ls .gpuwhl/deep_gemm-*.tar.xz > /dev/null 2>&1; then
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .gpuwhl/deep_gemm-*.tar.xz \
    /tmp/site || echo "DeepGEMM's unpack failed: fp8_deepgemm=1 serves cuBLAS"
fi
export PYTHONPATH=/tmp/site:$(pwd) PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deepgemm_jit}
budget=${DOCTOR_BUDGET:-560}
declare -A flags=(
  [serve]=""
  [delta-first]="--no-enable-prefix-caching"
  [shrink-expand]="--no-enable-prefix-caching --lora-delta-first-from 0"
  [mtp]='--speculative-config {"method":"mtp","num_speculative_tokens":2}'
  [fp8]="--quantization fp8"
  [fp8-weight-only]="--quantization fp8 --fp8-activations none"
  [fp8-split]="--quantization fp8 --fp8-activations split"
  [fp8-deepgemm]="--quantization fp8 --kernels fp8_deepgemm=1"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(serve delta-first shrink-expand mtp fp8 fp8-weight-only fp8-split)
for name in "${names[@]}"; do
  left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt 45 ]; then
    echo "== $name: not run (budget spent)"
    continue
  fi
  # shellcheck disable=SC2086  # the flags split into arguments on purpose
  timeout "$left" python3 -m hylora doctor --demo ${flags[$name]} ${DOCTOR_ARGS:-} --json "$OUT/doctor-$name.json" \
    > "$OUT/doctor-$name.log" 2>&1
  rc=$?
  echo "== $name (${flags[$name]:-the defaults} ${DOCTOR_ARGS:-}): rc $rc at $(( $(date +%s) - t0 )) s"
  grep -E "^(fidelity|mixed_batches|pollution|decode|prefix_cache|speculative|fp8|load) |^ +✗|^(PASSED|FAILED)" \
    "$OUT/doctor-$name.log" | cut -c1-240
  [ "$rc" -eq 124 ] && echo "   (cut at the budget)"
done
echo "doctor gpu: $(( $(date +%s) - t0 )) s"
