"""Tokenizer and chat template from the model directory."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json / tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, ready for the reply
    (`template_kwargs` reach the template, e.g. enable_thinking=False)."""
    if not tokenizer.chat_template:
        raise ValueError("this model directory has no chat template; send a plain completion prompt instead")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the characters one token covers (the longest vocabulary entry), so that
    `chars > max_model_len * max_token_chars` proves a text too long without tokenising it."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=1)
