"""Shared pytest fixtures. Used by every test file:
    python -m pytest tests -q
"""

import string

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.fixture(scope="session")
def char_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny character-level tokenizer: one id per printable ASCII char, plus chat special tokens."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(string.printable))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab))
    # every character is its own word; special tokens are matched before this split
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>", pad_token="<|pad|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
