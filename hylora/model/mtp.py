"""The checkpoint's multi-token-prediction (MTP) layer: the draft model of speculative decoding.

Checkpoint keys `mtp.*` (top level in the VL and the text checkpoints alike):

    mtp.pre_fc_norm_embedding.weight   [H]      zero-centred RMSNorms, as the decoder's
    mtp.pre_fc_norm_hidden.weight      [H]
    mtp.fc.weight                      [H, 2H]  over [norm(embed(token)), norm(hidden)]
    mtp.layers.{i}.*                            full-attention decoder layers (gated attention, dense MLP)
    mtp.norm.weight                    [H]

The embedding and lm_head are the decoder's. At position t the layer takes the decoder's final-norm
hidden state h_t and the embedding of token t+1 and predicts token t+2; its own attention layer keeps
a KV cache over those rows (in the decoder's pages, as an extra attention layer). Further drafts feed
the layer its own output (after `mtp.norm`) with the draft just made, at the next position. Every
draft reuses layer 0 when there are fewer layers than drafts (vLLM does the same).

The layer always runs on the base weights: an adapter changes what the verify step accepts, never
what is output (docs/SERVING.md, "Speculative decoding").
"""

from __future__ import annotations

import torch
from torch import nn

from hylora.cache.paged_kv import PagedKVCache
from hylora.cache.state_pool import StatePool
from hylora.config import FULL, ModelConfig
from hylora.model.forward_batch import ForwardBatch
from hylora.model.layers import Linear, RMSNorm


class MTPHead(nn.Module):
    def __init__(self, config: ModelConfig):
        from hylora.model.decoder import DecoderLayer  # (decoder.py builds this head)

        super().__init__()
        h = config.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, config.rms_norm_eps)
        self.fc = Linear(2 * h, {"fc": h})
        # layer ids after the decoder's: their KV lives in the paged cache as extra attention layers
        self.layers = nn.ModuleList(
            DecoderLayer(config, config.num_layers + i, layer_type=FULL) for i in range(config.mtp_num_hidden_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps)

    @property
    def layer_ids(self) -> list[int]:
        return [layer.self_attn.layer_idx for layer in self.layers]

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] the embeddings of the tokens after each row's position
        hidden: torch.Tensor,  # [T, H] the decoder's final-norm hidden state (or this head's output)
        batch: ForwardBatch,  # the rows' positions and KV rows; no adapter (batch.lora None)
        kv: PagedKVCache,
        states: StatePool,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: int = 0,  # which draft this is: picks layer step % len(layers)
    ) -> torch.Tensor:
        """The head's output hidden state [T, H] after `mtp.norm` (the lm_head gives its logits)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[step % len(self.layers)](x, None, batch, kv, states, cos, sin)
        return self.norm(x, residual)[0]
