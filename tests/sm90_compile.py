"""Compile hylora's Triton kernels for sm_90a on a machine without a GPU (ptxas ships with triton).

Run as a script, without TRITON_INTERPRET: the real wrappers are called on meta-free CPU tensors of
the Qwen3.6-27B shapes (bf16) with the launch intercepted; each launch is compiled by
`triton.compile` for GPUTarget("cuda", 90, 32) and its PTX assembled by the bundled `ptxas -v`;
`--test-configs` compiles the FP8 GEMM configurations the tests run on a GPU instead. Prints one
JSON line per launch: kernel, constexprs, num_warps, registers, spill bytes, shared memory. This
catches what the CPU interpreter cannot: code the Hopper backend rejects, register spills, and
tiles whose pipeline stages need more shared memory than an SM has.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import jit
from triton.tools.tensor_descriptor import TensorDescriptor

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32", torch.int64: "i64",
         torch.float8_e4m3fn: "fp8e4nv"}  # fmt: skip


def capture_launches(calls) -> list[tuple[jit.JITFunction, tuple, dict]]:
    launches = []

    def record(self, *args, grid, warmup=False, **kwargs):
        launches.append((self, args, kwargs))

    original, jit.JITFunction.run = jit.JITFunction.run, record
    try:
        calls()
    finally:
        jit.JITFunction.run = original
    return launches


def compile_sm90(fn: jit.JITFunction, args: tuple, kwargs: dict) -> dict:
    bound = dict(zip(fn.arg_names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in fn.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = bound[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, TensorDescriptor):  # a host-side TMA descriptor
            signature[p.name] = f"tensordesc<{TYPES[v.base.dtype]}[{', '.join(map(str, v.block_shape))}]>"
        elif isinstance(v, torch.Tensor):
            signature[p.name], attrs[(i,)] = "*" + TYPES[v.dtype], [["tt.divisibility", 16]]
        elif isinstance(v, int):
            signature[p.name] = "i32" if abs(v) < 2**31 else "i64"
            if v and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[p.name] = "fp32"
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return {
        "kernel": fn.__name__,
        "constexprs": {k: v for k, v in constexprs.items() if k.isupper()},
        "num_warps": options.get("num_warps"),
        "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)),
        "shared_bytes": kernel.metadata.shared,
    }


def launches_27b() -> None:
    from hylora.ops.causal_conv1d import triton as conv
    from hylora.ops.fp8_linear import triton as fp8
    from hylora.ops.gated_delta_rule import triton as recurrent
    from hylora.ops.gdn_decode import triton as gdn
    from hylora.ops.logits_scan import triton as logits_scan
    from hylora.ops.lora import triton as lora
    from hylora.ops.output_gate import triton as output_gate
    from hylora.ops.paged_decode_attention import triton as attention
    from hylora.ops.rmsnorm import triton as rmsnorm
    from hylora.ops.rotary import triton as rotary
    from hylora.ops.silu_mul import triton as silu

    dt, N = torch.bfloat16, 4

    def e(*shape, dtype=dt):
        return torch.empty(*shape, dtype=dtype)

    hk, hv, dk, dv, S = 16, 48, 128, 128, 8
    C = 2 * hk * dk + hv * dv
    slots = torch.zeros(N, dtype=torch.long)
    gdn_args = (e(N, C), e(N, hv), e(N, hv), e(C, 4), e(hv, dtype=torch.float32), e(hv, dtype=torch.float32),
                e(S, C, 3), e(S, hv, dk, dv, dtype=torch.float32), slots)  # fmt: skip
    gdn.gdn_decode(*gdn_args, block_v=32, v_blocks=4)  # the fused form
    gdn.gdn_decode(*gdn_args)  # the split form (the default)
    q, cache, lens = e(N, 24, 256), e(64 * 16, 4, 256), torch.ones(N, dtype=torch.int32)
    for pages in (64, 8):  # split-KV (8 partitions) and direct
        attention.paged_decode_attention(q, cache, cache, torch.zeros(N, pages, dtype=torch.int32), lens, 16, 0.0625)
    rows = (12288, 1024, 1024)  # q_proj | k_proj | v_proj
    r = 64  # the largest rank: the most registers
    a, b = [e(8, r, 5120)] * 3, [e(8, r, n) for n in rows]
    offsets = [(0, 12288), (12288, 1024), (13312, 1024)]
    for T in (32, 512):  # the small and the large configuration
        meta = lora.LoRAKernelMeta.build(torch.zeros(T, dtype=torch.long), 8)
        lora.lora_apply(e(T, 5120), e(T, sum(rows)), a, b, offsets, meta)
    lora.lora_expand(e(1, 32, 3, 8, r), b, offsets, e(32, sum(rows)), meta)  # decode's stacked expand: bf16 h
    b_mlp = [e(8, r, 17408)] * 2  # gate_up's B: its expand in the activation (plain, and for an FP8 down_proj)
    for T, h in ((32, e(1, 32, 2, 8, r)), (2048, e(8, 2048, 2, r, dtype=torch.float32))):  # stacked h, partials
        meta = lora.LoRAKernelMeta.build(torch.zeros(T, dtype=torch.long), 8)
        silu.silu_mul_lora(e(T, 2 * 17408), h, b_mlp, meta)
        silu.silu_mul_lora(e(T, 2 * 17408), h, b_mlp, meta, group=128, keep=True)
    q = e(N, 24, 512)[..., :256]  # the query half of [query | gate] heads
    rmsnorm.rms_norm(q, e(256), 1e-6, rotary=(e(N, 64), e(N, 64)))  # q norm + rotary (partial: 64 of 256)
    conv.causal_conv1d_by_slot(e(N, C), e(C, 4), e(S, C, 3), slots, [1] * N, splits=(hk * dk, hk * dk, hv * dv))
    ba = e(N, 2 * hv)  # b | a: columns of the GDN in_proj output
    recurrent.recurrent_by_slot(e(N, hk, dk), e(N, hk, dk), e(N, hv, dv), ba[:, :hv], ba[:, hv:],
                                e(hv, dtype=torch.float32), e(hv), e(S, hv, dk, dv, dtype=torch.float32), slots,
                                [1] * N, dk**-0.5)  # fmt: skip
    w8, w8_scale = e(5120, 17408, dtype=torch.float8_e4m3fn), e(40, 136, dtype=torch.float32)  # down_proj, FP8
    rmsnorm.rms_norm_quantized(e(N, 5120), e(5120), 1e-6, e(N, 5120), keep=True)  # norm + FP8 quantisation
    z = e(N, 2 * hv * dv)[:, hv * dv :].reshape(N, hv, dv)  # the in_proj's z columns
    rmsnorm.gated_rms_norm_quantized(e(N, hv, dv), z, e(dv), 1e-6)  # the GDN output norm for its FP8 out_proj
    # the same producers for split activations (both e4m3 terms), and the MLP activation's for the down_proj
    rmsnorm.rms_norm_quantized(e(N, 5120), e(5120), 1e-6, e(N, 5120), keep=True, split=True)
    rmsnorm.gated_rms_norm_quantized(e(N, hv, dv), z, e(dv), 1e-6, split=True)
    for split in (False, True):
        silu.silu_mul_quantized(e(N, 2 * 17408), keep=True, split=split)
    gate = e(N, 24, 512)[..., 256:]  # the gate half of [query | gate] heads, o_proj's input
    output_gate.output_gate(e(N, 24, 256), gate)  # bf16: o * sigmoid(gate)
    for split in (False, True):  # and quantised for an FP8 o_proj (one term, two)
        output_gate.output_gate_quantized(e(N, 24, 256), gate, keep=True, split=split)
    meta = lora.LoRAKernelMeta.build(torch.zeros(32, dtype=torch.long), 8)
    silu.silu_mul_lora(e(32, 2 * 17408), e(1, 32, 2, 8, r), b_mlp, meta, group=128, keep=True, split=True)
    for T in (1, 32, 2048):  # the decode, 32-token (TMA tiles) and prefill configurations
        fp8.fp8_linear(e(T, 17408), w8, w8_scale)  # quantisation, GEMM (+ the split-K sum below 2048)
        fp8.fp8_weight_only_linear(e(T, 17408), w8, w8_scale)  # GEMM (+ sum)
    extra = e(2 * 8 * r, 17408)  # 16-bit rows in the FP8 GEMM's launch: 8 slots' LoRA A of two slices
    for T in (1, 32, 64):  # decode steps (the stacked LoRA shrink) and a short chunk's (the GDN in_proj's tail)
        fp8.fp8_linear(e(T, 17408), w8, w8_scale, extra=(e(T, 17408), extra))  # quantisation, GEMM (+ sum past 1)
        fp8.fp8_weight_only_linear(e(T, 17408), w8, w8_scale, extra=(e(T, 17408), extra))  # GEMM (+ sum past 1)
    for T in (1, 32, 256):  # split activations: decode, TMA tiles, a short prefill chunk (64-token tiles)
        fp8.fp8_split_linear(e(T, 17408), w8, w8_scale)  # split quantisation, GEMM with two dots (+ sum)
    qkv = e(N, 48, 72)  # the tower's fused qkv: 16 heads of 72
    rotary.rotate_half(qkv[:, :32], e(N, 72, dtype=torch.float32), e(N, 72, dtype=torch.float32), out=qkv[:, :32])
    logits_scan.scan_logits(e(N, 248320, dtype=torch.float32))  # chunk scan, merge


def launches_test_configs() -> None:
    """The FP8 GEMM configurations tests/test_fp8_linear.py runs on a GPU, on its fp32 inputs (the
    weight-only path then holds fp32 x tiles: the most shared memory), dynamic and weight-only."""
    from hylora.ops.fp8_linear import triton as fp8
    from tests.fp8_gemm_configs import CONFIGS

    x, w, w_scale = torch.empty(17, 384), torch.empty(257, 384, dtype=torch.float8_e4m3fn), torch.empty(3, 3)
    extra = (x, torch.empty(129, 384))  # the 16-bit rows the same launch serves (fp32 here)
    for config in CONFIGS.values():
        fp8.fp8_linear(x, w, w_scale, config=config)
        fp8.fp8_weight_only_linear(x, w, w_scale, config=config)
        fp8.fp8_linear(x, w, w_scale, config=config, extra=extra)
        fp8.fp8_weight_only_linear(x, w, w_scale, config=config, extra=extra)
        fp8.fp8_split_linear(x, w, w_scale, config=config, extra=extra)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this compiles")
    launches = launches_test_configs if sys.argv[1:] == ["--test-configs"] else launches_27b
    for fn, args, kwargs in capture_launches(launches):
        print(json.dumps(compile_sm90(fn, args, kwargs)), flush=True)
