"""A prompt's visual embeddings: the tower's output rows placed at its image / video placeholder tokens.

A request's media are encoded once; each prefill chunk then takes the rows that fall inside it
(`PromptEmbeds.window`), so a chunk may start or end anywhere inside a run of visual tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylora.config import VisionConfig
from hylora.model.vision import VisionTower


@dataclass(frozen=True)
class PromptEmbeds:
    rows: torch.Tensor  # [K] long, ascending prompt indices of the placeholder tokens (CPU)
    values: torch.Tensor  # [K, hidden] their embeddings

    def window(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(offsets from `start`, values) of the rows in tokens start .. end-1; None if there are none
        — the form SequenceChunk.embeds takes."""
        lo, hi = torch.searchsorted(self.rows, torch.tensor([start, end])).tolist()
        if lo == hi:
            return None
        return self.rows[lo:hi] - start, self.values[lo:hi]


def placeholder_embeds(
    token_ids: Sequence[int],
    vision: VisionConfig,
    image_embeds: torch.Tensor | None = None,
    video_embeds: torch.Tensor | None = None,
) -> PromptEmbeds:
    """Place image rows at the image tokens and video rows at the video tokens, each in order.
    The counts must match exactly."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    rows, values = [], []
    for name, token, embeds in (
        ("image", vision.image_token_id, image_embeds),
        ("video", vision.video_token_id, video_embeds),
    ):
        at = (ids == token).nonzero()[:, 0]
        count = 0 if embeds is None else embeds.shape[0]
        if len(at) != count:
            raise ValueError(f"the prompt has {len(at)} {name} placeholder tokens but the {name}s give {count} rows")
        if count:
            rows.append(at)
            values.append(embeds)
    if not rows:
        return PromptEmbeds(torch.zeros(0, dtype=torch.long), torch.zeros(0, vision.out_hidden_size))
    rows_t, values_t = torch.cat(rows), torch.cat([v.to(values[0].device) for v in values])
    order = rows_t.argsort()
    return PromptEmbeds(rows_t[order], values_t[order.to(values_t.device)])


@torch.inference_mode()
def encode_media(
    tower: VisionTower,
    token_ids: Sequence[int],
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> PromptEmbeds:
    """Run the tower once over a prompt's images and videos and place the rows at its placeholders."""
    pairs = ((pixel_values, image_grid_thw), (pixel_values_videos, video_grid_thw))
    items = [(p, g) for p, g in pairs if p is not None]
    if not items:
        return placeholder_embeds(token_ids, tower.config)
    if any(g is None for _, g in items):
        raise ValueError("pixel values need their grid_thw")
    device = tower.patch_embed.proj.weight.device
    out = tower(torch.cat([p.to(device) for p, _ in items]), torch.cat([g for _, g in items]))
    unit = tower.config.merge_unit
    image_rows = 0 if pixel_values is None else int(image_grid_thw.prod(-1).sum()) // unit
    image, video = out[:image_rows], out[image_rows:]
    return placeholder_embeds(
        token_ids,
        tower.config,
        image if pixel_values is not None else None,
        video if pixel_values_videos is not None else None,
    )
