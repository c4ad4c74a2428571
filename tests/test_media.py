"""hylora.media against transformers 5.x (CPU, no torchvision, all media made offline by tests/media_helpers.py).

How each reference is built:
- Images: transformers' own `Qwen2VLImageProcessorPil`, loaded by `from_pretrained` from the same
  preprocessor_config.json, fed the PIL image after `ImageOps.exif_transpose` (what `load_image` does).
- Videos: transformers' own `Qwen3VLVideoProcessor` (sampling, smart_resize, padding, fused normalise, patchify)
  with a torchvision stand-in whose resize is PIL bicubic per frame (hylora's documented choice; everything
  else is transformers' code), fed every frame PyAV decodes and `VideoMetadata(total = decoded count,
  fps = stream.average_rate)`, as its PyAV reader does. Timestamps: `Qwen3VLProcessor._calculate_timestamps`.
- Prompts: transformers' own `Qwen3VLProcessor` with those two processors and the demo tokenizer (and a
  `Qwen3_5Tokenizer` built on its vocab, for Qwen's digit-splitting pre-tokenizer); its input_ids must equal
  `expand_prompt_ids` on the unexpanded prompt's ids.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib
import io
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from hylora.demo import SPECIAL_TOKENS, write_tokenizer
from hylora.media import (
    FetchPolicy,
    MediaConfig,
    MediaError,
    MediaLimits,
    VisionTokens,
    check_visual_tokens,
    expand_prompt_ids,
    fetch_bytes,
    process_image,
    process_video,
)
from hylora.media import image as media_image
from hylora.media import processor as media_processor
from hylora.media.cache import ProcessedCache
from hylora.media.config import ImageConfig, VideoConfig, apply_overrides, layer_overrides, merge_overrides
from hylora.media.fetch import frame_bytes, is_frame_list, split_frame_list
from hylora.media.pools import MediaPools, set_frame_threads
from hylora.media.processor import process_frame_list
from hylora.media.video import sample_indices
from tests.media_helpers import (
    decode_all,
    frame_list,
    garbage,
    image_bytes,
    install_torchvision_stand_in,
    video_bytes,
)

IMAGE_JSON = {
    "size": {"shortest_edge": 4096, "longest_edge": 16384},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48, 0.45, 0.4],
    "image_std": [0.27, 0.26, 0.28],
    "resample": 3,
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_JSON = {
    "size": {"shortest_edge": 4096, "longest_edge": 40000},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.45, 0.5, 0.55],
    "image_std": [0.3, 0.25, 0.2],
    "video_processor_type": "Qwen3VLVideoProcessor",
}
LIMITS = MediaLimits()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vl")
    (path / "preprocessor_config.json").write_text(json.dumps(IMAGE_JSON))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_JSON))
    write_tokenizer(path, 1024)
    return path


@pytest.fixture(scope="module")
def cfg(model_dir) -> MediaConfig:
    return MediaConfig.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    """transformers' image processor, video processor and Qwen3VLProcessor for `model_dir`."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    with pytest.MonkeyPatch.context() as mp:
        install_torchvision_stand_in(mp)
        video_module = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")
        ip = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        vp = video_module.Qwen3VLVideoProcessor.from_pretrained(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        proc = Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp)
        yield {"image": ip, "video": vp, "processor": proc, "tokenizer": tok}


def hf_image(ip, data: bytes):
    out = ip(ImageOps.exif_transpose(Image.open(io.BytesIO(data))), return_tensors="pt")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


def assert_image_matches(ours, ref_pixels, ref_grid):
    assert ours.grid_thw == ref_grid
    assert ours.pixel_values.dtype == torch.float32
    torch.testing.assert_close(ours.pixel_values, ref_pixels, atol=1e-6, rtol=0)
    assert ours.num_tokens == ref_pixels.shape[0] // 4


# --- images -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "width,height",
    [(100, 60), (64, 64), (20, 30), (500, 300), (150, 1), (33, 200), (7, 1200)],
    ids=["round", "exact", "below-min", "above-max", "thin-150", "odd", "tall"],
)
def test_image_equals_transformers(cfg, hf, width, height):
    data = image_bytes(width, height, seed=width)
    assert_image_matches(process_image(data, cfg, LIMITS), *hf_image(hf["image"], data))


@pytest.mark.parametrize(
    "mode,fmt", [("RGBA", "PNG"), ("P", "PNG"), ("L", "PNG"), ("LA", "PNG"), ("CMYK", "JPEG"), ("RGB", "JPEG")]
)
def test_image_modes_equal_transformers(cfg, hf, mode, fmt):
    data = image_bytes(50, 40, mode, fmt)
    assert_image_matches(process_image(data, cfg, LIMITS), *hf_image(hf["image"], data))


def test_exif_orientation_is_applied_like_load_image(cfg, hf):
    data = image_bytes(96, 40, "RGB", "JPEG", exif_orientation=6)
    ours = process_image(data, cfg, LIMITS)
    assert ours.grid_thw[1] > ours.grid_thw[2]  # rotated to portrait
    assert_image_matches(ours, *hf_image(hf["image"], data))


def test_16_bit_gray_is_scaled_not_clipped(cfg, hf):
    """Deviation: PIL (and so transformers) clips 16-bit gray to 255; hylora keeps the high byte."""
    data = image_bytes(50, 40, "I;16")
    wide = np.asarray(Image.open(io.BytesIO(data)))
    eight_bit = io.BytesIO()
    Image.fromarray((wide >> 8).astype(np.uint8)).save(eight_bit, "PNG")
    assert_image_matches(process_image(data, cfg, LIMITS), *hf_image(hf["image"], eight_bit.getvalue()))


def test_checkpoint_defaults_equal_transformers_defaults():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    video_cls = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl").Qwen3VLVideoProcessor
    for ours, theirs in ((ImageConfig(), Qwen2VLImageProcessorPil), (VideoConfig(), video_cls)):
        assert (ours.min_pixels, ours.max_pixels) == (theirs.size["shortest_edge"], theirs.size["longest_edge"])
        for key in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor"):
            assert getattr(ours, key) == getattr(theirs, key), key
        assert ours.image_mean == tuple(theirs.image_mean) and ours.image_std == tuple(theirs.image_std)
        assert ours.resample == int(theirs.resample)
    for key in ("fps", "num_frames", "min_frames", "max_frames", "do_sample_frames", "max_video_tokens"):
        assert getattr(VideoConfig(), key) == getattr(video_cls, key), key
    assert video_cls.cap_pixels_per_frame in (None, False)  # unset means False in transformers 5.24

    data = image_bytes(90, 70)  # and the default (patch 14, CLIP mean) path equals transformers'
    assert_image_matches(process_image(data, MediaConfig(), LIMITS), *hf_image(Qwen2VLImageProcessorPil(), data))


def test_config_files_legacy_keys_and_precedence(tmp_path):
    assert MediaConfig.from_model_dir(tmp_path) == MediaConfig()
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**IMAGE_JSON, "min_pixels": 1024, "max_pixels": 9999, "fps": 3})
    )
    cfg = MediaConfig.from_model_dir(tmp_path)
    assert (cfg.image.min_pixels, cfg.image.max_pixels, cfg.image.image_mean) == (1024, 9999, (0.48, 0.45, 0.4))
    # no video file: transformers falls back to preprocessor_config.json, where only `size` counts for videos
    assert (cfg.video.min_pixels, cfg.video.max_pixels, cfg.video.fps) == (4096, 16384, 3)
    nested = {"image_processor": {"patch_size": 14}, "video_processor": {"fps": 1, "max_frames": 64}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    cfg = MediaConfig.from_model_dir(tmp_path)
    assert (cfg.image.patch_size, cfg.video.fps, cfg.video.max_frames) == (14, 1, 64)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"size": {"longest_edge": 9}}}))
    with pytest.raises(ValueError, match="shortest_edge and longest_edge"):
        MediaConfig.from_model_dir(tmp_path)


# --- videos -------------------------------------------------------------------------------------------------

CLIPS = {
    "h264-30f": dict(num_frames=30, width=64, height=48, fps=10),
    "vp8-webm-12f": dict(num_frames=12, width=64, height=48, fps=6, fmt="webm", codec="libvpx"),
    "mpeg4-3f": dict(num_frames=3, width=64, height=48, fps=10, codec="mpeg4"),
    "h264-small-10f": dict(num_frames=10, width=40, height=24, fps=5),
}


@functools.cache
def clip(name: str) -> bytes:
    return video_bytes(**CLIPS[name])


VIDEO_CASES = {
    "default-fps-6-frames": ("h264-30f", {}),
    "fps-odd-7-frames": ("h264-30f", {"fps": 2.5}),
    "fps-budget-12-frames": ("h264-30f", {"fps": 4}),
    "num-frames-odd": ("h264-30f", {"num_frames": 5}),
    "num-frames-even": ("h264-30f", {"num_frames": 8}),
    "num-frames-above-total": ("h264-30f", {"num_frames": 40}),
    "size-override": ("h264-30f", {"size": {"shortest_edge": 2048, "longest_edge": 20000}}),
    "webm-zero-frame-header": ("vp8-webm-12f", {}),
    "short-clamped-to-total-odd": ("mpeg4-3f", {}),
    "below-factor-upscale": ("h264-small-10f", {}),
}


def hf_video(vp, data: bytes, overrides: dict, cap: bool = False):
    frames, fps = decode_all(data)
    kwargs = dict(overrides)
    if "num_frames" in kwargs:
        kwargs["fps"] = None  # transformers refuses its default fps together with num_frames; hylora drops it
    metadata = _metadata(len(frames), fps)
    out = vp(
        torch.from_numpy(frames).permute(0, 3, 1, 2),
        video_metadata=metadata,
        return_tensors="pt",
        return_metadata=True,
        cap_pixels_per_frame=cap,
        **kwargs,
    )
    indices = np.asarray(out["video_metadata"][0].frames_indices)
    return out["pixel_values_videos"], tuple(out["video_grid_thw"][0].tolist()), indices, fps, len(frames)


def _metadata(total: int, fps: float):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=total, fps=fps)


def _hf_timestamps(indices, fps: float, temporal_patch_size: int) -> list[float]:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    return Qwen3VLProcessor._calculate_timestamps(None, indices, fps, temporal_patch_size)


CAPPED = ("default-fps-6-frames", "fps-budget-12-frames", "num-frames-above-total")


@pytest.mark.parametrize(
    "case,cap",
    [(case, False) for case in VIDEO_CASES] + [(case, True) for case in CAPPED],
    ids=list(VIDEO_CASES) + [f"{case}-cap-per-frame" for case in CAPPED],
)
def test_video_equals_transformers(cfg, hf, case, cap):
    name, overrides = VIDEO_CASES[case]
    data = clip(name)
    config = dataclasses.replace(cfg, video=dataclasses.replace(cfg.video, cap_pixels_per_frame=cap))
    ours = process_video(data, config, LIMITS, overrides)
    ref_pixels, ref_grid, ref_indices, fps, total = hf_video(hf["video"], data, overrides, cap)
    assert sample_indices(total, fps, apply_overrides(config.video, overrides, LIMITS)).tolist() == ref_indices.tolist()
    assert ours.kind == "video" and ours.grid_thw == ref_grid
    assert ours.grid_thw[0] == -(-len(ref_indices) // 2)  # odd counts padded with the last frame
    assert list(ours.timestamps) == _hf_timestamps(ref_indices, fps, 2)
    torch.testing.assert_close(ours.pixel_values, ref_pixels, atol=1e-6, rtol=0)


def test_webm_header_says_zero_frames_but_all_are_counted(cfg):
    import av

    data = clip("vp8-webm-12f")
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].frames == 0
    ours = process_video(data, cfg, LIMITS, {"num_frames": 12})
    assert ours.timestamps[-1] == pytest.approx((10 / 6 + 11 / 6) / 2)  # reached the last of the 12 frames


def test_videos_decode_with_pyav_19_which_has_no_metadata_errors(cfg, monkeypatch):
    """PyAV 19 (what pip installs on Python >= 3.12) dropped av.open's metadata_errors: every video
    failed with a TypeError."""
    import av

    real_open = av.open

    def open_without_metadata_errors(*args, **kwargs):
        if "metadata_errors" in kwargs:
            raise TypeError("open() got an unexpected keyword argument 'metadata_errors'")
        return real_open(*args, **kwargs)

    data = clip("vp8-webm-12f")
    expected = process_video(data, cfg, LIMITS, {"num_frames": 12})
    monkeypatch.setattr(av, "open", open_without_metadata_errors)
    got = process_video(data, cfg, LIMITS, {"num_frames": 12})
    assert torch.equal(got.pixel_values, expected.pixel_values) and got.timestamps == expected.timestamps


# --- prompt expansion ---------------------------------------------------------------------------------------


# merges that join a video's first timestamp to the text before it (`?<`, ` <`): real vocabularies have such
# tokens; the demo's has none
JOINING_MERGES = [("?", "<"), ("Ġ", "<")]


def _qwen_tokenizer(model_dir: Path, extra_merges: list[tuple[str, str]] = ()):
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    model = json.loads((model_dir / "tokenizer.json").read_text())["model"]
    vocab = dict(model["vocab"])
    for a, b in extra_merges:
        vocab[a + b] = len(vocab)
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=[tuple(m) for m in model["merges"]] + list(extra_merges))
    tok.add_tokens(SPECIAL_TOKENS, special_tokens=True)
    return tok


@pytest.mark.parametrize("tokenizer", ["demo", "qwen3_5", "qwen3_5-joining"])
def test_prompt_expansion_equals_transformers_processor(cfg, hf, model_dir, tokenizer):
    """transformers 5.25's processor: a video's outer wrapper collapses, and its first timestamp is tokenized
    with the text before it (the `-joining` vocabulary merges across that join)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    merges = JOINING_MERGES if tokenizer.endswith("-joining") else []
    tok = hf["tokenizer"] if tokenizer == "demo" else _qwen_tokenizer(model_dir, merges)
    image_a, image_b = image_bytes(100, 60, seed=1), image_bytes(40, 90, "RGBA", seed=2)
    video_a, video_b = clip("h264-30f"), clip("vp8-webm-12f")
    image_ph, video_ph = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
    text = (
        f"<|im_start|>user\n{image_ph}What happens at 12 seconds?{video_ph} Compare {image_ph}"
        f"with {video_ph}{video_ph}<|im_end|>\n<|im_start|>assistant\n"
    )
    frames = [decode_all(v) for v in (video_a, video_b, video_a)]  # the last two back to back
    with pytest.MonkeyPatch.context() as mp:
        install_torchvision_stand_in(mp)
        proc = Qwen3VLProcessor(image_processor=hf["image"], tokenizer=tok, video_processor=hf["video"])
        ref = proc(
            text=[text],
            images=[ImageOps.exif_transpose(Image.open(io.BytesIO(b))) for b in (image_a, image_b)],
            videos=[torch.from_numpy(f).permute(0, 3, 1, 2) for f, _ in frames],
            video_metadata=[_metadata(len(f), fps) for f, fps in frames],
            return_tensors="pt",
            cap_pixels_per_frame=False,
        )
    items = [
        process_image(image_a, cfg, LIMITS),
        process_video(video_a, cfg, LIMITS),
        process_image(image_b, cfg, LIMITS),
        process_video(video_b, cfg, LIMITS),
        process_video(video_a, cfg, LIMITS),
    ]
    ids = expand_prompt_ids(tok.encode(text, add_special_tokens=False), items, tok)
    assert ids == ref["input_ids"][0].tolist()
    tokens = VisionTokens.from_tokenizer(tok)
    assert ids.count(tokens.image_pad) + ids.count(tokens.video_pad) == sum(i.num_tokens for i in items)
    # each frame has its own wrapper; the template's outer one is gone
    assert ids.count(tokens.vision_start) == 2 + sum(item.grid_thw[0] for item in items if item.kind == "video")
    if merges:
        assert {tok.convert_tokens_to_ids(a + b) for a, b in merges} <= set(ids)  # the joins were merged
    torch.testing.assert_close(torch.cat([items[0].pixel_values, items[2].pixel_values]), ref["pixel_values"])
    videos = torch.cat([items[1].pixel_values, items[3].pixel_values, items[4].pixel_values])
    torch.testing.assert_close(videos, ref["pixel_values_videos"])


def test_placeholder_count_must_match_items(cfg, hf):
    tok = hf["tokenizer"]
    image = process_image(image_bytes(64, 64), cfg, LIMITS)
    ids = tok.encode("<|vision_start|><|image_pad|><|vision_end|>" * 2, add_special_tokens=False)
    with pytest.raises(MediaError, match="2 image placeholder.*1 image"):
        expand_prompt_ids(ids, [image], tok)
    with pytest.raises(MediaError, match="0 video placeholder.*1 video"):
        expand_prompt_ids(ids, [image, image, process_video(clip("mpeg4-3f"), cfg, LIMITS)], tok)


def test_vision_tokens_are_checked_against_config_ids(hf):
    tok = hf["tokenizer"]
    tokens = VisionTokens.from_tokenizer(tok, {"image_token_id": tok.convert_tokens_to_ids("<|image_pad|>")})
    assert tokens.video_pad == tok.convert_tokens_to_ids("<|video_pad|>")
    with pytest.raises(ValueError, match="image_token_id"):
        VisionTokens.from_tokenizer(tok, {"image_token_id": 7})


# --- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,match",
    [
        (garbage(), "could not decode image"),
        (image_bytes(200, 150, fmt="JPEG")[:4000], "corrupt or truncated"),
        (image_bytes(200, 150)[:40000], "corrupt or truncated"),
        (b"", "empty"),
        (image_bytes(402, 2), "aspect ratio must be at most 200"),
    ],
    ids=["garbage", "truncated-jpeg", "truncated-png", "empty", "aspect-201"],
)
def test_bad_images(cfg, data, match):
    with pytest.raises(MediaError, match=match):
        process_image(data, cfg, LIMITS)


def test_aspect_ratio_is_an_error_in_transformers_too(hf):
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_image(hf["image"], image_bytes(402, 2))


def test_image_limits(cfg):
    data = image_bytes(300, 200)
    with pytest.raises(MediaError, match="at most 50000 pixels"):
        process_image(data, cfg, MediaLimits(max_source_pixels=50_000))
    with pytest.raises(MediaError, match="at most 1000"):
        process_image(data, cfg, MediaLimits(max_bytes=1000))
    with pytest.raises(MediaError, match="visual tokens"):
        process_image(data, cfg, MediaLimits(max_visual_tokens=10))
    with pytest.raises(MediaError, match="above this model's limit of 16384"):
        process_image(data, cfg, LIMITS, {"max_pixels": 20_000})
    with pytest.raises(MediaError, match="unsupported mm_processor_kwargs"):
        process_image(data, cfg, LIMITS, {"patch_size": 8})
    small = process_image(data, cfg, LIMITS, {"max_pixels": 5000, "fps": 1})  # fps is a video key: ignored
    assert (small.grid_thw, small.num_tokens) == ((1, 2, 4), 2)  # 32x64 pixels
    with pytest.raises(MediaError, match="need 4 visual tokens; the server allows 3"):
        check_visual_tokens([small, small], MediaLimits(max_visual_tokens=3))


def _faststart_truncated(tmp_path: Path) -> bytes:
    data = video_bytes(30, 64, 48, path=tmp_path / "fs.mp4", options={"movflags": "faststart"})
    return data[: len(data) * 2 // 3]


def _audio_only() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return buf.getvalue()


def _zero_frames() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
    return buf.getvalue()


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda tmp: garbage(), "could not open video"),
        (lambda tmp: clip("h264-30f")[: len(clip("h264-30f")) // 2], "could not open video"),
        (_faststart_truncated, "corrupt or truncated|truncated"),
        (lambda tmp: _zero_frames(), "no decodable frames"),
        (lambda tmp: _audio_only(), "no video stream"),
        (lambda tmp: image_bytes(64, 48), "needs at least 2"),
    ],
    ids=["garbage", "truncated-moov-at-end", "truncated-faststart", "zero-frames", "audio-only", "one-frame-png"],
)
def test_bad_videos(cfg, tmp_path, make, match):
    with pytest.raises(MediaError, match=match):
        process_video(make(tmp_path), cfg, LIMITS)


@pytest.mark.parametrize(
    "limits,overrides,match",
    [
        (MediaLimits(max_source_frames=20), {}, "30 frames; the server decodes at most 20"),
        (MediaLimits(max_source_pixels=1000), {}, "at most 1000 pixels per frame"),
        (MediaLimits(max_frames=16), {"num_frames": 17}, r"num_frames must be in \[2, 16\]"),
        (MediaLimits(max_frames=16), {"max_frames": 17}, "above the server's limit of 16"),
        (MediaLimits(max_fps=4), {"fps": 5}, r"fps must be a number in \(0, 4"),
        (LIMITS, {"fps": 1, "num_frames": 4}, "mutually exclusive"),
        (LIMITS, {"num_frames": 1}, r"num_frames must be in \[2"),
        (LIMITS, {"fps": "fast"}, "fps must be a number"),
        (LIMITS, {"size": {"longest_edge": 10**9}}, "max_pixels=1000000000 is above this model's limit"),
        (LIMITS, {"size": {"shortest_edge": 10**9}}, "min_pixels=1000000000 is above this model's limit"),
        (LIMITS, {"min_frames": 9, "max_frames": 8}, "min_frames=9 is above max_frames=8"),
    ],
)
def test_video_limits_and_overrides(cfg, limits, overrides, match):
    with pytest.raises(MediaError, match=match):
        process_video(clip("h264-30f"), cfg, limits, overrides)


@pytest.mark.parametrize(("n", "rate"), [(6, None), (7, 2.5)], ids=["even-default-fps", "odd-fps-2.5"])
def test_frame_list_equals_transformers_without_sampling(cfg, hf, n, rate):
    """vLLM's data:video/jpeg frames go to the processor with do_sample_frames=False and fps 1 unless given."""
    from transformers.video_utils import VideoMetadata

    frames = [image_bytes(96, 64, fmt="JPEG", seed=i) for i in range(n)]
    overrides = {} if rate is None else {"fps": rate}
    ours = process_frame_list(frame_list(frames), cfg, LIMITS, overrides)
    decoded = np.stack([np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in frames])
    fps = rate or 1.0
    out = hf["video"](
        torch.from_numpy(decoded).permute(0, 3, 1, 2),
        video_metadata=VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(range(n))),
        do_sample_frames=False,
        return_tensors="pt",
        cap_pixels_per_frame=False,
    )
    assert ours.grid_thw == tuple(out["video_grid_thw"][0].tolist()) and ours.grid_thw[0] == -(-n // 2)
    assert list(ours.timestamps) == _hf_timestamps(np.arange(n), fps, 2)
    torch.testing.assert_close(ours.pixel_values, out["pixel_values_videos"], atol=1e-6, rtol=0)
    assert process_frame_list(frame_list(frames), cfg, LIMITS, {"fps": 4}).key != ours.key  # the rate is in the key


def frame_list_bytes(url: str, max_frames: int = LIMITS.max_frames) -> list[bytes]:
    parts = split_frame_list(url, LIMITS.max_bytes, max_frames)
    return [frame_bytes(parts, i) for i in range(len(parts))]


def test_frame_list_urls_and_their_refusals(cfg):
    frames = [image_bytes(64, 64, fmt="JPEG", seed=i) for i in range(3)]
    parts = [base64.b64encode(f).decode() for f in frames]
    url = frame_list(frames)
    assert is_frame_list(url) and not is_frame_list("data:video/mp4;base64,AAAA")
    assert frame_list_bytes(url) == frames
    with pytest.raises(MediaError, match="takes at most 2"):
        split_frame_list(url, LIMITS.max_bytes, 2)
    with pytest.raises(MediaError, match="more than 1000 bytes"):
        split_frame_list(url, 1000, 8)
    bad = f"data:video/jpeg;base64,{parts[0]},!!{parts[1]}"
    with pytest.raises(MediaError, match="frame 1 of the data:video/jpeg frame list is not valid base64"):
        frame_list_bytes(bad)
    with pytest.raises(MediaError, match="^frame 1 of the data:video/jpeg frame list is not valid base64"):
        process_frame_list(bad, cfg, LIMITS)  # named once, not wrapped as a JPEG error
    with pytest.raises(MediaError, match="frame 1 of the data:video/jpeg frame list is empty"):
        process_frame_list(f"data:video/jpeg;base64,{parts[0]},,{parts[2]}", cfg, LIMITS)
    wrapped = [base64.encodebytes(f).decode() for f in frames]  # a line break every 76 characters
    assert "\n" in wrapped[0]
    assert frame_list_bytes("data:video/jpeg;base64," + ",".join(wrapped)) == frames
    with pytest.raises(MediaError, match="frame 2 of the data:video/jpeg frame list is not valid base64"):
        frame_list_bytes(f"data:video/jpeg;base64,{wrapped[0]},{wrapped[1]},{wrapped[2]}!")
    with pytest.raises(MediaError, match="frame 1 of the frame list is 32x64, frame 0 is 64x64"):
        process_frame_list(frame_list([frames[0], image_bytes(32, 64, fmt="JPEG")]), cfg, LIMITS)
    with pytest.raises(MediaError, match="frame 0 of the frame list: could not decode image"):
        process_frame_list(frame_list([garbage()]), cfg, LIMITS)
    with pytest.raises(MediaError, match="the frame list has 3 frames of 64x64"):  # planned before the 2nd decode
        process_frame_list(url, cfg, MediaLimits(max_decode_pixels=2 * 64 * 64))


def test_a_frame_list_sent_again_is_served_from_the_cache_without_decoding(cfg, monkeypatch):
    """The three task adapters' requests about one video: the second finds the first's rows by the URL's text,
    decoding neither its base64 nor its JPEGs; the same frames at another rate are another item."""
    url = frame_list([image_bytes(96, 64, fmt="JPEG", seed=i) for i in range(5)])
    cache = ProcessedCache(1 << 30)
    first = process_frame_list(url, cfg, LIMITS, cache=cache)

    def refuse(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(media_processor, "frame_bytes", refuse)
    again = process_frame_list(url, cfg, LIMITS, cache=cache)
    assert again is first and (cache.hits, cache.misses) == (1, 1)
    with pytest.raises(AssertionError, match="decoded again"):
        process_frame_list(url, cfg, LIMITS, {"fps": 4}, cache=cache)


def test_a_frame_list_with_broken_base64_is_refused_before_any_jpeg_is_decoded(cfg, monkeypatch):
    frames = [image_bytes(64, 64, fmt="JPEG", seed=i) for i in range(6)]
    decoded = []
    decode = media_image.decode_image
    monkeypatch.setattr(media_image, "decode_image", lambda data, *a, **k: decoded.append(1) or decode(data, *a, **k))
    with pytest.raises(MediaError, match="^frame 6 of the data:video/jpeg frame list is not valid base64"):
        process_frame_list(frame_list(frames) + ",not*base64", cfg, LIMITS)
    assert decoded == []


def test_the_frame_pool_takes_its_size_from_the_server(cfg, monkeypatch):
    """`--media-frame-threads N`: a video's frames run on N threads, and a bad N is refused at start."""
    names = set()
    decode = media_image.decode_image

    def recorded(*args, **kwargs):
        names.add(threading.current_thread().name)
        time.sleep(0.01)  # long enough for every thread of the pool to take a frame
        return decode(*args, **kwargs)

    monkeypatch.setattr(media_image, "decode_image", recorded)
    try:
        pools = MediaPools(decode_threads=1, frame_threads=3)
        assert pools.sizes["frame_threads"] == 3
        process_frame_list(frame_list([image_bytes(64, 64, fmt="JPEG", seed=i) for i in range(12)]), cfg, LIMITS)
        names.discard(threading.current_thread().name)  # frame 0, decoded first for the video's size
        assert len(names) == 3 and all(n.startswith("hylora-media-frames") for n in names)
        pools.close()
    finally:
        set_frame_threads(None)
    with pytest.raises(ValueError, match="frame_threads must be a positive integer"):
        MediaPools(frame_threads=0)


def test_a_broken_frame_stops_its_frame_list(cfg, monkeypatch):
    """The frames queued behind a broken one are dropped, not decoded for a request that already failed
    (they share one frame pool with every other request's videos)."""
    good = image_bytes(64, 64, fmt="JPEG")
    frames = [good, garbage(), *[good] * 62]
    decoded = []
    decode = media_image.decode_image

    def counted(data, *args, **kwargs):
        decoded.append(data)
        if data != frames[1]:
            time.sleep(0.005)
        return decode(data, *args, **kwargs)

    monkeypatch.setattr(media_image, "decode_image", counted)
    with pytest.raises(MediaError, match="frame 1 of the frame list: could not decode image"):
        process_frame_list(frame_list(frames), cfg, LIMITS)
    time.sleep(0.5)  # what was still queued would have run by now (62 × 5 ms on the pool's threads)
    assert len(decoded) < len(frames) // 2, f"{len(decoded)} of {len(frames)} frames decoded"


def test_vllm_option_spellings_merge_like_vllm(cfg):
    data = clip("h264-30f")
    base = process_video(data, cfg, LIMITS)
    assert process_video(data, cfg, LIMITS, {"use_fast": True}).key == base.key  # accepted, no effect
    # media_io_kwargs' num_frames -1 (vLLM: the loader keeps every frame) is hylora's default
    assert merge_overrides({"fps": 1}, {"video": {"num_frames": -1}, "image": {}}) == {"fps": 1}
    assert merge_overrides(None, {"video": {"num_frames": 8}}) == {"num_frames": 8}
    with pytest.raises(MediaError, match=r"media_io_kwargs\['image'\] \['x'\]"):  # the field it came in
        merge_overrides(None, {"image": {"x": 1}})
    with pytest.raises(MediaError, match="min_pixels=9000 is above max_pixels=5000"):
        apply_overrides(cfg.image, {"min_pixels": 9000, "max_pixels": 5000}, LIMITS)
    # a request's fps replaces the server's default num_frames, and the other way round
    assert layer_overrides({"num_frames": 8, "max_frames": 20}, {"fps": 1}) == {"max_frames": 20, "fps": 1}
    assert layer_overrides({"fps": 1}, {"num_frames": 4}) == {"num_frames": 4}
    assert layer_overrides({"fps": 1}, None) == {"fps": 1}
    # launch lines' `{"truncation": false}` (hylora never truncates) and `{"do_sample_frames": false}`: every frame
    assert process_video(data, cfg, LIMITS, {"truncation": False}).key == base.key
    with pytest.raises(MediaError, match="never truncates"):
        apply_overrides(cfg.video, {"truncation": True}, LIMITS)
    every = process_video(data, cfg, LIMITS, {"do_sample_frames": False})
    assert every.grid_thw[0] * cfg.video.temporal_patch_size == 30 > base.grid_thw[0] * 2  # all 30 frames
    with pytest.raises(MediaError, match="30 frames sampled; the server takes at most 16"):
        process_video(data, cfg, MediaLimits(max_frames=16), {"do_sample_frames": False})
    with pytest.raises(MediaError, match="do_sample_frames must be true or false"):
        apply_overrides(cfg.video, {"do_sample_frames": "no"}, LIMITS)


def test_frame_count_of_a_zero_frame_header_stops_at_the_cap(cfg):
    with pytest.raises(MediaError, match="more than 8 frames"):
        process_video(clip("vp8-webm-12f"), cfg, MediaLimits(max_source_frames=8))


def test_server_max_frames_caps_the_checkpoint_default(cfg):
    long = process_video(clip("h264-30f"), cfg, LIMITS, {"fps": 10})
    capped = process_video(clip("h264-30f"), cfg, MediaLimits(max_frames=8), {"fps": 10})
    assert (long.grid_thw[0], capped.grid_thw[0]) == (15, 4)


def test_cache_key_covers_bytes_and_effective_parameters(cfg):
    data = clip("h264-30f")
    base = process_video(data, cfg, LIMITS)
    assert process_video(data, cfg, LIMITS, {"fps": 2}).key == base.key  # same effective parameters
    assert process_video(data, cfg, LIMITS, {"fps": 1}).key != base.key
    assert process_video(clip("mpeg4-3f"), cfg, LIMITS).key != base.key
    image = image_bytes(64, 64)
    assert process_image(image, cfg, LIMITS).key == process_image(image, cfg, LIMITS, {"fps": 1}).key
    assert process_image(image, cfg, LIMITS).key != process_image(image, cfg, LIMITS, {"max_pixels": 8192}).key


# --- fetching -----------------------------------------------------------------------------------------------


def test_data_urls():
    payload = image_bytes(8, 8)
    url = "data:image/png;base64," + base64.b64encode(payload).decode()
    assert fetch_bytes(url, FetchPolicy(), 10_000) == payload
    for bad, match in [
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        ("data:text/plain,hello", "must look like data:<mime>;base64"),
        (url, "more than 100 bytes"),
    ]:
        with pytest.raises(MediaError, match=match):
            fetch_bytes(bad, FetchPolicy(), 100)
    # line breaks are allowed and do not count against the size limit
    wrapped = "data:image/png;base64," + base64.encodebytes(payload).decode().replace("\n", "\r\n")
    assert fetch_bytes(wrapped, FetchPolicy(), len(payload)) == payload
    with pytest.raises(MediaError, match="not valid base64"):
        fetch_bytes(wrapped + "%", FetchPolicy(), 10_000)


def test_file_urls_only_under_the_allowed_root(tmp_path):
    root, outside = tmp_path / "media", tmp_path / "secret"
    root.mkdir()
    outside.mkdir()
    (root / "a.png").write_bytes(b"inside")
    (outside / "b.png").write_bytes(b"outside")
    (root / "link.png").symlink_to(outside / "b.png")
    (root / "sub").mkdir()
    policy = FetchPolicy(allowed_local_root=root)
    assert fetch_bytes((root / "a.png").as_uri(), policy, 100) == b"inside"
    messages = set()
    for path in [
        outside / "b.png",  # exists, outside
        outside / "missing.png",
        root / "link.png",  # a symlink out
        root / ".." / "secret" / "b.png",
        root / "missing.png",
        root / "sub",  # a directory
        outside,
    ]:
        with pytest.raises(MediaError, match="no readable file") as e:
            fetch_bytes("file://" + str(path), policy, 100)
        messages.add(str(e.value).replace(str(path), "PATH"))
        assert str(root) not in str(e.value).replace(str(path), "")
    assert len(messages) == 1, messages  # no existence oracle: one answer, the root never named
    with pytest.raises(MediaError, match="at most 3"):
        fetch_bytes((root / "a.png").as_uri(), policy, 3)
    with pytest.raises(MediaError, match="file:// URLs are disabled"):
        fetch_bytes((root / "a.png").as_uri(), FetchPolicy(), 100)


async def _chunks(*parts: bytes):
    for part in parts:
        yield part


def test_http_only_to_allowed_hosts_with_cap_and_timeout():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.path == "/img":
            return httpx.Response(200, content=_chunks(b"x" * 50))
        if request.url.path == "/hop":
            return httpx.Response(302, headers={"location": "https://evil.test/img"})
        if request.url.path == "/big":
            return httpx.Response(200, headers={"content-length": "5000"}, content=_chunks(b"x" * 5000))
        if request.url.path == "/stream":
            return httpx.Response(200, content=_chunks(b"x" * 60, b"x" * 60))
        if request.url.path == "/slow":
            raise httpx.ReadTimeout("slow", request=request)
        return httpx.Response(404)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    policy = FetchPolicy(allowed_domains=frozenset({"media.test"}), timeout_s=1.0)
    assert fetch_bytes("https://media.test/img", policy, 100, client) == b"x" * 50
    for url, match in [
        ("https://other.test/img", "host 'other.test' is not allowed"),
        ("https://media.test/hop", "host 'evil.test' is not allowed"),
        ("https://media.test/big", "5000 bytes; the server accepts at most 100"),
        ("https://media.test/stream", "larger than 100 bytes"),
        ("https://media.test/slow", "timed out"),
        ("https://media.test/nothing", "HTTP 404"),
        ("ftp://media.test/img", "unsupported media URL scheme"),
    ]:
        with pytest.raises(MediaError, match=match):
            fetch_bytes(url, policy, 100, client)
    assert not any("other.test" in u or "evil.test" in u for u in seen)


def test_process_frames_equals_process_video_on_the_decoded_frames():
    from hylora.media.processor import process_frames

    data = video_bytes(14, 96, 64, fps=4)
    frames, fps = decode_all(data)
    cfg = MediaConfig()
    a = process_video(data, cfg, MediaLimits())
    b = process_frames(frames, fps, cfg, MediaLimits())
    assert a.grid_thw == b.grid_thw and a.timestamps == b.timestamps
    assert torch.equal(a.pixel_values, b.pixel_values)
