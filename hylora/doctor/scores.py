"""What a deployment says about a prompt (Scores) and what the reference says (ReferenceScores).

Positions count the tokens being predicted: for an n-token prompt, position p (1 ≤ p ≤ n) is the
prediction made from tokens 0..p-1 — of prompt token p for p < n, of the generated (greedy) token
at p = n.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from hylora.engine.engine import RequestOutput

Token = int | str  # a token id, or the text a server rendered it as
TOKEN_ID = re.compile(r"token_id:(\d+)")  # vLLM's return_tokens_as_token_ids rendering


@dataclass
class Scores:
    """One served request: per position p = 1..n the token scored there (prompt token p, or the
    generated token at p = n), its logprob (nan when the server gave none or a non-finite one) and,
    when the server said, the most likely token there."""

    tokens: list[Token] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top1: list[Token | None] = field(default_factory=list)
    error: str | None = None  # the request failed: HTTP status / engine error
    top1_logprobs: list[float] = field(default_factory=list)  # the top-1's logprob, when the server said
    # per position, the server's top-k {token: logprob} (k = SERVED_TOP_K; empty when it said none): a
    # top-1 that differs between two served results may be a near-tie (compare.diff_served)
    tops: list[dict[Token, float]] = field(default_factory=list)

    @classmethod
    def failed(cls, error: str) -> Scores:
        return cls(error=error)

    @classmethod
    def from_output(cls, out: RequestOutput) -> Scores:
        """From a finished engine request asked for prompt logprobs and logprobs (k ≥ 1)."""
        if out.error:
            kind = f" [{out.failure.value}]" if out.failure is not None else ""
            return cls.failed(f"{out.error}{kind}")
        entries = [lp for lp in (out.prompt_logprobs or [])[1:] if lp is not None]
        entries += (out.logprobs or [])[:1]
        return cls(
            tokens=[lp.token_id for lp in entries],
            logprobs=[finite_or_nan(lp.logprob) for lp in entries],
            top1=[max(lp.top, key=lp.top.__getitem__) if lp.top else None for lp in entries],
            top1_logprobs=[finite_or_nan(max(lp.top.values())) if lp.top else math.nan for lp in entries],
            tops=[{t: finite_or_nan(v) for t, v in (lp.top or {}).items()} for lp in entries],
        )

    def logprob_of(self, p: int, token: Token, texts: TokenTexts) -> float | None:
        """This result's logprob of `token` at position p (1-based), when the server said it: among
        its top-k there, or as the token scored there."""
        top = self.tops[p - 1] if p <= len(self.tops) else {}
        for t, lp in top.items():
            if texts.same(t, token):
                return lp
        if texts.same(self.tokens[p - 1], token):
            return self.logprobs[p - 1]
        return None


@dataclass
class Generation:
    """One generated continuation (greedy): per generated token its id (or text), logprob and the
    top-1 there, and what the deployment said about the request: prompt tokens served from its
    prefix cache (None: not reported)."""

    tokens: list[Token] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top1: list[Token | None] = field(default_factory=list)
    cached_tokens: int | None = None
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> Generation:
        return cls(error=error)

    @classmethod
    def from_output(cls, out: RequestOutput) -> Generation:
        if out.error:
            kind = f" [{out.failure.value}]" if out.failure is not None else ""
            return cls.failed(f"{out.error}{kind}")
        entries = out.logprobs or []
        return cls(
            tokens=list(out.token_ids),
            logprobs=[finite_or_nan(lp.logprob) for lp in entries],
            top1=[max(lp.top, key=lp.top.__getitem__) if lp.top else None for lp in entries],
            cached_tokens=getattr(out, "num_cached_tokens", None),
        )


@dataclass
class ReferenceScores:
    """The reference for the prefixes of the doctor's sequence up to n tokens: the logprob of token p
    at p = 1..n-1 and the top-k tokens at p = 1..n."""

    logprobs: list[float]
    top: list[dict[int, float]]

    @property
    def length(self) -> int:
        return len(self.top)

    @classmethod
    def from_output(cls, out: RequestOutput) -> ReferenceScores:
        if out.error:
            raise RuntimeError(f"the reference request failed: {out.error}")
        prompt = [lp for lp in (out.prompt_logprobs or [])[1:] if lp is not None]
        return cls(
            logprobs=[lp.logprob for lp in prompt],
            top=[lp.top for lp in prompt] + [out.logprobs[0].top if out.logprobs else {}],
        )


def finite_or_nan(value: object) -> float:
    """A logprob as a float; anything missing, non-numeric, non-finite or OpenAI's -9999 sentinel
    for -inf becomes nan (reported as non-finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    value = float(value)
    return value if math.isfinite(value) and value > -9999.0 else math.nan


class TokenTexts:
    """Matches tokens that servers render as text to ids, with the tokenizer that made the prompt."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id])
        return self._text[token_id]

    def resolve(self, token: Token | None, candidates: dict[int, float]) -> int | None:
        """The id of `token`: itself, a `token_id:N` rendering, or the candidate id with the same text
        (the most likely, if several share it); None if it is none of the candidates."""
        if token is None or isinstance(token, int):
            return token
        m = TOKEN_ID.fullmatch(token)
        if m:
            return int(m.group(1))
        matches = [t for t in candidates if self.text(t) == token]
        return max(matches, key=candidates.__getitem__) if matches else None

    def same(self, a: Token | None, b: Token | None) -> bool:
        """Whether two servers' renderings name the same token."""
        if a is None or b is None:
            return a is b
        return self._as_text(a) == self._as_text(b)

    def is_token0(self, token: Token | None) -> bool:
        return token is not None and (token == 0 or self._as_text(token) == self.text(0))

    def _as_text(self, token: Token) -> str:
        if isinstance(token, int):
            return self.text(token)
        m = TOKEN_ID.fullmatch(token)
        return self.text(int(m.group(1))) if m else token
