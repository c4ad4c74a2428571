"""Text helpers the streaming parsers share: how much of a buffer's end could still become a tag.

A streamed delta can end in the middle of a tag ("</th" + "ink>"); the parsers hold back exactly
the buffer's longest suffix that is a proper prefix of a tag they look for, and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable

WHITESPACE = " \t\n\r"


def held_suffix(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper, non-empty prefix of one of `tags`
    (0 when no tag can start in the text's tail)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def is_prefix_of_any(text: str, tags: Iterable[str]) -> bool:
    """`text` is a proper prefix of one of `tags` (the rest of the tag may still come)."""
    return any(len(text) < len(tag) and tag.startswith(text) for tag in tags)


def skip_whitespace(text: str, pos: int) -> int:
    """The first index at or after `pos` that is not JSON / XML whitespace."""
    n = len(text)
    while pos < n and text[pos] in WHITESPACE:
        pos += 1
    return pos
