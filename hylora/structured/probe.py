"""Compile a spec once and test-drive the result: what a grammar worker process does with each
spec (structured/worker.py), and what the server does itself when no worker can run.

`probe_spec(spec, tokenizer, tokenizer_size, eos_ids)` returns (grammar text, compiled LLMatcher)
or raises StructuredOutputError (HTTP 400), in this order:

1. the pre-compile bounds (structured/limits.py, structured/rules.py);
2. the grammar text (structured/grammar.py), then LLMatcher: its errors are the client's;
3. the first mask must allow a token of the tokenizer (EOS counts: an empty output may be valid);
4. three short walks — always the lowest, always the highest and a pseudo-random allowed token
   (EOS excepted), up to WALK_STEPS tokens each — must not break the matcher. This is where
   llguidance fails the specs it compiles but cannot serve, measured: a `$ref` loop, an empty Lark
   language or a regex that matches nothing stop at the first mask ("NoExtensionBias"); a required
   property that refers back to its own schema or `("a"{1000}){1000}` force an endless run of
   tokens ("Too many items ... ff_tokens"); 2,000 alternatives that share a first token overflow
   the Earley row after it ("Current row has 2001 items"); `(a{1000}){1000}` blows up the lexer
   ("too many expressions constructed"). Each walk costs a few masks (tens of µs each on a small
   vocabulary, ~0.1–3 ms on a 248k one).

Only llguidance, the standard library and the light structured modules are imported here: the
worker process starts in ~60 ms (no torch).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

import llguidance

from hylora.structured.errors import StructuredOutputError
from hylora.structured.grammar import grammar_text
from hylora.structured.limits import check_spec
from hylora.structured.spec import StructuredSpec

WALK_STEPS = 4

# llguidance's default work limits bound compile and per-step time; terse errors keep the
# client's schema out of our logs and error messages.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def probe_spec(
    spec: StructuredSpec, tokenizer: llguidance.LLTokenizer, tokenizer_size: int, eos_ids: Sequence[int]
) -> tuple[str, llguidance.LLMatcher]:
    check_spec(spec)
    try:
        text = grammar_text(spec)
    except RecursionError:
        raise StructuredOutputError(f"the {spec.label} is nested too deeply") from None
    except Exception as e:  # llguidance raises ValueError for what it cannot parse
        raise StructuredOutputError(f"invalid {spec.label}: {e}") from None
    matcher = compile_text(spec, tokenizer, text)
    test_drive(matcher, spec, tokenizer_size, eos_ids)
    return text, matcher


def compile_text(spec: StructuredSpec, tokenizer: llguidance.LLTokenizer, text: str) -> llguidance.LLMatcher:
    try:
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=LIMITS)
    except Exception as e:  # llguidance reports grammar errors through is_error(); this is unexpected
        raise StructuredOutputError(f"cannot compile the {spec.label}: {e}") from e
    if matcher.is_error():
        raise StructuredOutputError(f"cannot compile the {spec.label}: {_clip(matcher.get_error())}")
    return matcher


def test_drive(
    matcher: llguidance.LLMatcher, spec: StructuredSpec, tokenizer_size: int, eos_ids: Sequence[int]
) -> None:
    """Raise StructuredOutputError when the first mask allows nothing or a short walk breaks the
    matcher (on copies: `matcher` itself is left at its start)."""
    eos = 0
    for e in eos_ids:
        eos |= 1 << e
    valid = ((1 << tokenizer_size) - 1) | eos  # padding rows past the tokenizer never count
    first = matcher.deep_copy()
    allowed = _mask(first) & valid
    if first.is_error():
        raise StructuredOutputError(_first_mask_error(spec, first.get_error()))
    if not allowed:
        raise StructuredOutputError(
            f"the {spec.label} allows no first token with this model's tokenizer (it cannot be generated)"
        )
    rng = random.Random(zlib.crc32(spec.label.encode() + str(spec.payload).encode()))
    for path in range(3):
        m = matcher.deep_copy()
        for step in range(WALK_STEPS):
            allowed = _mask(m) & valid
            if m.is_error():
                raise StructuredOutputError(_walk_error(spec, step, m.get_error()))
            if not allowed:
                raise StructuredOutputError(
                    f"the {spec.label} allows no next token after {step} generated tokens with this model's "
                    "tokenizer (it cannot be completed)"
                )
            choices = allowed & ~eos
            if not choices:
                break  # only EOS: the output may end here
            token = _pick(choices, path, rng)
            if not m.consume_token(token) or m.is_error():
                raise StructuredOutputError(_walk_error(spec, step + 1, m.get_error()))
            if m.is_stopped():
                break


def _mask(m: llguidance.LLMatcher) -> int:
    """The allowed tokens as an int: bit t is token t."""
    return int.from_bytes(m.compute_bitmask(), "little")


def _pick(bits: int, path: int, rng: random.Random) -> int:
    if path == 0:
        return (bits & -bits).bit_length() - 1
    if path == 1:
        return bits.bit_length() - 1
    start = rng.randrange(bits.bit_length())
    above = bits >> start
    return start + (above & -above).bit_length() - 1 if above else (bits & -bits).bit_length() - 1


def _first_mask_error(spec: StructuredSpec, error: str) -> str:
    if "NoExtension" in error:
        return (
            f"the {spec.label} matches no output at all (an empty language, a pattern that matches nothing, "
            "or a $ref / rule loop)"
        )
    return f"the {spec.label} cannot start: {_clip(error)}"


def _walk_error(spec: StructuredSpec, tokens: int, error: str) -> str:
    hint = ""
    if "ff_tokens" in error or "Too many items" in error:
        hint = (
            " (it forces an endless or huge run of output, e.g. a required property that refers back to its "
            "own schema, or too many alternatives in a row)"
        )
    elif "Current row has" in error:
        hint = " (too many alternatives are open at once for the matcher)"
    elif "too many expressions" in error or "lexer" in error:
        hint = " (a pattern is too large for the lexer)"
    return f"the {spec.label} exceeds the matcher's limits after {tokens} generated tokens: {_clip(error)}{hint}"


def _clip(message: str, limit: int = 1000) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip() and line.strip() != "<non-verbose/>"]
    message = " ".join(lines) or "unknown error"
    return message if len(message) <= limit else message[:limit] + " …"
