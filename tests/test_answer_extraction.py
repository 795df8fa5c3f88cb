"""Answer extraction: the last box, else an explicit final-answer statement, recorded as a fallback."""

from __future__ import annotations

import pytest

from tmas.agents.solution import parse_solution
from tmas.answers import extract_answer


@pytest.mark.parametrize(
    ("text", "answer", "source"),
    [
        ("2 + 2 = 4, so \\boxed{4}.", "4", "boxed"),
        ("First \\boxed{3}, corrected: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "boxed"),
        ("A box wins over a statement: \\boxed{9}.\nFinal answer: 4", "9", "boxed"),
        ("So 2 + 2 = 4.\nFinal answer: 4", "4", "stated"),
        ("Hence the answer is $\\frac{1}{2}$.", "\\frac{1}{2}", "stated"),
        ("**Final Answer:** 42", "42", "stated"),
        ("The final answer is: 12", "12", "stated"),
        ("Answer: 3\nOn reflection, the answer is 5.", "5", "stated"),  # the last statement counts
        ("An empty box \\boxed{} is no answer. The answer is 7", "7", "stated"),
        ("We answer this with care.", None, "none"),  # "answer" in prose is not a statement
        ("I will answer: no idea", None, "none"),
        ("The value is 6 and then we stop.", None, "none"),
        ("The answer is that we must first look at the parity of n.", None, "none"),  # a sentence, not an answer
        ("Final answer: x = 3, y = -1", "x = 3, y = -1", "stated"),
    ],
)
def test_extraction_falls_back_to_an_explicit_statement(text: str, answer: str | None, source: str) -> None:
    assert extract_answer(text) == (answer, source)


def test_solution_parser_records_the_extraction() -> None:
    boxed = parse_solution("## Solution\n17*23 = 391, so \\boxed{391}", "numeric")
    stated = parse_solution("17*23 = 391.\nThe answer is 391.", "numeric")
    nothing = parse_solution("I would write a program for this.", "numeric")
    proof = parse_solution("## Solution\nBy induction. The answer is 3.", "proof")
    assert (boxed.answer, boxed.extraction) == ("391", "boxed")
    assert (stated.answer, stated.extraction) == ("391", "stated")
    assert (nothing.answer, nothing.extraction) == (None, "none")
    assert (proof.answer, proof.extraction) == (None, "none")  # proofs have no answer to extract
