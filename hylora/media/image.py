"""Images: bytes → upright uint8 RGB, Qwen-VL's resize rule, and the flat patch rows the vision tower eats.

Follows transformers' `Qwen2VLImageProcessorPil` (after `load_image`'s EXIF transpose): alpha is composited
onto white, PIL resizes, rescale and normalise run in numpy exactly as there. One deliberate difference:
16-bit grayscale is scaled to 8 bits (PIL's own conversion, used by transformers, clips it to white).

Only the still-image formats in `FORMATS` are opened (a container such as ICO can hold an image larger than
its header says), the size is checked from the header before any pixel is decoded, and Pillow's own
decompression-bomb limit is the server's `max_source_pixels`. An animated image decodes its first frame only.
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import torch
from PIL import Image, ImageOps

from hylora.media import pixels
from hylora.media.budget import CancelFlag
from hylora.media.config import ImageConfig, MediaLimits, VisionParams
from hylora.media.errors import MediaError

MAX_ASPECT_RATIO = 200
CHANNELS = 3  # decoded images are RGB
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # Pillow's names; JPEG includes MPO, PNG APNG
# Pillow warns between MAX_IMAGE_PIXELS and twice that; hylora refuses above it itself (decode_image)
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def decode_image(data: bytes, limits: MediaLimits, cancel: CancelFlag | None = None) -> Image.Image:
    """Decode `data` into an upright RGB image; the size is checked from the header before decoding."""
    Image.MAX_IMAGE_PIXELS = limits.max_source_pixels  # Pillow's backstop: the server's cap, not Pillow's 89 M
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise MediaError(f"image is too large to decode: {e}") from e
    except (OSError, ValueError, SyntaxError) as e:
        raise MediaError(
            f"could not decode image: not a supported format ({', '.join(FORMATS)}) or corrupt ({e})"
        ) from e
    width, height = image.size
    if width * height > limits.max_source_pixels:
        raise MediaError(
            f"image is {width}x{height} = {width * height} pixels; the server accepts at most "
            f"{limits.max_source_pixels} pixels per image"
        )
    if cancel is not None:
        cancel.check()
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        return to_rgb(image)
    except (OSError, ValueError, SyntaxError) as e:
        raise MediaError(f"image data is corrupt or truncated ({e}); send the complete file") from e


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`: transparency composited onto white, everything else PIL's conversion."""
    if image.mode.startswith("I;16"):
        image = Image.fromarray((np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8), mode="L")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image rule: sides rounded to multiples of `factor`, the area brought into
    [min_pixels, max_pixels] (floor when shrinking, ceil when growing), aspect ratio kept."""
    check_aspect_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar == 0 or w_bar == 0:
        raise MediaError(f"image {width}x{height} is too small for this model (min_pixels is {min_pixels})")
    return h_bar, w_bar


def check_aspect_ratio(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            f"image or video is {width}x{height}: the aspect ratio must be at most {MAX_ASPECT_RATIO}:1; "
            "crop or pad it first"
        )


def resize(image: Image.Image, height: int, width: int, resample: int) -> np.ndarray:
    """PIL resize to (height, width); uint8 [H, W, 3]."""
    return np.asarray(image.resize((width, height), resample=Image.Resampling(resample)))


def rescale_and_normalize(pixels: np.ndarray, cfg: VisionParams) -> np.ndarray:
    """uint8 [..., H, W, C] → float32 [..., C, H, W] the way transformers' PIL backend does it
    (rescale in float64, cast, then subtract and divide in float32)."""
    x = np.moveaxis(pixels, -1, -3)
    x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32) if cfg.do_rescale else x.astype(np.float32)
    if cfg.do_normalize:
        x = (x - _channels(cfg.image_mean)) / _channels(cfg.image_std)
    return x


def _channels(values: tuple[float, ...]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)[:, None, None]


def preprocess_image(image: Image.Image, cfg: ImageConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An RGB image → (uint8 rows, grid_thw) with grid_thw = (1, H/patch, W/patch); `pixels.byte_table`
    of `rescale_and_normalize` turns the rows into the tower's input."""
    height, width = smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = resize(image, height, width, cfg.resample)
    rows = pixels.patchify(resized[None], cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return rows, (1, height // cfg.patch_size, width // cfg.patch_size)
