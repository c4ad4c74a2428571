"""ops.logits_scan: one pass over the logits gives each row's greedy token and its NaN / inf flags.
The Triton kernel (Triton's interpreter on the CPU, compiled on a GPU) equals the torch reference at
vocabulary sizes straddling its block and chunk boundaries, with ties across chunks, NaN, ±inf and
fully forbidden rows; the start-up check rejects a wrong kernel; the sampler gives the same draws
and the same per-row errors through either."""

from __future__ import annotations

import pytest
import torch

from tests.triton_mode import interpret_without_cuda, kernel_device

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from hylora.engine.request import Request, SamplingParams  # noqa: E402
from hylora.engine.sampler import SamplingError, sample  # noqa: E402
from hylora.kernels import checks  # noqa: E402
from hylora.ops.logits_scan import (  # noqa: E402
    ALL_FINITE,
    HAS_FINITE,
    HAS_NAN,
    NOT_FINITE,
    reference,  # noqa: E402
)
from hylora.ops.logits_scan import triton as kernel  # noqa: E402

DEVICE = kernel_device(kernel._scan_chunk_kernel)
BLOCK, CHUNK = 256, 1024  # small, so that the interpreter crosses several of each
VOCABS = (1, BLOCK - 1, BLOCK, BLOCK + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5)


def scan(logits: torch.Tensor) -> torch.Tensor:
    return kernel.scan_logits(logits, chunk=CHUNK, block=BLOCK)


def special_rows(vocab: int, rows: int, seed: int) -> torch.Tensor:
    """Random rows, then: the top in the last column, in column 0, a NaN, +inf, -inf only, a tie
    between a column of the first chunk and one of the last, -inf and finite mixed."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    edits = [
        lambda r: r.__setitem__(-1, 50.0),
        lambda r: r.__setitem__(0, 50.0),
        lambda r: r.__setitem__(vocab // 2, float("nan")),
        lambda r: r.__setitem__(vocab - 1, float("inf")),
        lambda r: r.fill_(float("-inf")),
        lambda r: (r.__setitem__(vocab // 3, 60.0), r.__setitem__(vocab - 1, 60.0)),
        lambda r: r.__setitem__(slice(0, vocab // 2), float("-inf")),
    ]
    for row, edit in zip(range(rows), edits, strict=False):
        edit(logits[row])
    return logits.to(DEVICE)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", (1, 7, 33))
def test_the_kernel_equals_the_reference(vocab, rows):
    logits = special_rows(vocab, rows, seed=vocab * 100 + rows)
    got, ref = scan(logits).cpu(), reference.scan_logits(logits).cpu()
    assert torch.equal(got[1], ref[1])
    nan_rows = (ref[1] & HAS_NAN).bool()
    assert torch.equal(got[0][~nan_rows], ref[0][~nan_rows])  # a NaN row's token is not specified
    assert bool(((got[0] >= 0) & (got[0] < vocab)).all())


def test_the_flags_say_what_each_row_holds():
    logits = special_rows(CHUNK + 1, 7, seed=1)
    tokens, flags = scan(logits).cpu()
    assert flags[0] == flags[1] == flags[5] == ALL_FINITE and tokens[0] == CHUNK and tokens[1] == 0
    assert flags[2] == HAS_NAN | NOT_FINITE | HAS_FINITE
    assert flags[3] == NOT_FINITE | HAS_FINITE and tokens[3] == CHUNK  # +inf is the largest
    assert flags[4] == NOT_FINITE and tokens[4] == 0  # every token forbidden: token 0, as torch.argmax
    assert tokens[5] == (CHUNK + 1) // 3  # a tie goes to the first column, across chunks
    assert flags[6] == NOT_FINITE | HAS_FINITE and tokens[6] >= (CHUNK + 1) // 2


def test_an_empty_batch():
    assert scan(torch.zeros(0, 10, device=DEVICE)).shape == (2, 0)


def test_the_start_up_check_passes_the_kernel_and_rejects_a_wrong_one():
    vocab = 2 * CHUNK + 3
    assert checks.logits_scan_error(vocab, DEVICE, rows=(1, 5, 33), kernel=scan) == 0.0

    def last_of_ties(logits: torch.Tensor) -> torch.Tensor:  # argmax picking the last of equal values
        out = reference.scan_logits(logits)
        out[0] = logits.shape[1] - 1 - logits.flip(-1).argmax(-1)
        return out

    def blind_to_inf(logits: torch.Tensor) -> torch.Tensor:
        out = reference.scan_logits(logits)
        out[1] &= ~NOT_FINITE
        return out

    for wrong in (last_of_ties, blind_to_inf):
        assert checks.logits_scan_error(vocab, DEVICE, rows=(1, 5, 33), kernel=wrong) == checks.FAILED


def req(params: SamplingParams) -> Request:
    return Request("r", [1, 2], params)


def test_the_sampler_draws_the_same_through_the_kernel():
    logits = special_rows(CHUNK + 7, 9, seed=3)
    logits[4, 5] = 0.0  # one allowed token in the forbidden row: it must be drawn
    params = [SamplingParams(temperature=0.0)] * 6 + [
        SamplingParams(temperature=0.7, top_k=20, seed=11),
        SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
        SamplingParams(temperature=0.0, logprobs=2),
    ]

    def run(scan_fn):
        return sample(logits.clone(), [req(p) for p in params], scan=scan_fn)

    fast, ref = run(scan), run(reference.scan_logits)
    assert isinstance(fast[2], SamplingError) and isinstance(ref[2], SamplingError)  # the NaN row fails alone
    assert str(fast[2]) == str(ref[2])
    assert [f[0] for i, f in enumerate(fast) if i != 2] == [r[0] for i, r in enumerate(ref) if i != 2]
    assert fast[4][0] == 5 and fast[7][0] == 3
    assert fast[8][1] == ref[8][1]
    forbidden = torch.full((2, 300), float("-inf"), device=DEVICE)
    forbidden[1, 9] = 1.0
    none_left, nine = sample(forbidden, [req(SamplingParams(temperature=0.0))] * 2, scan=scan)
    assert isinstance(none_left, SamplingError) and "every token is forbidden" in str(none_left)
    assert nine[0] == 9
