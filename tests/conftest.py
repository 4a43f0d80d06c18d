"""Shared pytest fixtures. Used by every test file:
    python -m pytest tests -q
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: import ppo, sft, ...

from sft import build_char_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def char_tokenizer():
    """The built-in byte-level tokenizer (one token per byte) with its minimal chat template."""
    return build_char_tokenizer()
