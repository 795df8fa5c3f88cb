"""Word-set Jaccard similarity, used to drop near-duplicate bank entries (as the official TMAS code does)."""

from __future__ import annotations

import re

_WORD = re.compile(r"\w+")


def word_set(text: str) -> frozenset[str]:
    """The distinct lower-cased words of ``text`` (runs of letters, digits and underscores)."""
    return frozenset(word.lower() for word in _WORD.findall(text))


def jaccard(a: str, b: str) -> float:
    """|A ∩ B| / |A ∪ B| over the word sets of ``a`` and ``b``; two texts without words count as identical."""
    wa, wb = word_set(a), word_set(b)
    if not wa and not wb:
        return 1.0
    return len(wa & wb) / len(wa | wb)
