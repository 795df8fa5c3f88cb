"""Extracting the final answer from a solution's text."""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# What counts braces in a box: a brace, or a backslash and the character after it, skipped together (the literal braces
# "\\{" and "\\}" group nothing; the "{" after a line break "\\\\" opens a group).
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.S)
# An explicit statement of the final answer, for models that do not box it: "Final answer: X", "The answer is X",
# "**Answer:** $X$." at the end of a line. A bare "answer" in the middle of prose does not count.
_FINAL_ANSWER = re.compile(
    r"(?:^[\s>#*_-]*|\bthe\s+|\bfinal\s+)(?:final\s+)?answer[*_]*\s*(?:is\b\s*:?|:)[\s*_]*\$?([^\n$]+?)\$?[\s*_]*\.?\s*$",
    re.I | re.M,
)

# A final answer in '$' ending its sentence, with more on the line: "Final Answer: The final answer is $X$. I hope it
# is correct." Only "final answer": a plain "the answer is $x$." in the middle of a line may be a step of the work.
_FINAL_ANSWER_MATH = re.compile(r"\bfinal\s+answer[*_]*\s*(?:is\b\s*:?|:)[\s*_]*\$([^\n$]+)\$[\s*_]*\.(?=\s)", re.I)

# What may stand between boxes that state one final answer together, on one line or adjacent lines: "\\boxed{3} or
# \\boxed{4}", "$\\boxed{1}$, $\\boxed{2}$ and $\\boxed{5}$", with the math delimiters "\\( \\)" and "\\[ \\]" as
# with '$'. Anything else between two boxes (a sentence, "(b)", "corrected:", a blank line) makes the earlier one no
# part of the last.
_LINK_WORD = r"\b(?:and|or|possibly|maybe|perhaps|either)\b"
_TEXT_LINK = rf"\\text\s*\{{(?:\s|[,;]|{_LINK_WORD})*\}}"
_JOINED = re.compile(
    rf"(?:[^\S\n]|\n(?!\s*\n)|[$,;()]|\\[,;:! ()\[\]]|\\q?quad\b|{_TEXT_LINK}|{_LINK_WORD})*",
    re.I,
)
# The name a box gives its value to, just before it: "x = \\boxed{3}", "$x_1 = \\boxed{3}$", "\\(n=\\boxed{3}"; its
# letter is the unknown (x_1 and x_2 are two solutions for x).
_NAMED = re.compile(r"(?<![A-Za-z\\])([A-Za-z])(?:_\{?[A-Za-z0-9]+\}?)?\s*=\s*(?:\$|\\\(|\\\[)?\s*$")
# How far before a box its name is looked for.
_NAME_REACH = 40
_ALTERNATIVE_WORD = re.compile(r"\b(?:or|possibly|maybe|perhaps|either)\b", re.I)
_TEXT_WORDS = re.compile(r"\\text\s*\{([^{}]*)\}")

# The opening of a plain "the answer is X" (no "final", not a label opening its line).
_PLAIN_LABEL = re.compile(r"the\s+answer\b", re.I)
# A statement's label opening its line: markdown, a connective, "the", then "(final) answer".
_OWN_LABEL = re.compile(
    r"[\s>#*_-]*(?:(?:so|thus|therefore|hence|finally|in\s+(?:conclusion|summary))\b[\s,:]*)?"
    r"(?:(?:the|my|our)\s+)?(?:final\s+)?answer\b",
    re.I,
)
# A statement that points at an answer given elsewhere rather than giving one.
_POINTS_BACK = re.compile(r"\b(?:above|below|boxed|earlier|previous(?:ly)?|see)\b", re.I)

# LaTeX's math delimiters "\\( \\)" and "\\[ \\]" (not a line break "\\\\[2pt]"): like '$', no part of an answer.
_MATH_DELIMITER = re.compile(r"(?<!\\)\\[()[\]]")

# A stated answer longer than this many words is a sentence about the answer, not the answer itself.
_MAX_STATED_WORDS = 6

ExtractionSource = Literal["boxed", "stated", "none"]


class Extraction(NamedTuple):
    answer: str | None
    # Where the answer came from: the last box, an explicit final-answer statement, or nowhere.
    source: ExtractionSource


def closing_braces(text: str, start: int = 0) -> dict[int, int]:
    """Each grouping brace of ``text`` from ``start``: an opening brace's index -> its closing brace's (one left open
    is absent), in one pass. The literal braces ``\\{`` and ``\\}`` group nothing."""
    closing: dict[int, int] = {}
    opened: list[int] = []
    for token in _BRACE_TOKEN.finditer(text, start):
        if token.group() == "{":
            opened.append(token.start())
        elif token.group() == "}" and opened:
            closing[opened.pop()] = token.start()
    return closing


def _boxes(text: str) -> list[tuple[int, int, str]]:
    """Each closed ``\\boxed{...}`` (nested braces allowed): its start, its end and its stripped content. The literal
    braces ``\\{`` and ``\\}`` group nothing: a set "\\{1, 2\\}", a case split "\\left\\{ ... \\right." opened and
    never closed. A box inside a box is no answer of its own: the outer box holds it, unboxed ("\\boxed{\\boxed{4}}"
    is the answer 4)."""
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return []
    # Each brace's match, in one pass (a long reply may open many boxes and close none).
    closing = closing_braces(text, boxes[0].end() - 1)
    out: list[tuple[int, int, str]] = []
    for match in boxes:
        start = match.end()
        end = closing.get(start - 1)
        if end is None or (out and match.start() < out[-1][1]):
            continue
        content = text[start:end]
        if _BOXED.search(content):
            content = _unboxed(content)
        out.append((match.start(), end + 1, content.strip()))
    return out


def _unboxed(text: str) -> str:
    """``text`` with each closed box in it replaced by its content."""
    parts = []
    at = 0
    for box_start, box_end, content in _boxes(text):
        parts += [text[at:box_start], content]
        at = box_end
    return "".join([*parts, text[at:]])


def boxed_values(text: str) -> list[str]:
    """The stripped content of every closed ``\\boxed{...}`` of ``text``, in order (nested braces allowed; the literal
    braces ``\\{`` and ``\\}`` group nothing)."""
    return [content for _, _, content in _boxes(text)]


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces allowed); None when there is none or it is unclosed."""
    boxes = _boxes(text)
    return boxes[-1][2] if boxes else None


def final_boxed(text: str) -> str | None:
    """The final boxed answer: the last box, with the boxes joined to it by "and", "or" or commas alone (and the name of
    an unknown each gives its value: "$x = \\boxed{2}$ or $x = \\boxed{5}$"). Boxes that
    hold different answers are given together, joined by "or" where they were offered as alternatives ("3 or 4",
    which the grading rules read as an answer that does not commit to one), else by commas (a list: "3, 4")."""
    boxes = [box for box in _boxes(text) if box[2]]
    if not boxes:
        return None
    group = [boxes[-1]]
    links: list[str] = []
    for box in reversed(boxes[:-1]):
        between = _without_same_name(text, box, text[box[1] : group[0][0]])
        if not _JOINED.fullmatch(between):
            break
        group.insert(0, box)
        links.append(_TEXT_WORDS.sub(r"\1", between))
    answers = list(dict.fromkeys(box[2] for box in group))
    if len(answers) == 1:
        return answers[0]
    joiner = " or " if any(_ALTERNATIVE_WORD.search(link) for link in links) else ", "
    return joiner.join(answers)


def _without_same_name(text: str, box: tuple[int, int, str], between: str) -> str:
    """``between`` (the text from ``box`` to the next box) less the name it gives the next box's value where ``box``
    gives its value a name of the same unknown: its solutions, "$x = \\boxed{2}$ or $x = \\boxed{5}$", "$x_1 =
    \\boxed{2}$, $x_2 = \\boxed{5}$"."""
    after = _NAMED.search(between)
    before = _NAMED.search(text[max(0, box[0] - _NAME_REACH) : box[0]])
    if after is None or before is None or after.group(1) != before.group(1):
        return between
    return between[: after.start()]


class _Statement(NamedTuple):
    start: int
    answer: str
    # Whether it states the reply's own final answer, not one of a side remark ("if the pairs were ordered, the answer
    # is 24") or a quotation ("Rollout 1's final answer: 12 was wrong"): its label opens its line (after a "So",
    # "Thus", ...), and says "final" or labels the line ("Answer: X"), or it is the reply's last line.
    final: bool


def _statements(text: str) -> list[_Statement]:
    """The explicit final-answer statements of ``text`` in order, less those whose "answer" is a sentence."""
    found = []
    for pattern in (_FINAL_ANSWER, _FINAL_ANSWER_MATH):
        for m in pattern.finditer(text):
            answer = _MATH_DELIMITER.sub("", m.group(1)).strip().strip("*_ ").strip()
            if answer and len(answer.split()) <= _MAX_STATED_WORDS:
                labelled = pattern is _FINAL_ANSWER_MATH or not _PLAIN_LABEL.match(text, m.start())
                line = text[text.rfind("\n", 0, m.start()) + 1 : m.start(1)]
                own = _OWN_LABEL.match(line) is not None
                found.append(_Statement(m.start(), answer, own and (labelled or not text[m.end() :].strip())))
    return sorted(found)


def extract_answer(text: str) -> Extraction:
    """The reply's final answer, saying where it came from: the final boxed answer (:func:`final_boxed`), unless an
    explicit final-answer statement comes after the last box and restates the answer as final (:func:`_restated`);
    without a box, the last statement."""
    boxes = [box for box in _boxes(text) if box[2]]
    statements = _statements(text)
    boxed = final_boxed(text)
    if boxes and boxed:
        restated = _restated(boxes[-1][1], boxed, statements)
        if restated is not None:
            return Extraction(restated, "stated")
        return Extraction(boxed, "boxed")
    return Extraction(statements[-1].answer, "stated") if statements else Extraction(None, "none")


def _restated(box_end: int, boxed: str, statements: list[_Statement]) -> str | None:
    """The answer a statement after the last box (ending at ``box_end``) gives as the reply's own final answer
    (:class:`_Statement`), where one does: a model that boxed an intermediate value and then states its final
    answer. One pointing back at the box ("Final answer: as boxed above") does not count, nor one that gives the
    ``boxed`` answer with words after it ("The answer is 12 because each pair counts once"): the box is the answer."""
    same = re.compile(re.escape(boxed) + r"(?![\w.])")
    final = [
        s
        for s in statements
        if s.start >= box_end and s.final and not _POINTS_BACK.search(s.answer) and not same.match(s.answer)
    ]
    return final[-1].answer if final else None


_TEXT_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|\s+")
# Punctuation ending a sentence after closing math ("$7$.", "\\(7\\),"): no part of the answer.
_AFTER_MATH = re.compile(r"(?<!\\)(\$|\\[)\]])\s*[.,;:!?]+\s*$")
# LaTeX's root of one token without braces: "\\sqrt38" is the root of 3 times 8, "\\sqrt x" the root of x.
_SHORT_ROOT = re.compile(r"\\sqrt(?![A-Za-z])\s*([0-9A-Za-z])")
# A number written in groups of three digits, alone or given a name ("n = 1,000"): its groups are separated by commas
# or LaTeX's "{,}", and by a comma and a space only where the group after them begins with 0 ("1, 000"; "3, 125" is a
# list of two numbers). A number's first group has no leading zero ("011,100" is a code or a list).
_GROUP_SEPARATOR = r"(?:\{,\}|,(?:\s|\\[,;:! ]|~)*(?=0)|,)"
_GROUPED = re.compile(rf"((?:[A-Za-z]\w*\s*=\s*)?[+-]?)([1-9]\d{{0,2}}(?:{_GROUP_SEPARATOR}\d{{3}})+(?:\.\d+)?)")


def normalize_answer(answer: str) -> str:
    """A canonical spelling for grouping equal answers (majority vote): styling, spacing, math delimiters ('$',
    "\\( \\)", "\\[ \\]") and the punctuation after them removed, the minus sign written as a hyphen-minus, a number
    written in groups of three digits as its digits (:func:`ungrouped`), and a root of one token without braces
    braced as LaTeX reads it ("\\sqrt38" is "\\sqrt{3}8", the root of 3 times 8)."""
    text = _SHORT_ROOT.sub(r"\\sqrt{\1}", ungrouped(_unstyled(answer)))
    text = _SPACING.sub("", text)
    return text.rstrip(".")


def _unstyled(answer: str) -> str:
    text = _MATH_DELIMITER.sub("", without_punctuation_after_math(answer)).strip().strip("$").strip()
    text = _TEXT_WRAPPER.sub(r"\1", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    # The minus sign of typeset text (U+2212), as models copy it, is the hyphen-minus.
    return text.replace("\u2212", "-")


def without_punctuation_after_math(answer: str) -> str:
    """``answer`` without the punctuation ending a sentence after its closing math delimiter: "$7$." is "$7$"."""
    return _AFTER_MATH.sub(r"\1", answer.strip())


def ungrouped(text: str) -> str:
    """``text`` with the separators of its digit groups removed where it is one number written in groups of three
    digits, alone or given a name: "1,000", "1{,}000", "n = 1,000" and "1, 000" (the group after a comma and a space
    begins with 0) are 1000; "3, 125" is a list of two numbers, and "60,100" the number 60100, not the list
    "60, 100" (a reference "60,100" reads as both: :func:`list_reading`)."""
    match = _GROUPED.fullmatch(text.strip())
    if match is None:
        return text
    return match.group(1) + "".join(c for c in match.group(2) if c.isdigit() or c == ".")


def list_reading(answer: str) -> str | None:
    """The list ``answer`` also reads as where it is one number in groups of three digits separated by plain commas
    only, none of its groups after the first beginning with 0: "60, 100" for "60,100", "2, 251, 252" for "2,251,252"
    (benchmark authors write lists without spaces). None for any other answer: "1,000" (a list's item has no leading
    zero), "12{,}345" (LaTeX's group separator), "1, 025", "3, 125", "1000"."""
    text = _unstyled(answer).strip()
    match = _GROUPED.fullmatch(text)
    if match is None:
        return None
    groups = match.group(2).split(",")
    if any(not group.isdigit() or group.startswith("0") for group in groups[1:-1]):
        return None
    if groups[-1].startswith("0") or not groups[-1].split(".")[0].isdigit():
        return None
    return match.group(1) + ", ".join(groups)
