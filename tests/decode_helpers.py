"""Random inputs for the decode-kernel tests: pools and caches whose unowned parts are NaN."""

from __future__ import annotations

import copy

import torch

from hylora.engine.decode_batch import bucket_for
from hylora.engine.padded_decode import PaddedDecode

NAN = float("nan")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def gdn_inputs(N: int, hk: int, hv: int, dk: int, dv: int, seed: int, dtype=torch.float32, padding=(), S=None):
    """Random decode inputs; pool slots not named by a live row are NaN."""
    g = torch.Generator().manual_seed(seed)
    C, K = 2 * hk * dk + hv * dv, 4
    S = S or N + 3
    slots = torch.randperm(S, generator=g)[:N]
    slots[list(padding)] = -1
    owned = torch.zeros(S, dtype=torch.bool)
    owned[slots[slots >= 0]] = True
    conv = torch.randn(S, C, K - 1, generator=g).to(dtype)
    recurrent = torch.randn(S, hv, dk, dv, generator=g) * 0.1
    conv[~owned], recurrent[~owned] = float("nan"), float("nan")
    args = dict(
        qkv=torch.randn(N, C, generator=g).to(dtype),
        b=torch.randn(N, hv, generator=g).to(dtype),
        a=torch.randn(N, hv, generator=g).to(dtype),
        conv_weight=(torch.randn(C, K, generator=g) * 0.5).to(dtype),
        A_log=torch.empty(hv).uniform_(0.01, 4.0, generator=g).log(),
        dt_bias=torch.randn(hv, generator=g) * 0.5,
    )
    return args, conv, recurrent, slots


def paged_case(seed: int, lens: list[int], hq: int, hkv: int, D: int, page_size: int, dtype=torch.float32):
    """Caches where every page no sequence owns, and every row past a sequence's length, is NaN;
    table entries past a length point at NaN pages; a padding row (length 0) at a NaN null page."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in lens]
    max_pages = max(pages_per) + 2
    num_pages = sum(pages_per) + 2
    order = torch.randperm(num_pages, generator=g).tolist()
    null_page, spare = order.pop(), order.pop()
    table = torch.full((len(lens), max_pages), spare, dtype=torch.int32)
    for i, n in enumerate(pages_per):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
        if lens[i] == 0:
            table[i] = null_page
    k_cache = torch.randn(num_pages * page_size, hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_pages * page_size, hkv, D, generator=g).to(dtype)
    for p in (null_page, spare):
        k_cache[p * page_size : (p + 1) * page_size] = float("nan")
        v_cache[p * page_size : (p + 1) * page_size] = float("nan")
    for i, n in enumerate(lens):  # rows past a length in its last page: not yet written
        if n % page_size:
            start = int(table[i, pages_per[i] - 1]) * page_size + n % page_size
            end = (start // page_size + 1) * page_size
            k_cache[start:end], v_cache[start:end] = float("nan"), float("nan")
    q = torch.randn(len(lens), hq, D, generator=g).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


def nan_fill_unowned(engine) -> None:
    """NaN in every free state slot, every free KV page and the null page."""
    kv, states = engine.kv, engine.states
    free_slots = sorted(set(range(states.num_slots)) - states._slots._allocated)
    states.conv[:, free_slots] = NAN
    states.recurrent[:, free_slots] = NAN
    ps = kv.page_size
    for p in [*sorted(set(range(kv.num_pages)) - kv._pages._allocated), kv.null_page]:
        kv.k[:, p * ps : (p + 1) * ps] = NAN
        kv.v[:, p * ps : (p + 1) * ps] = NAN


def padded(engine):
    """Decode steps through PaddedDecode (as with CUDA graphs), the null page NaN before each step;
    records (rows, bucket) of every padded step, and counts the steps planned ahead."""
    config = engine.config
    decode = PaddedDecode(engine.model, engine.kv, engine.states, config.max_num_seqs, config.max_model_len)
    engine.runner.decode = decode
    decode.calls = []
    decode.ahead = 0
    run_padded = decode.run

    def run_recorded(rows, input_ids=None):
        ps, null = engine.kv.page_size, engine.kv.null_page
        engine.kv.k[:, null * ps : (null + 1) * ps] = NAN  # a live row reading it would fail its request
        engine.kv.v[:, null * ps : (null + 1) * ps] = NAN
        decode.calls.append((len(rows), bucket_for(len(rows), decode.buckets)))
        decode.ahead += input_ids is not None
        return run_padded(rows, input_ids)

    decode.run = run_recorded
    return engine


def eager_step_on_copies(engine, chunks) -> tuple:
    """(the eager step's results for `chunks`, run on copies of the engine's caches; those copies' kv
    and states after it; cache_snapshot of the engine's own caches; a fresh runner on them, for the
    padded step to compare)."""
    from hylora.engine.runner import ModelRunner

    eager_kv, eager_states = copy.deepcopy(engine.kv), copy.deepcopy(engine.states)
    eager = ModelRunner(engine.model, eager_kv, eager_states).execute(chunks)
    before = cache_snapshot(engine.kv, engine.states)
    return eager, eager_kv, eager_states, before, ModelRunner(engine.model, engine.kv, engine.states)


def cache_snapshot(kv, states) -> tuple[torch.Tensor, ...]:
    """(k, v, conv, recurrent) cloned: what a step may write."""
    return kv.k.clone(), kv.v.clone(), states.conv.clone(), states.recurrent.clone()


def assert_step_wrote_only_its_own(kv, states, chunks, eager_kv, eager_states, before, **tol) -> None:
    """After a padded step of `chunks`: their own state slots and pages hold what the eager step wrote
    (within `tol`), and everything else (foreign sequences, free slots and pages, still NaN) is bit for
    bit as `before` (cache_snapshot); the null page is the padding rows' write sink."""
    before_k, before_v, before_conv, before_rec = before
    own_slots = [c.request.state_slot for c in chunks]
    ps = kv.page_size
    own_rows = torch.cat([torch.arange(p * ps, (p + 1) * ps) for c in chunks for p in c.request.pages])
    torch.testing.assert_close(states.recurrent[:, own_slots], eager_states.recurrent[:, own_slots], **tol)
    torch.testing.assert_close(states.conv[:, own_slots], eager_states.conv[:, own_slots], **tol)
    torch.testing.assert_close(kv.k[:, own_rows], eager_kv.k[:, own_rows], equal_nan=True, **tol)
    other_slots = [s for s in range(states.num_slots) if s not in own_slots]
    keep = torch.ones(kv.k.shape[1], dtype=torch.bool)
    keep[own_rows] = False
    keep[kv.null_page * ps : (kv.null_page + 1) * ps] = False
    assert same_bits(states.recurrent[:, other_slots], before_rec[:, other_slots])
    assert same_bits(states.conv[:, other_slots], before_conv[:, other_slots])
    assert same_bits(kv.k[:, keep], before_k[:, keep]) and same_bits(kv.v[:, keep], before_v[:, keep])
