"""The compiled quantisation's division (`ops.fp8_linear.triton._div_rows`): one IEEE division a row,
then q0 = x·y and two FMAs an element, must give div_rn(x, scale) bit for bit, which the interpreter
cannot show (its fma rounds twice, and the kernels keep div_rn there). This checks the arithmetic
itself in numpy, with an exact emulation of the GPU's fma.rn.f32: every bf16 |x| against a spread of
amax values, random fp32 pairs over the whole exponent range, and the special values. The e4m3 bytes
must agree everywhere; the fp32 q may differ only where the remainder or the quotient underflows
(subnormal x or q), all at |q| < 2^-50: an e4m3 zero either way (its least subnormal is 2^-9)."""

from __future__ import annotations

import numpy as np
import torch

from hylora.ops.fp8_linear.reference import AMAX_FLOOR, FP8_MAX

F32, F64 = np.float32, np.float64


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """RN32(a·b + c) exactly: a·b is exact in f64; the f64 sum's own rounding error (TwoSum) decides
    a result that lands on an f32 midpoint; an exact zero takes IEEE fma's sign."""
    a, b, c = a.astype(F64), b.astype(F64), c.astype(F64)
    p = a * b
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        r = s.astype(F32)
        back = r.astype(F64)
        nb = np.nextafter(r, np.where(s - back > 0, F32(np.inf), F32(-np.inf)).astype(F32))
        tie = (s != back) & (s == (back + nb.astype(F64)) / 2) & (err != 0) & np.isfinite(s)
    r = np.where(tie & ((err > 0) == (nb.astype(F64) > back)), nb, r)
    zero = (p == 0) & (c == 0)
    return np.where(zero, np.where(np.signbit(p) & np.signbit(c), F32(-0.0), F32(0.0)), r).astype(F32)


def div_rows(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """`_div_rows` step by step."""
    y = F32(1.0) / scale
    s = np.minimum(scale, F32(np.finfo(np.float32).max))
    with np.errstate(invalid="ignore", over="ignore"):
        q0 = (x * y).astype(F32)
        r = -fma32(q0, s, -x)
        return fma32(r, y, q0)


def e4m3_bytes(q: np.ndarray) -> np.ndarray:
    q = np.minimum(np.maximum(q, F32(-FP8_MAX)), F32(FP8_MAX))
    return torch.from_numpy(q).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def assert_division_matches(x: np.ndarray, amax: np.ndarray) -> None:
    scale = (np.maximum(amax, F32(AMAX_FLOOR)) / F32(FP8_MAX)).astype(F32)
    with np.errstate(all="ignore"):
        want = (x / scale).astype(F32)
    got = div_rows(x, scale)
    differ = ~((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want)))
    assert (np.abs(want[differ]) < F32(2.0**-50)).all(), (x[differ][:5], got[differ][:5], want[differ][:5])
    assert (e4m3_bytes(got) == e4m3_bytes(want)).all()


def test_every_bf16_value_against_a_spread_of_group_maxima():
    pos = (np.arange(0, 0x7F80, dtype=np.uint32) << 16).view(F32)  # every finite non-negative bf16
    x = np.concatenate([pos, -pos])
    rng = np.random.default_rng(0)
    maxima = np.concatenate([pos[rng.integers(0, pos.size, 40)], pos[[1, 100, 0x3F80, 0x7F7F]]])
    for a in maxima:
        group = x[np.abs(x) <= a]  # a group's amax bounds its values
        assert_division_matches(group, np.full(group.size, a, dtype=F32))


def test_random_fp32_pairs_over_the_exponent_range():
    rng = np.random.default_rng(1)
    n = 2_000_000
    amax = rng.integers(1, 0x7F7FFFFF, n, dtype=np.uint32).view(F32)
    frac = (rng.random(n) * np.where(rng.random(n) < 0.5, -1, 1)).astype(F32)
    x = (amax * frac * (2.0 ** -rng.integers(0, 60, n))).astype(F32)
    assert_division_matches(np.where(np.abs(x) <= amax, x, amax).astype(F32), amax)


def test_signed_zeros_tiny_values_and_an_inf_in_the_group():
    specials = np.array([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-40, -1e-40, np.inf, -np.inf], dtype=F32)
    for a in (0.0, 1e-13, 1.0, 3.0e38, np.inf):
        group = specials[np.abs(specials) <= a]
        assert_division_matches(group, np.full(group.size, a, dtype=F32))
