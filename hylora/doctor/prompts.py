"""What doctor sends: one fixed token sequence, the prompt lengths of the sweep, and the probes.

Every prompt of the sweep is a prefix of the same sequence, so one reference request per target at
the longest length gives the reference logprobs of every shorter prompt (the model is causal).
The mixed-batch prompts are windows elsewhere in the sequence: different content in one batch.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from pathlib import Path

from hylora.demo import CORPUS

# Prompt lengths straddling the tile / chunk / block sizes of the kernels in use (and the ~400-token
# cliff of the LoRA NaN reports), then doubling up to the sweep's longest length.
BOUNDARY_LENGTHS = (1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 400, 511, 512, 513, 1024, 2048, 4096)
SHORT_MAX = 513  # the sweep's short prompts (≤ this) run before the long requests of the pollution burst
MIXED_LENGTHS = (97, 161)  # mixed-batch prompts: every target gets both, all at once
PROBE_LENGTH = 129  # the pollution probe


def sweep_lengths(longest: int) -> list[int]:
    """The boundary lengths up to `longest`, continued by doubling, ending at `longest` itself."""
    if longest < 1:
        raise ValueError("the sweep needs a longest length >= 1")
    lengths = [n for n in BOUNDARY_LENGTHS if n <= longest]
    n = BOUNDARY_LENGTHS[-1] * 2
    while n < longest:
        lengths.append(n)
        n *= 2
    if lengths[-1] != longest:
        lengths.append(longest)
    return lengths


def parse_lengths(text: str) -> list[int]:
    """`--lengths 1,64,65,400` → sorted unique lengths."""
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--lengths expects comma-separated integers, got {text!r}") from None
    if not lengths or lengths[0] < 1:
        raise ValueError("--lengths must be positive integers")
    return lengths


@dataclass(frozen=True)
class Window:
    """A prompt: `length` tokens of the doctor's sequence from `offset` (offset 0: a sweep prefix)."""

    offset: int
    length: int

    def ids(self, sequence: list[int]) -> list[int]:
        return sequence[self.offset : self.offset + self.length]


@dataclass(frozen=True)
class Probe:
    """One request: a prompt window for a target (an adapter's name; None = the base model), or a
    video with a short question (its answer is not compared, only whether it was served)."""

    target: str | None
    window: Window
    fault: str | None = None  # in-process only: inject this engine fault ("nan")
    video: Path | None = None
    prompt: tuple[int, ...] | None = None  # these token ids instead of the window's (e.g. a continuation)

    def ids(self, sequence: list[int]) -> list[int]:
        return list(self.prompt) if self.prompt is not None else self.window.ids(sequence)


VIDEO_QUESTION = "Describe what the video shows."


def video_data_url(path: Path) -> str:
    mime = {".mp4": "video/mp4", ".webm": "video/webm", ".mkv": "video/x-matroska", ".mov": "video/quicktime"}
    return f"data:{mime.get(path.suffix.lower(), 'video/mp4')};base64,{base64.b64encode(path.read_bytes()).decode()}"


def video_messages(path: Path) -> list[dict]:
    """An OpenAI chat message with the video (as a data: URL) and the question."""
    parts = [
        {"type": "video_url", "video_url": {"url": video_data_url(path)}},
        {"type": "text", "text": VIDEO_QUESTION},
    ]
    return [{"role": "user", "content": parts}]


def mixed_windows(sequence_len: int, max_len: int) -> list[Window]:
    """Windows of MIXED_LENGTHS (at most `max_len` tokens) at different offsets in the sequence."""
    windows = []
    for i, n in enumerate(MIXED_LENGTHS):
        n = min(n, max_len, sequence_len)
        windows.append(Window(min(1 + 211 * i, sequence_len - n), n))
    return windows


def doctor_sequence(tokenizer, length: int, text: str | None = None, seed: int = 0) -> list[int]:
    """`length` token ids of plain text (no special tokens): the lines of `text` (default: a built-in
    archaeology text) in a seeded random order, reshuffled each time round."""
    lines = [line for line in (text or CORPUS).splitlines() if line.strip()]
    if not lines:
        raise ValueError("the prompt text is empty")
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < length:
        rng.shuffle(lines)
        chunk = tokenizer.encode("\n".join(lines) + "\n", add_special_tokens=False)
        if not chunk:
            raise ValueError("the prompt text tokenises to nothing")
        ids.extend(chunk)
    return ids[:length]


def read_prompt_text(path: str | Path | None) -> str | None:
    return Path(path).read_text(encoding="utf-8") if path else None
