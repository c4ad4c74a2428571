"""Incremental detokenization with stop strings: streams only complete UTF-8 and never a part of
a stop string."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so the first tokens' spacing is right


class TextStream:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop, self.include_stop = stop, include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        # the Rust tokenizer itself when the wrapper's decode adds nothing to it (no clean-up of
        # spaces): the wrapper's argument handling costs more than the decode, twice per token
        backend = getattr(tokenizer, "_tokenizer", None)
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend_decode = backend.decode if backend is not None and plain else None

    def append(self, token_id: int) -> str | None:
        """Add one generated token. Returns the stop string if the text now contains one (the text
        is then cut there)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next token
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        search_from = max(0, len(self.text) - self.holdback)
        self.text += new
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at >= 0:
                self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
                return s
        return None

    def take(self, finished: bool) -> str:
        """Text not yet handed out; while running, the tail that could start a stop string stays back."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
