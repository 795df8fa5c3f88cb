"""Numbers written in other forms, read alike by the spelling normalization, votes, the grading rules and the
viewer's live grades: leading zeros, digit groups, the root shorthand and punctuation after math."""

from __future__ import annotations

import pytest

from tmas.answer_classes import value_key
from tmas.answers import normalize_answer
from tmas.view.live_grades import exact_verdict


def rules(gold: str, pred: str) -> bool | None:
    pytest.importorskip("math_verify")
    from tmas.answer_rules import check_pair

    return check_pair(gold, pred).correct


def test_the_root_shorthand_is_the_root_of_its_first_digit() -> None:
    # LaTeX's \sqrt takes one token: \sqrt38 is \sqrt{3} times 8, not \sqrt{38}.
    assert normalize_answer("\\sqrt38") == normalize_answer("\\sqrt{3}8") == "\\sqrt{3}8"
    assert normalize_answer("\\sqrt x") == "\\sqrt{x}"
    assert normalize_answer("\\sqrt{38}") == "\\sqrt{38}"
    assert normalize_answer("\\sqrt[3]{2}") == "\\sqrt[3]{2}"
    assert value_key("\\sqrt38") == value_key("\\sqrt{3}8") != value_key("\\sqrt{38}")
    assert rules("8\\sqrt{3}", "\\sqrt38") is True
    assert rules("\\sqrt38", "8\\sqrt{3}") is True
    assert rules("\\sqrt{38}", "\\sqrt38") is False


@pytest.mark.parametrize(
    "answer", ["$7$.", "$7$ .", "$7$,", "$7$;", "$7$:", "$7$!", "\\(7\\).", "\\(7\\),", "\\[7\\].", "7.", "$7.$"]
)
def test_punctuation_after_math_is_no_part_of_the_answer(answer: str) -> None:
    assert normalize_answer(answer) == "7"
    assert value_key(answer) == "7"
    assert exact_verdict("7", answer) is True
    assert rules("7", answer) is True


def test_punctuation_inside_math_is_kept() -> None:
    assert normalize_answer("$5!$.") == "5!"
    assert normalize_answer("$\\frac{1}{2}$.") == "\\frac{1}{2}"
