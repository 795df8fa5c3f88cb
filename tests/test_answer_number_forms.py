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


# Digit groups: "1,000", "1{,}000", "1\\,000" are 1000; "1, 000" too, as the group after the comma and space begins
# with 0; "3, 125" is a list of two numbers, and "60,100" the number 60100, not the list "60, 100".
@pytest.mark.parametrize(
    ("answer", "spelling"),
    [
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        ("1\\,000", "1000"),
        ("1, 000", "1000"),
        ("$1,000,000$.", "1000000"),
        ("-12,345.5", "-12345.5"),
        ("n = 1,000", "n=1000"),
        ("3, 125", "3,125"),
        ("60, 100", "60,100"),
        ("60,100", "60100"),
        ("1, 025", "1025"),
        ("011,100", "011,100"),
        ("(1,234)", "(1,234)"),
        ("1,0000", "1,0000"),
    ],
)
def test_digit_groups_are_written_as_the_number(answer: str, spelling: str) -> None:
    assert normalize_answer(answer) == spelling


def test_votes_key_a_number_in_digit_groups_by_its_value_and_a_list_apart() -> None:
    assert value_key("1,000") == value_key("1{,}000") == value_key("1, 000") == value_key("1000.0") == "1000"
    assert value_key("3, 125") != value_key("3125")
    assert value_key("60,100") == "60100" != value_key("60, 100")


@pytest.mark.parametrize(
    ("gold", "pred", "verdict"),
    [
        ("1000", "1,000", True),
        ("1000", "1{,}000", True),
        ("1000", "1, 000", True),
        ("1, 000", "1000", True),
        ("1,000", "1000", True),
        ("60100", "60,100", True),
        ("3125", "3, 125", False),
    ],
)
def test_digit_groups_in_the_rules_and_live(gold: str, pred: str, verdict: bool) -> None:
    assert rules(gold, pred) is verdict
    assert exact_verdict(gold, pred) is (verdict or None)  # live: a list is no number, so no verdict


def test_the_live_check_reads_digit_groups_in_a_box_as_the_rules_do() -> None:
    assert exact_verdict("1000", "\\boxed{1, 000}") is True
    assert exact_verdict("1000", "$\\boxed{1,000}$.") is True
    assert exact_verdict("3125", "\\boxed{3, 125}") is None


def test_a_number_in_digit_groups_is_not_the_list_of_its_groups() -> None:
    # "60,100" is the number 60100: against the list "60, 100" the rules leave it to the judge, as the live check does.
    assert rules("60, 100", "60,100") is None
    assert exact_verdict("60, 100", "60,100") is None
    assert rules("60, 100", "60, 100") is True
    assert rules("60,100", "60,100") is True


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
