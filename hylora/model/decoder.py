"""The hybrid text decoder: embeddings, [GDN | gated attention] + MLP blocks, final norm, lm_head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hylora.cache.paged_kv import PagedKVCache
from hylora.cache.state_pool import StatePool
from hylora.config import LINEAR, ModelConfig
from hylora.model.attention import GatedAttention
from hylora.model.forward_batch import ForwardBatch
from hylora.model.gdn import GatedDeltaNet
from hylora.model.layers import MLP, RMSNorm, _param
from hylora.model.rotary import MRotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_linear = config.layer_types[layer_idx] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = GatedAttention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: PagedKVCache,
        states: StatePool,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, batch, states)
        else:
            h = self.self_attn(h, batch, kv, cos, sin)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), batch.lora)


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = _param(vocab, hidden)


class HybridDecoder(nn.Module):
    """Parameter names follow the checkpoint's text keys with the `model.` /
    `model.language_model.` prefix removed (`layers.3.self_attn.q_proj.weight`, `lm_head.weight`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Embedding(config.vocab_size, config.hidden_size)
        self.rotary: MRotaryEmbedding | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, batch: ForwardBatch, kv: PagedKVCache, states: StatePool) -> torch.Tensor:
        """Returns the final-norm hidden states [T, hidden] of every new token."""
        if self.rotary is None:
            self.rotary = MRotaryEmbedding(self.config, self.device)
        x = F.embedding(batch.input_ids, self.embed_tokens.weight)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, batch, kv, states, cos, sin)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight).float()
