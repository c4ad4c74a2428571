"""M-RoPE positions of one prompt with images and videos (per request; nothing kept on the model).

Runs of text take `cur + arange` on all three axes. A run of placeholder tokens is one (1, H, W)
grid in patches: temporal = cur, height = cur + row, width = cur + col over the (H/m) x (W/m) merged
tokens in row-major order, then cur += max(H, W) / m. A video grid (T, H, W) is T such grids, one
per temporal patch, because timestamp text separates the temporal patches in the prompt. Generated
token i (i >= prompt length) sits at i + delta on all three axes, delta = max(prompt) + 1 - length.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hylora.config import VisionConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches, as the vision tower's grid_thw


@dataclass(frozen=True)
class MRopePositions:
    prompt: torch.Tensor  # [3, L] long: temporal / height / width position of each prompt token
    delta: int  # token i >= L sits at i + delta on all three axes

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[1])

    def window(self, start: int, end: int) -> torch.Tensor:
        """Positions [3, end - start] of sequence tokens start .. end-1 (prompt, then generated)."""
        if not 0 <= start < end:
            raise ValueError(f"empty or negative window [{start}, {end})")
        L = self.prompt_len
        parts = []
        if start < L:
            parts.append(self.prompt[:, start : min(end, L)])
        if end > L:
            parts.append((torch.arange(max(start, L), end) + self.delta).expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def mrope_positions(
    token_ids: Sequence[int],
    vision: VisionConfig,
    image_grids: Sequence[Grid] | torch.Tensor = (),
    video_grids: Sequence[Grid] | torch.Tensor = (),
) -> MRopePositions:
    """Positions of a prompt whose image / video placeholder runs stand for `image_grids` /
    `video_grids` (each in prompt order). Raises ValueError when runs and grids do not match."""
    if not len(token_ids):
        raise ValueError("empty prompt")
    m = vision.spatial_merge_size
    grids: dict[int, Iterator[Grid]] = {
        vision.image_token_id: iter(_as_grids(image_grids)),
        vision.video_token_id: iter(g for t, h, w in _as_grids(video_grids) for g in [(1, h, w)] * t),
    }
    pieces, cur = [], 0
    for token, start, end in token_runs(token_ids, grids):
        n = end - start
        if token == -1:  # text
            pieces.append((torch.arange(n) + cur).expand(3, n))
            cur += n
            continue
        kind = "image" if token == vision.image_token_id else "video frame"
        grid = next(grids[token], None)
        if grid is None:
            raise ValueError(f"the prompt has more {kind} placeholder runs than {kind} grids")
        gh, gw = grid[1] // m, grid[2] // m
        if n != gh * gw:
            raise ValueError(f"a run of {n} {kind} placeholder tokens does not fit its grid {grid} ({gh * gw} tokens)")
        t = torch.full((gh, gw), cur)
        h = (torch.arange(gh)[:, None] + cur).expand(gh, gw)
        w = (torch.arange(gw)[None, :] + cur).expand(gh, gw)
        pieces.append(torch.stack([t, h, w]).reshape(3, n))
        cur += max(gh, gw)
    for token, rest in grids.items():
        if (left := sum(1 for _ in rest)) > 0:
            kind = "image" if token == vision.image_token_id else "video frame"
            raise ValueError(f"{left} {kind} grid(s) have no placeholder run in the prompt")
    prompt = torch.cat(pieces, dim=1)
    return MRopePositions(prompt, int(prompt.max()) + 1 - len(token_ids))


def token_runs(token_ids: Sequence[int], placeholders: Iterable[int]) -> list[tuple[int, int, int]]:
    """The prompt as maximal runs (token, start, end): a run of one placeholder id (`placeholders`), or
    of text (token -1). In numpy: a Python loop over a video prompt's ~9k ids cost milliseconds a request."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size == 0:
        return []
    key = np.where(np.isin(ids, np.fromiter(placeholders, dtype=np.int64)), ids, -1)
    bounds = np.flatnonzero(key[1:] != key[:-1]) + 1
    starts = [0, *bounds.tolist()]
    ends = [*bounds.tolist(), len(ids)]
    return [(int(key[a]), a, b) for a, b in zip(starts, ends, strict=True)]


def _as_grids(grids: Sequence[Grid] | torch.Tensor) -> list[Grid]:
    rows = grids.tolist() if isinstance(grids, torch.Tensor) else grids
    return [(int(t), int(h), int(w)) for t, h, w in rows]
