"""Every Triton kernel hylora launches at the 27B shapes, the FP8 GEMMs (dynamic, weight-only, split) and
the tower's rotary included, compiles for sm_90a (Hopper) without register spills — checked on the
CPU with triton's own compiler and bundled ptxas (see tests/sm90_compile.py), in a subprocess because
the interpreter must be off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

ROOT = Path(__file__).resolve().parent.parent


SM90_SHARED_BYTES = 232448  # the most shared memory one block may take on sm_90 (227 KiB)


def compile_sm90(*args: str) -> list[dict]:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sm90_compile.py"), *args],
        cwd=ROOT,
        env=env | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_kernels_compile_for_sm90_without_spills():
    kernels = compile_sm90()
    names = {k["kernel"] for k in kernels}
    assert names == {"_gdn_decode_kernel", "_conv_state_kernel", "_partition_kernel", "_merge_kernel",
                     "_shrink_kernel", "_expand_kernel", "_rms_norm_kernel", "_conv_kernel",
                     "_chunk_head_kernel", "_recurrent_kernel", "_quantize_kernel", "_gemm_kernel",
                     "_sum_splits_kernel", "_rotate_half_kernel", "_scan_chunk_kernel", "_merge_chunks_kernel",
                     "_conv_step_kernel", "_delta_rule_step_kernel", "_gemm_tma_kernel",
                     "_silu_mul_lora_kernel", "_sum_with_extra_kernel",
                     "_silu_mul_quant_kernel", "_output_gate_kernel"}  # fmt: skip
    # gdn 2 fused + 2 split, attention split (2) + direct (1), lora 2 x (shrink, expand) + the stacked
    # expand (bf16 h) 1, the activation with gate_up's expand (stacked h, partials; plain and FP8) 4,
    # q norm + rotary 1, the hidden and the gated norm quantising for FP8 2, prefill conv 2,
    # short-prefill delta rule 1; FP8 at 1, 32 and 2048 tokens: dynamic 3 + 3 + 2 (no split-K sum at
    # 2048), weight-only 2 + 2 + 1; FP8 with 16-bit rows in the launch at 1, 32 and 64 tokens: dynamic
    # 2 + 3 + 3, weight-only 1 + 2 + 2 (at one token the GEMM's last programs sum the partials, no sum
    # launch); split activations at 1, 32 and 256 tokens: split quantisation, GEMM and split-K sum, 3 + 3 + 3;
    # their producers (the two norms, the activation with gate_up's expand) 3, the MLP activation quantising
    # (one term, two) 2; the attention's output gate (bf16, quantising with one term, two) 3; the tower's
    # rotary 1; the logits scan 2
    assert len(kernels) == 2 + 2 + 3 + 2 * 2 + 1 + 4 + 1 + 2 + 2 + 1 + 8 + 5 + 8 + 5 + 9 + 3 + 2 + 3 + 1 + 2
    spilling = [k for k in kernels if k["spill_bytes"]]
    assert not spilling, spilling
    assert all(k["shared_bytes"] <= SM90_SHARED_BYTES for k in kernels), kernels


def test_fp8_gemm_test_configs_fit_an_sm90_sm():
    """Each FP8 GEMM configuration the tests run compiled on a GPU fits its pipeline in an SM's shared
    memory (weight-only on fp32 x with 256-wide tiles and 4 stages took 248 KiB: out of resources on
    the H200 in run 33, one failed case in a cut run)."""
    kernels = compile_sm90("--test-configs")
    gemms = {"_gemm_kernel", "_gemm_tma_kernel", "_quantize_kernel"}
    assert {k["kernel"] for k in kernels} == gemms | {"_sum_with_extra_kernel"}  # the extra rows' partials
    too_big = [k for k in kernels if k["shared_bytes"] > SM90_SHARED_BYTES]
    assert not too_big, too_big
