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
