"""Per-request grammar state: which tokens may come next, and advancing by the sampled token.

Token masks are int32 bitmasks, one bit per model vocabulary row (bit j of word i is token
32·i + j), as llguidance and vLLM lay them out. Rows past the tokenizer's vocabulary (the model's
padding rows) are never allowed; once the grammar is terminated only the EOS ids are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch


class GrammarError(RuntimeError):
    """This request's grammar state broke mid-generation (a token it rejects was sampled, or no
    token can continue it). The request fails alone."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def bits_row(vocab_size: int, token_ids: list[int] | range) -> torch.Tensor:
    """An int32 bitmask row with exactly `token_ids` set."""
    bits = np.zeros(bitmask_words(vocab_size) * 32, dtype=bool)
    bits[list(token_ids)] = True
    return torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


@dataclass(frozen=True, eq=False)
class VocabContext:
    """What every matcher of one tokenizer + model shares."""

    tokenizer: llguidance.LLTokenizer
    vocab_size: int  # model rows (the logits' width)
    tokenizer_size: int  # ids [tokenizer_size, vocab_size) are padding
    eos_ids: tuple[int, ...]
    valid_row: torch.Tensor  # int32 [W]: ids < tokenizer_size, plus the EOS ids
    eos_row: torch.Tensor  # int32 [W]: the EOS ids only
    executor: llguidance.LLExecutor  # fills many requests' masks in parallel

    @classmethod
    def build(
        cls,
        tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        tokenizer_size: int,
        eos_ids: tuple[int, ...],
        mask_threads: int | None = None,
    ) -> VocabContext:
        valid = sorted(set(range(min(tokenizer_size, vocab_size))) | set(eos_ids))
        return cls(
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            tokenizer_size=tokenizer_size,
            eos_ids=eos_ids,
            valid_row=bits_row(vocab_size, valid),
            eos_row=bits_row(vocab_size, list(eos_ids)),
            executor=llguidance.LLExecutor(mask_threads),
        )


class GrammarMatcher:
    """One request's position in its grammar. Used on the engine thread only.

    With `starts_after` (the token ids of `</think>`), the grammar applies only to the tokens after
    the model has written that sequence: the reasoning of a thinking model is free, its answer is
    constrained (vLLM's default with a reasoning parser). Until then the matcher is not `active`."""

    def __init__(self, ll: llguidance.LLMatcher, context: VocabContext, label: str, starts_after: Sequence[int] = ()):
        self._ll = ll
        self.context = context
        self.label = label  # "JSON schema", "regex", ... for messages
        self.num_tokens = 0  # tokens accepted so far
        self._ended = False  # EOS accepted
        self._starts_after = tuple(starts_after)
        self._seen = 0  # how much of `starts_after` the last tokens matched

    @property
    def active(self) -> bool:
        """The grammar applies to the next token (the reasoning, if any, is over)."""
        return self._seen == len(self._starts_after)

    def is_terminated(self) -> bool:
        """The output is complete: only EOS may follow (the engine can finish the request now)."""
        if not self.active:
            return False
        return self._ended or (self._ll.is_stopped() and not self._ll.is_error())

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (int32, CPU, contiguous, W words). Raises GrammarError."""
        errors = fill_masks(row.view(1, -1), [(0, self)])
        if errors:
            raise errors[0]

    def accept(self, token_id: int) -> None:
        """Advance by the sampled token. A token the grammar rejects raises GrammarError (the
        request fails alone; the mask should have made this impossible)."""
        if not self.active:  # still reasoning: watch for the end of it
            target = self._starts_after
            self._seen = self._seen + 1 if token_id == target[self._seen] else int(token_id == target[0])
            return
        if self._ended:
            raise GrammarError(f"token {token_id} was sampled after the output of the {self.label} had ended")
        if token_id in self.context.eos_ids and self.is_terminated():
            self._ended = True
            return
        if not self._ll.consume_token(token_id):
            text = self.context.tokenizer.dbg_tokens([token_id]) if 0 <= token_id < self.context.vocab_size else "?"
            raise self._error(f"rejected token {token_id} {text}")
        self.num_tokens += 1
        if token_id in self.context.eos_ids:
            self._ended = True

    def draft_prefix(self, drafts: Sequence[int]) -> list[int]:
        """The longest prefix of `drafts` (speculative decoding's) that the grammar can take: drafts
        stop at EOS (it ends the output: the verify step's own token may still be EOS) and, while the
        reasoning before the grammar runs, at the draft that ends it, so every draft after the first
        constrained position is checked here and every verified row has one grammar state."""
        if not self.active:
            target, seen = self._starts_after, self._seen
            for j, t in enumerate(drafts):
                seen = seen + 1 if t == target[seen] else int(t == target[0])
                if seen == len(target):
                    return list(drafts[: j + 1])
            return list(drafts)
        if self.is_terminated() or self._ll.is_error():
            return []
        cut = next((j for j, t in enumerate(drafts) if t in self.context.eos_ids), len(drafts))
        valid = [t for t in drafts[:cut] if 0 <= t < self.context.vocab_size]
        return list(drafts[: min(len(valid), self._ll.validate_tokens(list(drafts[:cut])))])

    def fill_draft_masks(self, rows: torch.Tensor, drafts: Sequence[int]) -> None:
        """Row j of `rows` (int32 [len(drafts) + 1, W], CPU) gets the mask after drafts[:j] (all
        allowed while the reasoning runs), for drafts from `draft_prefix`. The matcher ends where it
        began (consumed drafts are rolled back). Raises GrammarError."""
        if not self.active:  # only the row after the draft that ends the reasoning is constrained
            rows[:-1].fill_(-1)
            target, seen = self._starts_after, self._seen
            for t in drafts:
                seen = seen + 1 if t == target[seen] else int(t == target[0])
            if seen == len(target):
                self.fill_mask(rows[-1])
            else:
                rows[-1].fill_(-1)
            return
        consumed = 0
        try:
            for j, t in enumerate(drafts):
                self.fill_mask(rows[j])
                if not self._ll.consume_token(t):
                    raise self._error(f"rejected draft token {t}")
                consumed += 1
            self.fill_mask(rows[len(drafts)])
        finally:
            if consumed:
                self._ll.rollback(consumed)

    def _error(self, what: str) -> GrammarError:
        detail = self._ll.get_error().strip()
        detail = detail.splitlines()[0][:500] if detail else "no details"
        return GrammarError(f"the {self.label} {what} after {self.num_tokens} generated tokens: {detail}")


def fill_masks(bitmask: torch.Tensor, matchers: Sequence[tuple[int, GrammarMatcher]]) -> dict[int, GrammarError]:
    """Fill row i of `bitmask` (int32 [N, W], CPU, contiguous) for every (i, matcher), in parallel
    through llguidance's executor. Returns the rows whose grammar broke; those rows are left
    all-allowed, so the logits stay finite until the caller fails the request."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("the token bitmask must be a contiguous int32 CPU tensor")
    errors: dict[int, GrammarError] = {}
    pending: list[tuple[int, GrammarMatcher]] = []
    for i, m in matchers:
        if bitmask.shape[1] != m.context.eos_row.numel():
            raise ValueError(
                f"bitmask rows have {bitmask.shape[1]} words, the grammar's vocabulary needs "
                f"{m.context.eos_row.numel()}"
            )
        if m.is_terminated():
            bitmask[i].copy_(m.context.eos_row)
        elif m._ll.is_error():
            errors[i] = m._error("is in an error state")
        else:
            pending.append((i, m))
    row_bytes = bitmask.shape[1] * 4
    try:
        if len(pending) > 1:  # drops the GIL; one thread per matcher up to the executor's size
            pending[0][1].context.executor.unsafe_compute_mask_ptr(
                [(m._ll, i) for i, m in pending], bitmask.data_ptr(), row_bytes, bitmask.shape[0]
            )
        elif pending:
            i, m = pending[0]
            m._ll.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
    except Exception:  # isolate whoever made it fail
        for i, m in pending:
            try:
                m._ll.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
            except Exception as e:
                errors[i] = GrammarError(f"computing the token mask of the {m.label} failed: {e!r}")
    for i, m in pending:
        if i in errors:
            continue
        row = bitmask[i]
        if m._ll.is_error():
            errors[i] = m._error("failed while computing the token mask")
            continue
        row.bitwise_and_(m.context.valid_row)  # padding rows are never allowed
        if not bool(row.any()):
            errors[i] = GrammarError(
                f"the {m.label} allows no next token after {m.num_tokens} generated tokens "
                "(the grammar cannot be continued with this tokenizer)"
            )
    for i in errors:
        bitmask[i] = -1
    return errors
