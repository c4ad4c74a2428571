"""The start-up checks of the fast kernels accept a kernel equal to the reference and reject wrong,
NaN, lazy (output left unwritten) and trespassing (foreign memory written) ones. Torch stand-ins
play the kernels, so this runs without Triton."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hylora.ops import fast_kernel_check as check
from hylora.ops.gdn_decode.reference import gdn_decode
from hylora.ops.lora import reference as lora_reference
from hylora.ops.paged_decode_attention.reference import paged_decode_attention

GDN = (2, 4, 8, 8, 4, torch.float32, "cpu")  # hk, hv, dk, dv, conv kernel, dtype, device
ATTN = (4, 2, 16, 4, torch.float32, "cpu")  # heads, kv heads, head_dim, page size
LORA = (32, [24, 8], 8, torch.float32, "cpu")  # in_features, slice rows, rank


def gdn_error(kernel) -> float:
    return check.gdn_decode_error(*GDN, batches=(1, 3, 8), kernel=kernel)


def attention_error(kernel) -> float:
    return check.paged_decode_attention_error(*ATTN, batches=(1, 3, 8), lengths=(1, 5, 17, 40), kernel=kernel)


def test_gdn_check():
    assert gdn_error(gdn_decode) == 0.0

    def leaves_a_row_unwritten(*args, out, **kw):
        o = gdn_decode(*args, **kw)
        out.copy_(o)
        out[0, 0, 0] = float("nan")
        return out

    def writes_a_foreign_slot(qkv, b, a, w, A_log, dt_bias, conv, recurrent, slots, out):
        gdn_decode(qkv, b, a, w, A_log, dt_bias, conv, recurrent, slots, out=out)
        recurrent[torch.isnan(recurrent[:, 0, 0, 0])] = 0.0  # scrubs slots it does not own
        return out

    def swapped_value_heads(qkv, b, a, w, A_log, dt_bias, conv, recurrent, slots, out):
        return gdn_decode(qkv, b.flip(1), a.flip(1), w, A_log, dt_bias, conv, recurrent, slots, out=out)

    def new_buffer(*args, out, **kw):
        return gdn_decode(*args, **kw)

    assert gdn_error(leaves_a_row_unwritten) == check.FAILED
    assert gdn_error(writes_a_foreign_slot) == check.FAILED
    assert gdn_error(new_buffer) == check.FAILED
    assert gdn_error(swapped_value_heads) > 0.05


def test_attention_check():
    assert attention_error(paged_decode_attention) == 0.0

    def nan_padding_row(q, k, v, table, lens, page_size, scale, out):
        paged_decode_attention(q, k, v, table, lens, page_size, scale, out=out)
        out[lens == 0] = float("nan")
        return out

    def reads_past_the_length(q, k, v, table, lens, page_size, scale, out):
        return paged_decode_attention(q, k, v, table, lens + 1, page_size, scale, out=out)

    def wrong_scale(q, k, v, table, lens, page_size, scale, out):
        return paged_decode_attention(q, k, v, table, lens, page_size, 2 * scale, out=out)

    assert attention_error(nan_padding_row) == check.FAILED
    assert attention_error(reads_past_the_length) == check.FAILED  # NaN page
    assert attention_error(wrong_scale) > 0.05


def test_lora_check():
    tokens = (1, 64, 65, 129)
    assert check.lora_error(*LORA, tokens=tokens, kernel=lora_reference.lora_apply) < 1e-6

    def touches_base_rows(x, y, stack, batch):
        lora_reference.lora_apply(x, y, stack, batch)
        y[batch.token_slots < 0] = 0.0
        return y

    def drops_slot_1(x, y, stack, batch):
        slots = batch.token_slots.clone()
        slots[slots == 1] = -1
        h = lora_reference.lora_shrink(x, stack.a, slots)
        return lora_reference.lora_expand(h, stack.b, stack.offsets, slots, y)

    assert check.lora_error(*LORA, tokens=tokens, kernel=touches_base_rows) == check.FAILED
    assert check.lora_error(*LORA, tokens=tokens, kernel=drops_slot_1) > 0.05


def test_selection_without_cuda_keeps_the_references():
    choice = check.select_fast_kernels(SimpleNamespace(device=torch.device("cpu")), page_size=16)
    assert set(choice) == set(check.FAST_KERNELS)
    assert all(v.startswith("reference") for v in choice.values())


def test_verdict():
    assert check._verdict("x", lambda: 1e-7, 1e-4).startswith("triton")
    assert check._verdict("x", lambda: float("nan"), 1e-4).startswith("reference")
    assert check._verdict("x", lambda: 1.0, 1e-4).startswith("reference")

    def fails():
        raise RuntimeError("no sm_90 here")

    assert "no sm_90 here" in check._verdict("x", fails, 1e-4)


NORM = (48, 4, 2, 16, 6, 8, 1e-6, torch.float32, "cpu")  # hidden, heads, kv heads, head_dim, hv, dv, eps


def test_norm_and_activation_checks():
    from hylora.ops.rmsnorm.reference import gated_rms_norm, rms_norm
    from hylora.ops.silu_mul.reference import silu_mul

    tokens = (1, 5, 33)
    assert check.rms_norm_error(*NORM, tokens=tokens, kernels=(rms_norm, gated_rms_norm)) == 0.0
    assert check.silu_mul_error(24, torch.float32, "cpu", tokens=tokens, kernel=silu_mul) == 0.0

    def no_weight(x, w, eps, residual=None, rotary=None):  # forgets the (1 + w) scale
        return rms_norm(x, torch.zeros_like(w), eps, residual, rotary=rotary)

    def contiguous_only(x, w, eps, residual=None, rotary=None):  # reads strided heads as if they were dense
        flat = torch.as_strided(x, x.shape, x.contiguous().stride()) if x.ndim == 3 else x
        return rms_norm(flat, w, eps, residual, rotary=rotary)

    def drops_residual(x, w, eps, residual=None, rotary=None):
        return rms_norm(x, w, eps, rotary=rotary) if residual is None else (rms_norm(x, w, eps), x)

    def rotates_the_wrong_half(x, w, eps, residual=None, rotary=None):
        if rotary is None:
            return rms_norm(x, w, eps, residual)
        cos, sin = rotary
        return rms_norm(x, w, eps, rotary=(cos, -sin))

    def nan_tail(gate_up):
        out = silu_mul(gate_up)
        out[-1, -1] = float("nan")
        return out

    for bad in (no_weight, contiguous_only, drops_residual, rotates_the_wrong_half):
        assert check.rms_norm_error(*NORM, tokens=tokens, kernels=(bad, gated_rms_norm)) > 0.05, bad.__name__
    assert check.rms_norm_error(*NORM, tokens=tokens, kernels=(rms_norm, lambda x, z, w, e: x)) > 0.05
    assert check.silu_mul_error(24, torch.float32, "cpu", tokens=tokens, kernel=nan_tail) == check.FAILED


def test_prefill_attention_check():
    from hylora.ops.attention import flash
    from hylora.ops.attention.reference import paged_attention

    attn = (4, 2, 16, 4, torch.float32, "cpu")  # heads, kv heads, head_dim, page size
    assert check.prefill_attention_error(*attn, kernel=paged_attention) == 0.0
    assert check.prefill_attention_error(*attn, kernel=flash.paged_attention) < 1e-5  # CPU SDPA, fp32

    def top_left_causal(q, k_cache, v_cache, table, ctx, lens, page_size, scale):  # forgets the cached prefix
        return paged_attention(q, k_cache, v_cache, table, [0] * len(ctx), lens, page_size, scale)

    assert check.prefill_attention_error(*attn, kernel=top_left_causal) > 0.05


def test_causal_conv1d_check():
    from hylora.ops.causal_conv1d.reference import causal_conv1d_by_slot

    conv = (12, 4, torch.float32, "cpu")
    batches = ((1,), (2, 1, 3, 9))
    assert check.causal_conv1d_error(*conv, batches=batches, kernel=causal_conv1d_by_slot) == 0.0

    def forgets_state(x, w, pool, slots, lens, splits=None):  # treats every chunk as a sequence start
        pool[slots] = 0.0
        return causal_conv1d_by_slot(x, w, pool, slots, lens, splits=splits)

    def writes_everywhere(x, w, pool, slots, lens, splits=None):
        out = causal_conv1d_by_slot(x, w, pool, slots, lens, splits=splits)
        pool[torch.isnan(pool)] = 0.0
        return out

    def strided_splits(x, w, pool, slots, lens, splits=None):  # views of one [T, C] output
        out = causal_conv1d_by_slot(x, w, pool, slots, lens)
        return out if splits is None else out.split(list(splits), dim=-1)

    assert check.causal_conv1d_error(*conv, batches=batches, kernel=forgets_state) > 0.05
    assert check.causal_conv1d_error(*conv, batches=batches, kernel=writes_everywhere) == check.FAILED
    assert check.causal_conv1d_error(*conv, batches=batches, kernel=strided_splits) == check.FAILED


def test_verdict_names_what_runs():
    assert check._verdict("prefill_attention", lambda: 1e-4, 2e-2).startswith("flash (max rel. error")


def test_gdn_recurrent_check():
    from hylora.ops.gated_delta_rule.reference import recurrent_by_slot

    def error(kernel) -> float:
        return check.gdn_recurrent_error(2, 4, 8, 8, torch.float32, "cpu", batches=((1,), (3, 0, 9, 1)), kernel=kernel)

    def into(out, o):
        out.copy_(o)
        return out

    def leaves_a_token_unwritten(*args, out):
        into(out, recurrent_by_slot(*args))[-1, 0, 0] = float("nan")
        return out

    def writes_a_foreign_slot(q, k, v, b, a, A_log, dt_bias, pool, slots, lens, scale, out):
        into(out, recurrent_by_slot(q, k, v, b, a, A_log, dt_bias, pool, slots, lens, scale))
        pool[torch.isnan(pool[:, 0, 0, 0])] = 0.0
        return out

    def forgets_the_state(
        q, k, v, b, a, A_log, dt_bias, pool, slots, lens, scale, out
    ):  # as if each chunk began a prompt
        pool[slots] = 0.0
        return into(out, recurrent_by_slot(q, k, v, b, a, A_log, dt_bias, pool, slots, lens, scale))

    def contiguous_gates(q, k, v, b, a, A_log, dt_bias, pool, slots, lens, scale, out):  # b, a read with a wrong stride
        b, a = (torch.as_strided(x, x.shape, (x.shape[1], 1)) for x in (b, a))
        return into(out, recurrent_by_slot(q, k, v, b, a, A_log, dt_bias, pool, slots, lens, scale))

    def new_buffer(*args, out):
        return recurrent_by_slot(*args)

    assert error(lambda *args, out: into(out, recurrent_by_slot(*args))) == 0.0
    assert error(leaves_a_token_unwritten) == check.FAILED
    assert error(writes_a_foreign_slot) == check.FAILED
    assert error(new_buffer) == check.FAILED
    assert error(forgets_the_state) > 0.05
    assert error(contiguous_gates) > 0.05
