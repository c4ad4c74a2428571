"""Gated full attention (the `self_attn` layers): output = o_proj(attn * sigmoid(gate))."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hylora import ops
from hylora.cache.paged_kv import PagedKVCache
from hylora.config import ModelConfig
from hylora.model.forward_batch import ForwardBatch
from hylora.model.layers import Linear, RMSNorm
from hylora.ops.fp8_linear.reference import QuantizedActivation
from hylora.ops.output_gate.reference import output_gate
from hylora.ops.paged_decode_attention.reference import paged_decode_attention as paged_decode_attention_reference


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # one GEMM for [q_proj | k_proj | v_proj]; q_proj rows per head: [query | gate]
        self.q_rows, self.kv_rows = self.heads * self.head_dim * 2, self.kv_heads * self.head_dim
        self.qkv_proj = Linear(c.hidden_size, {"q_proj": self.q_rows, "k_proj": self.kv_rows, "v_proj": self.kv_rows})
        self.o_proj = Linear(self.heads * self.head_dim, {"o_proj": c.hidden_size})
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        # decode attention over the block table (ops.paged_decode_attention), when one passed its check
        self.decode_attention: Callable[..., torch.Tensor] | None = None
        # prefill attention over the paged cache: the fp32 reference, or ops.attention.flash once checked
        self.prefill_attention: Callable[..., torch.Tensor] = ops.paged_attention
        # o * sigmoid(gate), the o_proj's input (ops.output_gate); and the same quantised for an FP8 o_proj
        # in that launch, set by the kernel floor with fused quantisation (None: the GEMM quantises it)
        self.output_gate: Callable[..., torch.Tensor] = output_gate
        self.output_gate_quantized: Callable[..., QuantizedActivation] | None = None

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x, batch.lora).split([self.q_rows, self.kv_rows, self.kv_rows], dim=-1)
        q, gate = q.reshape(T, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q, rotary=(cos, sin))  # norm + rotary in one kernel (ops.rmsnorm)
        k = self.k_norm(k.reshape(T, self.kv_heads, self.head_dim), rotary=(cos, sin))
        v = v.reshape(T, self.kv_heads, self.head_dim)

        layer = kv.layer_index[self.layer_idx]
        kv.k[layer].index_copy_(0, batch.kv_slot_mapping, k.to(kv.k.dtype))  # no host sync, graph-safe
        kv.v[layer].index_copy_(0, batch.kv_slot_mapping, v.to(kv.v.dtype))
        if batch.attends_by_row and (self.decode_attention is not None or batch.padded):
            attend = self.decode_attention or paged_decode_attention_reference  # both: length 0 gives zeros
            o = attend(
                q, kv.k[layer], kv.v[layer], batch.block_table, batch.decode_lens, batch.page_size,
                self.head_dim**-0.5, max_seq_len=batch.max_decode_len,
            )  # fmt: skip
            return self._project_out(o, gate, batch)
        o = self.prefill_attention(
            q,
            kv.k[layer],
            kv.v[layer],
            batch.block_table,
            batch.context_lens,
            batch.seq_lens,
            batch.page_size,
            self.head_dim**-0.5,
        )
        return self._project_out(o, gate, batch)

    def _project_out(self, o: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """o_proj(o * sigmoid(gate)): o the attention's output, gate [T, H, d] (a view of the qkv output)."""
        o = o.reshape(gate.shape)
        if self.output_gate_quantized is not None and self.o_proj.is_fp8:
            keep = self.o_proj.needs_input_values(batch.lora)  # the o_proj's LoRA reads the gated values
            x = self.output_gate_quantized(o, gate, self.o_proj.quant_block[1], keep)
            return self.o_proj(x, batch.lora)
        return self.o_proj(self.output_gate(o, gate), batch.lora)
