"""Extracting the final answer from a solution's text."""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# An explicit statement of the final answer, for models that do not box it: "Final answer: X", "The answer is X",
# "**Answer:** $X$." at the end of a line. A bare "answer" in the middle of prose does not count.
_FINAL_ANSWER = re.compile(
    r"(?:^[\s>#*_-]*|\bthe\s+|\bfinal\s+)(?:final\s+)?answer\s*(?:is\b\s*:?|:)[\s*_]*\$?([^\n$]+?)\$?[\s*_]*\.?\s*$",
    re.I | re.M,
)

# A stated answer longer than this many words is a sentence about the answer, not the answer itself.
_MAX_STATED_WORDS = 6

ExtractionSource = Literal["boxed", "stated", "none"]


class Extraction(NamedTuple):
    answer: str | None
    # Where the answer came from: the last box, an explicit final-answer statement, or nowhere.
    source: ExtractionSource


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces allowed); None when there is none or it is unclosed."""
    result = None
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            char = text[pos]
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    result = text[start:pos].strip()
                    break
    return result


def extract_answer(text: str) -> Extraction:
    """The last non-empty boxed answer, else the last explicit final-answer statement, saying which it was."""
    boxed = last_boxed(text)
    if boxed:
        return Extraction(boxed, "boxed")
    matches = [m.strip().strip("*_ ").strip() for m in _FINAL_ANSWER.findall(text)]
    matches = [m for m in matches if m and len(m.split()) <= _MAX_STATED_WORDS]
    return Extraction(matches[-1], "stated") if matches else Extraction(None, "none")


_TEXT_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|\s+")


def normalize_answer(answer: str) -> str:
    """A canonical spelling for grouping equal answers (majority vote): styling, spacing and '$' removed."""
    text = answer.strip().strip("$").strip()
    text = _TEXT_WRAPPER.sub(r"\1", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _SPACING.sub("", text)
    return text.rstrip(".")
