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

import contextlib
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hylora.config import VisionConfig
from hylora.lora import LoRABatch, LoRAStack
from hylora.model.layers import _param, add_lora
from hylora.ops.rotary.reference import rotate_half


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
        self.rotary = rotate_half  # ops.rotary (set by the kernel floor): q and k rotated in place
        self.sdpa_backend: str | None = None  # torch's SDPA backend (set by the kernel floor); None: torch's pick

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        runs: list[tuple[int, int, int]],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        n, H, d = x.shape[0], self.heads, self.head_dim
        qkv = self.qkv(x, lora).reshape(n, 3 * H, d)  # [n, 3H, d]: q, k, v heads
        self.rotary(qkv[:, : 2 * H], cos, sin, out=qkv[:, : 2 * H])
        q, k, v = qkv.view(n, 3, H, d).unbind(1)  # [n, H, d] views each
        with sdpa_backend(self.sdpa_backend):
            if len(runs) == 1 and runs[0][1] * runs[0][2] == n:
                _, B, L = runs[0]
                o = F.scaled_dot_product_attention(*(_run_view(t, 0, B, L) for t in (q, k, v)))  # [B, H, L, d]
                return self.proj(o.transpose(1, 2).reshape(n, H * d), lora)
            out = torch.empty(n, H, d, dtype=qkv.dtype, device=qkv.device)
            for start, B, L in runs:  # B consecutive segments of length L, attended in one batched call
                o = F.scaled_dot_product_attention(*(_run_view(t, start, B, L) for t in (q, k, v)))
                out[start : start + B * L].view(B, L, H, d).copy_(o.transpose(1, 2))
        return self.proj(out.view(n, H * d), lora)


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
        runs: list[tuple[int, int, int]],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs, lora)
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
        x = self.patch_embed(pixel_values.to(self.dtype), patch_lora)
        # positions and rotary angles depend on a frame's (h, w) only: made once per frame size, added and
        # repeated over each item's t temporal patches
        frames = {hw: self._frame_tables(*hw, device) for hw in dict.fromkeys((h, w) for _, h, w in grids)}
        offset, cos, sin = 0, [], []
        for t, h, w in grids:
            positions, frame_cos, frame_sin = frames[(h, w)]
            x[offset : offset + t * h * w].view(t, h * w, -1).add_(positions)
            cos.append(frame_cos.repeat(t, 1))
            sin.append(frame_sin.repeat(t, 1))
            offset += t * h * w
        cos, sin = torch.cat(cos), torch.cat(sin)  # [N, head_dim] fp32
        runs = _segment_runs(grids)
        for block in self.blocks:
            x = block(x, cos, sin, runs, patch_lora)
        return self.merger(x, merged_lora)

    def _frame_tables(self, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One h x w frame's rows, in merge-block order: the learned side x side position table bilinearly
        resampled to the frame (align_corners=True) [h*w, hidden] in the tower's dtype, and the rotary's
        cos and sin [h*w, head_dim] fp32 (laid out [h, w, h, w]). Built on the device: a pageable copy
        would make the host wait for the step in flight."""
        c = self.config
        side = c.position_grid_side
        rows, cols = _frame_coordinates(h, w, c.spatial_merge_size, device)  # [h*w] each
        h_taps, h_weights = _bilinear_taps(rows, torch.full((h * w,), h, device=device), side)
        w_taps, w_weights = _bilinear_taps(cols, torch.full((h * w,), w, device=device), side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        positions = (F.embedding(index, self.pos_embed.weight) * weight[:, :, None]).sum(1).to(self.dtype)
        d = c.head_dim // 2  # rotary dims per axis
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return positions, emb.cos(), emb.sin()


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


def sdpa_backend(name: str | None) -> contextlib.AbstractContextManager:
    """torch's SDPA restricted to one backend by name (flash, cudnn, efficient, math); None: torch's pick."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(_sdpa_backends()[name])


@functools.cache
def _sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    return backends | {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def _run_view(t: torch.Tensor, start: int, B: int, L: int) -> torch.Tensor:
    """Rows [start, start + B*L) of t [n, H, d] as B segments of L rows: a [B, H, L, d] view, no copy."""
    return t[start : start + B * L].view(B, L, *t.shape[1:]).transpose(1, 2)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two source taps and weights of each target index on an axis of `size`, as F.interpolate
    (bilinear, align_corners=True) computes them from a `side`-long table."""
    src = index.float() * (side - 1) / (size - 1).clamp(min=1)
    floor = src.floor()
    taps = floor.long()[:, None] + torch.arange(2, device=index.device)
    weights = (1 - (src[:, None] - taps).abs()).clamp(min=0)
    return taps.clamp(max=side - 1), weights


def _frame_coordinates(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch of an h x w frame, in merge-block order; made on `device`."""
    r = torch.arange(h, device=device)[:, None].expand(h, w)
    c = torch.arange(w, device=device)[None, :].expand(h, w)
    blocks = (h // merge, merge, w // merge, merge)
    return r.reshape(blocks).transpose(1, 2).flatten(), c.reshape(blocks).transpose(1, 2).flatten()


def _segment_runs(grids: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The attention segments (one per temporal patch of every item) in row order, as maximal runs of
    consecutive segments of one length: (start row, segments B, length L) each."""
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for t, h, w in grids:
        for _ in range(t):
            if runs and runs[-1][2] == h * w:
                start, count, length = runs[-1]
                runs[-1] = (start, count + 1, length)
            else:
                runs.append((offset, 1, h * w))
            offset += h * w
    return runs


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
