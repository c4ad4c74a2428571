"""Multimodal prompts built by hand (token ids, random pixel rows, grids) and the transformers reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from hylora.demo import write_tokenizer
from tests.conftest import randomise, text_config

# The demo tokenizer's ids of <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|> (vocab 320).
VISION_START, VISION_END, IMAGE, VIDEO = 316, 317, 318, 319
TOKEN_IDS = dict(
    vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, image_token_id=IMAGE, video_token_id=VIDEO
)
# A 10 x 10 position table: the test grids are both smaller and larger than it.
VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=100
)
PATCH_DIM = 3 * 2 * 16 * 16
MERGE = 2


def write_vl_media(path: Path, seed: int = 0, **vision_overrides):
    """A tiny VL checkpoint whose media token ids fit the 320-token vocabulary."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen3_5Config(text_config=text_config(), vision_config=VISION | vision_overrides, **TOKEN_IDS)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    randomise(model, seed)
    model.save_pretrained(path)
    write_tokenizer(path, cfg.text_config.vocab_size)
    return model


def pixels(grids: list[tuple[int, int, int]], seed: int) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


@dataclass
class Prompt:
    ids: list[int] = field(default_factory=list)
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    video_grids: list[tuple[int, int, int]] = field(default_factory=list)
    pixel_values: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        return torch.tensor(self.image_grids) if self.image_grids else None

    @property
    def video_grid_thw(self) -> torch.Tensor | None:
        return torch.tensor(self.video_grids) if self.video_grids else None

    def visual_runs(self) -> list[tuple[int, int]]:
        """[start, end) of every run of placeholder tokens."""
        runs, start = [], None
        for i, tok in enumerate([*self.ids, -1]):
            if tok in (IMAGE, VIDEO) and start is None:
                start = i
            elif tok not in (IMAGE, VIDEO) and start is not None:
                runs.append((start, i))
                start = None
        return runs


def build_prompt(parts: list[tuple[str, object]], seed: int) -> Prompt:
    """parts: ("text", n) | ("image", (1, h, w)) | ("video", (t, h, w)), laid out as transformers'
    processor expands them (a video: per temporal patch a timestamp, then its own start/end pair,
    all inside the chat template's outer start/end)."""
    g = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(0, VISION_START, (n,), generator=g).tolist()

    p = Prompt()
    for kind, arg in parts:
        if kind == "text":
            p.ids += text(arg)
            continue
        t, h, w = arg
        n = h * w // MERGE**2
        if kind == "image":
            p.ids += [VISION_START] + [IMAGE] * n + [VISION_END]
            p.image_grids.append(arg)
        else:
            p.ids.append(VISION_START)
            for _ in range(t):
                p.ids += text(4) + [VISION_START] + [VIDEO] * n + [VISION_END]
            p.ids.append(VISION_END)
            p.video_grids.append(arg)
    if p.image_grids:
        p.pixel_values = pixels(p.image_grids, seed + 1)
    if p.video_grids:
        p.pixel_values_videos = pixels(p.video_grids, seed + 2)
    return p


def token_types(ids: list[int]) -> torch.Tensor:
    """transformers' mm_token_type_ids: 1 at image tokens, 2 at video tokens, else 0."""
    t = torch.tensor(ids)
    return ((t == IMAGE).int() + 2 * (t == VIDEO).int())[None]


@torch.no_grad()
def hf_vl_logits(ref, prompt: Prompt, extra: list[int] = ()) -> torch.Tensor:
    """transformers' logits [len(prompt) + len(extra), V] for the prompt followed by `extra` tokens."""
    ids = prompt.ids + list(extra)
    out = ref(
        input_ids=torch.tensor([ids]),
        pixel_values=prompt.pixel_values,
        image_grid_thw=prompt.image_grid_thw,
        pixel_values_videos=prompt.pixel_values_videos,
        video_grid_thw=prompt.video_grid_thw,
        mm_token_type_ids=token_types(ids),
    )
    return out.logits[0].float()


def poison_tower(engine, bad: torch.Tensor, kind: str = "nan") -> None:
    """Make `engine`'s vision tower fail on the segment whose pixel rows equal `bad` (as the tower gets
    them, whichever other segments share the call): it raises (`kind` "raise") or gives non-finite rows
    for that segment ("nan"). Every other segment's rows are the tower's own."""
    real = engine.model.visual.forward

    def tower(pixels, grids, slots):
        sizes = [int(g.prod()) for g in grids]  # each segment's pixel rows, in order
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        hit = [i for i, (a, n) in enumerate(zip(starts, sizes, strict=True)) if torch.equal(pixels[a : a + n], bad)]
        if hit and kind == "raise":
            raise RuntimeError("the tower breaks on this video")
        out = real(pixels, grids, slots)
        unit = pixels.shape[0] // out.shape[0]
        for i in hit:
            out[starts[i] // unit : (starts[i] + sizes[i]) // unit] = float("nan")
        return out

    engine.model.visual.forward = tower
