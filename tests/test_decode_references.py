"""The references of the fast decode kernels equal hylora's existing paths (no Triton needed):

- gdn_decode == causal_conv1d_varlen + the gating of model/gdn.py + varlen_gated_delta_rule on
  one-token sequences, and == the GatedDeltaNet layer itself (fp32 and bf16);
- paged_decode_attention == the decode rows of ops.paged_attention;
- ops.lora's shrink/expand == the grouped LoRA reference.
Padding rows (slot < 0, length 0) read nothing, write nothing and output zeros; unowned pool
slots and KV pages hold NaN so that any read of them shows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylora import ops
from hylora.cache.state_pool import StatePool
from hylora.config import ModelConfig
from hylora.lora import LoRABatch
from hylora.model.forward_batch import ForwardBatch
from hylora.model.gdn import GatedDeltaNet
from hylora.ops.gdn_decode.reference import gdn_decode
from hylora.ops.lora import reference as lora_reference
from hylora.ops.paged_decode_attention.reference import paged_decode_attention
from tests.conftest import text_config
from tests.decode_helpers import gdn_inputs, paged_case, same_bits
from tests.lora_helpers import grouped_reference, random_stack


@pytest.mark.parametrize("group", [1, 2, 3])
def test_gdn_decode_equals_conv_gating_and_varlen_delta_rule(group):
    hk, dk, dv, N = 2, 16, 8, 5
    hv = hk * group
    args, conv, recurrent, slots = gdn_inputs(N, hk, hv, dk, dv, seed=group, padding=(1, 4))
    conv0, rec0 = conv.clone(), recurrent.clone()
    o = gdn_decode(**args, conv_state=conv, recurrent_state=recurrent, slots=slots, out=torch.full((N, hv, dv), 1.0))

    live = slots >= 0
    idx, n = slots[live], int(live.sum())
    mixed, conv_new = ops.causal_conv1d_varlen(args["qkv"][live], args["conv_weight"], conv0[idx], [1] * n)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    beta = args["b"][live].sigmoid()
    g = -args["A_log"].float().exp() * F.softplus(args["a"][live].float() + args["dt_bias"])
    o_ref, rec_new = ops.varlen_gated_delta_rule(
        q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g, beta, rec0[idx], [1] * n, dk**-0.5
    )
    torch.testing.assert_close(o[live], o_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(o[~live], torch.zeros_like(o[~live]))  # padding rows: zeros
    torch.testing.assert_close(conv[idx], conv_new, atol=0, rtol=0)
    torch.testing.assert_close(recurrent[idx], rec_new, atol=1e-6, rtol=1e-6)
    unowned = torch.ones(len(conv), dtype=torch.bool)
    unowned[idx] = False
    assert same_bits(conv[unowned], conv0[unowned]) and same_bits(recurrent[unowned], rec0[unowned])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gdn_decode_equals_the_model_layer(dtype):
    """The GatedDeltaNet layer's own forward on a decode batch vs in_proj → gdn_decode → norm → out_proj."""
    config = ModelConfig.from_hf({"model_type": "qwen3_5_text", **text_config()})
    layer_idx = config.gdn_layers[0]
    g = torch.Generator().manual_seed(0)
    layer = GatedDeltaNet(config, layer_idx)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name == "dt_bias" else 0.2))
        layer.A_log.copy_(torch.empty(config.linear_num_value_heads).uniform_(0.01, 4.0, generator=g).log())
    layer = layer.to(dtype)
    N, slots = 3, torch.tensor([4, 0, 2])
    pool = StatePool(config, num_slots=5, dtype=dtype, device="cpu")
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=g) * 0.1)
    x = torch.randn(N, config.hidden_size, generator=g).to(dtype)
    batch = ForwardBatch(
        input_ids=torch.zeros(N, dtype=torch.long),
        positions=torch.zeros(3, N, dtype=torch.long),
        seq_lens=[1] * N,
        context_lens=[5] * N,
        state_slots=slots,
        block_table=torch.zeros(N, 1, dtype=torch.int32),
        kv_slot_mapping=torch.zeros(N, dtype=torch.long),
        page_size=16,
    )
    li = pool.layer_index[layer_idx]
    conv, recurrent = pool.conv[li].clone(), pool.recurrent[li].clone()
    with torch.no_grad():
        y_ref = layer(x, batch, pool)
        qkv, z, b, a = layer.in_proj(x).split([layer.conv_dim, layer.value_dim, layer.hv, layer.hv], dim=-1)
        o = gdn_decode(qkv, b, a, layer.conv1d.weight[:, 0], layer.A_log, layer.dt_bias, conv, recurrent, slots)
        y = layer.out_proj(layer.norm(o, z.reshape(N, layer.hv, layer.dv)).reshape(N, -1))
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(conv, pool.conv[li], atol=0, rtol=0)
    torch.testing.assert_close(recurrent, pool.recurrent[li], **tol)


def test_gdn_decode_all_padding_touches_nothing():
    args, conv, recurrent, slots = gdn_inputs(3, 1, 2, 8, 8, seed=3, padding=(0, 1, 2))
    conv0, rec0 = conv.clone(), recurrent.clone()
    o = gdn_decode(**args, conv_state=conv, recurrent_state=recurrent, slots=slots)
    assert torch.equal(o, torch.zeros_like(o))
    assert same_bits(conv, conv0) and same_bits(recurrent, rec0)


@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=lambda h: f"H{h[0]}kv{h[1]}")
def test_paged_decode_equals_paged_attention_decode_rows(heads, page_size):
    lens = [1, 2, 16, 17, 33, 0, 64, 5]
    q, k_cache, v_cache, table, seq_lens = paged_case(page_size, lens, *heads, 32, page_size)
    out = paged_decode_attention(q, k_cache, v_cache, table, seq_lens, page_size, 32**-0.5)
    live = [i for i, n in enumerate(lens) if n]
    ref = ops.paged_attention(
        q[live], k_cache, v_cache, table[live], [lens[i] - 1 for i in live], [1] * len(live), page_size, 32**-0.5
    )
    torch.testing.assert_close(out[live], ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(out[5], torch.zeros_like(out[5]))  # padding row: zeros, not NaN
    assert torch.isfinite(out).all()


def test_paged_decode_all_padding_is_zero():
    q, k_cache, v_cache, table, seq_lens = paged_case(0, [0, 0], 2, 1, 16, 4)
    out = paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 4, 0.25, out=torch.full_like(q, float("nan")))
    assert torch.equal(out, torch.zeros_like(q))


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 127, 128, 129, 257], ids=lambda t: f"T{t}")
def test_lora_reference_equals_grouped(T):
    g = torch.Generator().manual_seed(T)
    rows = [48, 16, 33]
    present = [[True, False, True], [True, True, True], [False, False, False], [False, True, True]]
    stack = random_stack(g, 40, rows, 4, 8, ranks=[8, 3, 0, 5], present=present)
    seq_slots = [-1, 0, 3, -1, 1, 0]
    cuts = sorted(torch.randint(0, T + 1, (5,), generator=g).tolist())
    seq_lens = [b - a for a, b in zip([0, *cuts], [*cuts, T], strict=True)]
    x = torch.randn(T, 40, generator=g)
    base = torch.randn(T, sum(rows), generator=g)
    batch = LoRABatch.build(seq_slots, seq_lens, "cpu")
    ref = grouped_reference(x, base.clone(), stack, batch)
    got = lora_reference.lora_apply(x, base.clone(), stack.a, stack.b, stack.offsets, batch.token_slots)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    base_rows = batch.token_slots == -1
    assert same_bits(got[base_rows], base[base_rows])
