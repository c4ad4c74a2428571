"""Pixels travel as bytes (hylora/media/pixels.py): looking each byte up in the table of normalised values
gives the bits that normalising the pixels first gives, for the image and the video formulas, across the
gather's row blocks, and on the way to a device."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from hylora.media import image, pixels, video
from hylora.media.config import ImageConfig, VideoConfig
from hylora.media.processor import ProcessedMedia


def _frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("normalise", "cfg"),
    [(image.rescale_and_normalize, ImageConfig()), (video.rescale_and_normalize, VideoConfig())],
    ids=["image", "video"],
)
@pytest.mark.parametrize(("n", "block"), [(1, 1024), (3, 7), (4, 64), (5, 1)])
def test_byte_rows_through_the_table_equal_normalised_rows(normalise, cfg, n, block):
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    frames = _frames(n, 2 * cfg.factor, 3 * cfg.factor, seed=n)
    direct = normalise(frames, cfg)  # float32 [N, C, H, W]
    expected = pixels.patchify(np.moveaxis(direct, 1, -1), p, m, tp)
    rows = pixels.patchify(frames, p, m, tp)
    assert rows.dtype == torch.uint8 and rows.shape == expected.shape
    table = pixels.byte_table(functools.partial(normalise, cfg=cfg), 3)
    got = pixels.normalise_rows(rows, table, block=block)
    assert torch.equal(got, expected)  # bit for bit, every row block written


def test_patchify_pads_time_with_the_last_frame_and_orders_rows_by_merge_block():
    frames = _frames(3, 4, 8, seed=0)  # tp 2, patch 2, merge 2: grid (2, 2, 4)
    rows = pixels.patchify(frames, 2, 2, 2)
    assert rows.shape == (2 * 2 * 4, 3 * 2 * 2 * 2)
    # row 1 is block (0, 0)'s top-right patch: pixel rows 0-1, columns 2-3; column 0 is channel 0, time 0
    assert rows[1, 0] == frames[0, 0, 2, 0]
    assert rows[1, 4] == frames[1, 0, 2, 0]  # time 1 of the same patch
    second = rows[8:].view(8, 3, 2, 2, 2)  # temporal patch 1 = frame 2 and its repeat
    assert torch.equal(second[:, :, 0], second[:, :, 1])


def test_processed_media_rows_move_as_bytes_and_equal_pixel_values():
    cfg = VideoConfig()
    frames = _frames(4, 64, 64, seed=3)
    rows = pixels.patchify(frames, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    table = pixels.byte_table(functools.partial(video.rescale_and_normalize, cfg=cfg), 3)
    item = ProcessedMedia("video", rows, (2, 4, 4), cfg.merge_size, "k", (0.0, 1.0), table)
    whole = item.pixel_values
    assert whole.dtype == torch.float32 and torch.isfinite(whole).all()
    assert torch.equal(item.rows(16, 32, "cpu"), whole[16:32])
    plain = ProcessedMedia("video", whole, (2, 4, 4), cfg.merge_size, "k")  # float rows pass through
    assert torch.equal(plain.rows(16, 32), whole[16:32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
def test_rows_normalised_on_the_gpu_equal_the_host_bits():
    cfg = VideoConfig()
    frames = _frames(6, 2 * cfg.factor, 5 * cfg.factor, seed=7)
    rows = pixels.patchify(frames, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    table = pixels.byte_table(functools.partial(video.rescale_and_normalize, cfg=cfg), 3)
    item = ProcessedMedia("video", rows, (3, 4, 10), cfg.merge_size, "k", (0.0, 1.0, 2.0), table)
    on_gpu = item.rows(8, 32, "cuda")
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), item.rows(8, 32))
