"""The gated attention's output gate, o * sigmoid(gate): the Triton kernel against the torch
reference (interpreted on the CPU, compiled on a GPU), and its FP8 form against the unfused gate then
the quantisation, bit for bit. The gate is a strided view of a fused qkv output, as the layer slices it;
heads and tokens straddle the 128-column groups and the 16-token programs."""

from __future__ import annotations

import pytest
import torch

from tests.triton_mode import interpret_without_cuda, kernel_device

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from hylora.ops.fp8_linear import reference as fp8_reference  # noqa: E402
from hylora.ops.fp8_linear import triton as fp8_triton  # noqa: E402
from hylora.ops.output_gate import reference as R  # noqa: E402
from hylora.ops.output_gate import triton as T  # noqa: E402

DEVICE = kernel_device(T._output_gate_kernel)
# (tokens, heads, head_dim, kv heads): rows of 120 (one partial group), 192 (a group and a part, a head
# across the boundary), 512 (whole groups of two heads each)
SHAPES = [(1, 3, 40, 1), (17, 2, 96, 1), (33, 4, 128, 2), (16, 1, 64, 1)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def gate_inputs(T_: int, H: int, d: int, kv: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """o [T, H, d] contiguous and gate [T, H, d] the second half of each head's q_proj rows in a fused
    [q | gate per head, k, v] output, with large and zero gates (sigmoid saturating both ways)."""
    g = torch.Generator().manual_seed(T_ * H * d)
    qkv = torch.randn(T_, H * d * 2 + 2 * kv * d, generator=g) * 4
    qkv[0, :d] = 40.0  # (the first head's query: untouched, must not be read as gate)
    gate = qkv.to(dtype).to(DEVICE)[:, : H * d * 2].reshape(T_, H, 2 * d).chunk(2, dim=-1)[1]
    gate[0, 0, :4] = torch.tensor([-60.0, 60.0, 0.0, -0.0])
    o = (torch.randn(T_, H, d, generator=g) * 3).to(dtype).to(DEVICE)
    return o, gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_output_gate_is_the_unfused_layer(shape, dtype):
    """o * sigmoid(gate) of the layer's views: bf16 within a rounding of the unfused ops (the sigmoid's
    fp32 exp may differ in its last bit, which a rounding can carry; the interpreter's fp32 → bf16 cast
    truncates, twice here), fp32 within 1e-6."""
    o, gate = gate_inputs(*shape, dtype)
    got = T.output_gate(o, gate)
    want = R.output_gate(o.cpu(), gate.cpu())
    assert got.shape == want.shape == (shape[0], shape[1] * shape[2]) and got.dtype == dtype
    assert torch.isfinite(got).all()
    rel = 1e-6 if dtype == torch.float32 else 2.0**-6 if DEVICE == "cpu" else 2.0**-7
    diff = (got.cpu().float() - want.float()).abs()
    assert (diff <= rel * want.float().abs() + 1e-30).all(), diff.max()


@pytest.mark.parametrize("split", [False, True], ids=["dynamic", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_output_gate_quantized_is_the_gate_then_the_quantisation_bit_for_bit(shape, dtype, split):
    """The gate and the FP8 quantisation of the o_proj's input in one launch: the same bits as the
    kernel's own gate then quantize_activation (`split`: its two terms), and the kept values those of
    the gate; the reference likewise from the reference gate."""
    o, gate = gate_inputs(*shape, dtype)
    h = T.output_gate(o, gate)
    want = fp8_triton.quantize_activation_split(h) if split else fp8_triton.quantize_activation(h)
    for keep in (False, True):
        got = T.output_gate_quantized(o, gate, keep=keep, split=split)
        terms = (got.q, got.lo, got.scale) if split else (got.q, got.scale)
        assert split or got.lo is None
        for a, b in zip(terms, want, strict=True):
            assert torch.equal(bits(a.cpu()), bits(b.cpu()))
        assert got.dtype == dtype and (torch.equal(got.x, h) if keep else got.x is None)
    ref = R.output_gate_quantized(o.cpu(), gate.cpu(), keep=True, split=split)
    values = R.output_gate(o.cpu(), gate.cpu())
    ref_want = fp8_reference.quantize_activation_split(values) if split else fp8_reference.quantize_activation(values)
    for a, b in zip((ref.q, ref.lo, ref.scale) if split else (ref.q, ref.scale), ref_want, strict=True):
        assert torch.equal(bits(a), bits(b))
    assert torch.equal(ref.x, values)


def test_output_gate_refuses_views_it_cannot_read():
    o, gate = gate_inputs(2, 2, 64, 1, torch.float32)
    with pytest.raises(ValueError, match="one \\[T, H, d\\] shape"):
        T.output_gate(o, gate[:, :1])
    with pytest.raises(ValueError, match="unit stride"):
        T.output_gate(o.transpose(1, 2).contiguous().transpose(1, 2), gate)
    with pytest.raises(ValueError, match="power of two"):
        T.output_gate_quantized(o, gate, group=100)


def test_start_up_checks_pass_the_kernels_and_fail_wrong_ones():
    """The kernel floor's check (`checks.output_gate_error`, the layer's strided gate view) passes both
    kernels and fails a gate read as if its heads lay side by side, a quantised form whose scales are
    off, and one that writes hi alone where two terms were asked for."""
    import math

    from hylora.kernels import checks

    def error(kernel=None, quantized=False, split=False, tokens=(1, 17)):
        return checks.output_gate_error(3, 64, 1, torch.float32, DEVICE, tokens=tokens, kernel=kernel,
                                        quantized=quantized, split=split)  # fmt: skip

    assert error() <= 1e-6
    for split in (False, True):
        assert error(quantized=True, split=split) <= 1e-6

    def heads_side_by_side(o, gate):  # the gate's heads read at a stride of d, not of the qkv rows' 2d
        T_, H, d = o.shape
        flat = torch.as_strided(gate, (T_, H, d), (gate.stride(0), d, 1))
        return T.output_gate(o, flat)

    def half_scale(o, gate, group=128, keep=False, split=False):
        a = T.output_gate_quantized(o, gate, group, keep, split)
        return fp8_reference.QuantizedActivation(a.q, a.scale * 0.5, a.dtype, a.x, a.lo)

    def one_term(o, gate, group=128, keep=False, split=False):
        return T.output_gate_quantized(o, gate, group, keep)

    assert error(heads_side_by_side) > 0.1
    for split in (False, True):
        assert error(half_scale, quantized=True, split=split, tokens=(17,)) > 0.3
    assert error(one_term, quantized=True, split=True) == math.inf
