"""Answers grouped by value, for votes: ``0.5``, ``1/2`` and ``\\frac{1}{2}`` are one answer.

Two stages, cheapest first:

1. :func:`value_key`: the spelling normalisation of :func:`tmas.answers.normalize_answer`, and plain numbers
   (:func:`plain_number`: integers, decimals, scientific notation ``4.25e6``, fractions ``a/b``, ``\\frac{a}{b}``
   and ``\\frac12``) written as their exact value, but a number written with leading zeros (``017``, a code or the
   rows of a grid) by its digits, as grading reads it (:func:`has_leading_zeros`);
2. :func:`answer_classes`: the few distinct keys left are compared pairwise by an :class:`EquivalenceCheck` (the
   project's grading rules, Math-Verify, run in worker processes: see ``tmas.answer_rules.RuleEquivalence``), and
   keys found equal are merged. Two plain numbers never need the check: their keys are equal exactly when they
   are one answer (so integer answers cost no check at all).

Without a check (Math-Verify is in the ``eval`` extra, not the core install) the first stage alone groups answers.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import Protocol

from tmas.answers import normalize_answer

# Most distinct keys compared pairwise: each pair costs two rule checks. Keys past this many (the rarest, then the
# latest first seen) keep their own group.
MAX_COMPARED = 12

_INTEGER = re.compile(r"[+-]?\d+")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
# Scientific notation as programs print it ("4.25e6", "2.5E-05"), written out where its power is at most 100.
_SCIENTIFIC = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)[eE]([+-]?\d+)")
_MAX_EXPONENT = 100
_SLASH = re.compile(r"([+-]?)(\d+)/(\d+)")
_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}")
# "\\frac12": a fraction of two digits without braces.
_FRAC_DIGITS = re.compile(r"([+-]?)\\frac(\d)(\d)")
# A number written with leading zeros ("017", "001020,010300": a code or the rows of a grid): its digits are the
# answer, whatever their value. Not the groups of a number written with separators (1,024 or 1{,}024), nor an exponent
# (1e-05).
_LEADING_ZEROS = re.compile(r"(?<![\d.,}eE])(?<![eE][+-])0\d")
# The brackets a list may be written in, whole: parentheses, square brackets, set braces.
_LIST_BRACKETS = re.compile(r"\((.*)\)|\[(.*)\]|\\\{(.*)\\\}")
# What separates the items of a list: a comma or a semicolon (not LaTeX's thousands separator "{,}").
_LIST_SEPARATOR = re.compile(r"(?<!\{)[,;]")


class EquivalenceCheck(Protocol):
    """Whether two answers are mathematically equal (both orders: the relation a vote groups by is symmetric)."""

    async def equivalent(self, first: str, second: str) -> bool: ...


def plain_number(text: str) -> Fraction | None:
    """The exact value of ``text`` (a :func:`tmas.answers.normalize_answer` spelling) where it is a plain number,
    else None. Votes key answers by it, and the viewer's live grades compare numbers by it."""
    text = text.replace("{,}", "")  # LaTeX thousands separator: 1{,}000
    if _INTEGER.fullmatch(text) or _DECIMAL.fullmatch(text):
        return Fraction(text)
    scientific = _SCIENTIFIC.fullmatch(text)
    if scientific is not None:
        return Fraction(Decimal(text)) if abs(int(scientific.group(1))) <= _MAX_EXPONENT else None
    match = _SLASH.fullmatch(text) or _FRAC.fullmatch(text) or _FRAC_DIGITS.fullmatch(text)
    if match is None:
        return None
    sign, numerator, denominator = match.groups()
    if int(denominator) == 0:
        return None
    value = Fraction(int(numerator), int(denominator))
    return -value if sign == "-" else value


def plain_numbers(text: str) -> list[Fraction] | None:
    """The values of ``text`` (a :func:`tmas.answers.normalize_answer` spelling) in order where it is a list of two or
    more plain numbers (:func:`plain_number`) separated by commas or semicolons, in brackets or not: "60,101" spelt
    from "60, 101", "(60,101)", "\\{1/2;3\\}". None for anything else: one number ("60,101" spelt from "60,101" is
    60101), an item that is no plain number, or one written with leading zeros ("1,000,5" may be a number's groups)."""
    brackets = _LIST_BRACKETS.fullmatch(text)
    if brackets is not None:
        text = next(group for group in brackets.groups() if group is not None)
    items = _LIST_SEPARATOR.split(text)
    if len(items) < 2 or any(has_leading_zeros(item) for item in items):
        return None
    values = [plain_number(item) for item in items]
    return None if any(value is None for value in values) else [value for value in values if value is not None]


def other_list(answer: str, listed: str) -> bool:
    """Whether ``answer`` (a :func:`tmas.answers.normalize_answer` spelling) is a list of as many plain numbers as the
    list ``listed`` whose set of values is not that of ``listed``'s items (:func:`plain_numbers`): in any order or as a
    set it differs, and a list of two or more numbers is never one number."""
    items, reference = plain_numbers(answer), plain_numbers(normalize_answer(listed))
    return items is not None and reference is not None and len(items) == len(reference) and set(items) != set(reference)


def has_leading_zeros(text: str) -> bool:
    """Whether ``text`` writes a number with leading zeros ("017", a code or the rows of a grid): then its digits are
    the answer, not their value. The grading rules read a reference so (:func:`tmas.answer_rules.leading_zeros`),
    and votes an answer."""
    return _LEADING_ZEROS.search(text) is not None


@lru_cache(maxsize=100_000)  # a pure function of the answer; a big run's metrics ask it of 100,000 candidates
def value_key(answer: str) -> str:
    """The key votes group ``answer`` by without any rule check: a plain number's exact value, else its normalized
    spelling. A number written with leading zeros keys by its spelling: "017" and "17" are two answers, as grading
    against "017" keeps them apart (against 17 both are right), while "17" and "17.0" are one. A number in digit
    groups ("1,000") keys by its value, a list ("3, 125") by its spelling."""
    text = normalize_answer(answer)
    value = plain_number(text)
    return text if value is None or has_leading_zeros(text) else str(value)


def _is_number_key(key: str) -> bool:
    return plain_number(key) is not None


async def answer_classes(answers: Iterable[str | None], check: EquivalenceCheck | None) -> dict[str, str]:
    """Each answer of ``answers`` -> the key of its class: :func:`value_key`, merged across keys ``check`` finds
    equal. A class's key is the key of its member seen first, so the result depends only on the answers' order and
    the check's verdicts."""
    given = [a for a in answers if a is not None]
    keys = {answer: value_key(answer) for answer in given}
    if check is None:
        return keys
    first_seen = list(dict.fromkeys(keys[a] for a in given))
    spelling: dict[str, str] = {}
    for answer in given:
        spelling.setdefault(keys[answer], answer)
    pairs = _compared_pairs([keys[a] for a in given])
    if not pairs:
        return keys
    verdicts = await asyncio.gather(*(check.equivalent(spelling[a], spelling[b]) for a, b in pairs))
    merged = _merge(first_seen, [pair for pair, equal in zip(pairs, verdicts, strict=True) if equal])
    return {answer: merged[key] for answer, key in keys.items()}


def asks_check(answers: Iterable[str | None]) -> bool:
    """Whether :func:`answer_classes` asks its check anything about ``answers``: where not, each answer's class
    is its :func:`value_key`, with a check or without."""
    return bool(_compared_pairs([value_key(a) for a in answers if a is not None]))


def _compared_pairs(keys: list[str]) -> list[tuple[str, str]]:
    """The pairs of distinct keys (the answers' keys in order) the check is asked about: among the
    :data:`MAX_COMPARED` most frequent, in the order first seen, every pair but two plain numbers."""
    counts = Counter(keys)
    first_seen = list(dict.fromkeys(keys))
    compared = sorted(first_seen, key=lambda k: (-counts[k], first_seen.index(k)))[:MAX_COMPARED]
    compared.sort(key=first_seen.index)
    return [
        (a, b)
        for i, a in enumerate(compared)
        for b in compared[i + 1 :]
        if not (_is_number_key(a) and _is_number_key(b))
    ]


def _merge(order: list[str], equal_pairs: list[tuple[str, str]]) -> dict[str, str]:
    """Union of the equal pairs; each key -> the earliest key (in ``order``) of its class."""
    parent = {key: key for key in order}
    position = {key: i for i, key in enumerate(order)}

    def root(key: str) -> str:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for a, b in equal_pairs:
        ra, rb = root(a), root(b)
        if ra != rb:
            first, second = (ra, rb) if position[ra] < position[rb] else (rb, ra)
            parent[second] = first
    return {key: root(key) for key in order}


def class_of(answer: str, classes: Mapping[str, str] | None) -> str:
    """``answer``'s class key in ``classes`` where it is there, else its :func:`value_key`."""
    if classes is not None and answer in classes:
        return classes[answer]
    return value_key(answer)
