"""Tokenizer and chat template from the model directory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hylora.config import read_json_object

# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs
# (a template of the client's choosing is prompt forgery and unbounded work on a shared worker;
# vLLM refuses it too). Everything else is a variable the template may read, e.g. enable_thinking.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
    }
)


class PromptTooLong(ValueError):
    """The rendered prompt has more characters than can fit in the context (checked before tokenising)."""

    def __init__(self, chars: int, max_chars: int):
        super().__init__(f"the rendered prompt has {chars} characters, more than can fit ({max_chars})")
        self.chars, self.max_chars = chars, max_chars


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json / tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception:
        for name in ("tokenizer_config.json", "tokenizer.json"):  # transformers' JSON errors name no file
            if (model_dir / name).is_file():
                read_json_object(model_dir / name)
        raise


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """A request's chat_template_kwargs as template variables; ValueError for anything else."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError("chat_template_kwargs must be a JSON object of template variables")
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {reserved}: the server renders with its own chat template; "
            "send template variables only (e.g. enable_thinking)"
        )
    bad = sorted(str(k)[:40] for k in kwargs if not isinstance(k, str) or not k.isidentifier())
    if bad:
        raise ValueError(f"chat_template_kwargs keys must be identifiers, got {bad}")
    return dict(kwargs)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> str:
    """`messages` as text through the model's chat template (`template_kwargs` are template variables).
    `continue_final_message`: the last message is left open (no end-of-turn after it), so that the
    reply continues it (vLLM's and transformers' name; an assistant "prefill")."""
    if not tokenizer.chat_template:
        raise ValueError("this model directory has no chat template; send a plain completion prompt instead")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message needs add_generation_prompt false")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, **template_kwargs,
    )  # fmt: skip


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    add_generation_prompt: bool = True,
    *,
    continue_final_message: bool = False,
    max_chars: int | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, ready for the reply
    (`template_kwargs` reach the template, e.g. enable_thinking=False). With `max_chars`, a rendered
    text longer than that raises PromptTooLong before any tokenising."""
    text = render_chat(tokenizer, messages, add_generation_prompt, continue_final_message, **template_kwargs)
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLong(len(text), max_chars)
    return tokenizer.encode(text, add_special_tokens=False)


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the characters one token covers (the longest vocabulary entry), so that
    `chars > max_model_len * max_token_chars` proves a text too long without tokenising it."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=1)


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: Sequence[str]) -> list[list[int]]:
    """vLLM's `bad_words` as token sequences: each word as written (leading spaces stripped) and, where
    the tokenizer gives it a different first token of the same length, with one leading space (the
    word inside a sentence). The sampler bans a sequence's last token where the output ends with the rest."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences += [bare] if bare else []
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences
