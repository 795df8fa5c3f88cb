"""Rule-based answer equivalence with Math-Verify, run in worker processes.

Math-Verify enforces its timeouts with ``signal.alarm``, which only works in a process's main thread: each check
runs in the main thread of a worker process, one that is killed and replaced when a check outlasts its deadline.
Workers are spawned, not forked, because the parent may hold an event loop and open sockets. :class:`RuleChecker`
keeps several for asyncio; a synchronous check (:func:`check_pair_bounded`) runs in the calling thread where that is
a main thread, else in one worker process kept for such checks.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import importlib.util
import math
import multiprocessing
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from tmas.answer_classes import has_leading_zeros, other_list, plain_number, plain_numbers
from tmas.answers import list_reading, normalize_answer, ungrouped, without_punctuation_after_math
from tmas.errors import TmasError


class MissingExtra(TmasError):
    exit_code = 2


class RuleWorkerError(TmasError):
    """The worker process for checks made off a main thread exited before it took one."""


@dataclass(frozen=True)
class RuleVerdict:
    """``correct`` is None when the rules cannot decide (unparseable, timed out, unequal non-numeric forms, a
    reference in words, one of digits with leading zeros spelt otherwise, or a reference written as a bare list whose
    items the answer gives in another order)."""

    correct: bool | None
    detail: str


# A sentence's full stop after an answer ("29.", "$\\frac{1}{2}$."); not the dots of an ellipsis.
_FULL_STOP = re.compile(r"(?<!\.)\.\s*$")
# A space between digit groups (12\,345, 12 345, 12~345, 12\ 345): Math-Verify reads it as a product; and LaTeX's
# thousands separator (12{,}345), which it reads as a list after a name ("N = 12{,}345").
_THIN_SPACE_GROUPS = re.compile(r"(?<=\d)(?:\\[, ]|[ ~]|\{,\})(?=\d{3}(?!\d))")
# A degree sign Math-Verify does not read (100°, 100\degree, 100\textdegree): written as the ^\circ it reads.
_DEGREE_SIGN = re.compile(r"\s*(?:°|\\(?:text)?degree(?![a-zA-Z]))")
# A reference that is a sentence about formulas ("odd $n$", "$f(x)=cx$ for some $c$", "0 if ..., ... otherwise"):
# Math-Verify reads one formula of it at most, so its "equal" could accept a part of the answer or a wrong one.
_PROSE = re.compile(
    r"\$|\\\(|\\\[|\b(?:if|otherwise|for|where|which|and|or|all|some|of|is|are|the|with|when|excluding)\b", re.I
)
# "and" joining the items of a list, after a comma or not, in text or not: "2, 3 and 5", "2 \\text{ and } 3".
_LIST_AND = re.compile(r"\s*,?\s*(?:\\text\s*\{\s*,?\s*and\s*\}|\band\b)\s*", re.I)
# A word of a sentence: three letters or more outside a command's name ("odd", "primes").
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")


# Words and signs that offer another answer beside the first: "3 or 4", "3 (maybe 4)", "x = 3, but possibly 4",
# "3 \\vee 4". A reference holding one is left to the judge (_PROSE); an answer holding one is read as its alternatives.
_ALTERNATIVE = re.compile(
    r"\\(?:vee|lor)(?![a-zA-Z])"
    r"|\b(?:but\s+)?(?:or|possibly|maybe|perhaps|probably|alternatively|either)(?:\s+equivalently)?\b",
    re.I,
)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
# What is left around one alternative: spaces, spacing commands, separators, '$'.
_PIECE_EDGE = re.compile(r"^(?:\s|\\[,;:! ]|\\q?quad\b|[,;:$])+|(?:\s|\\[,;:! ]|\\q?quad\b|[,;:$])+$")
# Signs of plain text Math-Verify does not read (it read "2^{5} · 3!" as another number): their LaTeX.
_TEXT_SIGNS = {"\u00b7": " \\cdot ", "\u22c5": " \\cdot ", "\u2219": " \\cdot ", "\u221e": "\\infty "}
# A square root sign and its radicand: a number, a letter, or a group in brackets ("8√10", "√(n+1)").
_ROOT_SIGN = re.compile(r"\u221a\s*(\d+(?:\.\d+)?|[A-Za-z]|\([^()]*\)|\{[^{}]*\})")
# A question asking for every value of something: its bare-list reference is a set.
_ASKS_FOR_ALL = re.compile(r"\b(?:find|determine|list|compute|give|state|what\s+are)\s+all\b|\ball\s+possible\b", re.I)
# What separates the items of a list: a comma or a semicolon (not LaTeX's thousands separator "{,}").
_LIST_SEPARATOR = re.compile(r"(?<!\{)[,;]")
# A set written in braces ("\\{1, 2\\}", "\\left\\{ 1, 2 \\right\\}"): its items have no order.
_SET_BRACES = re.compile(r"(?:\\left\s*)?\\\{")
# Letters ending an answer, after a digit, a brace or a space (not a command's name, "\\pi"): what Math-Verify may take
# for a unit and drop.
_TRAILING_LETTERS = re.compile(r"(?<=[\d}\s])[A-Za-z]+(?=\s*$)")
# A number alone, once the commands a number is written with are gone: digits, separators, braces, a sign first.
_QUANTITY_COMMANDS = re.compile(r"\\(?:[dt]?frac|sqrt|[,;:! ])")
_PLAIN_QUANTITY = re.compile(r"[+-]?[\d.,{}\s]+")
# A letter outside a command's name.
_BARE_LETTER = re.compile(r"(?<![\\A-Za-z])[A-Za-z]")
# A number in scientific notation as programs print it ("1e-05", "6.02e23"): Math-Verify reads a small "e" as Euler's.
_SCIENTIFIC = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?)e([+-]?\d+)(?![\w.])")
# A decimal times a power of ten ("1.5 \\times 10^{8}", "1.5 \\cdot 10^8"): Math-Verify reads the decimal as a float,
# whose product with the power may miss the number it is.
_DECIMAL_TIMES_POWER = re.compile(
    r"(?<![\w.}])(\d+\.\d+)\s*(?:\\times|\\cdot|\u00d7)\s*10\s*\^\s*(?:\{\s*([+-]?\d+)\s*\}|(\d))(?![\d^!])"
)
# What binds a number before it more tightly than a product would: "1/2.5 \\times 10^{2}" is (1/2.5) \\times 100.
_BINDS_BEFORE = re.compile(r"(?:/|\^|_|\\div)\s*$")
# Scientific notation up to this power of ten is written out in digits.
_MAX_WRITTEN_EXPONENT = 100
# What Math-Verify reads as a letter, where case counts: a letter outside command names, escaped signs, and the braces
# of text and fonts ("\\mathbb{R}" is a set, "\\text{No}" a word).
_CASED_LETTER = re.compile(
    r"(\\(?:text\w*|math\w*|operatorname|mbox|begin|end)\s*\{[^{}]*\}|\\[A-Za-z]+|\\.)|([A-Za-z])"
)
# The Greek letters an upper-case letter is written as where case must count: none is a constant to Math-Verify.
_STAND_INS = (
    "alpha", "beta", "gamma", "delta", "zeta", "eta", "theta", "iota", "kappa",
    "mu", "nu", "xi", "sigma", "tau", "upsilon", "chi", "psi", "omega",
)  # fmt: skip
# A choice's letter alone, in brackets or not ("C", "(C)"), once spelling is normalized.
_CHOICE_LETTER = re.compile(r"([A-Z])|\(([A-Z])\)")
_YES_NO = frozenset({"yes", "no"})
# Bounds on the numbers the exact check builds: beyond them it leaves the verdict to Math-Verify.
_MAX_EXACT_BITS = 1 << 22
_MAX_EXACT_ARGUMENT = 100_000


def _clean(answer: str) -> str:
    """``answer`` without a full stop (or other punctuation after closing math), enclosing '$' or the separators of
    digit groups (:func:`tmas.answers.ungrouped`); its degree signs as ^\\circ, and the signs of plain text (·, ∞, √)
    as LaTeX."""
    text = _FULL_STOP.sub("", without_punctuation_after_math(answer)).strip().strip("$").strip()
    text = _DEGREE_SIGN.sub("^\\\\circ", _THIN_SPACE_GROUPS.sub("", ungrouped(text)))
    for sign, latex in _TEXT_SIGNS.items():
        text = text.replace(sign, latex)
    return _ROOT_SIGN.sub(_latex_root, text)


def _latex_root(match: re.Match[str]) -> str:
    radicand = match.group(1)
    if radicand[0] in "({":
        radicand = radicand[1:-1]
    return "\\sqrt{" + radicand + "}"


def _wrap(answer: str, letters_are_unknowns: bool = True) -> str:
    """``answer`` boxed for Math-Verify (it extracts LaTeX from \\boxed{} or $...$; boxing also copes with answers that
    contain '$'). Math-Verify drops letters ending an answer that it takes for a unit ("2-2m" is read as 2-2, "3s" as
    3): letters that end an expression ("2-2m", "2 \\cdot m") or any answer where ``letters_are_unknowns`` are kept as
    unknowns; after a plain number ("5 m", "12 cm" against a numeric reference) they stay a unit. Where letters are
    not unknowns (the reference is a number), "1e-05" is scientific notation, not Euler's number (1·e - 5)."""
    text = _DECIMAL_TIMES_POWER.sub(_exact_decimal_times_power, _clean(answer))
    if not letters_are_unknowns:
        text = _SCIENTIFIC.sub(_exact_scientific, text)
    tail = _TRAILING_LETTERS.search(text)
    if tail is not None and (letters_are_unknowns or not _plain_quantity(text[: tail.start()])):
        text = text[: tail.start()] + "{" + tail.group() + "}"
    return "\\boxed{" + text + "}"


def _exact_scientific(match: re.Match[str]) -> str:
    """A number in scientific notation written out as the decimal it is ("6.02e23" as 602000000000000000000000, "3.3e-1"
    as 0.33: a float times a large power no longer equals the integer), or as an integer times a power of ten where
    that would be long ("1e70840" as 1 \\times 10^{70840})."""
    return _written_out(match.group(1), match.group(2))


def _exact_decimal_times_power(match: re.Match[str]) -> str:
    """A decimal times a power of ten written out as :func:`_exact_scientific` writes one, unless what stands before it
    binds the decimal first (a division, a power)."""
    if _BINDS_BEFORE.search(match.string, 0, match.start()):
        return match.group()
    return _written_out(match.group(1), match.group(2) or match.group(3))


def _written_out(mantissa: str, exponent: str) -> str:
    value = Decimal(mantissa + "e" + exponent)
    if abs(value.adjusted()) <= _MAX_WRITTEN_EXPONENT:
        return format(value, "f")
    whole, _, fraction = mantissa.partition(".")
    return f"{int(whole + fraction)} \\times 10^{{{int(exponent) - len(fraction)}}}"


def _plain_quantity(text: str) -> bool:
    """Whether ``text`` is a number alone (digits, a fraction, a root, a sign first): what a unit may follow."""
    return _PLAIN_QUANTITY.fullmatch(_QUANTITY_COMMANDS.sub("", text).strip()) is not None


def _has_unknowns(answer: str) -> bool:
    """Whether ``answer`` holds a letter outside LaTeX's commands and text: "2-2m", "x \\in [1,3)", not "\\pi/6"."""
    return _BARE_LETTER.search(_TEXT_WRAPPER.sub("", _clean(answer))) is not None


def alternatives(answer: str) -> list[str]:
    """The answers ``answer`` offers: ``["3", "4"]`` for "3 or 4", "3 (maybe 4)" or "x = 3, but possibly 4"; one
    item, ``answer`` itself, where it offers no other."""
    text = _TEXT_WRAPPER.sub(r" \1 ", answer)
    if not _ALTERNATIVE.search(text):
        return [answer]
    pieces = [_trim(piece) for piece in _ALTERNATIVE.split(text)]
    pieces = [piece for piece in pieces if piece]
    return pieces or [answer]


def _trim(piece: str) -> str:
    """One alternative without the separators around it or a bracket the split cut off ("3 (or 4)": "3 (", "4)")."""
    while True:
        piece = _PIECE_EDGE.sub("", piece)
        opened = piece.count("(") + piece.count("[")
        closed = piece.count(")") + piece.count("]")
        if piece.endswith(("(", "[")):
            piece = piece[:-1]
        elif opened > closed and piece.startswith(("(", "[")):
            piece = piece[1:]
        elif closed > opened and piece.endswith((")", "]")):
            piece = piece[:-1]
        else:
            return piece


def _listed(gold: str) -> str:
    """``gold`` with the "and" joining its items written as a comma ("2 \\text{ and } 7" is the list "2, 7", as an
    answer's "and" is), where no other word makes it a sentence ("1 and odd primes")."""
    joined = _LIST_AND.sub(", ", gold)
    return gold if joined == gold or _WORD.search(joined) else joined


def _closed_answer(answer: str) -> tuple[str, str] | None:
    """What ``answer`` is where it is only a yes-or-no word (any case: "NO", "\\text{yes}.") or only a choice's
    upper-case letter ("C", "\\textbf{(C)}"): its kind and its word or letter; None for anything else (a reason after
    the word, an option's text after its letter, a lower-case letter, which may be an unknown)."""
    text = normalize_answer(_clean(answer))
    if text.lower() in _YES_NO:
        return "yes-or-no", text.lower()
    letter = _CHOICE_LETTER.fullmatch(text)
    return ("choice", letter.group(1) or letter.group(2)) if letter else None


def _closed_verdict(gold: str, pred: str) -> RuleVerdict | None:
    """The verdict on two yes-or-no answers or two choice letters, which Math-Verify reads as products of unknowns
    (it leaves "Yes" against "No" undecided): the same word or letter is right, another wrong. None where either is
    something else."""
    first, second = _closed_answer(gold), _closed_answer(pred)
    if first is None or second is None or first[0] != second[0]:
        return None
    if first == second:
        return RuleVerdict(True, f"the same {first[0]} answer")
    return RuleVerdict(False, f"a different {first[0]} answer")


def _letters(text: str) -> set[str]:
    return {m.group(2) for m in _CASED_LETTER.finditer(text) if m.group(2)}


def _case_apart(gold: str, pred: str) -> tuple[str, str] | None:
    """``gold`` and ``pred`` with each upper-case letter written as a Greek letter neither uses, where either of them
    writes a letter in both cases ("R - 2r"): Math-Verify lowercases every letter it reads, so the circumradius R and
    the inradius r would be one unknown ("R - 2r" equal to "-r"). Elsewhere they are returned as they are (case does
    not count: "Yes" is "yes"); None where there are not enough Greek letters to go round."""
    letters = [_letters(gold), _letters(pred)]
    if not any(c.isupper() and c.lower() in found for found in letters for c in found):
        return gold, pred
    upper = sorted({c for found in letters for c in found if c.isupper()})
    free = [g for g in _STAND_INS if not re.search(rf"\\{g}(?![A-Za-z])", gold + " " + pred)]
    if len(free) < len(upper):
        return None
    names = dict(zip(upper, free, strict=False))

    def rename(text: str) -> str:
        return _CASED_LETTER.sub(lambda m: f"\\{names[m.group(2)]} " if m.group(2) in names else m.group(), text)

    return rename(gold), rename(pred)


def check_pair(gold: str, pred: str, timeout_s: int | None = 5, any_order: bool = False) -> RuleVerdict:
    """Compare one pair (gold first: Math-Verify's ``verify`` is asymmetric). Runs in a worker process or any main
    thread (``timeout_s`` None runs without Math-Verify's timeouts, unbounded: from another thread call
    :func:`check_pair_bounded`). ``any_order``: a reference written as a bare list is a set (the problem asks for all
    of something: :func:`asks_for_all`); else an answer giving its items in another order is left undecided.

    An answer offering alternatives ("3 or 4", "3 (maybe 4)") is the list of its different alternatives: against a
    single number that is several answers, none committed to (wrong); against a list it is compared as a list."""
    if normalize_answer(gold) == normalize_answer(pred):
        return RuleVerdict(True, "same answer")
    closed = _closed_verdict(gold, pred)
    if closed is not None:
        return closed
    listed = list_reading(gold)
    if listed is not None:
        return _either_reading(normalize_answer(gold), listed, pred, timeout_s, any_order)
    try:
        from math_verify import parse
    except ImportError:  # pragma: no cover - surfaced by the pool's owner
        return RuleVerdict(None, "math-verify not installed")
    gold = _listed(gold)
    if _PROSE.search(_clean(gold)):
        return RuleVerdict(None, "reference in words: not checked by the rules")
    if leading_zeros(gold):
        if normalize_answer(_clean(gold)) == normalize_answer(_clean(pred)):
            return RuleVerdict(True, "same answer")
        return RuleVerdict(
            None, "reference of digits with leading zeros: only the same digits are checked by the rules"
        )
    # Letters ending the answer are a unit only where the reference is a number ("12 cm" for 12).
    unknowns = _has_unknowns(gold)
    # Two plain numbers of one value are one answer, however written ("\\text{017}" for 17, which Math-Verify does not
    # read); unequal ones are left to Math-Verify, which reads a decimal as a rounded float. Not a reference with a
    # letter: its "2e-1" is Euler's number.
    value = None if unknowns else plain_number(normalize_answer(_clean(gold)))
    if value is not None and value == plain_number(normalize_answer(_clean(pred))):
        return RuleVerdict(True, "the same number")
    apart = _case_apart(gold, pred)
    if apart is None:
        return RuleVerdict(None, "too many letters written in both cases to tell apart")
    gold, pred = apart
    try:
        gold_parsed = parse(_wrap(gold), parsing_timeout=timeout_s)
        offered = _distinct(alternatives(_clean(pred)), timeout_s, unknowns)
        pred_parsed = parse(_wrap(", ".join(offered), unknowns), parsing_timeout=timeout_s)
    except Exception as exc:  # Math-Verify raises on odd input; that is "cannot decide", not a crash
        return RuleVerdict(None, f"parse error: {type(exc).__name__}")
    if not gold_parsed:
        return RuleVerdict(None, "reference not parseable")
    if not pred_parsed:
        return RuleVerdict(None, "answer not parseable")
    if _is_number(gold_parsed[0]) and (len(offered) > 1 or _several_numbers(pred_parsed[0])):
        return RuleVerdict(False, "several different answers where the reference is one number")
    try:
        shown = _verify(gold_parsed, pred_parsed, timeout_s)
    except Exception as exc:
        return RuleVerdict(None, f"verify error: {type(exc).__name__}")
    if shown is None:
        return RuleVerdict(None, f"math-verify: timed out comparing (over {timeout_s} s)")
    equal = shown
    if equal and _values_differ(gold, pred, gold_parsed[0], pred_parsed[0]):
        return RuleVerdict(False, "the values differ (math-verify rounded their difference away)")
    if equal and not any_order and not _same_order(gold, gold_parsed[0], pred_parsed, timeout_s):
        return RuleVerdict(
            None, "not the reference's items in its order: the rules cannot tell whether the order matters"
        )
    if equal:
        return RuleVerdict(True, "math-verify: equivalent")
    # A "no" is trusted only between plain numbers; symbolic or textual answers may be equal in ways the rules
    # miss (e.g. "all n >= 3" vs "n \ge 3"), so those go to the judge in combined mode.
    if _is_number(gold_parsed[0]) and _is_number(pred_parsed[0]):
        return RuleVerdict(False, "math-verify: different numbers")
    return RuleVerdict(None, "math-verify: not shown equivalent (non-numeric)")


def _either_reading(number: str, listed: str, pred: str, timeout_s: int | None, any_order: bool) -> RuleVerdict:
    """The verdict on ``pred`` against a reference that reads both as a number in digit groups and as a list
    ("60,100": 60100 or "60, 100"): right where it is either. Wrong where it is one plain number the number reading
    finds wrong (one number is never a list of two or more: "5", "60099"), or a list of as many plain numbers as the
    list reading has whose set of values is not that of its items (a list of two or more numbers is never one number;
    in any order or as a set it still differs: "60, 101", "60, 60"). Anything else is left to the judge: a symbolic
    answer, a list of another length, the reference's items in another order."""
    verdicts: dict[str, RuleVerdict] = {}
    for reading, name in ((number, "number"), (listed, "list")):
        verdict = check_pair(reading, pred, timeout_s, any_order)
        if verdict.correct:
            return RuleVerdict(True, f"the reference read as a {name}: {verdict.detail}")
        verdicts[name] = verdict
    answer = normalize_answer(_clean(pred))
    if plain_number(answer) is not None and verdicts["number"].correct is False:
        return RuleVerdict(
            False, f"one number, not the reference read as a number ({verdicts['number'].detail}) nor a list"
        )
    if other_list(answer, listed):
        count = len(plain_numbers(answer) or ())
        return RuleVerdict(False, f"a list of {count} numbers, not the reference's items nor one number")
    return RuleVerdict(None, "reference reads both as a number in digit groups and as a list: neither shown equal")


def _verify(gold_parsed: list[Any], pred_parsed: list[Any], timeout_s: int | None) -> bool | None:
    """Math-Verify's ``verify``: whether some reading of the reference equals some reading of the answer; None where
    none was shown equal and a comparison ran out of time. Its own ``verify`` answers False for a comparison that
    timed out ("10^{10^{10}} - 10^{10^{10}} + 2" against 2), which would pass as "different"."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    timed_out = False
    for gold in gold_parsed:
        for pred in pred_parsed:
            try:
                if verify([gold], [pred], timeout_seconds=timeout_s, raise_on_error=True):
                    return True
            except TimeoutException:
                timed_out = True
            except Exception:  # as Math-Verify's own: a reading that cannot be compared is not shown equal
                continue
    return None if timed_out else False


def _is_number(value: Any) -> bool:
    return bool(getattr(value, "is_number", False)) and not getattr(value, "free_symbols", None)


def _distinct(offered: list[str], timeout_s: int | None, letters_are_unknowns: bool = True) -> list[str]:
    """``offered`` less the alternatives Math-Verify shows equal to an earlier one ("3 (or 6/2)" offers one answer)."""
    if len(offered) < 2:
        return offered
    from math_verify import parse

    kept: list[tuple[str, Any]] = []
    for piece in offered:
        parsed = parse(_wrap(piece, letters_are_unknowns), parsing_timeout=timeout_s)
        if not parsed:
            return offered
        same = (
            _verify(k, parsed, timeout_s) is True
            and _verify(parsed, k, timeout_s) is True
            and not _values_differ(other, piece, k[0], parsed[0])
            for other, k in kept
        )
        if not any(same):
            kept.append((piece, parsed))
    return [piece for piece, _ in kept]


def leading_zeros(reference: str) -> bool:
    """Whether ``reference`` writes a number with leading zeros ("017", a code or the rows of a grid): then only the
    same digits are that answer, whatever their value (against a reference written as a number, 17, an answer "017"
    is its value). Math-Verify reads their value (1020 for "001020") and a list of them as a set, so its "equal"
    would accept other strings; votes key such an answer by its digits as well
    (:func:`tmas.answer_classes.has_leading_zeros`)."""
    return has_leading_zeros(_clean(reference))


def asks_for_all(question: str) -> bool:
    """Whether ``question`` asks for all of something ("Find all n", "all possible values"): then a reference written
    as a bare list is the set of them, in any order."""
    return bool(_ASKS_FOR_ALL.search(question))


def _same_order(gold: str, gold_value: Any, pred_parsed: list[Any], timeout_s: int | None) -> bool:
    """Whether the answer gives a reference written as a bare list ("1, 2, 3", no braces) in its written order, and
    each item as often. Math-Verify reads a bare list as a set, but whether it is one ("all solutions: 1, 2, 3") or a
    sequence ("x, y: 1, 2", "the answers for p = 5 and p = 7") is for the problem to say: "3, 2, 1" may be right or
    wrong. A reference that is not a bare list of several items (a number, a tuple, a set in braces) passes."""
    from sympy import FiniteSet, Tuple

    # Math-Verify's sets keep the items in their written order.
    unsorted = getattr(gold_value, "_unsorted_args", None) if isinstance(gold_value, FiniteSet) else None
    text = _clean(gold)
    # Not a list a sign makes ("\\pm 2" is the set of 2 and -2), nor a set in braces.
    if unsorted is None or len(unsorted) < 2 or not _LIST_SEPARATOR.search(text) or _SET_BRACES.match(text):
        return True

    try:
        return _verify([Tuple(*unsorted)], pred_parsed, timeout_s) is True
    except Exception:  # as in check_pair: an error is "cannot tell", so the order is not shown the same
        return False


def _several_numbers(value: Any) -> bool:
    """Whether ``value`` is a set or tuple of more than one number (an answer listing several)."""
    from sympy import FiniteSet, Tuple

    if not isinstance(value, FiniteSet | Tuple):
        return False
    elements = list(value)
    return len(elements) > 1 and all(_is_number(e) for e in elements)


def exact_value(value: Any) -> Fraction | None:
    """The exact rational value of a number built from integers, fractions, integer powers, factorials and binomials
    (``4^{2024} / \\binom{4048}{2024} - 2``); None for anything else (roots, pi, floats, symbols) or a number too
    large to build (over about four million bits, a factorial or binomial of more than 100,000)."""
    from sympy import Add, Mul, Pow, Rational, binomial, factorial

    if isinstance(value, Rational):
        return Fraction(int(value.p), int(value.q))
    if isinstance(value, Add | Mul):
        parts = [exact_value(arg) for arg in value.args]
        if any(part is None for part in parts):
            return None
        known = [part for part in parts if part is not None]
        total = Fraction(0) if isinstance(value, Add) else Fraction(1)
        for part in known:
            total = total + part if isinstance(value, Add) else total * part
            if _bits(total) > _MAX_EXACT_BITS:
                return None
        return total
    if isinstance(value, Pow):
        base, exponent = exact_value(value.base), exact_value(value.exp)
        if base is None or exponent is None or exponent.denominator != 1 or (base == 0 and exponent < 0):
            return None
        if abs(exponent.numerator) * max(_bits(base), 1) > _MAX_EXACT_BITS:
            return None
        return base**exponent.numerator
    if isinstance(value, factorial | binomial):
        arguments = [exact_value(arg) for arg in value.args]
        if any(a is None or a.denominator != 1 or not 0 <= a <= _MAX_EXACT_ARGUMENT for a in arguments):
            return None
        ints = [int(a) for a in arguments if a is not None]
        return Fraction(math.factorial(ints[0]) if isinstance(value, factorial) else math.comb(ints[0], ints[1]))
    return None


def _bits(value: Fraction) -> int:
    return abs(value.numerator).bit_length() + value.denominator.bit_length()


def _values_differ(gold: str, pred: str, gold_value: Any, pred_value: Any) -> bool:
    """Whether two numbers Math-Verify found equal have different values. Its numeric check rounds their difference at
    15 digits of its largest term, so ``4^{2025}/\\binom{4048}{2024}`` "equals" ``4^{2024}/\\binom{4048}{2024}``:
    numbers built exactly (:func:`exact_value`) are compared exactly, other numbers at 30 digits each. Floats and
    percentages are left to it (it rounds floats on purpose, and reads 60% and 60 as one answer)."""
    if "%" in gold or "%" in pred or not (_is_number(gold_value) and _is_number(pred_value)):
        return False
    first, second = exact_value(gold_value), exact_value(pred_value)
    if first is not None and second is not None:
        return first != second
    from sympy import Float

    if gold_value.atoms(Float) or pred_value.atoms(Float):
        return False
    try:
        a, b = complex(gold_value.evalf(30)), complex(pred_value.evalf(30))
    except (TypeError, ValueError, OverflowError):
        return False
    scale = max(1.0, abs(a), abs(b))
    return math.isfinite(scale) and abs(a - b) > 1e-12 * scale


def ensure_math_verify() -> None:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        raise MissingExtra("rule-based grading needs Math-Verify: pip install 'tmas[eval]' (or math-verify)") from None


class RuleChecker:
    """Worker processes checking answer pairs, ``workers`` checks at a time: ``async with RuleChecker() as rc:
    await rc.check(g, p)``. Each check runs in a worker as a synchronous one off the main thread does
    (:class:`_Worker`): one not done ``deadline_s`` after its worker took it (by default ``4 * timeout_s + 60``;
    Math-Verify's own alarms bound each parse and comparison) is undecided ("timed out") and its worker is stopped,
    the next check starting another, while the other checks go on. Leaving stops every worker, one in a check
    included."""

    def __init__(self, workers: int = 2, timeout_s: int = 5, deadline_s: float | None = None) -> None:
        ensure_math_verify()
        self.timeout_s = timeout_s
        self.deadline_s = 4 * timeout_s + 60 if deadline_s is None else deadline_s
        self._workers = workers
        self._slots: asyncio.Semaphore | None = None
        # A thread waits on each check, one per worker: a stuck check never holds a thread of the event loop's own
        # pool, which the other work on the loop (tmas serve's jobs) shares.
        self._threads: ThreadPoolExecutor | None = None
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._cache: dict[tuple[str, str, bool], RuleVerdict] = {}

    async def __aenter__(self) -> RuleChecker:
        self._slots = asyncio.Semaphore(self._workers)
        self._threads = ThreadPoolExecutor(self._workers, thread_name_prefix="tmas-rules")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._slots = None
        threads, self._threads = self._threads, None
        idle, self._idle = self._idle, []
        busy, self._busy = list(self._busy), set()
        if idle or busy:
            # Killed, not waited for: a worker stuck in a check never holds up the exit. On a thread: the other runs
            # on this event loop (tmas serve's requests) go on meanwhile.
            await asyncio.to_thread(_stop_workers, idle, busy)
        if threads is not None:
            threads.shutdown(wait=False)  # each ends as its worker's check does, the workers being stopped

    async def check(self, gold: str, pred: str, any_order: bool = False) -> RuleVerdict:
        key = (gold, pred, any_order)
        if key in self._cache:
            return self._cache[key]
        if self._slots is None:
            raise RuntimeError("RuleChecker used outside 'async with'")
        async with self._slots:
            if self._slots is None:
                return RuleVerdict(None, "the rules checker was closed")
            verdict = await self._check_in(self._idle.pop() if self._idle else _Worker(), gold, pred, any_order)
        if self._slots is not None:
            self._cache[key] = verdict
        return verdict

    async def _check_in(self, worker: _Worker, gold: str, pred: str, any_order: bool) -> RuleVerdict:
        self._busy.add(worker)
        args = (gold, pred, self.timeout_s, any_order)
        loop = asyncio.get_running_loop()
        try:
            verdict = await loop.run_in_executor(self._threads, _check_once, worker, check_pair, args, self.deadline_s)
        except RuleWorkerError:
            if self._slots is None:  # stopped by leaving, not by failing to start
                return RuleVerdict(None, "the rules checker was closed")
            raise
        except BaseException:
            # Cancelled (a report or a request stopped): the check would go on in its worker, holding it and a core.
            worker.kill()
            raise
        finally:
            self._busy.discard(worker)
        if not worker.lost:
            if self._slots is None:
                worker.stop()
            else:
                self._idle.append(worker)
        return verdict


def _check_once(
    worker: _Worker, check: Callable[..., RuleVerdict], args: tuple[Any, ...], deadline_s: float
) -> RuleVerdict:
    """``worker.check``, on a thread; a worker lost in it (timed out, killed, or dead) is stopped."""
    try:
        return worker.check(check, args, deadline_s)
    finally:
        if worker.lost:
            worker.stop()


def _stop_workers(idle: list[_Worker], busy: list[_Worker]) -> None:
    for worker in idle:
        worker.stop()
    for worker in busy:  # the thread waiting on its check finds it stopped, and closes its end
        worker.kill()


# A synchronous check off the main thread (a trainer calling its reward function from a thread pool) runs in one
# worker process, started on the first such check: Math-Verify's alarms need a main thread, and without them one
# answer ("3^{10^{8}}") can hold the interpreter, every thread included, for minutes.
_STARTED = "started"
# Time for the worker to start (spawn, import SymPy) and take a check: a machine busy with training may be slow.
_WORKER_START_S = 120.0


def _serve(conn: Connection) -> None:
    """The worker's loop: takes ``(check, args)``, answers that it started, then with the check's verdict."""
    if math_verify_installed():  # else check_pair answers that itself
        import math_verify  # noqa: F401  # loaded before the first check, so its deadline is the check's alone
    while True:
        try:
            check, args = conn.recv()
        except EOFError:
            return
        conn.send(_STARTED)
        try:
            verdict = check(*args)
        except Exception as exc:  # a check that raises is one the rules cannot decide
            verdict = RuleVerdict(None, f"check error: {type(exc).__name__}")
        conn.send(verdict)


class _Worker:
    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), name="tmas-rules", daemon=True)
        self.process.start()
        child.close()
        self.lost = False
        self.served = 0

    def check(self, check: Callable[..., RuleVerdict], args: tuple[Any, ...], deadline_s: float) -> RuleVerdict:
        """The verdict of ``check(*args)``, or an undecided one (and the worker lost) where the worker did not take
        it in time, did not finish it within ``deadline_s`` of starting it, or died in it. A worker that exited before
        taking it is an error."""
        try:
            self.conn.send((check, args))
            if not self.conn.poll(_WORKER_START_S):
                return self._lose(f"the rules worker did not start the check within {_WORKER_START_S:g} s")
            started = self.conn.recv() == _STARTED
        except (EOFError, OSError):
            started = False
        if not started and self.served:
            return self._lose("the rules worker stopped between checks")
        if not started:
            # Not the answer's doing: every check would fail alike, and a reward of "undecided" for all would hide it.
            self.lost = True
            self.process.join(5)
            raise RuleWorkerError(
                f"the rules worker process exited before taking a check (exit code {self.process.exitcode}): a script "
                "that grades answers off its main thread must run its work under 'if __name__ == \"__main__\":' "
                "(the worker is spawned, and spawning runs the main module again)"
            )
        try:
            if not self.conn.poll(deadline_s):
                return self._lose(f"timed out (over {deadline_s:g} s)")
            verdict: RuleVerdict = self.conn.recv()
            self.served += 1
            return verdict
        except (EOFError, OSError):
            return self._lose("the rules worker stopped")

    def _lose(self, detail: str) -> RuleVerdict:
        self.lost = True
        return RuleVerdict(None, detail)

    def kill(self) -> None:
        """Kills the process, leaving the connection to the thread that may be waiting on it."""
        self.lost = True
        self.process.kill()
        self.process.join()

    def stop(self) -> None:
        self.kill()
        self.conn.close()


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def check_pair_bounded(
    gold: str, pred: str, timeout_s: int = 5, any_order: bool = False, *, deadline_s: float = 30.0
) -> RuleVerdict:
    """:func:`check_pair`, bounded whichever thread calls it. In a main thread Math-Verify's alarms bound it
    (``timeout_s`` a parse or comparison). In another thread it runs in a worker process with the same alarms, and
    one not done ``deadline_s`` after it started is undecided ("timed out"): the worker is stopped and the next check
    starts another. Checks from several threads take turns. The worker is started on the first check made off a main
    thread, and stops when this process exits."""
    if threading.current_thread() is threading.main_thread():
        return check_pair(gold, pred, timeout_s, any_order)
    global _worker
    with _worker_lock:
        worker = _worker = _worker or _Worker()
        try:
            return worker.check(check_pair, (gold, pred, timeout_s, any_order), deadline_s)
        finally:
            if worker.lost:
                worker.stop()
                if _worker is worker:
                    _worker = None


def _stop_worker() -> None:
    """Stops the worker, without waiting for a check in progress (at exit, a daemon thread may hold the lock): that
    check's caller finds the worker stopped and answers undecided."""
    global _worker
    worker, _worker = _worker, None
    if worker is not None:
        worker.stop()


def _forget_worker() -> None:
    """In a forked child: the parent's worker and lock are the parent's."""
    global _worker, _worker_lock
    _worker, _worker_lock = None, threading.Lock()


atexit.register(_stop_worker)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)


@functools.cache
def math_verify_installed() -> bool:
    """Whether Math-Verify can be imported (found, not imported: importing it loads SymPy, which takes a while);
    looked up once a process, not once a run (the proxy starts a run per request)."""
    return importlib.util.find_spec("math_verify") is not None


class RuleEquivalence:
    """The grading rules as the symmetric equivalence votes group answers by (tmas.answer_classes.EquivalenceCheck):
    two answers are equal when Math-Verify shows each equal to the other (the second order is checked only where the
    first holds). Its worker pool starts on the first check (runs whose answers are all plain numbers never start it)
    and stops at :meth:`aclose`."""

    def __init__(self, workers: int = 1, timeout_s: int = 5) -> None:
        self._workers = workers
        self._timeout_s = timeout_s
        self._checker: RuleChecker | None = None
        self._start = asyncio.Lock()

    async def equivalent(self, first: str, second: str) -> bool:
        async with self._start:
            if self._checker is None:
                checker = RuleChecker(workers=self._workers, timeout_s=self._timeout_s)
                await checker.__aenter__()
                self._checker = checker
        checker = self._checker
        # The second order only where the first holds: most pairs a vote compares differ, and one check shows it.
        if (await checker.check(first, second)).correct is not True:
            return False
        return (await checker.check(second, first)).correct is True

    async def aclose(self) -> None:
        if self._checker is not None:
            await self._checker.__aexit__(None, None, None)
            self._checker = None
