"""Damaged media in every container and codec the server takes: each file, mutated byte by byte (values
flipped, 32-bit fields set to extremes, spans deleted, copied or repeated, the tail cut off), gives either its
rows or a MediaError (a 400 naming what is wrong), never another exception (a 500 that tells the user nothing).

The mutations are seeded, so a failure names a case that reproduces. An exploratory run of 4400 such files
(the same mutator, each in a forked process with a time limit) found no crash, hang or other exception; this
keeps a slice of it in CI so that a change to the decoders' error handling cannot let one through.
"""

from __future__ import annotations

import base64
import functools
import json
import random

import pytest
import torch

from hylora.media import MediaConfig, MediaError, MediaLimits, process_image, process_video
from hylora.media.processor import process_frame_list
from tests.media_helpers import frame_list, hostile_gif, image_bytes, video_bytes
from tests.test_media import IMAGE_JSON, VIDEO_JSON

CASES_PER_FILE = 24
LIMITS = MediaLimits()
FIELD_EXTREMES = (b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\xff\xff", b"\x80\x00\x00\x00")

VIDEOS = {
    "h264-mp4": lambda: video_bytes(12, 64, 48, fps=10),
    "vp8-webm": lambda: video_bytes(8, 64, 48, fps=6, fmt="webm", codec="libvpx"),
    "vp9-webm": lambda: video_bytes(8, 64, 48, fps=6, fmt="webm", codec="libvpx-vp9"),
    "mpeg4-avi": lambda: video_bytes(8, 64, 48, fps=10, fmt="avi", codec="mpeg4"),
    "animated-gif": lambda: hostile_gif(64, 48, 6),
}
IMAGES = {
    "png": lambda: image_bytes(64, 48),
    "jpeg": lambda: image_bytes(64, 48, fmt="JPEG"),
    "webp": lambda: image_bytes(64, 48, fmt="WEBP"),
    "tiff-rgba": lambda: image_bytes(64, 48, mode="RGBA", fmt="TIFF"),
    "bmp": lambda: image_bytes(64, 48, fmt="BMP"),
    "gif": lambda: image_bytes(64, 48, mode="P", fmt="GIF"),
}


@functools.cache
def original(name: str) -> bytes:
    return {**VIDEOS, **IMAGES}[name]()


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4, 8, 32))):
        if not b:
            b = bytearray(b"\0")
        op, i = rng.random(), rng.randrange(len(b))
        if op < 0.4:
            b[i] = rng.randrange(256)
        elif op < 0.55:
            b[i : i + 4] = rng.choice(FIELD_EXTREMES)
        elif op < 0.7:
            j = rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randrange(1, 64)]
        elif op < 0.8:
            del b[i : i + rng.randrange(1, 64)]
        elif op < 0.9:
            del b[max(i, 1) :]
        else:
            j, n = rng.randrange(len(b)), rng.randrange(1, 256)
            b[i : i + n] = b[j : j + n]
    return bytes(b)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> MediaConfig:
    path = tmp_path_factory.mktemp("media")
    (path / "preprocessor_config.json").write_text(json.dumps(IMAGE_JSON))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_JSON))
    return MediaConfig.from_model_dir(path)


def _rows_or_media_error(process, data, cfg: MediaConfig, case: str) -> str:
    try:
        item = process(data, cfg, LIMITS)
    except MediaError as e:
        assert str(e).strip(), f"{case}: a MediaError without a message"
        return "refused"
    except Exception as e:  # noqa: BLE001 - what this test looks for
        pytest.fail(f"{case}: {type(e).__name__} escaped as a server error, not a MediaError: {e}")
    assert torch.isfinite(item.pixel_values).all(), f"{case}: non-finite rows"
    return "decoded"


@pytest.mark.parametrize("name", [*VIDEOS, *IMAGES])
def test_a_damaged_file_gives_its_rows_or_a_media_error(cfg, name):
    process = process_video if name in VIDEOS else process_image
    outcomes = []
    for k in range(CASES_PER_FILE):
        data = mutate(original(name), random.Random(f"{name}/{k}"))
        outcomes.append(_rows_or_media_error(process, data, cfg, f"{name} case {k}"))
    # the mutations must reach both outcomes, or this test checks less than it claims; a PNG checks a CRC on
    # every chunk, so each of its damaged copies is refused
    assert set(outcomes) == ({"refused"} if name == "png" else {"decoded", "refused"}), outcomes


def test_a_damaged_frame_in_a_frame_list_gives_the_rows_or_a_media_error(cfg):
    frames = [image_bytes(64, 48, fmt="JPEG", seed=i) for i in range(4)]
    outcomes = []
    for k in range(CASES_PER_FILE):
        rng = random.Random(f"frame-list/{k}")
        damaged = list(frames)
        i = rng.randrange(len(frames))
        damaged[i] = mutate(frames[i], rng)
        outcomes.append(_rows_or_media_error(process_frame_list, frame_list(damaged), cfg, f"frame list case {k}"))
    assert set(outcomes) == {"decoded", "refused"}, outcomes


def test_a_frame_list_of_damaged_base64_is_a_media_error(cfg):
    good = base64.b64encode(image_bytes(64, 48, fmt="JPEG")).decode()
    for k, bad in enumerate(["%%%", good[:-3], good + "=", "", good.replace("A", "-", 3)]):
        url = f"data:video/jpeg;base64,{good},{bad},{good}"
        _rows_or_media_error(process_frame_list, url, cfg, f"base64 case {k}")
