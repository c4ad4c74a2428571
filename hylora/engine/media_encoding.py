"""The vision tower's part of a step: every media segment the step's chunks need, from the encoder
cache or encoded (one tower call for all of them); a request whose media fail to encode fails
alone, and a device fault escapes.

The tower's output is checked for NaN/Inf after the step that reads it is queued (`settle`): the host
builds and queues the step while the tower runs, instead of waiting for the tower first. A request
whose rows are not finite then fails with its rows in that step; each row of a forward reads only
its own request's, and the read of the step drops a finished request's."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from hylora.engine.encoder_cache import EncoderCache
from hylora.engine.errors import DeviceFault, is_device_error
from hylora.engine.host_copy import HostCopy
from hylora.engine.multimodal import Segment
from hylora.engine.request import FailureKind, Request
from hylora.engine.scheduler import ScheduledChunk
from hylora.model.decoder import HybridDecoder

# fail(request, message, why) ends the request with that error and returns its final output
Fail = Callable[[Request, str, FailureKind], object]
Use = tuple[Request, Segment]  # a request that needs a segment


@dataclass
class EncodedMedia:
    """The segments a step's `prepare` encoded, their finiteness on its way to the host."""

    finite: HostCopy  # [segments] bool
    segments: list[tuple[Hashable, list[Use], torch.Tensor]]  # (cache key, its users, its rows)


def media_key(req: Request, seg: Segment) -> tuple:
    """Encoder-cache key: the media content and preprocessing, the temporal patch, and the adapter
    version when it changes the tower."""
    version = req.lora.version if req.lora is not None else None
    tower = (version.name, version.version) if version is not None and version.has_tower_lora else None
    return (req.mm.items[seg.item].key, seg.t, tower)  # type: ignore[union-attr]


class MediaEncoder:
    def __init__(self, model: HybridDecoder, cache: EncoderCache, fail: Fail):
        self.model, self.cache, self.fail = model, cache, fail

    def prepare(
        self, chunks: list[ScheduledChunk], step: int
    ) -> tuple[list[ScheduledChunk], list, EncodedMedia | None]:
        """(the chunks whose media are ready, the final outputs of the requests that failed, the
        segments encoded now). A segment several chunks need (one video sent to several adapters in
        the same step) is encoded once. Encoded rows are handed to their requests before they are known
        to be finite: queue the step, then `settle` them."""
        todo: dict[Hashable, list[Use]] = {}
        for c in chunks:
            for seg in c.media:
                key = media_key(c.request, seg)
                if key in todo:  # another chunk of this step encodes it
                    todo[key].append((c.request, seg))
                    self.cache.hits += 1
                    continue
                cached = self.cache.get(key)
                if cached is not None:
                    c.request.mm.ready[seg.id] = cached  # type: ignore[union-attr]
                else:
                    todo[key] = [(c.request, seg)]
        failed: dict[str, object] = {}
        encoded: list[tuple[Hashable, list[Use], torch.Tensor]] = []
        if todo:
            self._encode(list(todo.items()), failed, encoded, step)
        ready = [c for c in chunks if c.request.request_id not in failed]
        if not encoded:
            return ready, list(failed.values()), None
        finite = HostCopy(torch.stack([torch.isfinite(rows).all() for _, _, rows in encoded]))
        return ready, list(failed.values()), EncodedMedia(finite, encoded)

    def settle(self, encoded: EncodedMedia | None) -> list:
        """Read the finiteness of the segments `prepare` encoded (waiting for the tower, not for the
        step queued behind it): a request given non-finite rows fails (its rows in the queued step are
        dropped when the step is read: no other row reads them), finite rows enter the encoder cache.
        The final outputs of the requests that failed."""
        if encoded is None:
            return []
        failed: dict[str, object] = {}
        for (key, uses, rows), finite in zip(encoded.segments, encoded.finite.values()[0], strict=True):
            if finite:
                self.cache.put(key, rows)
                continue
            for req, seg in uses:
                if req.finished or req.request_id in failed:
                    continue
                message = (
                    f"numerical fault: non-finite values (NaN/Inf) in the vision tower output of request "
                    f"{req.request_id!r} (media item {seg.item}, temporal patch {seg.t}); other requests "
                    "are unaffected"
                )
                failed[req.request_id] = self.fail(req, message, FailureKind.NUMERICAL_FAULT)
        return list(failed.values())

    @torch.inference_mode()
    def _encode(
        self,
        todo: list[tuple[Hashable, list[Use]]],
        failed: dict[str, object],
        encoded: list[tuple[Hashable, list[Use], torch.Tensor]],
        step: int,
    ) -> None:
        """Encode each key's segment once (with its first user's pixels and tower adapter: the key holds
        both) and hand the rows to every user."""
        firsts = [uses[0] for _, uses in todo]
        try:
            pieces = [req.mm.pixels(seg, self.model.device) for req, seg in firsts]  # type: ignore[union-attr]
            pixels = torch.cat([p for p, _ in pieces])
            grids = torch.tensor([g for _, g in pieces])
            slots = [req.lora.tower_slot if req.lora is not None else -1 for req, _ in firsts]
            out = self.model.visual(pixels, grids, slots).split([seg.num_tokens for _, seg in firsts])  # type: ignore[misc]
        except Exception as e:
            if is_device_error(e):
                raise DeviceFault(f"device fault in the vision tower at engine step {step}: {e}") from e
            if len(todo) > 1:  # find the media that break it: encode each alone
                for entry in todo:
                    self._encode([entry], failed, encoded, step)
                return
            for req, _ in todo[0][1]:
                if req.request_id not in failed:
                    failed[req.request_id] = self.fail(req, f"encoding its media failed: {e!r}", FailureKind.INTERNAL)
            return
        for (key, uses), rows in zip(todo, out, strict=True):
            for req, seg in uses:
                if req.request_id not in failed:
                    req.mm.ready[seg.id] = rows  # type: ignore[union-attr]
            encoded.append((key, uses, rows))
