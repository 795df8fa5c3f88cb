"""Word-set Jaccard similarity, used to drop near-duplicate bank entries (as the official TMAS code does).

Two entries that state different values are never near-duplicates, however many words they share: the TMAS
experience prompt (appendix D) merges only entries that "say the exact same thing about the exact same step", and
"for n = 3 the count is 12" and "for n = 4 the count is 30" are two verified facts, not one.
"""

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


def numbers(text: str) -> frozenset[str]:
    """The words of ``text`` that hold a digit (``12``, ``a_5``, ``2n``): the values and indices it states."""
    return frozenset(word for word in word_set(text) if any(ch.isdigit() for ch in word))


def near_duplicate(a: str, b: str, threshold: float) -> bool:
    """Whether ``a`` and ``b`` say the same thing: Jaccard at least ``threshold`` and the same values stated."""
    return jaccard(a, b) >= threshold and numbers(a) == numbers(b)
