"""Numbers written in other forms, read alike by the spelling normalization, votes, the grading rules and the
viewer's live grades: leading zeros, digit groups, the root shorthand and punctuation after math."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tmas.answer_classes import plain_numbers, value_key
from tmas.answers import list_reading, normalize_answer
from tmas.view.live_grades import exact_verdict


def rules(gold: str, pred: str) -> bool | None:
    pytest.importorskip("math_verify")
    from tmas.answer_rules import check_pair

    return check_pair(gold, pred).correct


# Leading zeros. A reference written as a number (17) is a value: an answer written with leading zeros ("017", as
# a three-digit answer sheet asks) is that value, right in the rules and live. A reference written with leading zeros
# ("007") is a code: only the same digits are right, in the rules and live; another spelling of its value is left to
# the judge. Votes key digits with leading zeros apart from the number ("017" and "17" are two answers), so that a
# vote never counts a "17" for a right "017".
@pytest.mark.parametrize(
    ("gold", "pred", "verdict"),
    [
        ("17", "017", True),
        ("17", "0017", True),
        ("7", "007", True),
        ("7", "$007$.", True),
        ("17", "\\text{017}", True),
        ("-17", "-017", True),
        ("17", "018", False),
        ("007", "007", True),
        ("007", "$007$.", True),
        ("007", "\\text{007}", True),
        ("007", "7", None),
        ("017", "17", None),
        ("017", "17.0", None),
        ("000", "0", None),
    ],
)
def test_leading_zeros_against_a_number_and_against_a_code(gold: str, pred: str, verdict: bool | None) -> None:
    assert rules(gold, pred) is verdict
    assert exact_verdict(gold, pred) is verdict


def test_votes_key_leading_zeros_apart_and_every_spelling_of_a_code_as_one() -> None:
    assert value_key("017") != value_key("17") == value_key("17.0")
    assert value_key("007") == value_key("$007$.") == value_key("\\text{007}") == "007"


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


# A reference in plain comma groups whose later groups begin with no 0 ("60,100", "9,737,333", as benchmark authors
# write a list without spaces) reads both as a number and as a list: an answer matching either reading is right, in
# the rules and live. One plain number other than the reference's number is wrong (one number is never a list of two
# or more), and so is a list of as many plain numbers as the list reading has whose set of values is not that of its
# items (a list of two or more numbers is never one number). Anything else is left to the judge: symbolic answers, a
# list of another length, or the reference's items in another order. "1,000" and "12{,}345" read only as numbers.
@pytest.mark.parametrize(
    ("gold", "pred", "verdict"),
    [
        ("60,100", "60100", True),
        ("60,100", "60,100", True),
        ("60,100", "60 100", True),
        ("60,100", "60, 100", True),
        ("60,100", "$60, 100$.", True),
        ("2,251,252", "(2,251,252)", True),
        ("2,251,252", "2, 251, 252", True),
        ("9,737,333", "9737333", True),
        ("-12,345.5", "-12345.5", True),
        ("60,100", "60101", False),
        ("60,100", "60099", False),
        ("60,100", "5", False),
        ("60,100", "60", False),
        ("60,100", "60 101", False),
        ("60,100", "\\frac{1}{2}", False),
        ("60,100", "60, 101", False),
        ("60,100", "60; 5", False),
        ("60,100", "60, 60", False),
        ("60,100", "(60, 101)", False),
        ("60,100", "\\{60, 101\\}", False),
        ("60,100", "100, 60", None),
        ("60,100", "x+1", None),
        ("60,100", "\\sqrt{2}", None),
        ("60,100", "60, x", None),
        ("60,100", "60, 100, 5", None),
        ("60,100", "1,000, 5", None),
        ("9,737,333", "9737334", False),
        ("9,737,333", "9, 737, 334", False),
        ("9,737,333", "9, 737", None),
        ("2,251,252", "(2,251,253)", False),
        ("-12,345.5", "-12, 345", False),
        ("1,000", "999", False),
        ("12{,}345", "12346", False),
        ("1,025", "1, 25", False),
    ],
)
def test_a_reference_read_both_as_a_number_and_as_a_list(gold: str, pred: str, verdict: bool | None) -> None:
    assert rules(gold, pred) is verdict


def test_the_items_of_such_a_reference_in_any_order_where_the_problem_asks_for_all() -> None:
    pytest.importorskip("math_verify")
    from tmas.answer_rules import check_pair

    # As a set "100, 60" is the list reading; "60, 60" is no set of it either, nor of its length in order.
    assert check_pair("60,100", "100, 60", any_order=True).correct is True
    assert check_pair("60,100", "60, 60", any_order=True).correct is False
    assert check_pair("60,100", "60, 60").correct is False


@pytest.mark.parametrize(
    ("reference", "listed"),
    [
        ("60,100", "60, 100"),
        ("$2,251,252$.", "2, 251, 252"),
        ("-12,345.5", "-12, 345.5"),
        ("1,000", None),
        ("1,025", None),
        ("12{,}345", None),
        ("3, 125", None),
        ("1, 000", None),
        ("60100", None),
        ("011,100", None),
    ],
)
def test_the_list_a_reference_in_digit_groups_also_reads_as(reference: str, listed: str | None) -> None:
    assert list_reading(reference) == listed


@pytest.mark.parametrize(
    ("gold", "pred", "verdict"),
    [
        ("60,100", "60100", True),
        ("60,100", "\\boxed{60,100}", True),
        ("60,100", "60, 100", True),
        ("9,737,333", "9737333", True),
        ("60,100", "60101", False),
        ("60,100", "5", False),
        ("60,100", "\\boxed{60099}", False),
        ("60,100", "60, 101", False),
        ("60,100", "\\boxed{60, 101}", False),
        ("9,737,333", "9737334", False),
        ("9,737,333", "9, 737, 334", False),
        ("60,100", "(60, 100)", None),
        ("60,100", "100, 60", None),
        ("60,100", "60, 100, 5", None),
        ("60,100", "x+1", None),
        ("1,000", "999", False),
    ],
)
def test_the_live_check_reads_such_a_reference_as_the_rules_do(gold: str, pred: str, verdict: bool | None) -> None:
    assert exact_verdict(gold, pred) is verdict


@pytest.mark.parametrize(
    ("answer", "values"),
    [
        ("60,101", None),
        ("60, 101", [60, 101]),
        ("(60, 101)", [60, 101]),
        ("\\left[60; -5\\right]", [60, -5]),
        ("\\{1/2, 3\\}", [Fraction(1, 2), 3]),
        ("60, 000", None),
        ("1,000, 5", None),
        ("60, x", None),
        ("60", None),
        ("(60, 101", None),
    ],
)
def test_the_values_of_a_list_of_plain_numbers(answer: str, values: list[int | Fraction] | None) -> None:
    # "60,101" and "60, 000" are one number in digit groups; "1,000, 5" may be a number's groups or a list's items.
    assert plain_numbers(normalize_answer(answer)) == values


@pytest.mark.parametrize("gold", ["60100", "60,100", "60, 100", "(60, 100)", "60", "60101", "60, 101"])
def test_votes_key_an_answer_in_digit_groups_with_its_number_which_the_rules_grade_alike(gold: str) -> None:
    # An answer in digit groups is read as its number, against any reference: "60,100" and "60100" are one answer
    # in a vote. The list "60, 100" keys apart: against the reference 60100 it is wrong where they are right.
    assert value_key("60,100") == value_key("60100") != value_key("60, 100")
    assert rules(gold, "60,100") is rules(gold, "60100")


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
