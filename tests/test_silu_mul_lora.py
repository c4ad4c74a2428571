"""The MLP activation with gate_up's LoRA expand in its launch (`silu_mul_lora`) against its torch
reference (the expand into [gate | up], then the activation): Triton's interpreter on a CPU, the
compiled kernel on a GPU (bench/gpu_tests.sh runs this module there). Unused slots and the h rows of
base tokens hold NaN: a read of either shows."""

from __future__ import annotations

import pytest
import torch

from tests.triton_mode import interpret_without_cuda, kernel_device

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from hylora.kernels import checks  # noqa: E402
from hylora.ops.fp8_linear import triton as fp8_triton  # noqa: E402
from hylora.ops.lora import triton as lora_triton  # noqa: E402
from hylora.ops.silu_mul import reference as silu_reference  # noqa: E402
from hylora.ops.silu_mul import triton as silu_triton  # noqa: E402

DEVICE = kernel_device(silu_triton._silu_mul_lora_kernel)
NAN = float("nan")
# (tokens, inner, rank): one and several 16-token tiles per slot, a 160-wide activation (a 128-column
# group and a tail), ranks under and at the dot's 16
CASES = [(5, 160, 8), (40, 160, 16), (130, 96, 8)]


def lora_inputs(T: int, inner: int, R: int, form: str, dtype: torch.dtype):
    """[gate | up] rows inside a wider output, B of gate and up (slot 2 unused, NaN), h as the shrink's
    fp32 partials (base rows NaN) or a stacked GEMM's h of every slot (slot 2 NaN), each token's slot:
    base runs and three adapters interleaved."""
    L = 4
    g = torch.Generator().manual_seed(T * inner + R)
    runs = [-1, 0, 3, -1, 1, 0]
    slots = torch.tensor([runs[t * len(runs) // T] for t in range(T)])
    gate_up = (torch.randn(T, 2 * inner + 24, generator=g) * 3)[:, : 2 * inner]
    b = [torch.randn(L, R, inner, generator=g) for _ in range(2)]
    for bi in b:
        bi[2] = NAN
    if form == "stacked-h":  # [1, T, 2, L, r], every slot's h, in the model dtype
        h = torch.randn(1, T, 2, L, R, generator=g).to(dtype)
        h[:, :, :, 2] = NAN
    else:  # [split, T, 2, r] shrink partials, fp32
        h = torch.randn(3, T, 2, R, generator=g)
        h[:, slots < 0] = NAN
    gate_up, b = gate_up.to(dtype), [bi.to(dtype) for bi in b]
    return gate_up, h, b, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", ["shrink-partials", "stacked-h"])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("group", [None, 32], ids=["plain", "fp8-out"])
def test_silu_mul_lora_is_the_expand_then_the_activation(case, form, group, dtype):
    """Every row equals the reference; base rows are the plain activation kernel's bit for bit, the
    adapters' rows differ from it (the delta is there); quantised, the values are those
    `quantize_activation` gives the kept ones."""
    gate_up, h, b, slots = lora_inputs(*case, form, dtype)
    meta = lora_triton.LoRAKernelMeta.build(slots.to(DEVICE), 4)
    got = silu_triton.silu_mul_lora(gate_up.to(DEVICE), h.to(DEVICE), [bi.to(DEVICE) for bi in b], meta, group, True)
    ref = silu_reference.silu_mul_lora(gate_up, h, b, slots, group=group, keep=True)
    plain = silu_triton.silu_mul(gate_up.to(DEVICE)).cpu()  # the same float formula as the fused kernel
    if group is None:
        values, want = got.cpu(), ref
    else:
        values, want = got.x.cpu(), ref.x
        q, scale = fp8_triton.quantize_activation(got.x, group)
        assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.scale, scale)
    assert not values.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-5)
    else:  # bf16: rounding flips in gate + delta (0.4 % of norm here) grow through silu·up, in both paths
        assert norm_error(values, want) < 3e-2
        unfused = unfused_path(gate_up, h, b, meta, group)  # the expand kernel, then the activation's
        # the expand's dot tiles differ from the fused kernel's: so does the order of their sums, on a GPU
        # and in the interpreter's BLAS alike (equal bits on some CPUs, not on an AMD EPYC's)
        assert norm_error(values, unfused) < 2e-3
    base = slots < 0
    assert torch.equal(values[base], plain[base])
    assert not torch.allclose(values[~base].float(), plain[~base].float())


@pytest.mark.parametrize("form", ["shrink-partials", "stacked-h"])
@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_silu_mul_lora_splits_for_a_split_gemm(case, form):
    """Quantising for a split FP8 down projection (`split`): hi, lo and scales are exactly
    quantize_activation_split of the kept values, in the kernel and in its reference."""
    from hylora.ops.fp8_linear import reference as fp8_reference

    gate_up, h, b, slots = lora_inputs(*case, form, torch.bfloat16)
    meta = lora_triton.LoRAKernelMeta.build(slots.to(DEVICE), 4)
    got = silu_triton.silu_mul_lora(
        gate_up.to(DEVICE), h.to(DEVICE), [bi.to(DEVICE) for bi in b], meta, 32, True, split=True
    )
    ref = silu_reference.silu_mul_lora(gate_up, h, b, slots, group=32, keep=True, split=True)
    for result, quantize in (
        (got, fp8_triton.quantize_activation_split),
        (ref, fp8_reference.quantize_activation_split),
    ):
        hi, lo, scale = quantize(result.x, 32)
        assert torch.equal(result.q.view(torch.uint8), hi.view(torch.uint8))
        assert torch.equal(result.lo.view(torch.uint8), lo.view(torch.uint8)) and torch.equal(result.scale, scale)
    assert norm_error(got.x.cpu(), ref.x) < 3e-2


def norm_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def unfused_path(gate_up, h, b, meta, group) -> torch.Tensor:
    """The expand kernel into [gate | up], then the plain or quantising activation kernel: kept values."""
    inner = gate_up.shape[1] // 2
    y = lora_triton.lora_expand(h.to(DEVICE), [bi.to(DEVICE) for bi in b], [(0, inner), (inner, inner)],
                                gate_up.to(DEVICE).contiguous(), meta)  # fmt: skip
    return (silu_triton.silu_mul(y) if group is None else silu_triton.silu_mul_quantized(y, group, True).x).cpu()


def test_the_start_up_check_passes_the_kernel_and_fails_wrong_ones():
    """The kernel floor's check: the kernel within fp32's bound, quantising for a dynamic or a split
    FP8 down projection; a kernel that drops the delta, sums one of the shrink's partials only, or
    gives every adapter token slot 0's delta fails, and so does one that writes one term where two
    were asked for."""
    small = dict(tokens=(5, 130), ranks=(8,))
    for split in (False, True):
        assert checks.silu_mul_lora_error(160, torch.float32, DEVICE, split=split, **small) <= 1e-5

    def no_delta(gate_up, h, b, meta, group=None, keep=False, split=False):
        zero = [torch.zeros_like(bi) for bi in b]
        return silu_triton.silu_mul_lora(gate_up, h, zero, meta, group, keep, split)

    def first_partial(gate_up, h, b, meta, group=None, keep=False, split=False):
        return silu_triton.silu_mul_lora(gate_up, h[:1] if h.ndim == 4 else h, b, meta, group, keep, split)

    def slot_zero(gate_up, h, b, meta, group=None, keep=False, split=False):
        slot0 = lora_triton.LoRAKernelMeta.build(meta.token_slots.clamp(max=0), meta.num_slots)
        return silu_triton.silu_mul_lora(gate_up, h, b, slot0, group, keep, split)

    def one_term(gate_up, h, b, meta, group=None, keep=False, split=False):
        return silu_triton.silu_mul_lora(gate_up, h, b, meta, group, keep)

    for wrong in (no_delta, first_partial, slot_zero):
        assert checks.silu_mul_lora_error(160, torch.float32, DEVICE, kernel=wrong, **small) > 1e-2, wrong.__name__
    assert checks.silu_mul_lora_error(160, torch.float32, DEVICE, kernel=one_term, split=True, **small) == float("inf")


def test_wrong_shapes_are_refused_with_what_is_expected():
    gate_up, h, b, slots = lora_inputs(5, 160, 8, "shrink-partials", torch.float32)
    meta = lora_triton.LoRAKernelMeta.build(slots, 4)
    with pytest.raises(ValueError, match="B of gate and up"):
        silu_triton.silu_mul_lora(gate_up, h, b[:1], meta)
    with pytest.raises(ValueError, match="is not"):
        silu_triton.silu_mul_lora(gate_up, h[:, :, :1], b, meta)
    with pytest.raises(ValueError, match="metadata for 5 slots"):
        silu_triton.silu_mul_lora(gate_up, h, b, lora_triton.LoRAKernelMeta.build(slots, 5))
