"""The vision tower (`model.visual.*`): pixel rows of images and video frames → LLM-sized embeddings.

Input rows come in merge-block order (block_row, block_col, in_row, in_col) per temporal patch, each
row one (C, T, p, p) patch flattened; `grid_thw` gives each item's (t, h, w) in patches. Every
temporal patch of every item is one attention segment; the merger turns each 2x2 block of four
consecutive rows into one output row, so item i yields t*h*w / 4 rows, in input order.

LoRA: each item of a call may use its own adapter slot (`item_lora_slots`, -1 = base). Every patch
row carries its item's slot through the patch embedding and the blocks, and every merged row (four
patch rows → one) carries it through the merger; with no adapter in the call nothing LoRA runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hylora.config import VisionConfig
from hylora.lora import LoRABatch, LoRAStack
from hylora.model.layers import _param, add_lora


class VisionLinear(nn.Module):
    """y = x W^T + b (+ the batch's LoRA deltas): every linear of the tower, and the unit tower LoRA
    attaches to.

    `weight` keeps the checkpoint's shape; the patch embedding is a Conv3d whose kernel equals its
    stride, i.e. a linear over the flattened (C, T, p, p) patch, so it is one of these too (and its
    LoRA a linear LoRA over that flattened patch)."""

    def __init__(self, in_features: int, out_features: int, weight_shape: tuple[int, ...] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(*(weight_shape or (out_features, in_features)))
        self.bias = _param(out_features)
        self.lora: LoRAStack | None = None  # set by the adapter registry
        self.lora_backend: str | None = None  # as Linear's; None: by device

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight.flatten(1), self.bias)
        if lora is not None and self.lora is not None and lora.has_adapters:
            y = add_lora(x, y, self.lora, lora, self.lora_backend)
        return y


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)
        self.bias = _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = VisionLinear(c.patch_dim, c.hidden_size, weight_shape=shape)

    def forward(self, pixels: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        return self.proj(pixels, lora)


class PositionTable(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.weight = _param(c.num_position_embeddings, c.hidden_size)


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = c.num_heads, c.head_dim
        self.qkv = VisionLinear(c.hidden_size, 3 * c.hidden_size)
        self.proj = VisionLinear(c.hidden_size, c.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: list[torch.Tensor],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x, lora).reshape(n, 3, self.heads, self.head_dim).unbind(1)  # [n, H, d] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for rows in segments:  # [B, L]: B segments of one length, attended in one batched call
            qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [B, H, L, d]
            out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1), lora)


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.approximate = c.gelu_approximate
        self.linear_fc1 = VisionLinear(c.hidden_size, c.intermediate_size)
        self.linear_fc2 = VisionLinear(c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x, lora), approximate=self.approximate), lora)


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1 = LayerNorm(c.hidden_size)
        self.norm2 = LayerNorm(c.hidden_size)
        self.attn = VisionAttention(c)
        self.mlp = VisionMLP(c)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: list[torch.Tensor],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments, lora)
        return x + self.mlp(self.norm2(x), lora)


class PatchMerger(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        merged = c.hidden_size * c.merge_unit
        self.norm = LayerNorm(c.hidden_size)
        self.linear_fc1 = VisionLinear(merged, merged)
        self.linear_fc2 = VisionLinear(merged, c.out_hidden_size)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """`lora` is per merged row (one 2x2 block)."""
        x = self.norm(x).reshape(-1, self.linear_fc1.in_features)  # 4 consecutive rows = one 2x2 block
        return self.linear_fc2(F.gelu(self.linear_fc1(x, lora)), lora)


class VisionTower(nn.Module):
    """Parameter names follow the checkpoint keys under `model.visual.`."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = PositionTable(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, item_lora_slots: Sequence[int] | None = None
    ) -> torch.Tensor:
        """pixel_values [sum(t*h*w), C*T*p*p], grid_thw [M, 3] → [sum(t*h*w) / merge², out_hidden].

        item_lora_slots: the adapter registry's device slot of each of the M items, -1 for the base
        tower (None: all base)."""
        c = self.config
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        _check_grids(grids, pixel_values, c)
        device = pixel_values.device
        stack = self.patch_embed.proj.lora
        num_slots = 0 if stack is None else len(stack.present)
        patch_lora, merged_lora = _lora_batches(item_lora_slots, grids, c.merge_unit, num_slots, device)
        rows, cols = _patch_coordinates(grids, c.spatial_merge_size)  # [N] each, merge-block order
        rows, cols = rows.to(device), cols.to(device)

        x = self.patch_embed(pixel_values.to(self.dtype), patch_lora)
        x = x + self._interpolated_positions(rows, cols, grids).to(x.dtype)
        d = c.head_dim // 2  # rotary dims per axis
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)  # [N, head_dim] fp32: cos/sin laid out [h, w, h, w]
        cos, sin = emb.cos(), emb.sin()
        segments = _segments(grids, device)
        for block in self.blocks:
            x = block(x, cos, sin, segments, patch_lora)
        return self.merger(x, merged_lora)

    def _interpolated_positions(self, rows: torch.Tensor, cols: torch.Tensor, grids: list) -> torch.Tensor:
        """The learned side x side table bilinearly resampled (align_corners=True) to each grid: [N, hidden]."""
        side = self.config.position_grid_side
        heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids]).to(rows.device)
        widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids]).to(rows.device)
        h_taps, h_weights = _bilinear_taps(rows, heights, side)
        w_taps, w_weights = _bilinear_taps(cols, widths, side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return (F.embedding(index, self.pos_embed.weight) * weight[:, :, None]).sum(1)


def _lora_batches(
    item_slots: Sequence[int] | None,
    grids: list[tuple[int, int, int]],
    merge_unit: int,
    num_slots: int,
    device: torch.device,
) -> tuple[LoRABatch | None, LoRABatch | None]:
    """The per-patch-row and per-merged-row LoRA batches of a call; (None, None) when no item has an
    adapter, so a base-only call runs no LoRA code at all."""
    if item_slots is None:
        return None, None
    slots = [int(s) for s in item_slots]
    if len(slots) != len(grids):
        raise ValueError(f"item_lora_slots has {len(slots)} entries for {len(grids)} items")
    if any(not -1 <= s < num_slots for s in slots):
        raise ValueError(
            f"item_lora_slots {slots}: each is -1 (base) or one of this tower's {num_slots} LoRA slots "
            "(an adapter registry gives the tower its slots)"
        )
    if all(s == -1 for s in slots):
        return None, None
    patches = [t * h * w for t, h, w in grids]
    return (
        LoRABatch.build(slots, patches, device),
        LoRABatch.build(slots, [n // merge_unit for n in patches], device),
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """2D axial rotary over the whole head, in fp32. x [n, H, d], cos/sin [n, d]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two source taps and weights of each target index on an axis of `size`, as F.interpolate
    (bilinear, align_corners=True) computes them from a `side`-long table."""
    src = index.float() * (side - 1) / (size - 1).clamp(min=1)
    floor = src.floor()
    taps = floor.long()[:, None] + torch.arange(2, device=index.device)
    weights = (1 - (src[:, None] - taps).abs()).clamp(min=0)
    return taps.clamp(max=side - 1), weights


def _patch_coordinates(grids: list[tuple[int, int, int]], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) in its frame of every patch row, in merge-block order, repeated over t."""
    rows, cols = [], []
    for t, h, w in grids:
        r = torch.arange(h)[:, None].expand(h, w)
        c = torch.arange(w)[None, :].expand(h, w)
        blocks = (h // merge, merge, w // merge, merge)
        rows.append(r.reshape(blocks).transpose(1, 2).flatten().repeat(t))
        cols.append(c.reshape(blocks).transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows), torch.cat(cols)


def _segments(grids: list[tuple[int, int, int]], device: torch.device) -> list[torch.Tensor]:
    """Attention segments (one per temporal patch) grouped by length: a [B, L] row-index tensor each."""
    starts: dict[int, list[int]] = {}
    offset = 0
    for t, h, w in grids:
        for _ in range(t):
            starts.setdefault(h * w, []).append(offset)
            offset += h * w
    return [(torch.tensor(s)[:, None] + torch.arange(length)).to(device) for length, s in sorted(starts.items())]


def _check_grids(grids: list[tuple[int, int, int]], pixels: torch.Tensor, c: VisionConfig) -> None:
    m = c.spatial_merge_size
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1 or h % m or w % m:
            raise ValueError(f"grid (t, h, w) = {(t, h, w)}: h and w must be positive multiples of {m}")
    rows = sum(t * h * w for t, h, w in grids)
    if pixels.ndim != 2 or tuple(pixels.shape) != (rows, c.patch_dim):
        raise ValueError(
            f"pixel_values {list(pixels.shape)} do not fit grids {grids}: expected [{rows}, {c.patch_dim}]"
        )
