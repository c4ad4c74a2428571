"""ops.rotary: the vision tower's rotate-half rotary. The Triton kernel (run on the CPU by Triton's
interpreter, compiled on a GPU) equals the torch reference bit for bit, on the tower's strided q/k
view of its fused qkv, in place and into a NaN-filled buffer; the reference equals transformers'
Qwen3-VL formula."""

from __future__ import annotations

import pytest
import torch

from tests.triton_mode import interpret_without_cuda, kernel_device

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from hylora.ops.rotary import reference  # noqa: E402
from hylora.ops.rotary import triton as kernel  # noqa: E402
from tests.decode_helpers import same_bits  # noqa: E402

DEVICE = kernel_device(kernel._rotate_half_kernel)
INTERPRETED = DEVICE == "cpu"

NAN = float("nan")


def inputs(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """A fused qkv [T, 3H, d] and fp32 cos/sin [T, d] as the tower builds them (angles repeated over
    the two halves)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, 3 * heads, head_dim, generator=g) * 3).to(dtype)
    angles = torch.randint(0, 64, (tokens, head_dim // 2), generator=g) * torch.rand(head_dim // 2, generator=g)
    angles = torch.cat([angles, angles], dim=-1)
    return qkv.to(DEVICE), angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def old_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The tower's rotary before ops.rotary (transformers' `apply_rotary_pos_emb_vision` on one tensor)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("head_dim", [72, 64, 8, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_equals_reference_bit_for_bit(gpu_bf16, dtype, head_dim, heads):
    """Launches of 64 (row, d) pairs a program split heads and tokens between programs, and the
    default launch; the q/k heads are the strided [:, :2H] view of the fused qkv."""
    pairs = 64  # a program's (row, d) pairs: small, so that programs split rows and tokens
    per_token = 2 * heads * head_dim // 2
    edges = {pairs // per_token, pairs // per_token + 1, 2 * pairs // per_token + 1, 300}
    for tokens in sorted(t for t in edges if t > 0):
        qkv, cos, sin = inputs(tokens, heads, head_dim, dtype, seed=tokens + head_dim)
        x = qkv[:, : 2 * heads]
        want = reference.rotate_half(x, cos, sin)

        out = torch.full_like(want, NAN)
        got = kernel.rotate_half(x, cos, sin, out=out, pairs=pairs)
        assert got is out and same_bits(got, want), tokens
        assert same_bits(kernel.rotate_half(x, cos, sin), want), tokens  # a buffer of its own, default launch

        ref_qkv, got_qkv = qkv.clone(), qkv.clone()
        reference.rotate_half(ref_qkv[:, : 2 * heads], cos, sin, out=ref_qkv[:, : 2 * heads])
        kernel.rotate_half(got_qkv[:, : 2 * heads], cos, sin, out=got_qkv[:, : 2 * heads], pairs=pairs)
        assert same_bits(got_qkv[:, : 2 * heads], want), tokens
        assert same_bits(ref_qkv, got_qkv), tokens
        assert same_bits(got_qkv[:, 2 * heads :], qkv[:, 2 * heads :]), tokens  # the v heads untouched


def test_kernel_with_no_tokens():
    qkv, cos, sin = inputs(0, 2, 72, torch.float32, seed=0)
    assert kernel.rotate_half(qkv[:, :4], cos, sin).shape == (0, 4, 72)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_is_the_transformers_formula(dtype):
    qkv, cos, sin = inputs(50, 4, 72, dtype, seed=1)
    q, k = qkv[:, :4], qkv[:, 4:8]
    want_q, want_k = old_formula(q, cos, sin), old_formula(k, cos, sin)
    try:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision
    except ImportError:
        pass
    else:
        want_q, want_k = apply_rotary_pos_emb_vision(q, k, cos, sin)
        assert same_bits(want_q, old_formula(q, cos, sin)) and same_bits(want_k, old_formula(k, cos, sin))
    assert same_bits(reference.rotate_half(q, cos, sin), want_q)
    assert same_bits(reference.rotate_half(k, cos, sin), want_k)
    out = torch.full_like(want_q, NAN)
    assert reference.rotate_half(q, cos, sin, out=out) is out and same_bits(out, want_q)
    in_place = qkv.clone()
    reference.rotate_half(in_place[:, :4], cos, sin, out=in_place[:, :4])
    assert same_bits(in_place[:, :4], want_q) and same_bits(in_place[:, 4:], qkv[:, 4:])


@pytest.mark.skipif(not INTERPRETED, reason="a CPU model: the kernel was imported compiled for CUDA")
def test_kernel_floor_gives_the_tower_the_kernel(vl_media_ckpt):
    """A passing tower_rotary verdict installs the Triton kernel on every tower attention; the tower
    output stays bit for bit (fp32); the default kernels put the reference back."""
    from hylora.kernels import model_kernels
    from hylora.kernels.select import fast_verdicts
    from hylora.model.kernels import ModelKernels
    from hylora.model.loader import load_model
    from tests.vl_helpers import pixels

    model = load_model(vl_media_ckpt[0], progress=False, vision=True)
    grids = torch.tensor([(1, 4, 4), (2, 6, 8), (1, 4, 4)])
    px = pixels(grids.tolist(), seed=3)
    with torch.no_grad():
        want = model.visual(px, grids)
        model.use_kernels(model_kernels(fast_verdicts(["tower_rotary"])))
        assert all(b.attn.rotary is kernel.rotate_half for b in model.visual.blocks)
        assert same_bits(model.visual(px, grids), want)
    model.use_kernels(ModelKernels())
    assert all(b.attn.rotary is reference.rotate_half for b in model.visual.blocks)
