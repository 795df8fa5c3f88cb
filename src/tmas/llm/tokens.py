"""Token counts for servers that report no usage: a tokenizer when configured, an estimate otherwise."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from tmas.errors import ConfigError

# Characters per token of typical English and LaTeX text under BPE vocabularies; only used when nothing better is
# known, and such counts are flagged as estimated.
CHARS_PER_TOKEN = 4.0


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN) if text else 0


@lru_cache(maxsize=8)
def _load_tokenizer(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"tokenizer {path!r} needs the 'tokenizers' package: pip install 'tmas[tokenizer]'") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:
        raise ConfigError(f"tokenizer {path!r} could not be loaded: {exc}") from None


class TokenCounter:
    """Counts tokens with a Hugging Face ``tokenizer.json`` if given, else estimates."""

    def __init__(self, tokenizer_path: str | None = None) -> None:
        self._tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path else None

    @property
    def exact(self) -> bool:
        return self._tokenizer is not None

    def count(self, text: str) -> int:
        if self._tokenizer is None:
            return estimate_tokens(text)
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
