"""A request's images and videos, as the engine schedules them: encoder segments and their rows.

The vision tower is separable by temporal patch (attention is per temporal patch, positions depend
only on the frame's h and w), so a video is encoded one segment — one temporal patch — at a time,
as the prefill reaches it; an image is one segment. A segment's output rows land on one contiguous
run of placeholder tokens of the prompt (a video's runs are separated by timestamp text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hylora.config import VisionConfig
from hylora.media.processor import ProcessedMedia
from hylora.model.mrope import MRopePositions, mrope_positions, token_runs

SegmentId = tuple[int, int]  # (item index in the prompt, temporal patch)


@dataclass(frozen=True)
class Segment:
    item: int
    t: int
    start: int  # prompt index of its first placeholder token
    num_tokens: int  # placeholder tokens (= tower output rows)

    @property
    def id(self) -> SegmentId:
        return (self.item, self.t)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class MultimodalPrompt:
    """The media of one prompt (in prompt order), where their rows go, and the prompt's M-RoPE."""

    items: list[ProcessedMedia]
    segments: list[Segment]  # in prompt order
    positions: MRopePositions
    # the segments' tower outputs this request holds ([num_tokens, hidden] each), until prefill passes them
    ready: dict[SegmentId, torch.Tensor] = field(default_factory=dict)

    @property
    def num_visual_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    def segments_in(self, start: int, end: int) -> list[Segment]:
        """Segments with at least one placeholder token in prompt tokens [start, end)."""
        return [s for s in self.segments if s.start < end and s.end > start]

    def pixels(self, segment: Segment, device: torch.device | str = "cpu") -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The tower's input rows of one segment, on `device`, and its (1, h, w) grid."""
        item = self.items[segment.item]
        _, h, w = item.grid_thw
        rows = h * w
        return item.rows(segment.t * rows, (segment.t + 1) * rows, device), (1, h, w)

    def chunk_embeds(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(offsets from `start`, rows) of the visual tokens in [start, end), from `ready` — the form
        SequenceChunk.embeds takes. Every segment in the window must be ready."""
        offsets, values = [], []
        for s in self.segments_in(start, end):
            lo, hi = max(s.start, start), min(s.end, end)
            offsets.append(torch.arange(lo, hi) - start)
            values.append(self.ready[s.id][lo - s.start : hi - s.start])
        if not offsets:
            return None
        return torch.cat(offsets), torch.cat(values)

    def release_before(self, computed: int) -> None:
        """Drop the outputs of segments the prefill has passed (they are in the caches now)."""
        for s in self.segments:
            if s.end <= computed:
                self.ready.pop(s.id, None)


def build_multimodal_prompt(
    ids: Sequence[int], items: Sequence[ProcessedMedia], vision: VisionConfig
) -> MultimodalPrompt:
    """Segments and positions of an expanded prompt (each item's placeholder runs in place, images
    and videos each in prompt order). Raises ValueError when the runs do not fit the items."""
    images = [i for i, item in enumerate(items) if item.kind == "image"]
    videos = [i for i, item in enumerate(items) if item.kind == "video"]
    # every placeholder run in order: one per image, one per temporal patch of a video
    expected = {
        vision.image_token_id: [(i, 0, items[i].num_tokens) for i in images],
        vision.video_token_id: [(i, t, items[i].tokens_per_frame) for i in videos for t in range(items[i].grid_thw[0])],
    }
    queues = {token: iter(runs) for token, runs in expected.items()}
    segments: list[Segment] = []
    for token, pos, run_end in token_runs(ids, queues):
        if token == -1:
            continue
        left = run_end - pos
        while left > 0:  # adjacent runs of the same kind (two images back to back) split by their sizes
            item, t, n = next(queues[token], (None, 0, 0))
            if item is None or n > left:
                raise ValueError("the prompt's image / video placeholder tokens do not fit its media")
            segments.append(Segment(item, t, pos + (run_end - pos - left), n))
            left -= n
    if any(next(q, None) is not None for q in queues.values()):
        raise ValueError("some images / videos have no placeholder tokens in the prompt")
    positions = mrope_positions(ids, vision, [items[i].grid_thw for i in images], [items[i].grid_thw for i in videos])
    return MultimodalPrompt(items=list(items), segments=segments, positions=positions)
