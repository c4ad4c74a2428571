"""Prompt expansion on token ids, equal to transformers 5.x `Qwen3VLProcessor` expanding the text and tokenizing.

The chat template renders one placeholder per item: `<|vision_start|><|image_pad|><|vision_end|>` or the same
with `<|video_pad|>`. transformers replaces the pad token of an image with `<|image_pad|>` × num_tokens, and of a
video with, per temporal patch, `<{t:.1f} seconds><|vision_start|>` + `<|video_pad|>` × tokens_per_frame +
`<|vision_end|>`; the template's outer wrapper stays (vLLM drops it; transformers does not).

Why ids equal: special tokens split the text before pre-tokenisation, so each piece between them is tokenized
alone. The only new text is a timestamp, always between two special tokens (`<|vision_start|>` or
`<|vision_end|>` before it, `<|vision_start|>` after it), so it is encoded here between the same guards and
the guards are cut off.
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


@dataclass(frozen=True)
class VisionTokens:
    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int
    vision_start_text: str
    vision_end_text: str

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
    for token_id in ids:
        if token_id not in queues:
            out.append(token_id)
            continue
        item = next(queues[token_id])
        if item.kind == "image":
            out.extend([tokens.image_pad] * item.num_tokens)
            continue
        for t in item.timestamps:
            text = f"<{t:.1f} seconds>"
            if text not in stamp_ids:
                stamp_ids[text] = _encode_between_guards(text, tokenizer, tokens)
            out.extend(stamp_ids[text])
            out.append(tokens.vision_start)
            out.extend([tokens.video_pad] * item.tokens_per_frame)
            out.append(tokens.vision_end)
    return out


def _encode_between_guards(text: str, tokenizer: Tokenizer, tokens: VisionTokens) -> list[int]:
    ids = tokenizer.encode(tokens.vision_end_text + text + tokens.vision_start_text, add_special_tokens=False)
    if ids[:1] != [tokens.vision_end] or ids[-1:] != [tokens.vision_start]:
        raise ValueError(f"the tokenizer does not split on {tokens.vision_end_text!r} / {tokens.vision_start_text!r}")
    return ids[1:-1]
