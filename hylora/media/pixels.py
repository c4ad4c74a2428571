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
    """[N, H, W, C] → rows [T·(H/p)·(W/p), C·tp·p·p] of the frames' dtype.

    N is padded to a multiple of `temporal_patch_size` by repeating the last frame (so an image is repeated
    along T). Rows go in merge-block order (t, block_row, block_col, in_row, in_col); columns are (C, tp, ph, pw),
    as transformers' Qwen2-VL / Qwen3-VL processors lay them out."""
    n, h, w, c = frames.shape
    rows = empty_rows(n, h, w, c, patch_size, temporal_patch_size, frames.dtype)
    for i in range(padded_count(n, temporal_patch_size)):
        write_frame_rows(rows.numpy(), i, frames[min(i, n - 1)], patch_size, merge_size, temporal_patch_size)
    return rows


def padded_count(frames: int, temporal_patch_size: int) -> int:
    """Frames once the last is repeated to fill the last temporal patch."""
    return -(-frames // temporal_patch_size) * temporal_patch_size


def empty_rows(
    frames: int, height: int, width: int, channels: int, patch_size: int, temporal_patch_size: int, dtype=np.uint8
) -> torch.Tensor:
    """The unwritten rows of `frames` frames (`patchify`'s shape), for `write_frame_rows` to fill."""
    shape = rows_shape(frames, height, width, channels, patch_size, temporal_patch_size)
    return torch.from_numpy(np.empty(shape, dtype))


def rows_shape(
    frames: int, height: int, width: int, channels: int, patch_size: int, temporal_patch_size: int
) -> tuple[int, int]:
    steps = padded_count(frames, temporal_patch_size) // temporal_patch_size
    p = patch_size
    return steps * (height // p) * (width // p), channels * temporal_patch_size * p * p


def write_frame_rows(
    rows: np.ndarray, i: int, frame: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int
) -> None:
    """Frame i ([H, W, C]) into its places in `rows` (temporal patch i // tp, time i % tp; `patchify`'s layout).
    A numpy copy, which releases the GIL: a video's frames are written on many threads at once, each as soon as
    it is decoded, with no stacked copy of the video (and at ~2.5× the speed of torch's copy of the same
    permutation on one thread)."""
    h, w, c = frame.shape
    p, m, tp = patch_size, merge_size, temporal_patch_size
    bh, bw, per_step = h // (p * m), w // (p * m), (h // p) * (w // p)
    t = i // tp
    block = rows[t * per_step : (t + 1) * per_step].reshape(bh, bw, m, m, c, tp, p, p)
    block[:, :, :, :, :, i % tp] = frame.reshape(bh, m, p, bw, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)


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
