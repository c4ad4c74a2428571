"""What the structured-output tests share: the demo's tokenizer, its EOS ids, a matcher's allowed tokens."""

from __future__ import annotations

from transformers import AutoTokenizer

from hylora.demo import write_tokenizer
from hylora.structured import GrammarMatcher
from hylora.structured.mask import allocate_bitmask

VOCAB = 720  # model rows: more than the tokenizer's ids (padding), and not a multiple of 32


def demo_tokenizer(tmp_path_factory):
    """The demo's 1024-token tokenizer (a module fixture's body)."""
    path = tmp_path_factory.mktemp("structured-tokenizer")
    write_tokenizer(path, 1024)
    return AutoTokenizer.from_pretrained(str(path))


def eos_pair(tokenizer) -> tuple[int, int]:
    return (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>"))


def allowed_ids(matcher: GrammarMatcher) -> set[int]:
    row = allocate_bitmask(1, VOCAB)[0]
    matcher.fill_mask(row)
    return {t for t in range(VOCAB) if (int(row[t // 32]) >> (t % 32)) & 1}
