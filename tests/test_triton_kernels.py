"""hylora's Triton kernels equal their torch references, run on the CPU by Triton's interpreter.

fp32, tight tolerances, sizes straddling every block / partition / tile boundary (kept small: the
interpreter runs each program in Python). Output buffers start NaN-filled and every pool slot, KV
page or LoRA slot the batch does not own holds NaN, so a read of foreign memory or an element left
unwritten shows; what a kernel must not write is compared bit for bit afterwards.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from tests.triton_mode import interpreter_only

interpreter_only()  # before triton is imported

pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")


from hylora.cache import StatePool  # noqa: E402
from hylora.config import ModelConfig  # noqa: E402
from hylora.kernels import checks as check  # noqa: E402
from hylora.lora import DeviceLoRABatch, LoRABatch, LoRAStack  # noqa: E402
from hylora.model.forward_batch import ForwardBatch  # noqa: E402
from hylora.model.gdn import GatedDeltaNet  # noqa: E402
from hylora.model.layers import STACKED_LORA_BELOW, Linear  # noqa: E402
from hylora.ops.causal_conv1d import reference as conv_reference  # noqa: E402
from hylora.ops.causal_conv1d import triton as conv_triton  # noqa: E402
from hylora.ops.gated_delta_rule import reference as gdn_prefill_reference  # noqa: E402
from hylora.ops.gated_delta_rule import triton as gdn_prefill_triton  # noqa: E402
from hylora.ops.gdn_decode import reference as gdn_reference  # noqa: E402
from hylora.ops.gdn_decode import triton as gdn_triton  # noqa: E402
from hylora.ops.lora import reference as lora_reference  # noqa: E402
from hylora.ops.lora import triton as lora_triton  # noqa: E402
from hylora.ops.paged_decode_attention import reference as attn_reference  # noqa: E402
from hylora.ops.paged_decode_attention import triton as attn_triton  # noqa: E402
from hylora.ops.rmsnorm import reference as norm_reference  # noqa: E402
from hylora.ops.rmsnorm import triton as norm_triton  # noqa: E402
from hylora.ops.silu_mul import reference as silu_reference  # noqa: E402
from hylora.ops.silu_mul import triton as silu_triton  # noqa: E402
from hylora.ops.varlen import RECURRENT_MAX_TOKENS  # noqa: E402
from tests.conftest import text_config  # noqa: E402
from tests.decode_helpers import gdn_inputs, paged_case, same_bits  # noqa: E402
from tests.lora_helpers import grouped_reference, random_stack  # noqa: E402

NAN = float("nan")


# --- GDN decode -------------------------------------------------------------------------------

GDN_SHAPES = {
    # name: (hk, hv, dk, dv, block_v, block_c, N, padding rows)
    "group2-dv2blocks-conv2blocks": (2, 4, 16, 16, 8, 64, 3, (1,)),
    "group3-dk24-dv40tail-conv168": (1, 3, 24, 40, 32, 64, 2, ()),
    "group1-one-row": (2, 2, 16, 16, 16, 256, 1, ()),
    "group3-dv40-block16": (1, 3, 16, 40, 16, 64, 2, (0,)),  # with 2 blocks a program: one all masked
}


@pytest.mark.parametrize("v_blocks", [1, 2, "split"], ids=lambda v: f"v_blocks{v}" if v != "split" else "split")
@pytest.mark.parametrize("shape", GDN_SHAPES, ids=str)
def test_gdn_decode_triton_equals_reference(shape, v_blocks):
    """The fused kernel (one or two dv blocks a program) and the split form (conv, then the delta rule)."""
    hk, hv, dk, dv, block_v, block_c, N, padding = GDN_SHAPES[shape]
    args, conv, recurrent, slots = gdn_inputs(N, hk, hv, dk, dv, seed=N, padding=padding)
    conv0, rec0 = conv.clone(), recurrent.clone()
    conv_ref, rec_ref = conv.clone(), recurrent.clone()
    o_ref = gdn_reference.gdn_decode(**args, conv_state=conv_ref, recurrent_state=rec_ref, slots=slots)
    out = torch.full((N, hv, dv), NAN)
    states = dict(conv_state=conv, recurrent_state=recurrent, slots=slots, out=out)
    knobs = dict(v_blocks=0, num_warps=1) if v_blocks == "split" else dict(v_blocks=v_blocks)
    o = gdn_triton.gdn_decode(**args, **states, block_v=block_v, block_c=block_c, **knobs)
    assert o is out
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-5)
    for i in padding:
        assert torch.equal(o[i], torch.zeros_like(o[i]))
    owned = torch.zeros(len(conv), dtype=torch.bool)
    owned[slots[slots >= 0]] = True
    torch.testing.assert_close(conv[owned], conv_ref[owned], atol=0, rtol=0)
    torch.testing.assert_close(recurrent[owned], rec_ref[owned], atol=1e-6, rtol=1e-5)
    assert same_bits(conv[~owned], conv0[~owned]) and same_bits(recurrent[~owned], rec0[~owned])


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_gdn_decode_triton_padding_only_writes_nothing(split):
    args, conv, recurrent, slots = gdn_inputs(2, 1, 2, 16, 16, seed=5, padding=(0, 1))
    conv0, rec0 = conv.clone(), recurrent.clone()
    states = dict(conv_state=conv, recurrent_state=recurrent, slots=slots)
    o = gdn_triton.gdn_decode(**args, **states, v_blocks=0 if split else None)
    assert torch.equal(o, torch.zeros_like(o))
    assert same_bits(conv, conv0) and same_bits(recurrent, rec0)


def test_gdn_decode_refuses_a_strided_state():
    """The kernels address a head's state tile with compile-time offsets: a view that is not contiguous
    per head would be read wrongly, so it is refused."""
    args, conv, recurrent, slots = gdn_inputs(2, 1, 2, 16, 16, seed=6)
    wide = torch.zeros(*recurrent.shape[:-1], 32)[..., :16]
    with pytest.raises(ValueError, match="contiguous"):
        gdn_triton.gdn_decode(**args, conv_state=conv, recurrent_state=wide, slots=slots)


def test_gdn_decode_start_up_check():
    """The start-up check itself, with fewer rows than on the GPU (the interpreter is slow)."""
    assert check.gdn_decode_error(2, 4, 16, 16, 4, torch.float32, "cpu", batches=(1, 3), block_v=16) < 1e-6


# --- GDN short prefill: the delta rule token by token, states by slot ----------------------------

RECURRENT_SHAPES = {
    # name: (hk, hv, dk, dv, block_v)
    "group2-dv2blocks": (2, 4, 16, 16, 8),
    "group3-dk24-dv40tail": (1, 3, 24, 40, 16),
}


def recurrent_case(lens: list[int], hk: int, hv: int, dk: int, dv: int, seed: int):
    """Inputs as the GDN layer gives them (b and a strided columns of one projection output) and a
    pool whose slots no sequence owns are NaN."""
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    ba = torch.randn(T, 2 * hv + 3, generator=g)
    args = dict(
        q=torch.randn(T, hk, dk, generator=g),
        k=torch.randn(T, hk, dk, generator=g),
        v=torch.randn(T, hv, dv, generator=g),
        b=ba[:, :hv],
        a=ba[:, hv : 2 * hv],
        A_log=torch.empty(hv).uniform_(0.01, 4.0, generator=g).log(),
        dt_bias=torch.randn(hv, generator=g) * 0.5,
    )
    slots = torch.randperm(N + 3, generator=g)[:N]
    pool = torch.full((N + 3, hv, dk, dv), NAN)
    pool[slots] = torch.randn(N, hv, dk, dv, generator=g) * 0.1
    return args, pool, slots


@pytest.mark.parametrize("lens", [[1], [64], [3, 1, 17], [1, 0, 2, 63, 1]], ids=str)
@pytest.mark.parametrize("shape", RECURRENT_SHAPES, ids=str)
def test_gdn_recurrent_triton_equals_reference(shape, lens):
    """Decode rows, a prompt's last tokens, an empty chunk and the 64-token limit in one step; the
    value-head groups and the dv tail straddled; the reference runs the chunked form on these."""
    hk, hv, dk, dv, block_v = RECURRENT_SHAPES[shape]
    args, pool, slots = recurrent_case(lens, hk, hv, dk, dv, seed=sum(lens) + hv)
    pool0, ref_pool = pool.clone(), pool.clone()
    o_ref = gdn_prefill_reference.recurrent_by_slot(**args, state_pool=ref_pool, slots=slots, seq_lens=lens, scale=0.3)
    out = torch.full((sum(lens), hv, dv), NAN)
    o = gdn_prefill_triton.recurrent_by_slot(
        **args, state_pool=pool, slots=slots, seq_lens=lens, scale=0.3, out=out, block_v=block_v
    )
    assert o is out
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-4)
    owned = torch.zeros(len(pool), dtype=torch.bool)
    owned[slots] = True
    torch.testing.assert_close(pool[owned], ref_pool[owned], atol=1e-5, rtol=1e-4)
    assert same_bits(pool[~owned], pool0[~owned])
    if 0 in lens:  # an empty chunk leaves its state bit for bit
        i = lens.index(0)
        assert same_bits(pool[slots[i]], pool0[slots[i]])


def test_gdn_recurrent_padding_row_writes_nothing():
    args, pool, slots = recurrent_case([2, 3], 1, 2, 16, 16, seed=9)
    slots[0] = -1
    pool0 = pool.clone()
    o = gdn_prefill_triton.recurrent_by_slot(**args, state_pool=pool, slots=slots, seq_lens=[2, 3], scale=0.25)
    assert torch.equal(o[:2], torch.zeros_like(o[:2])) and torch.isfinite(o[2:]).all()
    assert same_bits(pool[pool0.isnan().flatten(1).all(1)], pool0[pool0.isnan().flatten(1).all(1)])


def test_gdn_recurrent_refuses_a_strided_state_pool():
    """The kernel addresses a head's state tile with compile-time offsets: a pool that is not contiguous
    per head would be read wrongly, so it is refused."""
    args, pool, slots = recurrent_case([2, 3], 1, 2, 16, 16, seed=9)
    wide = torch.zeros(*pool.shape[:-1], 32)[..., :16]
    with pytest.raises(ValueError, match="contiguous"):
        gdn_prefill_triton.recurrent_by_slot(**args, state_pool=wide, slots=slots, seq_lens=[2, 3], scale=0.25)


def test_gdn_recurrent_start_up_check():
    batches = ((1,), (3, 0, 64, 1), (1, 1, 106, 1))  # the last: a prefill burst's tail in a short step
    assert check.gdn_recurrent_error(2, 4, 16, 16, torch.float32, "cpu", batches=batches, block_v=8) < 1e-5


@pytest.mark.parametrize("lens", [[64, 1, 5], [65, 1]], ids=str)
def test_gdn_layer_with_the_short_form_equals_its_chunked_path(lens):
    """The GDN layer with the kernel installed: a step whose chunks all have at most
    RECURRENT_MAX_TOKENS tokens runs token by token, a longer one through the chunked delta rule;
    outputs and states equal the layer without the kernel either way."""
    config = ModelConfig.from_hf({"model_type": "qwen3_5_text", **text_config()})
    g = torch.Generator().manual_seed(len(lens))
    layer = GatedDeltaNet(config, config.gdn_layers[0])
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name == "dt_bias" else 0.2))
        layer.A_log.copy_(torch.empty(config.linear_num_value_heads).uniform_(0.01, 4.0, generator=g).log())
    T, N = sum(lens), len(lens)
    x = torch.randn(T, config.hidden_size, generator=g)
    batch = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long),
        positions=torch.zeros(3, T, dtype=torch.long),
        seq_lens=lens,
        context_lens=[3] * N,
        state_slots=torch.tensor([4, 0, 2][:N]),
        block_table=torch.zeros(N, 1, dtype=torch.int32),
        kv_slot_mapping=torch.zeros(T, dtype=torch.long),
        page_size=16,
    )
    pool = StatePool(config, num_slots=5, dtype=torch.float32, device="cpu")
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=g) * 0.1)
    ref_pool = copy.deepcopy(pool)
    calls = []
    with torch.no_grad():
        y_ref = layer(x, batch, ref_pool)
        layer.short_prefill = lambda *args, **kw: calls.append(1) or gdn_prefill_triton.recurrent_by_slot(*args, **kw)
        y = layer(x, batch, pool)
    assert bool(calls) == (max(lens) <= RECURRENT_MAX_TOKENS)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pool.recurrent, ref_pool.recurrent, atol=1e-5, rtol=1e-4)
    assert same_bits(pool.conv, ref_pool.conv)


# --- paged decode attention --------------------------------------------------------------------

LENGTHS = [1, 15, 16, 17, 31, 32, 33, 0, 64, 65]  # around block_t 16 and partition 32
ATTN_CASES = {
    # name: (H, Hkv, D, page_size, partition, block_t)
    "D32-gqa2-page7-split": (4, 2, 32, 7, 32, 16),
    "D64-gqa3-page16-split": (6, 2, 64, 16, 32, 16),
    "D256-gqa2-page16-split": (2, 1, 256, 16, 32, 16),
    "D32-mha-page1-direct": (4, 4, 32, 1, 512, 32),
    "D256-gqa6-page16-direct": (6, 1, 256, 16, 512, 32),
}


@pytest.mark.parametrize("case", ATTN_CASES, ids=str)
def test_paged_decode_attention_triton_equals_reference(case):
    H, hkv, D, page_size, partition, block_t = ATTN_CASES[case]
    q, k_cache, v_cache, table, seq_lens = paged_case(D, LENGTHS, H, hkv, D, page_size)
    ref = attn_reference.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, page_size, D**-0.5)
    out = torch.full_like(q, NAN)
    o = attn_triton.paged_decode_attention(
        q, k_cache, v_cache, table, seq_lens, page_size, D**-0.5, out=out, partition=partition, block_t=block_t
    )
    assert o is out
    torch.testing.assert_close(o, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(o[7], torch.zeros_like(o[7]))  # padding row


def test_paged_decode_attention_max_seq_len_bounds_the_partitions():
    """A host-known bound gives fewer partitions than the table width; results are unchanged."""
    q, k_cache, v_cache, table, seq_lens = paged_case(1, [65, 3, 0, 40], 4, 2, 32, 4)
    ref = attn_reference.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 4, 0.2)
    for bound in (65, 96, None):
        o = attn_triton.paged_decode_attention(
            q, k_cache, v_cache, table, seq_lens, 4, 0.2, max_seq_len=bound, partition=32, block_t=16
        )
        torch.testing.assert_close(o, ref, atol=1e-6, rtol=1e-5)


def test_paged_decode_attention_merges_more_partitions_than_one_merge_step():
    """19 partitions of 32 tokens: the merge kernel's loop takes two chunks of MERGE_CHUNK."""
    assert attn_triton.MERGE_CHUNK == 16
    q, k_cache, v_cache, table, seq_lens = paged_case(2, [600, 0, 17, 512], 4, 2, 32, 8)
    ref = attn_reference.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 8, 0.2)
    out = torch.full_like(q, NAN)
    attn_triton.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 8, 0.2, out=out, partition=32)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_paged_decode_attention_bits_do_not_depend_on_the_length_bound():
    """A sequence's output is the same bits whatever bound the batch passes (its neighbours' lengths in
    an eager step, max_model_len in a CUDA graph): the partition length is fixed."""
    q, k_cache, v_cache, table, seq_lens = paged_case(3, [300, 17, 0, 129], 4, 2, 32, 16)
    outs = [
        attn_triton.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 16, 0.2, max_seq_len=bound)
        for bound in (300, 1024, 4096, None)
    ]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    ref = attn_reference.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 16, 0.2)
    torch.testing.assert_close(outs[0], ref, atol=1e-6, rtol=1e-5)


def test_paged_decode_attention_fp32_ignores_the_16bit_pv_switch():
    """fp32 caches keep their exact P @ V whatever `pv_16bit` says (it rounds only 16-bit caches)."""
    q, k_cache, v_cache, table, seq_lens = paged_case(4, [65, 3, 0, 40], 4, 2, 32, 4)
    args = (q, k_cache, v_cache, table, seq_lens, 4, 0.2)
    plain = attn_triton.paged_decode_attention(*args, partition=32, block_t=16)
    assert torch.equal(attn_triton.paged_decode_attention(*args, partition=32, block_t=16, pv_16bit=True), plain)


def test_paged_decode_attention_start_up_check():
    error = check.paged_decode_attention_error(
        4, 2, 32, 16, torch.float32, "cpu", batches=(1, 3), lengths=(1, 31, 32, 33), partition=32, block_t=16
    )
    assert error < 1e-6


# --- LoRA shrink / expand ----------------------------------------------------------------------


def lora_case(T: int, seed: int, rows=(48, 16, 33), in_features=40, rank=8, ranks=(8, 3, 0, 5), seq_lens=None):
    """Base tokens and adapter slots 0, 1, 3 (slot 3 non-contiguous); slot 2 unused and NaN;
    y's base rows NaN (they must come back bit-identical). `seq_lens`: the 6 segments' lengths
    (base, 0, 3, base, 1, 3), random cuts of T when None."""
    g = torch.Generator().manual_seed(seed)
    present = [[i != 1 or s == 1 for i in range(len(rows))] for s in range(4)]  # some absent slices
    present[2] = [False] * len(rows)
    stack = random_stack(g, in_features, list(rows), 4, rank, ranks=list(ranks), present=present)
    for a, b in zip(stack.a, stack.b, strict=True):
        a[2], b[2] = NAN, NAN
    seq_slots = [-1, 0, 3, -1, 1, 3]
    if seq_lens is None:
        cuts = sorted(torch.randint(0, T + 1, (5,), generator=g).tolist())
        seq_lens = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, T], strict=True)]
    if not any(n for s, n in zip(seq_slots, seq_lens, strict=True) if s >= 0):
        seq_slots = [0] * len(seq_slots)
    batch = LoRABatch.build(seq_slots, seq_lens, "cpu")
    x = torch.randn(T, in_features, generator=g)
    y = torch.randn(T, sum(rows), generator=g)
    y[batch.token_slots < 0] = NAN
    return x, y, stack, batch


def assert_lora_matches(got: torch.Tensor, y0: torch.Tensor, ref: torch.Tensor, batch: LoRABatch) -> None:
    base = batch.token_slots < 0
    assert same_bits(got[base], y0[base])
    scale = float(ref[~base].abs().max()) if (~base).any() else 1.0  # fp32 sums of ~300 terms of size ~10
    torch.testing.assert_close(got[~base], ref[~base], atol=1e-6 * scale, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 257], ids=lambda t: f"T{t}")
def test_lora_triton_equals_grouped(T):
    """Default configuration choice (switches at 128 tokens), absent slices, an unused NaN slot."""
    x, y0, stack, batch = lora_case(T, seed=T)
    ref = grouped_reference(x, y0.clone(), stack, batch)
    assert_lora_matches(check.triton_lora_apply(x, y0.clone(), stack, batch), y0, ref, batch)


KC = lora_triton.KernelConfig
CONFIGS = {
    "small-split3": KC(block_m=16, block_n=64, block_k=32, split_k=3),
    "small-bn128": KC(block_m=16, block_n=128, block_k=128, split_k=2),
    "large": lora_triton.LARGE,
    # several column tiles per program: 96 / 128 columns a program, neither dividing 130
    "np3-bn32-split3": KC(block_m=16, block_n=32, block_k=32, split_k=3, n_per_program=3),
    "np2-shrink-m32": KC(block_m=16, block_n=64, block_k=64, split_k=2, n_per_program=2, shrink_block_m=32),
}


@pytest.mark.parametrize("rank", [8, 16, 32, 64])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_lora_configs_at_tile_boundaries(config, rank):
    """Each configuration on both sides of its M tiles (expand's and shrink's) and of the 64 / 128
    column tiles, every rank."""
    cfg = CONFIGS[config]
    rows = (130, 17)  # 130: past one 128 tile and two 64 tiles; 96 inputs: 3 K splits, 2 K steps of 64
    for T in sorted({cfg.block_m - 1, cfg.block_m + 1, cfg.shrink_m + 1}):  # the adapters' shares straddle too
        x, y0, stack, batch = lora_case(T, seed=rank + T, rows=rows, in_features=96, rank=rank, ranks=(rank, 5, 0, 1))
        ref = grouped_reference(x, y0.clone(), stack, batch)
        got = check.triton_lora_apply(x, y0.clone(), stack, batch, config=cfg)
        assert_lora_matches(got, y0, ref, batch)


@pytest.mark.parametrize("config", ["np3-bn32-split3", "np2-shrink-m32", "large"], ids=str)
def test_lora_slot_counts_straddle_the_m_tiles(config):
    """Slot 0 holds BLOCK_M + 1 tokens, slot 3 exactly BLOCK_M (in two segments), slot 1 BLOCK_M - 1,
    slot 2 none, base tokens between them (for the expand's and then the shrink's M tile). h's rows
    of base tokens are NaN before the expand: it must not read them."""
    cfg = CONFIGS[config]
    for bm in sorted({cfg.block_m, cfg.shrink_m}):
        seq_lens = [3, bm + 1, bm // 2, 2, bm - 1, bm - bm // 2]
        x, y0, stack, batch = lora_case(sum(seq_lens), seed=bm, rows=(130, 17), in_features=96, seq_lens=seq_lens)
        meta = lora_triton.LoRAKernelMeta.build(batch.token_slots, num_slots=4)
        assert meta.counts.tolist() == [bm + 1, bm - 1, 0, bm]
        h = lora_triton.lora_shrink(x, stack.a, meta, cfg)
        h[:, batch.token_slots < 0] = NAN
        got = lora_triton.lora_expand(h, stack.b, stack.offsets, y0.clone(), meta, cfg)
        assert_lora_matches(got, y0, grouped_reference(x, y0.clone(), stack, batch), batch)


@pytest.mark.parametrize("name", lora_triton.SWEEP_CONFIGS, ids=str)
def test_lora_sweep_candidates(name):
    """Every candidate of the GPU sweep equals the reference (rank 16, past both M tiles)."""
    cfg = lora_triton.SWEEP_CONFIGS[name]
    T = max(cfg.block_m, cfg.shrink_m) + 1
    x, y0, stack, batch = lora_case(T, seed=T, rows=(130, 17), in_features=96, rank=16, ranks=(16, 5, 0, 1))
    ref = grouped_reference(x, y0.clone(), stack, batch)
    assert_lora_matches(check.triton_lora_apply(x, y0.clone(), stack, batch, config=cfg), y0, ref, batch)


TILE_MAP_CASES = {
    # name: (token slots, slots)
    "empty": ([], 4),
    "one-base-token": ([-1], 4),
    "one-adapter-token": ([2], 4),
    "all-base": ([-1] * 20, 4),
    "one-slot-all-tokens": ([1] * 37, 4),
    "fewer-tokens-than-slots": ([3, -1, 0], 8),
    "worst-case-bound": ([0, 1, 2] + [3] * 30, 4),  # L - 1 single tokens, one slot of the rest: every tile live
    "interleaved": ([-1, 0, 0, 3, -1, 1, 3, 3, 0, -1] * 7 + [3] * 9, 5),
}


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("case", TILE_MAP_CASES, ids=str)
def test_lora_tile_map_covers_each_adapter_token_once(case, block_m):
    token_slots, L = TILE_MAP_CASES[case]
    slots = torch.tensor(token_slots, dtype=torch.long)
    meta = lora_triton.LoRAKernelMeta.build(slots, num_slots=L)
    tiles = meta.tile_map(block_m)
    assert tiles is meta.tile_map(block_m)  # memoized
    T = len(token_slots)
    assert tiles.dtype == torch.int32 and tiles.shape == (lora_triton.max_tiles(T, L, block_m), 4)
    live = tiles[:, 2] < tiles[:, 3]
    n_live = int(live.sum())
    dead = torch.tensor([[L, 0, 0, 0]], dtype=torch.int32).expand(len(tiles) - n_live, 4)
    assert live[:n_live].all() and torch.equal(tiles[n_live:], dead)  # live tiles first, then empty rows
    order, covered = meta.order.tolist(), []
    expected_tiles = [(s, k) for s in range(L) for k in range(-(-token_slots.count(s) // block_m))]
    assert [tuple(t[:2]) for t in tiles[:n_live].tolist()] == expected_tiles  # slot by slot, in order
    for slot, k, lo, hi in tiles[:n_live].tolist():
        assert lo == int(meta.starts[slot]) + k * block_m and 0 < hi - lo <= block_m
        assert all(token_slots[t] == slot for t in order[lo:hi])
        covered += order[lo:hi]
    assert sorted(covered) == [t for t, s in enumerate(token_slots) if s >= 0]  # each adapter token once
    if case == "worst-case-bound":
        assert n_live == len(tiles)  # the bound is tight


def test_lora_shrink_and_expand_each_equal_the_reference():
    x, y0, stack, batch = lora_case(70, seed=1)
    meta = lora_triton.LoRAKernelMeta.build(batch.token_slots, num_slots=4)
    cfg = CONFIGS["small-split3"]
    h = lora_triton.lora_shrink(x, stack.a, meta, cfg)
    h_ref = lora_reference.lora_shrink(x, stack.a, batch.token_slots)
    adapter = batch.token_slots >= 0
    torch.testing.assert_close(h.sum(0)[adapter], h_ref[adapter], atol=1e-5, rtol=1e-5)
    ref = lora_reference.lora_expand(h_ref, stack.b, stack.offsets, batch.token_slots, y0.clone())
    got = lora_triton.lora_expand(h, stack.b, stack.offsets, y0.clone(), meta, cfg)
    assert_lora_matches(got, y0, ref, batch)


def test_lora_more_slices_than_one_launch_takes():
    rows = (24, 40, 16, 8, 33)  # 5 slices: two launches of up to 4
    x, y0, stack, batch = lora_case(37, seed=2, rows=rows)
    ref = grouped_reference(x, y0.clone(), stack, batch)
    assert_lora_matches(check.triton_lora_apply(x, y0.clone(), stack, batch), y0, ref, batch)


def test_lora_start_up_check():
    assert check.lora_error(64, [48, 16], 64, torch.float32, "cpu", tokens=(1, 128)) < 1e-6
    stacked = check.lora_error(64, [48, 16], 64, torch.float32, "cpu", tokens=(1, 65), kernel=check.stacked_lora_apply)
    assert stacked < 1e-6
    delta_first = check.lora_error(
        64, [48, 16], 64, torch.float32, "cpu", tokens=(1, 129), kernel=check.delta_first_lora_apply
    )
    assert delta_first < 1e-6


def test_lora_expand_takes_a_16_bit_h_as_it_is():
    """The stacked GEMM's h is already 16-bit: the expand's dot takes it and B unconverted (fp32 sums;
    the interpreter runs that form for fp16 only). Unused NaN slots, base rows and column tails as above."""
    half = check.lora_error(
        64, [48, 16, 33], 16, torch.float16, "cpu", tokens=(1, 17, 65), kernel=check.stacked_lora_apply
    )
    assert half < 2e-3
    x, y0, stack, batch = lora_case(17, seed=5)
    L, R, _ = stack.a[0].shape
    h = torch.zeros(2, 17, len(stack.a), L, R, dtype=torch.float16)
    with pytest.raises(ValueError, match="split_k 1"):
        lora_triton.lora_expand(
            h, stack.b, stack.offsets, y0.half(), lora_triton.LoRAKernelMeta.build(batch.token_slots, L)
        )


def stacked_linear(T: int, seed: int) -> tuple[Linear, torch.Tensor, torch.Tensor, LoRABatch]:
    """A Linear whose LoRA A lives under its weight (Linear.stack_lora_a), loaded with lora_case's
    adapters (slot 2 NaN, unused). Returns it, x, the reference output and the batch."""
    x, _, stack, batch = lora_case(T, seed)
    linear = Linear(x.shape[1], {"s0": 48, "s1": 16, "s2": 33})
    linear.weight = torch.nn.Parameter(torch.randn(97, x.shape[1], generator=torch.Generator().manual_seed(seed)))
    weight = linear.weight.detach().clone()
    a = linear.stack_lora_a(4, stack.a[0].shape[1])
    for dst, src in zip(a, stack.a, strict=True):
        dst.copy_(src)
    linear.lora = LoRAStack(a=a, b=stack.b, offsets=stack.offsets, present=stack.present)
    linear.lora_backend = "triton"
    assert torch.equal(linear.weight, weight)  # the weight moved, its values did not
    ref = grouped_reference(x, torch.nn.functional.linear(x, weight), stack, batch)
    return linear, x, ref, batch


@pytest.mark.parametrize("T", [1, 17, 65, 127, 128, 129], ids=lambda t: f"T{t}")
def test_lora_shrink_inside_the_base_gemm_equals_grouped(T):
    """Decode steps' LoRA: one GEMM over [W; A] gives y and every slot's h, the expand reads each
    token's own slot. Eager steps below `lora_stacked_below` and every padded (graph) step take it; an unused
    NaN slot's h is computed for every token and must never be read."""
    linear, x, ref, batch = stacked_linear(T, seed=T)
    device_batch = DeviceLoRABatch(token_slots=batch.token_slots)
    outputs = [linear(x, device_batch)] + ([linear(x, batch)] if T < STACKED_LORA_BELOW else [])
    base = batch.token_slots < 0
    plain = torch.nn.functional.linear(x, linear.stacked_weight)[:, : linear.out_features]
    for y in outputs:
        assert y.shape == ref.shape and y.isfinite().all()
        assert same_bits(y[base], plain[base])  # base rows: the GEMM's own output
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fp8_kernel", ["reference", "triton"])
@pytest.mark.parametrize("T", [1, 17, 127, 128, 129], ids=lambda t: f"T{t}")
def test_fp8_linear_lora_takes_h_from_a_gemm_over_its_tail_and_a(T, fp8_kernel):
    """An FP8 projection (slices s0, s1 in e4m3; s2 its unquantised tail, as the GDN in_proj's b / a
    rows): A is stacked under the tail, and a decode step's FP8 GEMM serves those 16-bit rows in its
    own launch: the tail's outputs and every slot's h after its FP8 columns. Plain and
    producer-quantised inputs (LoRA reads the kept values), device (graph) batches at every size and
    host batches below 128 tokens; longer host steps take the shrink. Equal to the grouped reference
    on the FP8 base output; base rows bit for bit. The FP8 GEMM: the reference, or the Triton kernel."""
    from hylora.ops.fp8_linear import reference as fp8_reference
    from hylora.ops.fp8_linear import triton as fp8_triton

    x, _, stack, batch = lora_case(T, seed=T + 7)
    linear = Linear(x.shape[1], {"s0": 48, "s1": 16, "s2": 33})
    w = torch.randn(97, x.shape[1], generator=torch.Generator().manual_seed(T))
    w8, scale = fp8_reference.quantize_weight(w[:64], (128, 128))
    tail = w[64:].clone()
    linear.set_fp8(w8, scale, (128, 128), tail, torch.float32)
    a = linear.stack_lora_a(4, stack.a[0].shape[1])
    for dst, src in zip(a, stack.a, strict=True):
        dst.copy_(src)
    linear.lora = LoRAStack(a=a, b=stack.b, offsets=stack.offsets, present=stack.present)
    linear.lora_backend = "triton"
    if fp8_kernel == "triton":
        linear.fp8_kernel = fp8_triton.fp8_linear
    assert torch.equal(linear.tail_weight, tail) and linear.tail_weight.data_ptr() == linear.stacked_weight.data_ptr()
    base_out = linear.base(x)
    ref = grouped_reference(x, base_out.clone(), stack, batch)
    quantized = fp8_reference.QuantizedActivation(*fp8_reference.quantize_activation(x), x.dtype, x)
    base = batch.token_slots < 0
    for inputs in (x, quantized):
        device_batch = DeviceLoRABatch(token_slots=batch.token_slots)
        for y in (linear(inputs, device_batch), linear(inputs, batch)):
            assert y.shape == ref.shape and y.isfinite().all()
            assert same_bits(y[base], base_out[base])
            torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 17, 127, 128, 129, 257], ids=lambda t: f"T{t}")
def test_lora_delta_first_equals_grouped(T):
    """Long prefill steps' LoRA: the delta written first (h of the step's slots, zero but each
    token's own, times those slots' B), then the base GEMM accumulating onto it. The unused NaN slot
    is never read, base rows are x Wᵀ, columns of a slice no adapter of the step targets get 0."""
    x, _, stack, batch = lora_case(T, seed=T)
    w = torch.randn(97, x.shape[1], generator=torch.Generator().manual_seed(T))
    ref = grouped_reference(x, torch.nn.functional.linear(x, w), stack, batch)
    meta = lora_triton.LoRAKernelMeta.build(batch.token_slots, 4)
    # (slice 1 is slot 1's alone; "no slice": the step's adapters target none of this linear)
    cases = {"every slice": list(range(3)), "slice 1 left out": [0, 2], "no slice": []}
    for name, used in cases.items():
        a, b, offsets = stack.pick(used)
        want = ref.clone()
        for first, n in [(0, 48), (48, 16), (64, 33)]:  # left-out slices: base only
            if not any(o == (first, n) for o in offsets):
                want[:, first : first + n] = torch.nn.functional.linear(x, w[first : first + n])
        got = lora_triton.lora_apply_delta_first(x, w, a, b, offsets, meta, len(batch.slots))
        assert got.isfinite().all(), name
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=name)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_lora_delta_first_keeps_a_token_overflow_in_its_row():
    """Every token reads the B of every slot its step uses (h 0 for the others): a token whose h
    overflows must spoil its own row only, the other tokens of its adapter and of the others stay
    finite and equal the reference."""
    x, _, stack, batch = lora_case(129, seed=3)
    bad = int((batch.token_slots >= 0).nonzero()[0])  # an adapter token
    x[bad] = 3e38  # x · A overflows to inf in fp32
    w = torch.randn(97, x.shape[1], generator=torch.Generator().manual_seed(3))
    meta = lora_triton.LoRAKernelMeta.build(batch.token_slots, 4)
    got = lora_triton.lora_apply_delta_first(x, w, stack.a, stack.b, stack.offsets, meta, len(batch.slots))
    assert not got[bad].isfinite().all()
    others = torch.arange(x.shape[0]) != bad
    ref = grouped_reference(x[others], torch.nn.functional.linear(x[others], w), stack, lora_subset(batch, others))
    assert got[others].isfinite().all()
    torch.testing.assert_close(got[others], ref, atol=1e-4, rtol=1e-5)


def lora_subset(batch: LoRABatch, rows: torch.Tensor) -> LoRABatch:
    """The batch of `rows`' tokens (each a one-token sequence with its slot)."""
    slots = batch.token_slots[rows].tolist()
    return LoRABatch.build(slots, [1] * len(slots), "cpu")


def test_linear_takes_the_delta_first_from_its_threshold(monkeypatch):
    """Linear.forward: host batches of `delta_first_from` tokens or more take the delta-first path
    (while slots × rank fits DELTA_FIRST_MAX_K), shorter ones the shrink + expand; 0 never takes it;
    same result either way."""
    import hylora.model.layers as layers

    calls = []
    delta_first = lora_triton.lora_apply_delta_first
    monkeypatch.setattr(lora_triton, "lora_apply_delta_first", lambda *args: calls.append(1) or delta_first(*args))
    for T, threshold, taken in [(128, 129, False), (129, 129, True), (300, 129, True), (300, 0, False)]:
        linear, x, ref, batch = stacked_linear(T, seed=T)
        linear.delta_first_from = threshold
        calls.clear()
        torch.testing.assert_close(linear(x, batch), ref, atol=1e-4, rtol=1e-5)
        assert bool(calls) == taken, (T, threshold)
    monkeypatch.setattr(layers, "DELTA_FIRST_MAX_K", 3 * 8 - 1)  # the batch's 3 slots at rank 8: one too many
    linear, x, ref, batch = stacked_linear(300, seed=300)
    linear.delta_first_from = 129
    calls.clear()
    torch.testing.assert_close(linear(x, batch), ref, atol=1e-4, rtol=1e-5)
    assert not calls


# --- bf16 ----------------------------------------------------------------------------------------


def test_bf16_start_up_checks(gpu_bf16):
    """bf16 pools/caches/stacks (the served dtype): each kernel rounds like its reference."""
    bf16 = torch.bfloat16
    assert check.gdn_decode_error(2, 4, 16, 16, 4, bf16, "cpu", batches=(3,), block_v=16) < 1e-4
    attention = check.paged_decode_attention_error(
        4, 2, 32, 16, bf16, "cpu", batches=(3,), lengths=(1, 31, 33), partition=32, block_t=16, pv_16bit=False
    )
    assert attention < 1e-3  # P @ V in tf32x3: exact products
    for block_t in (16, 32):  # P @ V as one 16-bit MMA (p rounded to bf16): within the start-up tolerance
        attention_pv16 = check.paged_decode_attention_error(
            4, 2, 32, 16, bf16, "cpu", batches=(3,), lengths=(1, 31, 33, 70), partition=64, block_t=block_t,
            pv_16bit=True,
        )  # fmt: skip
        assert 0 < attention_pv16 < 1e-2
    assert check.lora_error(64, [48, 16], 16, bf16, "cpu", tokens=(1, 128)) < 1e-3
    assert check.lora_error(64, [48, 16], 16, bf16, "cpu", tokens=(1, 65), kernel=check.stacked_lora_apply) < 1e-2
    assert check.lora_error(64, [48, 16], 16, bf16, "cpu", tokens=(1, 129), kernel=check.delta_first_lora_apply) < 1e-2
    assert check.rms_norm_error(48, 4, 2, 16, 6, 8, 1e-6, bf16, "cpu", tokens=(1, 5), rotary_dim=8) < 1e-2
    assert check.gdn_recurrent_error(2, 4, 16, 16, bf16, "cpu", batches=((3, 1, 17),), block_v=16) < 1e-3


# --- norms and the MLP activation ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 70], ids=lambda t: f"T{t}")
def test_rms_norms_equal_reference(tokens, dtype):
    """Rows straddle the rows-per-program block (64 rows of 64), a row length off the power of two
    (48 → block 64) and the strided head views the attention layer passes."""
    g = torch.Generator().manual_seed(tokens)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    eps, tol = 1e-6, dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    x, res, w = rand(tokens, 48) * 3, rand(tokens, 48), rand(48) * 0.1
    torch.testing.assert_close(norm_triton.rms_norm(x, w, eps), norm_reference.rms_norm(x, w, eps), **tol)
    got, total = norm_triton.rms_norm(x, w, eps, res)
    ref, ref_total = norm_reference.rms_norm(x, w, eps, res)
    torch.testing.assert_close(got, ref, **tol)
    # the residual stream is the same add; bit for bit in fp32 (the interpreter rounds fp32 → bf16
    # toward zero, the GPU to nearest even, so bf16 is compared within its tolerance here)
    assert same_bits(total, ref_total) if dtype == torch.float32 else torch.allclose(total, ref_total, **tol)
    fused = rand(tokens, 3, 2 * 16)  # [T, heads, query | gate]: q is a strided view
    q = fused.chunk(2, dim=-1)[0]
    wh = rand(16)
    torch.testing.assert_close(norm_triton.rms_norm(q, wh, eps), norm_reference.rms_norm(q, wh, eps), **tol)
    for r in (4, 16):  # partial rotary (the rest passed through) and rotary over the whole head
        angles = torch.rand(tokens, r // 2, generator=g) * 100
        rotary = (torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype))
        got = norm_triton.rms_norm(q, wh, eps, rotary=rotary)
        torch.testing.assert_close(got, norm_reference.rms_norm(q, wh, eps, rotary=rotary), **tol)
        assert not torch.allclose(got, norm_triton.rms_norm(q, wh, eps), **tol)  # the rotation did something
    o, z = rand(tokens, 3, 40), rand(tokens, 2 * 120)[:, 120:].reshape(tokens, 3, 40)
    wv = rand(40) + 1
    got = norm_triton.gated_rms_norm(o, z, wv, eps)
    torch.testing.assert_close(got, norm_reference.gated_rms_norm(o, z, wv, eps), **tol)
    assert got.is_contiguous() and got.shape == o.shape


@pytest.mark.parametrize("shape", [(1, 10), (3, 1500), (2, 2048)], ids=str)
def test_silu_mul_equals_reference(shape):
    tokens, inner = shape  # 3 x 1500: the flat index crosses the 2048-element block mid-row
    gate_up = torch.randn(tokens, 2 * inner, generator=torch.Generator().manual_seed(inner)) * 4
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):  # bf16: the interpreter's rounding
        x = gate_up.to(dtype)
        got, ref = silu_triton.silu_mul(x), silu_reference.silu_mul(x)
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


# --- causal conv1d by slot (GDN prefill) ----------------------------------------------------------


@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("lens", [[1], [5, 1, 17, 2], [40, 3]], ids=str)
def test_causal_conv1d_by_slot_equals_reference(lens, kernel):
    """Chunks shorter and longer than the kernel, decode rows mixed in, token and channel blocks
    straddled (block_t 8, block_c 16 over 40 channels); unowned pool slots hold NaN and must stay so."""
    g = torch.Generator().manual_seed(sum(lens) + kernel)
    C, S = 40, len(lens) + 3
    x = torch.randn(sum(lens), C, generator=g)
    weight = torch.randn(C, kernel, generator=g)
    slots = torch.randperm(S, generator=g)[: len(lens)]
    pool = torch.full((S, C, kernel - 1), NAN)
    pool[slots] = torch.randn(len(lens), C, kernel - 1, generator=g)
    ref_pool = pool.clone()
    pool0 = pool.clone()
    ref = conv_reference.causal_conv1d_by_slot(x, weight, ref_pool, slots, lens)
    got = conv_triton.causal_conv1d_by_slot(x, weight, pool, slots, lens, block_t=8, block_c=16)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    # q | k | v groups (widths 12, 12, 16: group edges inside the 16-channel blocks), each contiguous
    split_pool = pool0.clone()
    blocks = dict(block_t=8, block_c=16)
    parts = conv_triton.causal_conv1d_by_slot(x, weight, split_pool, slots, lens, **blocks, splits=(12, 12, 16))
    assert [p.shape for p in parts] == [(sum(lens), n) for n in (12, 12, 16)] and all(p.is_contiguous() for p in parts)
    assert same_bits(torch.cat(parts, dim=1), got) and same_bits(split_pool, pool)
    assert same_bits(pool, ref_pool) or torch.allclose(pool[slots], ref_pool[slots])
    unowned = torch.ones(S, dtype=torch.bool)
    unowned[slots] = False
    assert torch.isnan(pool[unowned]).all()


@pytest.mark.parametrize("blocks", [(8, 16), (16, 256), (32, 8)], ids=str)
def test_causal_conv1d_by_slot_long_chunks_and_a_padded_layout(blocks, monkeypatch):
    """Chunks spanning many token tiles (tiles read from x alone, tiles where a chunk starts mid-tile),
    a chunk shorter than the kernel's K-1 taps, then a padded short step's tail as the device lays it
    out: one-token padding sequences on slot -1 and empty sequences starting at T. The live rows and
    slots equal the reference; the output is written in full (it starts as NaN) and padding writes no
    state (unowned slots stay NaN)."""
    block_t, block_c = blocks
    g = torch.Generator().manual_seed(block_t + block_c)
    K, C, lens = 4, 40, [37, 2, 29, 9]
    live, T_live = len(lens), sum(lens)
    padding, empty = 5, 3
    T, N = T_live + padding, live + padding + empty
    x = torch.randn(T, C + 7, generator=g)[:, :C]  # strided rows, as the in_proj's columns
    weight = torch.randn(C, K, generator=g)
    S = live + 4
    slots = torch.cat([torch.randperm(S, generator=g)[:live], torch.full((padding + empty,), -1)])
    pool = torch.full((S, C, K - 1), NAN)
    pool[slots[:live]] = torch.randn(live, C, K - 1, generator=g)
    ref_pool = pool.clone()
    ref = conv_reference.causal_conv1d_by_slot(x[:T_live], weight, ref_pool, slots[:live], lens)
    seq_lens = lens + [1] * padding + [0] * empty
    starts = torch.tensor([0, *itertools.accumulate(seq_lens)])
    token_seq = torch.repeat_interleave(torch.arange(N, dtype=torch.int32), torch.tensor(seq_lens))
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(NAN))  # every output element is written
    parts = conv_triton.causal_conv1d_by_slot(
        x, weight, pool, slots, seq_lens, block_t=block_t, block_c=block_c, splits=(12, 12, 16),
        layout=(token_seq, starts),
    )  # fmt: skip
    monkeypatch.undo()
    got = torch.cat(parts, dim=1)
    torch.testing.assert_close(got[:T_live], ref, atol=1e-6, rtol=1e-5)
    assert not got.isnan().any()
    assert torch.allclose(pool[slots[:live]], ref_pool[slots[:live]])
    unowned = torch.ones(S, dtype=torch.bool)
    unowned[slots[:live]] = False
    assert torch.isnan(pool[unowned]).all()


def test_decode_attention_switches_reach_the_kernel(gpu_bf16):
    """KernelsConfig's decode attention switches (P @ V in 16 bits, BLOCK_T) are what the model's decode
    attention runs: its bf16 output is the kernel's with them, bit for bit; the defaults (16-bit P @ V,
    32-token steps) and the exact tf32x3 P @ V at 16-token steps give other bits, both within bf16's
    tolerance of the reference; an unknown BLOCK_T is refused."""
    from hylora.kernels import KernelsConfig, model_kernels
    from hylora.kernels.select import fast_verdicts

    q, k_cache, v_cache, table, seq_lens = paged_case(5, [70, 0, 129, 300], 6, 2, 64, 16, dtype=torch.bfloat16)
    q = q.to(torch.bfloat16)
    args = (q, k_cache, v_cache, table, seq_lens, 16, 0.125)
    ref = attn_reference.paged_decode_attention(*args)
    outputs = []
    for config, kernel_args in (
        (KernelsConfig(), dict(pv_16bit=True, block_t=32)),
        (KernelsConfig(decode_attention_pv_16bit=False, decode_attention_block_t=16), dict(pv_16bit=False, block_t=16)),
    ):
        served = model_kernels(fast_verdicts(["paged_decode_attention"]), config).decode_attention(*args)
        assert torch.equal(served, attn_triton.paged_decode_attention(*args, **kernel_args))
        torch.testing.assert_close(served.float(), ref.float(), atol=2e-2, rtol=2e-2)
        outputs.append(served)
    assert not torch.equal(*outputs)
    with pytest.raises(ValueError, match="decode_attention_block_t"):
        KernelsConfig(decode_attention_block_t=8)


@pytest.mark.parametrize(("value", "config"), [("32,8", (32, 8, 1)), ("16,2,4", (16, 2, 4)), ("32,1,0", (32, 1, 0))])
def test_gdn_decode_launch_flag(value, config):
    """--gdn-decode-launch (what bench/kernel_sweep_gpu.py --gdn-best-out writes) reaches every call."""
    from hylora.kernels import KernelsConfig, model_kernels
    from hylora.kernels.config import parse_launch
    from hylora.kernels.select import fast_verdicts

    assert parse_launch(value) == config
    kernels = model_kernels(fast_verdicts(["gdn_decode"]), KernelsConfig(gdn_decode_launch=config))
    assert kernels.gdn_decode.keywords == dict(zip(("block_v", "num_warps", "v_blocks"), config, strict=True))
    assert model_kernels(fast_verdicts(["gdn_decode"])).gdn_decode is gdn_triton.gdn_decode
    with pytest.raises(ValueError):
        parse_launch("32")
    with pytest.raises(ValueError):
        KernelsConfig(gdn_decode_launch=(32, 0, 1))
