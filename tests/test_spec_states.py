"""Per-position GDN states for speculative verify steps: with `spec_slots`, the state after token j of
sequence i (j < n_i - 1) lands in pool slot spec_slots[i, j] (-1: nowhere), and equals the final state
the same op leaves after only the first j + 1 tokens, which is what lets the engine keep the state of
the accepted prefix. The Triton kernel runs on the CPU under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_mode import interpreter_only

interpreter_only()  # before triton is imported

pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from hylora.kernels import checks as check  # noqa: E402
from hylora.ops.causal_conv1d import triton as conv_triton  # noqa: E402
from hylora.ops.causal_conv1d.reference import causal_conv1d_by_slot, save_conv_states  # noqa: E402
from hylora.ops.gated_delta_rule import reference as gdn_reference  # noqa: E402
from hylora.ops.gated_delta_rule import triton as gdn_triton  # noqa: E402
from hylora.ops.varlen import seq_starts  # noqa: E402
from tests.decode_helpers import same_bits  # noqa: E402

NAN = float("nan")
HK, HV, DK, DV = 2, 4, 16, 16
SCALE = 0.3


def spec_case(lens: list[int], seed: int, shape: tuple[int, ...], unused: int = 2):
    """Main slots, a [N, max(n)] spec table of distinct spare slots (every third entry -1) and a pool
    of `shape` per slot: owned slots random, every other slot NaN."""
    g = torch.Generator().manual_seed(seed)
    N, J = len(lens), max(lens)
    order = torch.randperm(N + N * J + unused, generator=g)
    slots, spec = order[:N], order[N : N + N * J].reshape(N, J).clone()
    spec.view(-1)[::3] = -1
    pool = torch.full((len(order), *shape), NAN)
    pool[slots] = torch.randn(N, *shape, generator=g)
    return g, slots, spec, pool


def gdn_args(lens: list[int], g: torch.Generator) -> dict:
    T = sum(lens)
    ba = torch.randn(T, 2 * HV + 3, generator=g)
    return dict(
        q=torch.randn(T, HK, DK, generator=g),
        k=torch.randn(T, HK, DK, generator=g),
        v=torch.randn(T, HV, DV, generator=g),
        b=ba[:, :HV],
        a=ba[:, HV : 2 * HV],
        A_log=torch.empty(HV).uniform_(0.01, 4.0, generator=g).log(),
        dt_bias=torch.randn(HV, generator=g) * 0.5,
    )


def truncated(args: dict, lens: list[int], i: int, n: int) -> dict:
    """The per-token inputs of sequence i's first n tokens alone; per-head ones as they are."""
    start = seq_starts(lens)[i]
    return {name: x if x.dim() == 1 else x[start : start + n] for name, x in args.items()}


def written(pool: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Slots whose bits changed."""
    ints = pool.view(torch.int32).flatten(1) != before.view(torch.int32).flatten(1)
    return ints.any(1)


LENS = [[1, 2, 3, 5], [3, 1, 5, 2], [2, 0, 4]]


@pytest.mark.parametrize("lens", LENS, ids=str)
def test_reference_spec_state_is_the_state_after_the_prefix(lens):
    g, slots, spec, pool = spec_case(lens, seed=sum(lens), shape=(HV, DK, DV))
    pool[slots] *= 0.1
    args = gdn_args(lens, g)
    pool0, plain = pool.clone(), pool.clone()
    o_plain = gdn_reference.recurrent_by_slot(**args, state_pool=plain, slots=slots, seq_lens=lens, scale=SCALE)
    o = gdn_reference.recurrent_by_slot(
        **args, state_pool=pool, slots=slots, seq_lens=lens, scale=SCALE, spec_slots=spec
    )
    torch.testing.assert_close(o, o_plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], plain[slots], atol=1e-5, rtol=1e-5)
    expected = torch.zeros(len(pool), dtype=torch.bool)
    expected[slots] = True
    for i, n in enumerate(lens):
        for j in range(n - 1):
            if spec[i, j] < 0:
                continue
            expected[spec[i, j]] = True
            prefix = pool0.clone()
            gdn_reference.recurrent_by_slot(
                **truncated(args, lens, i, j + 1),
                state_pool=prefix,
                slots=slots[i : i + 1],
                seq_lens=[j + 1],
                scale=SCALE,
            )
            torch.testing.assert_close(pool[spec[i, j]], prefix[slots[i]], atol=1e-5, rtol=1e-5)
    assert same_bits(pool[~expected], pool0[~expected])  # -1 entries, columns past n_i - 1, unowned slots


@pytest.mark.parametrize("block_v", [8, 16], ids=lambda b: f"block_v{b}")
@pytest.mark.parametrize("lens", [[1, 2, 3, 5, 0], [3, 1, 5, 2]], ids=str)
def test_triton_spec_states_equal_the_reference(lens, block_v):
    g, slots, spec, pool = spec_case(lens, seed=7 + sum(lens), shape=(HV, DK, DV))
    pool[slots] *= 0.1
    args = gdn_args(lens, g)
    pool0, ref_pool = pool.clone(), pool.clone()
    o_ref = gdn_reference.recurrent_by_slot(
        **args, state_pool=ref_pool, slots=slots, seq_lens=lens, scale=SCALE, spec_slots=spec
    )
    out = torch.full_like(o_ref, NAN)
    o = gdn_triton.recurrent_by_slot(
        **args, state_pool=pool, slots=slots, seq_lens=lens, scale=SCALE, out=out, block_v=block_v,
        spec_slots=spec.to(torch.int32),
    )  # fmt: skip
    assert o is out
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    finite = ref_pool.flatten(1).isfinite().all(1)
    torch.testing.assert_close(pool[finite], ref_pool[finite], atol=1e-5, rtol=1e-5)
    assert same_bits(pool[~finite], pool0[~finite])  # -1 entries, columns past n_i - 1, unowned slots
    assert finite.sum() == len(lens) + sum(int((spec[i, : max(n - 1, 0)] >= 0).sum()) for i, n in enumerate(lens))


def test_triton_spec_padding_row_writes_nothing():
    lens = [3, 4, 2]
    g, slots, spec, pool = spec_case(lens, seed=5, shape=(HV, DK, DV))
    pool[slots] *= 0.1
    args = gdn_args(lens, g)
    live = [0, 2]
    ref_pool = pool.clone()
    o_ref = gdn_reference.recurrent_by_slot(
        **{name: x if x.dim() == 1 else torch.cat([x[:3], x[7:]]) for name, x in args.items()},
        state_pool=ref_pool, slots=slots[live], seq_lens=[3, 2], scale=SCALE, spec_slots=spec[live],
    )  # fmt: skip
    slots[1] = -1
    spec[1] = torch.arange(3, 3 + spec.shape[1])  # a padding row's spec entries are ignored too
    pool0 = pool.clone()
    o = gdn_triton.recurrent_by_slot(
        **args, state_pool=pool, slots=slots, seq_lens=lens, scale=SCALE, spec_slots=spec, block_v=8
    )
    assert torch.equal(o[3:7], torch.zeros_like(o[3:7]))
    torch.testing.assert_close(torch.cat([o[:3], o[7:]]), o_ref, atol=1e-5, rtol=1e-5)
    changed = written(pool, pool0)
    assert torch.equal(changed, written(ref_pool, pool0))
    torch.testing.assert_close(pool[changed], ref_pool[changed], atol=1e-5, rtol=1e-5)


def test_triton_spec_slots_are_validated():
    lens = [1, 4]
    g, slots, spec, pool = spec_case(lens, seed=1, shape=(HV, DK, DV))
    args = dict(**gdn_args(lens, g), state_pool=pool, slots=slots, seq_lens=lens, scale=SCALE)
    for bad in (spec[:, :2], spec[:1], spec[0], spec.float()):
        with pytest.raises(ValueError, match="spec_slots"):
            gdn_triton.recurrent_by_slot(**args, spec_slots=bad)
    gdn_triton.recurrent_by_slot(**args, spec_slots=spec[:, :3])  # J = max(n) - 1 is enough


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lens", [[1, 2, 3, 5, 0], [5, 2, 4]], ids=str)
def test_save_conv_states_is_the_conv_state_after_the_prefix(lens, dtype):
    C, K = 6, 4
    g, slots, spec, pool = spec_case(lens, seed=len(lens), shape=(C, K - 1))
    pool = pool.to(dtype)
    x = torch.randn(sum(lens), 2 * C, generator=g).to(dtype)[:, :C]  # strided, as the projection split
    weight = torch.randn(C, K, generator=g).to(dtype)
    pool0 = pool.clone()
    save_conv_states(x, pool, slots, lens, spec)
    assert pool.dtype == dtype
    expected = torch.zeros(len(pool), dtype=torch.bool)
    for i, n in enumerate(lens):
        for j in range(n - 1):
            if spec[i, j] < 0:
                continue
            expected[spec[i, j]] = True
            prefix = pool0.clone()
            start = seq_starts(lens)[i]
            causal_conv1d_by_slot(x[start : start + j + 1], weight, prefix, slots[i : i + 1], [j + 1])
            assert same_bits(pool[spec[i, j]], prefix[slots[i]])
    assert same_bits(pool[~expected], pool0[~expected])  # main slots too: the conv reads them next


def test_save_conv_states_padding_row_and_short_steps_write_nothing():
    lens = [3, 2]
    g, slots, spec, pool = spec_case(lens, seed=3, shape=(5, 3))
    x = torch.randn(5, 5, generator=g)
    pool0 = pool.clone()
    save_conv_states(x, pool, torch.tensor([-1, -1]), lens, spec)
    assert same_bits(pool, pool0)
    save_conv_states(x[:2], pool, slots, [1, 1], spec[:, :0])  # decode rows only: nothing to keep
    assert same_bits(pool, pool0)
    with pytest.raises(ValueError, match="spec_slots"):
        save_conv_states(x, pool, slots, lens, spec[:, :1])


def test_start_up_check_covers_spec_slots():
    assert check.gdn_recurrent_error(2, 4, 16, 16, torch.float32, "cpu", batches=(), block_v=8) < 1e-5
    broken = check.gdn_recurrent_error(
        2, 4, 16, 16, torch.float32, "cpu", batches=(), kernel=ignore_spec_slots, block_v=8
    )
    assert broken == check.FAILED


def ignore_spec_slots(*args, spec_slots=None, **kwargs):
    return gdn_triton.recurrent_by_slot(*args, **kwargs)


def test_save_conv_states_columns_bound_the_work_not_the_result():
    lens = [3, 20, 2]  # a verify chunk of 1 + 2 drafts beside a longer prefill chunk: spec slots 19 wide
    g, slots, spec, pool = spec_case(lens, seed=7, shape=(5, 3))
    spec[:, 2:] = -1  # only the drafts' columns hold slots
    x = torch.randn(sum(lens), 5, generator=g)
    full, narrow = pool.clone(), pool.clone()
    save_conv_states(x, full, slots, lens, spec)
    save_conv_states(x, narrow, slots, lens, spec, columns=2)
    assert same_bits(narrow, full) and not same_bits(full, pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "lens,columns,block_c",
    [([1, 2, 3, 5, 0], None, 4), ([3, 20, 2], 2, 8), ([3, 20, 2], None, 16), ([4, 1, 4, 1], 3, 16)],
    ids=str,
)
def test_triton_save_conv_states_equals_the_reference(lens, columns, block_c, dtype):
    """Chunks shorter and longer than K-1 (a column's window reaches back into the held state or lies
    wholly in the chunk), empty and one-token sequences, `columns` narrower than the table, a padding
    row and the channel tail straddled (C = 10, blocks of 4 / 8 / 16): the pool equals the
    reference's bit for bit, every slot nobody writes (NaN-filled) untouched."""
    C, K = 10, 4
    g, slots, spec, pool = spec_case(lens, seed=sum(lens), shape=(C, K - 1))
    if columns is not None:
        spec[:, columns:] = -1
    slots[-1] = -1  # a padding row: reads and writes nothing
    pool = pool.to(dtype)
    x = torch.randn(sum(lens), 2 * C, generator=g).to(dtype)[:, :C]  # strided, as the projection split
    ref, got = pool.clone(), pool.clone()
    save_conv_states(x, ref, slots, lens, spec, columns=columns)
    conv_triton.save_conv_states(x, got, slots, lens, spec.to(torch.int32), columns=columns, block_c=block_c)
    assert same_bits(got, ref)
    assert not same_bits(got, pool)  # something was saved


def test_triton_save_conv_states_reads_the_layout_from_the_device():
    """A padded step's `starts` decide which columns write, not `seq_lens` (which fix only N and T)."""
    lens, padded = [3, 1, 2], [1, 1, 4]  # the same N and T, another split
    C, K = 6, 4
    g, slots, spec, pool = spec_case(lens, seed=4, shape=(C, K - 1))
    x = torch.randn(sum(lens), C, generator=g)
    ref, got = pool.clone(), pool.clone()
    save_conv_states(x, ref, slots, lens, spec)
    starts = torch.tensor(seq_starts(lens))
    conv_triton.save_conv_states(x, got, slots, padded, spec, starts=starts)
    assert same_bits(got, ref)
    with pytest.raises(ValueError, match="spec_slots"):
        conv_triton.save_conv_states(x, got, slots, [5, 1], spec[:2, :1])


def test_start_up_check_of_the_conv_states_kernel():
    assert check.save_conv_states_error(12, 4, torch.float32, "cpu") == 0.0
    assert check.save_conv_states_error(12, 4, torch.bfloat16, "cpu") == 0.0

    def pads_too(x, pool, slots, lens, spec, columns=None):  # the padding row saves states as a live one
        conv_triton.save_conv_states(x, pool, slots.clamp_min(0), lens, spec, columns=columns)

    def one_token_late(x, pool, slots, lens, spec, columns=None):
        conv_triton.save_conv_states(
            x[1:], pool, slots, [n - (i == 0) for i, n in enumerate(lens)], spec, columns=columns
        )

    assert check.save_conv_states_error(12, 4, torch.float32, "cpu", kernel=pads_too) == check.FAILED
    assert check.save_conv_states_error(12, 4, torch.float32, "cpu", kernel=one_token_late) > 0.05
