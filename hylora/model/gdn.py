"""Gated DeltaNet mixer (the `linear_attn` layers)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hylora import ops
from hylora.cache.state_pool import StatePool
from hylora.config import ModelConfig
from hylora.model.forward_batch import ForwardBatch
from hylora.model.layers import GatedRMSNorm, Linear, _param
from hylora.ops.causal_conv1d.reference import save_conv_states
from hylora.ops.fp8_linear.reference import QuantizedActivation
from hylora.ops.gated_delta_rule.reference import gating
from hylora.ops.gated_delta_rule.reference import recurrent_by_slot as recurrent_by_slot_reference
from hylora.ops.gdn_decode.reference import gdn_decode as gdn_decode_reference
from hylora.ops.varlen import RECURRENT_MAX_TOKENS


class DepthwiseConv(nn.Module):
    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = _param(channels, 1, kernel)  # checkpoint layout of nn.Conv1d(groups=channels)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = c.linear_key_dim, c.linear_value_dim, c.linear_conv_dim
        # the four input projections as one GEMM (model/packing.py): [qkv | z | b | a]
        self.in_proj = Linear(
            c.hidden_size,
            {"in_proj_qkv": c.linear_conv_dim, "in_proj_z": self.value_dim, "in_proj_b": self.hv, "in_proj_a": self.hv},
        )
        self.conv1d = DepthwiseConv(c.linear_conv_dim, c.linear_conv_kernel_dim)
        self.dt_bias = _param(self.hv)
        self.A_log = _param(self.hv)
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, {"out_proj": c.hidden_size})
        # kernels: the torch references until HybridDecoder.use_kernels (model/kernels.py) sets them
        self.delta_rule = ops.varlen_gated_delta_rule
        self.decode_step: Callable[..., torch.Tensor] | None = None  # fused decode step by state slot
        self.conv = ops.causal_conv1d_by_slot  # the prefill conv, conv state in place by slot
        # the delta rule token by token, states in place by slot, for steps whose chunks are all short
        self.short_prefill: Callable[..., torch.Tensor] | None = None
        self.split_single_tokens = False  # leading one-token sequences of an eager step token by token
        self.save_conv_states: Callable[..., None] = save_conv_states  # a verify step's per-token conv states

    def forward(self, x: torch.Tensor, batch: ForwardBatch, states: StatePool) -> torch.Tensor:
        T = x.shape[0]
        layer = states.layer_index[self.layer_idx]
        slots = batch.state_slots
        qkv, z, b, a = self.in_proj(x, batch.lora).split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        if batch.is_decode and (self.decode_step is not None or batch.padded):
            step = self.decode_step or gdn_decode_reference  # both: slot < 0 reads and writes nothing
            weight = self.conv1d.weight[:, 0]
            o = step(qkv, b, a, weight, self.A_log, self.dt_bias, states.conv[layer], states.recurrent[layer], slots)
            return self.output(o, z, batch)

        layout = batch.seq_layout  # a padded short step: the sequences as the device holds them
        starts = layout[1] if layout is not None else None
        if batch.spec_slots is not None:  # a verify step: the conv state after each token, before the conv moves on
            self.save_conv_states(
                qkv, states.conv[layer], slots, batch.seq_lens, batch.spec_slots, starts=starts,
                columns=batch.spec_columns,
            )  # fmt: skip
        # q, k, v as three contiguous tensors: the delta-rule kernels would copy strided views
        splits = (self.key_dim, self.key_dim, self.value_dim)
        w = self.conv1d.weight[:, 0]
        q, k, v = self.conv(qkv, w, states.conv[layer], slots, batch.seq_lens, splits=splits, layout=layout)
        q, k = q.reshape(T, self.hk, self.dk), k.reshape(T, self.hk, self.dk)
        v = v.reshape(T, self.hv, self.dv)

        # token by token (keeping the state after each token for a verify step) when every chunk is short
        # (a padded step's chunk may be as long as its bucket: the kernel has no length limit, a verify
        # step's chunks are bounded by the spec-slot columns the short step keeps)
        if batch.spec_slots is not None or layout is not None:
            if batch.spec_slots is not None and max(batch.seq_lens) > RECURRENT_MAX_TOKENS:
                raise ValueError(f"a verify step's chunks must be at most {RECURRENT_MAX_TOKENS} tokens")
            recurrent = self.short_prefill or recurrent_by_slot_reference
            o = recurrent(
                q, k, v, b, a, self.A_log, self.dt_bias, states.recurrent[layer], slots, batch.seq_lens,
                self.dk**-0.5, spec_slots=batch.spec_slots, starts=starts,
            )  # fmt: skip
        elif self.short_prefill is not None and max(batch.seq_lens) <= RECURRENT_MAX_TOKENS:
            o = self.short_prefill(
                q, k, v, b, a, self.A_log, self.dt_bias, states.recurrent[layer], slots, batch.seq_lens, self.dk**-0.5
            )
        else:
            n = leading_single_tokens(batch.seq_lens) if self.split_single_tokens else 0
            if n:  # (decode rows with prompt chunks: the scheduler puts running requests first)
                recurrent = self.short_prefill or recurrent_by_slot_reference
                single = recurrent(
                    q[:n], k[:n], v[:n], b[:n], a[:n], self.A_log, self.dt_bias, states.recurrent[layer], slots[:n],
                    batch.seq_lens[:n], self.dk**-0.5,
                )  # fmt: skip
                chunked = self._chunked(q[n:], k[n:], v[n:], b[n:], a[n:], states, layer, slots[n:], batch.seq_lens[n:])
                o = torch.cat([single, chunked])
            else:
                o = self._chunked(q, k, v, b, a, states, layer, slots, batch.seq_lens)
        return self.output(o, z, batch)

    def _chunked(
        self,
        q: torch.Tensor,  # [T, Hk, dk]
        k: torch.Tensor,
        v: torch.Tensor,  # [T, Hv, dv]
        b: torch.Tensor,  # [T, Hv]
        a: torch.Tensor,
        states: StatePool,
        layer: int,
        slots: torch.Tensor,  # [N]
        seq_lens: list[int],
    ) -> torch.Tensor:
        """The chunked delta rule over whole sequences, each starting from its slot's state, which it
        then holds the sequence's final state. o [T, Hv, dv]."""
        g, beta = gating(b, a, self.A_log, self.dt_bias)  # [T, Hv] each
        initial = states.recurrent[layer, slots]
        o, recurrent = self.delta_rule(q, k, v, g, beta, initial, seq_lens, self.dk**-0.5)
        # index_copy_ on the layer's view: 41 against 59 µs for 16 states (run 39 a)
        states.recurrent[layer].index_copy_(0, slots, recurrent.to(states.recurrent.dtype))
        return o

    def output(self, o: torch.Tensor, z: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """out_proj(gated norm of the heads o [T, Hv, dv] by z), the norm quantised for an FP8 out_proj."""
        T = o.shape[0]
        normed = self.norm(o, z.reshape(T, self.hv, self.dv), quantize_for=self.out_proj, lora=batch.lora)
        if isinstance(normed, QuantizedActivation):  # already [T, value_dim] rows
            return self.out_proj(normed, batch.lora)
        return self.out_proj(normed.reshape(T, self.value_dim), batch.lora)


def leading_single_tokens(seq_lens: list[int]) -> int:
    """How many sequences of one token lead the step, when longer ones follow (0 otherwise)."""
    n = 0
    while n < len(seq_lens) and seq_lens[n] == 1:
        n += 1
    return n if n < len(seq_lens) else 0
