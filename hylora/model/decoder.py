"""The hybrid text decoder: embeddings, [GDN | gated attention] + MLP blocks, final norm, lm_head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hylora.cache.paged_kv import PagedKVCache
from hylora.cache.state_pool import StatePool
from hylora.config import LINEAR, ConfigError, ModelConfig
from hylora.model.attention import GatedAttention
from hylora.model.forward_batch import ForwardBatch
from hylora.model.gdn import GatedDeltaNet
from hylora.model.kernels import ModelKernels, install
from hylora.model.layers import MLP, RMSNorm, _param
from hylora.model.mtp import MTPHead
from hylora.model.rotary import MRotaryEmbedding
from hylora.model.vision import VisionTower
from hylora.ops.logits_scan import ALL_FINITE


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, layer_type: str | None = None):
        """`layer_type` None: the config's type of layer `layer_idx` (the MTP layer gives its own)."""
        super().__init__()
        self.is_linear = (layer_type or config.layer_types[layer_idx]) == LINEAR
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
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        kv: PagedKVCache,
        states: StatePool,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it); the next layer (or the final norm)
        adds the two inside its norm. `residual` None: `x` is the embedding, the stream itself."""
        # an FP8 projection behind a norm may take the norm quantised in the norm's launch
        mixer_in = self.linear_attn.in_proj if self.is_linear else self.self_attn.qkv_proj
        if residual is None:
            h, residual = self.input_layernorm(x, quantize_for=mixer_in, lora=batch.lora), x
        else:
            h, residual = self.input_layernorm(x, residual, quantize_for=mixer_in, lora=batch.lora)
        if self.is_linear:
            h = self.linear_attn(h, batch, states)
        else:
            h = self.self_attn(h, batch, kv, cos, sin)
        h, residual = self.post_attention_layernorm(h, residual, quantize_for=self.mlp.gate_up_proj, lora=batch.lora)
        return self.mlp(h, batch.lora), residual


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = _param(vocab, hidden)


class HybridDecoder(nn.Module):
    """Parameter names follow the checkpoint's text keys with the `model.` /
    `model.language_model.` prefix removed (`layers.3.self_attn.q_proj.weight`, `lm_head.weight`);
    the optional vision tower's are its keys with `model.` removed (`visual.blocks.0.attn.qkv.weight`).

    The tower is not run by `forward`: a request's media are encoded once (`visual(...)`), and the
    rows of its placeholder tokens reach the decoder as embedding overrides in the ForwardBatch."""

    def __init__(self, config: ModelConfig, vision: bool = False, mtp: bool = False):
        """`mtp`: also build the checkpoint's multi-token-prediction layer (`mtp.*`, the draft
        model of speculative decoding; model/mtp.py)."""
        super().__init__()
        self.config = config
        if vision and config.vision is None:
            raise ConfigError("vision=True needs a config with a vision tower")
        if vision and config.vision.out_hidden_size != config.hidden_size:
            raise ConfigError(
                f"vision out_hidden_size {config.vision.out_hidden_size} != text hidden_size {config.hidden_size}"
            )
        self.visual = VisionTower(config.vision) if vision else None
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Embedding(config.vocab_size, config.hidden_size)
        if mtp and config.mtp_num_hidden_layers < 1:
            raise ConfigError("mtp=True needs a checkpoint with an MTP layer (mtp_num_hidden_layers >= 1)")
        self.mtp = MTPHead(config) if mtp else None
        self.rotary: MRotaryEmbedding | None = None
        self.kernels = ModelKernels()  # the torch references until the kernel floor chooses

    def use_kernels(self, kernels: ModelKernels) -> None:
        """Run every layer with `kernels` (chosen by hylora.kernels after their start-up checks)."""
        install(self, kernels)
        self.kernels = kernels

    @property
    def kv_layers(self) -> list[int]:
        """Layer ids with a KV cache: the attention layers, then the MTP layers when built."""
        return self.config.attention_layers + (self.mtp.layer_ids if self.mtp is not None else [])

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, batch: ForwardBatch, kv: PagedKVCache, states: StatePool) -> torch.Tensor:
        """Returns the final-norm hidden states [T, hidden] of every new token."""
        x = F.embedding(batch.input_ids, self.embed_tokens.weight)
        if batch.embed_rows is not None:
            x = x.index_copy(0, batch.embed_rows, batch.embed_values.to(x.dtype))
        cos, sin = self._cos_sin(batch, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, kv, states, cos, sin)
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)

    def draft(
        self, batch: ForwardBatch, hidden: torch.Tensor, kv: PagedKVCache, states: StatePool, step: int = 0
    ) -> torch.Tensor:
        """The MTP layer over `batch` (row t: the token after position t, `hidden` [T, H] at t);
        returns its output hidden states [T, H] (`logits` gives the drafts' logits)."""
        if self.mtp is None:
            raise RuntimeError("this model was built without its MTP layer (HybridDecoder(..., mtp=True))")
        embeds = F.embedding(batch.input_ids, self.embed_tokens.weight)
        cos, sin = self._cos_sin(batch, embeds.dtype)
        return self.mtp(embeds, hidden.to(embeds.dtype), batch, kv, states, cos, sin, step)

    def _cos_sin(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary is None:  # built on first use, on the weights' device
            self.rotary = MRotaryEmbedding(self.config, self.device)
        return self.rotary.cos_sin(batch.positions, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight).float()

    def finite_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] fp32 → [N] bool: every logit of the row is finite (one pass of the logits scan)."""
        return self.kernels.logits_scan(logits)[1] == ALL_FINITE
