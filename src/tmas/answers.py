"""Extracting the final answer from a solution's text."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Fallbacks for models that state the answer without boxing it, most specific first.
_FINAL_ANSWER = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*\$?([^\n$]+?)\$?\s*\.?\s*$", re.I | re.M)


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


def extract_answer(text: str, *, fallback: bool = True) -> str | None:
    """The last boxed answer, else (with ``fallback``) a trailing "final answer: X" statement."""
    boxed = last_boxed(text)
    if boxed is not None or not fallback:
        return boxed or None
    matches = _FINAL_ANSWER.findall(text)
    return matches[-1].strip() if matches else None


_TEXT_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|\s+")


def normalize_answer(answer: str) -> str:
    """A canonical spelling for grouping equal answers (majority vote): styling, spacing and '$' removed."""
    text = answer.strip().strip("$").strip()
    text = _TEXT_WRAPPER.sub(r"\1", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _SPACING.sub("", text)
    return text.rstrip(".")
