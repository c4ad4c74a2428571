"""Prompt expansion on token ids, equal to transformers 5.25's `Qwen3VLProcessor` expanding the text and tokenizing.

The chat template renders one placeholder per item: `<|vision_start|><|image_pad|><|vision_end|>` or the same
with `<|video_pad|>`. transformers replaces the pad token of an image with `<|image_pad|>` × num_tokens. A
video's wrapper collapses to its pad token (each frame brings a wrapper of its own), which becomes, per temporal
patch, `<{t:.1f} seconds><|vision_start|>` + `<|video_pad|>` × tokens_per_frame + `<|vision_end|>`, as vLLM
serves it too (transformers 5.17-5.24 kept the template's outer wrapper around the frames; docs/MEDIA.md).

Why ids equal: added tokens split the text before pre-tokenisation, so each piece between them is tokenized
alone. A timestamp after a frame sits between two added tokens and is encoded between the same guards. The
first timestamp of a video joins the text piece before it (`Look:<0.5 seconds>`; byte-level BPE may merge
across that join), so that piece is decoded and encoded again with the timestamp.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hylora.media.errors import MediaError
from hylora.media.processor import ProcessedMedia

ROLES = {
    "image": "<|image_pad|>",
    "video": "<|video_pad|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
}


class Tokenizer(Protocol):
    def convert_tokens_to_ids(self, tokens: str) -> int | None: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(
        self, ids: list[int], skip_special_tokens: bool = ..., clean_up_tokenization_spaces: bool = ...
    ) -> str: ...


@dataclass(frozen=True)
class VisionTokens:
    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int
    vision_start_text: str
    vision_end_text: str
    added: frozenset[int]  # every added token's id: the tokenizer splits the text at each of them

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, model_config: Mapping[str, Any] | None = None) -> VisionTokens:
        """Strings as `Qwen3VLProcessor` finds them (tokenizer attributes, else the Qwen names); ids from the
        tokenizer, checked against config.json's `*_token_id` when `model_config` is given."""
        found: dict[str, tuple[str, int]] = {}
        for role, default in ROLES.items():
            text = getattr(tokenizer, f"{role}_token", None) or default
            token_id = tokenizer.convert_tokens_to_ids(text)
            if token_id is None or tokenizer.encode(text, add_special_tokens=False) != [token_id]:
                raise ValueError(f"the tokenizer has no special token {text!r}: this model cannot take images/videos")
            expected = (model_config or {}).get(f"{role}_token_id")
            if expected is not None and expected != token_id:
                raise ValueError(f"config.json has {role}_token_id={expected}, the tokenizer {text!r}={token_id}")
            found[role] = (text, token_id)
        return cls(
            image_pad=found["image"][1],
            video_pad=found["video"][1],
            vision_start=found["vision_start"][1],
            vision_end=found["vision_end"][1],
            vision_start_text=found["vision_start"][0],
            vision_end_text=found["vision_end"][0],
            added=frozenset(getattr(tokenizer, "added_tokens_decoder", {})) | {i for _, i in found.values()},
        )


def expand_prompt_ids(
    ids: Sequence[int], items: Sequence[ProcessedMedia], tokenizer: Tokenizer, tokens: VisionTokens | None = None
) -> list[int]:
    """Replace each image / video pad id in `ids` (one per item) by the item's placeholder sequence.

    `items` are in prompt order; the i-th image pad takes the i-th image, the i-th video pad the i-th video.
    """
    tokens = tokens or VisionTokens.from_tokenizer(tokenizer)
    by_kind = {kind: [item for item in items if item.kind == kind] for kind in ("image", "video")}
    pads = {"image": tokens.image_pad, "video": tokens.video_pad}
    for kind, pad in pads.items():
        found, sent = sum(1 for i in ids if i == pad), len(by_kind[kind])
        if found != sent:
            raise MediaError(f"the prompt has {found} {kind} placeholder(s) but the request sends {sent} {kind}(s)")
    queues = {pad: iter(by_kind[kind]) for kind, pad in pads.items()}
    stamp_ids: dict[str, list[int]] = {}
    out: list[int] = []
    i = 0
    while i < len(ids):
        token_id = ids[i]
        i += 1
        if token_id not in queues:
            out.append(token_id)
            continue
        item = next(queues[token_id])
        if item.kind == "image":
            out.extend([tokens.image_pad] * item.num_tokens)
            continue
        if out[-1:] == [tokens.vision_start] and ids[i : i + 1] == [tokens.vision_end]:  # the template's wrapper
            out.pop()
            i += 1
        for k, t in enumerate(item.timestamps):
            text = f"<{t:.1f} seconds>"
            if k == 0 and out and out[-1] not in tokens.added:
                _join_text_before(out, text, tokenizer, tokens)
            else:
                if text not in stamp_ids:
                    stamp_ids[text] = _encode_between_guards(text, tokenizer, tokens)
                out.extend(stamp_ids[text])
            out.append(tokens.vision_start)
            out.extend([tokens.video_pad] * item.tokens_per_frame)
            out.append(tokens.vision_end)
    return out


def _join_text_before(out: list[int], text: str, tokenizer: Tokenizer, tokens: VisionTokens) -> None:
    """Encode the text piece that ends `out` (back to its last added token) together with `text`, in place: the
    tokens transformers gets from the rendered text, where the timestamp follows that piece."""
    start = len(out)
    while start > 0 and out[start - 1] not in tokens.added:
        start -= 1
    piece = tokenizer.decode(out[start:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    out[start:] = _encode_between_guards(piece + text, tokenizer, tokens)


def _encode_between_guards(text: str, tokenizer: Tokenizer, tokens: VisionTokens) -> list[int]:
    ids = tokenizer.encode(tokens.vision_end_text + text + tokens.vision_start_text, add_special_tokens=False)
    if ids[:1] != [tokens.vision_end] or ids[-1:] != [tokens.vision_start]:
        raise ValueError(f"the tokenizer does not split on {tokens.vision_end_text!r} / {tokens.vision_start_text!r}")
    return ids[1:-1]
