#!/bin/bash
# The test modules that run on a GPU (compiled Triton kernels, CUDA graphs, the FP8 GEMMs), in one
# device call, from the repo root with .peerwhl carried (the engine's server dependencies; the
# device image lacks pydantic and llguidance):
#   GPU_TESTS_BUDGET=540 bash bench/gpu_tests.sh
#   GPU_TESTS_MODULES="tests/test_silu_mul_lora.py tests/test_fp8_linear.py" bash bench/gpu_tests.sh  # a subset
# Cheapest first, each module under what is left of the budget, each test under --timeout; a module
# cut short by the budget says so instead of hiding the others. Writes $OUT/gpu_tests.log (everything)
# and prints one summary line per module.
OUT=${OUT:-/tmp/gpu_tests_out}
mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peerwhl/*.whl > /dev/null 2>&1 \
  || { echo "pip install of .peerwhl failed"; exit 1; }
export PYTHONPATH=/tmp/site:$(pwd) PYTHONUNBUFFERED=1
budget=${GPU_TESTS_BUDGET:-540}
modules=${GPU_TESTS_MODULES:-tests/test_logits_scan.py tests/test_rotary_op.py tests/test_silu_mul_lora.py \
  tests/test_cuda_graphs.py tests/test_output_gate.py tests/test_fp8_linear.py}
for module in $modules; do
  left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt 20 ]; then
    echo "$module: not run (budget spent)"
    continue
  fi
  # -v: each test's verdict as it happens, so a call cut by the budget still names what failed
  timeout "$left" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --timeout=150 "$module" \
    > "$OUT/$(basename "$module" .py).log" 2>&1
  rc=$?
  log="$OUT/$(basename "$module" .py).log"
  cat "$log" >> "$OUT/gpu_tests.log"
  summary=$(grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|error)| (FAILED|ERROR) +\[" "$log" | tail -6)
  passed=$(grep -c " PASSED" "$log")
  [ "$rc" -eq 124 ] && summary="$summary (cut at the budget after $passed passed tests)"
  echo "$module: rc $rc; $summary"
done
echo "gpu tests: $(( $(date +%s) - t0 )) s"
