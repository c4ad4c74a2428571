"""The tower's input rows, kept as bytes until they reach the tower's device.

Rescale and normalise map each byte of each channel to one float32 value, so a processed image or video
keeps its resized pixels as uint8 rows (a quarter of the float32 size: less host memory, less to copy to
the GPU) plus a [C, 256] table of those values, built by running the processor's own float32 arithmetic
(`image.rescale_and_normalize`, `video.rescale_and_normalize`) on the 256 byte values. Looking the bytes
up in that table gives the same bits as normalising the pixels, on any device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def byte_table(normalise: Callable[[np.ndarray], np.ndarray], channels: int) -> torch.Tensor:
    """float32 [C, 256]: what `normalise` (uint8 [N, H, W, C] → float32 [N, C, H, W]) makes of each byte
    value in each channel."""
    ramp = np.repeat(np.arange(256, dtype=np.uint8)[None, None, :, None], channels, axis=-1)  # [1, 1, 256, C]
    return torch.from_numpy(np.ascontiguousarray(normalise(ramp)[0, :, 0, :], dtype=np.float32))


def patchify(frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> torch.Tensor:
    """uint8 [N, H, W, C] → uint8 rows [T·(H/p)·(W/p), C·tp·p·p].

    N is padded to a multiple of `temporal_patch_size` by repeating the last frame (so an image is repeated
    along T). Rows go in merge-block order (t, block_row, block_col, in_row, in_col); columns are (C, tp, ph, pw),
    as transformers' Qwen2-VL / Qwen3-VL processors lay them out."""
    n, h, w, c = frames.shape
    tp, p, m = temporal_patch_size, patch_size, merge_size
    x = torch.from_numpy(np.ascontiguousarray(frames) if frames.flags.writeable else frames.copy())  # PIL's are not
    if pad := -n % tp:
        x = torch.cat([x, x[-1:].expand(pad, h, w, c)])
    gt, gh, gw = x.shape[0] // tp, h // p, w // p
    x = x.view(gt, tp, gh // m, m, p, gw // m, m, p, c).permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return x.reshape(gt * gh * gw, c * tp * p * p)  # one copy, a byte per element


def normalise_rows(rows: torch.Tensor, table: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """uint8 rows [R, C·k] (channel-major columns) → float32 rows: table[c, byte], on the rows' device.
    In blocks of rows, so the int64 index stays small (and in cache on a CPU)."""
    r, cols = rows.shape
    c = table.shape[0]
    table = table.to(rows.device)
    offsets = torch.arange(c, device=rows.device)[:, None] * 256
    out = torch.empty(r, c, cols // c, dtype=torch.float32, device=rows.device)
    for i in range(0, r, block):
        index = rows[i : i + block].view(-1, c, cols // c).long() + offsets  # [block, C, k]
        torch.take(table, index, out=out[i : i + block])
    return out.view(r, cols)
