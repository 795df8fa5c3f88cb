"""Votes count values, not spellings: answer keys, classes merged by an equivalence check, each
vote rule and MV@k grouping equal answers, and whole runs in process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conftest import scripted_settings
from tmas.answer_classes import MAX_COMPARED, answer_classes, asks_check, class_of, value_key
from tmas.api import asolve
from tmas.methods.base import Candidate
from tmas.methods.selection import select
from tmas.reports.metrics import vote_share
from tmas.testing import Rule, ScriptedModel, SimScript


class TableCheck:
    """An equivalence given as a table of equal pairs (either order), counting the checks asked for."""

    def __init__(self, *equal: tuple[str, str]) -> None:
        self.equal = {frozenset(pair) for pair in equal}
        self.asked: list[tuple[str, str]] = []

    async def equivalent(self, first: str, second: str) -> bool:
        self.asked.append((first, second))
        return frozenset((first, second)) in self.equal


def unscored(pool: list[Candidate]) -> list[Candidate]:
    return [c.model_copy(update={"score": None}) for c in pool]


def cand(i: int, answer: str | None, score: float | None = None) -> Candidate:
    return Candidate(index=i, text=f"text {i}", answer=answer, score=score)


def test_plain_numbers_are_keyed_by_their_exact_value() -> None:
    halves = ["0.5", "1/2", "\\frac{1}{2}", "$\\dfrac{1}{2}$", " \\tfrac{1}{2} ", "0.50", "\\frac{2}{4}"]
    assert {value_key(a) for a in halves} == {"1/2"}
    assert value_key("-\\frac{3}{4}") == value_key("-0.75") == "-3/4"
    assert value_key("2.0") == value_key("2") == value_key("\\text{2}.") == "2"
    assert value_key("1{,}000") == "1000"
    # The minus sign (U+2212) that models copy from typeset text is the hyphen-minus, in numbers and expressions alike;
    # full-width digits are the digits.
    assert value_key("\u22123") == value_key("-3") == "-3"
    assert value_key("x \u2212 1") == value_key("x-1") == "x-1"
    assert value_key("\uff11\uff12") == "12"
    # A sentence's full stop after the answer is no part of it, number or not.
    assert value_key("\\sqrt{2}.") == value_key("\\sqrt{2}") == "\\sqrt{2}"
    # LaTeX's math delimiters, like '$', are no part of the answer (a line break "\\\\[2pt]" is).
    assert value_key("\\(7\\)") == value_key("\\[ 7 \\]") == value_key("$7$") == "7"
    assert value_key("\\(x = 3\\), \\(y = 4\\)") == value_key("x = 3, y = 4") == "x=3,y=4"
    assert value_key("a \\\\[2pt] b") == "a\\\\[2pt]b"
    # Not a plain number: the normalized spelling.
    assert value_key("\\sqrt{2} / 2") == "\\sqrt{2}/2"
    assert value_key("1/0") == "1/0"
    assert value_key("0.333") != value_key("1/3")
    # Scientific notation as programs print it is the number it writes, as the grading rules read it against a
    # number: the vote, checking each answer against the other, kept "4.25e6" apart from 4250000.
    assert value_key("4.25e6") == value_key("4.25E+06") == value_key("4250000") == "4250000"
    assert value_key("2.5e-05") == value_key("0.000025")
    assert value_key("4.25e6") != value_key("4.25e5")
    assert value_key("1e400") == "1e400"  # too long to write out: left to the rules


def test_numbers_written_with_leading_zeros_are_keyed_by_their_digits() -> None:
    # Grading reads a reference with leading zeros (a code, a grid's rows) by its digits: "17" is not "017". The vote
    # read both as the number 17 and counted them as one answer, so a wrong "17" voted for a right "017".
    assert value_key("017") == "017" != value_key("17")
    assert len({value_key(a) for a in ["017", "0017", "17", "-017", "05.5", "5.5", "1/02", "1/2"]}) == 8
    assert value_key("$017$") == value_key("\\text{017}.") == "017"
    # Written without leading zeros, the same number is still one answer; zeros of a group, a fraction's digits or
    # an exponent are no leading zeros.
    assert value_key("17") == value_key("17.0") == value_key("17.00") == "17"
    assert value_key("0.05") == value_key("1/20") == "1/20"
    assert value_key("0") == "0"
    assert value_key("1{,}024") == "1024"
    assert value_key("2.5e-05") == value_key("2.5E-05") == value_key("0.000025")
    # Two of these are never sent to the rules: their keys tell them apart as the rules would.
    assert not asks_check(["017", "17", "17.0"])
    # In a vote: 5 holds three votes against two each for 017 and 17, not four for one answer 17.
    bare = [cand(i, a) for i, a in enumerate(["5", "5", "5", "017", "017", "17", "17.0"])]
    assert select(bare, "numeric", "vote") is bare[0]


async def test_classes_merge_the_keys_the_check_finds_equal_in_first_seen_order() -> None:
    check = TableCheck(("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"))
    answers = ["\\frac{\\sqrt{2}}{2}", "7", "0.5", "\\frac{1}{\\sqrt{2}}", "1/2", None, "9"]
    classes = await answer_classes(answers, check)
    # The class key is its first member's key; 0.5 and 1/2 needed no check.
    assert classes == {
        "\\frac{\\sqrt{2}}{2}": "\\frac{\\sqrt{2}}{2}",
        "7": "7",
        "0.5": "1/2",
        "\\frac{1}{\\sqrt{2}}": "\\frac{\\sqrt{2}}{2}",
        "1/2": "1/2",
        "9": "9",
    }
    # One check per pair of distinct keys, never between two plain numbers (7, 1/2, 9), each spelling sent as given.
    asked = {frozenset(pair) for pair in check.asked}
    assert len(check.asked) == len(asked) == 7  # 5 keys: 10 pairs, less the 3 pairs of numbers
    assert asked == {
        frozenset(("\\frac{\\sqrt{2}}{2}", other)) for other in ("7", "0.5", "\\frac{1}{\\sqrt{2}}", "9")
    } | {frozenset(("\\frac{1}{\\sqrt{2}}", other)) for other in ("7", "0.5", "9")}
    # Without a check: spelling and exact numbers only.
    assert (await answer_classes(answers, None))["\\frac{1}{\\sqrt{2}}"] == "\\frac{1}{\\sqrt{2}}"


async def test_merging_is_transitive_and_bounded() -> None:
    check = TableCheck(("a", "b"), ("b", "c"))
    classes = await answer_classes(["c", "a", "b"], check)
    assert set(classes.values()) == {"c"}
    # Only the MAX_COMPARED most frequent keys are compared: a rare key past them keeps its own class.
    many = [f"x_{i}" for i in range(MAX_COMPARED)] * 2 + ["rare"]
    bounded = TableCheck(("x_0", "rare"))
    classes = await answer_classes(many, bounded)
    assert classes["rare"] == "rare"
    # The MAX_COMPARED keys are compared pair by pair, and never with the rare key.
    assert len(bounded.asked) == MAX_COMPARED * (MAX_COMPARED - 1) // 2
    assert all("rare" not in pair for pair in bounded.asked)
    # Plain numbers only: no check at all.
    spy = TableCheck()
    await answer_classes(["1", "2", "0.5", "1", "-\\frac{3}{4}"], spy)
    assert spy.asked == []


async def test_the_grading_rules_merge_symbolic_spellings() -> None:
    pytest.importorskip("math_verify")
    from tmas.answer_rules import RuleEquivalence

    equivalence = RuleEquivalence()
    try:
        classes = await answer_classes(
            ["\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", "\\sqrt{3}", "x+1"], equivalence
        )
    finally:
        await equivalence.aclose()
    assert classes["\\frac{1}{\\sqrt{2}}"] == classes["\\frac{\\sqrt{2}}{2}"]
    assert len(set(classes.values())) == 3


async def test_votes_keep_letters_apart_by_case_as_grading_does() -> None:
    # Math-Verify lowercases letters: "A - 3a", "-2a" and "a - 3A" were one answer to the vote, so wrong answers
    # counted as votes for the right one.
    pytest.importorskip("math_verify")
    from tmas.answer_rules import RuleEquivalence

    equivalence = RuleEquivalence()
    try:
        classes = await answer_classes(["A - 3a", "-2a", "a - 3A", "-3a + A"], equivalence)
    finally:
        await equivalence.aclose()
    assert classes["-3a + A"] == classes["A - 3a"]
    assert len({classes["A - 3a"], classes["-2a"], classes["a - 3A"]}) == 3


async def test_the_event_loop_goes_on_while_the_rules_worker_stops() -> None:
    # A run cancelled in its first check (a tmas serve client gone) stops a worker still starting, which takes
    # seconds; the other runs on the event loop (the proxy's other requests) must go on meanwhile.
    pytest.importorskip("math_verify")
    from tmas.answer_rules import RuleChecker

    checker = RuleChecker(workers=1)
    await checker.__aenter__()
    checking = asyncio.ensure_future(checker.check("\\frac{1}{2}", "0.5"))
    await asyncio.sleep(0)  # submitted: its worker process starts
    checking.cancel()
    other: list[str] = []
    asyncio.get_running_loop().call_soon(other.append, "ran")
    await checker.__aexit__(None, None, None)
    assert other == ["ran"]  # the loop ran other work before the worker had stopped


async def test_the_grading_rules_group_two_answers_only_when_each_is_shown_equal_to_the_other() -> None:
    pytest.importorskip("math_verify")
    from tmas.answer_rules import RuleEquivalence, check_pair

    # Math-Verify's check is asymmetric (reference first): it shows "0<x<1" equal to the reference "(0,1)" but not
    # the other way round. A vote's grouping must not depend on which answer came first: they stay apart.
    assert check_pair("0<x<1", "(0,1)").correct is True and check_pair("(0,1)", "0<x<1").correct is None
    equivalence = RuleEquivalence()
    try:
        assert not await equivalence.equivalent("(0,1)", "0<x<1")
        assert not await equivalence.equivalent("0<x<1", "(0,1)")
        assert await equivalence.equivalent("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}")
    finally:
        await equivalence.aclose()


async def test_the_grading_rules_check_the_second_order_only_where_the_first_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Most pairs of answers a vote compares differ, and one check shows it: asking both orders of every pair doubled
    # the Math-Verify checks of a run page's first view. Checked here in this process, each order asked recorded.
    pytest.importorskip("math_verify")
    from tmas.answer_rules import RuleChecker, RuleEquivalence, RuleVerdict, check_pair

    asked: list[tuple[str, str]] = []

    async def enter(self: RuleChecker) -> RuleChecker:
        return self

    async def check(self: RuleChecker, gold: str, pred: str) -> RuleVerdict:
        asked.append((gold, pred))
        return check_pair(gold, pred, None)

    monkeypatch.setattr(RuleChecker, "__aenter__", enter)
    monkeypatch.setattr(RuleChecker, "check", check)
    equivalence = RuleEquivalence()
    assert not await equivalence.equivalent("\\sqrt{3}", "x+1")
    assert asked == [("\\sqrt{3}", "x+1")]
    assert not await equivalence.equivalent("0<x<1", "(0,1)")  # shown one way round only: apart, both asked
    assert asked[1:] == [("0<x<1", "(0,1)"), ("(0,1)", "0<x<1")]
    assert await equivalence.equivalent("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}")
    assert asked[3:] == [
        ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ]


def test_each_vote_rule_groups_equal_values() -> None:
    # By spelling "7" would win every vote (two holders); by value 1/2 has three.
    pool = [
        cand(0, "7", 0.5),
        cand(1, "0.5", 0.5),
        cand(2, "\\frac{1}{2}", 0.5),
        cand(3, "7", 0.5),
        cand(4, "1/2", 1.0),
    ]
    assert select(pool, "numeric", "vote") is pool[4]
    # Sums: 1/2 has 0.5 + 0.5 + 1.0 = 2.0 against 1.0 for 7.
    assert select(pool, "numeric", "score_weighted_vote") is pool[4]
    # best_score: tied top scores share the answer most of them give, by value.
    tied = [cand(0, "3", 1.0), cand(1, "0.5", 1.0), cand(2, "\\frac{1}{2}", 1.0)]
    assert select(tied, "numeric", "best_score") is tied[1]
    # The unscored majority vote (the baselines': the first holder of the most frequent value) and MV@k.
    bare = unscored(pool)
    assert select(bare, "numeric", "vote") is bare[1]
    # MV's vote groups answers by value: 0.5 and 1/2 are one answer, which wins over 3 (right only for 1/2 here).
    assert vote_share([(class_of(a, None), float(a != "3")) for a in ["3", "0.5", "1/2"]]) == 1.0


def test_vote_rules_use_the_classes_given() -> None:
    # Two spellings the rules find equal; a class map from answer_classes joins them.
    pool = [cand(0, "9", 1.0), cand(1, "\\frac{\\sqrt{2}}{2}", 0.5), cand(2, "\\frac{1}{\\sqrt{2}}", 0.75)]
    classes = {"9": "9", "\\frac{\\sqrt{2}}{2}": "s", "\\frac{1}{\\sqrt{2}}": "s"}
    assert select(pool, "numeric", "vote") is pool[0]  # without classes: three answers, one vote each
    assert select(pool, "numeric", "vote", classes) is pool[2]  # the class's best-scored holder
    assert select(pool, "numeric", "score_weighted_vote", classes) is pool[2]  # 1.25 against 1.0
    bare = unscored(pool)
    assert select(bare, "numeric", "vote", classes) is bare[1]
    # With the classes the two spellings are one vote of two against 9: the class wins (right, 9 wrong).
    assert vote_share([(class_of(c.answer, classes), float(c.answer != "9")) for c in pool]) == 1.0
    assert vote_share([(class_of(c.answer, None), float(c.answer != "9")) for c in pool]) == 2 / 3


async def test_majority_vote_counts_values_in_a_run(tmp_path: Path) -> None:
    # Five samples: 0.25 spelled three ways (3 votes) against 2 (2 votes).
    replies = [
        "So the answer is \\boxed{2}.",
        "So the answer is \\boxed{0.25}.",
        "So the answer is \\boxed{2}.",
        "So the answer is \\boxed{\\frac{1}{4}}.",
        "So the answer is \\boxed{1/4}.",
    ]
    settings = scripted_settings(concurrency=1, method={"name": "majority", "params": {"k": 5}})
    model = ScriptedModel(SimScript(rules=[Rule(role="solution", replies=replies)]), settings)
    result = await asolve("What is 1/4 of 1?", model=model, run_dir=tmp_path / "run")
    assert len(model.calls_of("solution")) == 5
    assert result.answer is not None and value_key(result.answer) == "1/4"
    assert result.iterations[0].state["votes"] == {"1/4": 3, "2": 2}


async def test_majority_vote_keeps_digits_with_leading_zeros_apart_in_a_run(tmp_path: Path) -> None:
    # "017" three times, 17 twice (spelled two ways): the run's vote was {"17": 5}.
    replies = [f"So the answer is \\boxed{{{a}}}." for a in ["017", "17", "017", "17.0", "017"]]
    settings = scripted_settings(concurrency=1, method={"name": "majority", "params": {"k": 5}})
    model = ScriptedModel(SimScript(rules=[Rule(role="solution", replies=replies)]), settings)
    result = await asolve("Which code opens the lock?", model=model, run_dir=tmp_path / "run")
    assert result.answer == "017"
    assert result.iterations[0].state["votes"] == {"017": 3, "17": 2}


@pytest.mark.slow
async def test_tmas_votes_group_by_the_grading_rules_in_a_run(tmp_path: Path) -> None:
    pytest.importorskip("math_verify")
    # Equal scores everywhere; by spelling three answers tie and the first (7) wins, by value the two spellings of
    # sqrt(2)/2 hold two votes of three.
    solutions = ["So \\boxed{7}.", "So \\boxed{\\frac{\\sqrt{2}}{2}}.", "So \\boxed{\\frac{1}{\\sqrt{2}}}."]
    verdict = Rule(role="verifier", replies=["## Analysis\nFine.\n\n## Score\nScore: 1"])
    params = {"n": 3, "m": 1, "iterations": 1, "select": "vote"}
    settings = scripted_settings(concurrency=1, method={"name": "tmas", "params": params})
    model = ScriptedModel(SimScript(rules=[Rule(role="solution", replies=solutions), verdict]), settings)
    result = await asolve("What is sin(pi/4)?", model=model, run_dir=tmp_path / "run")
    assert [c.answer for c in result.iterations[0].candidates] == [
        "7",
        "\\frac{\\sqrt{2}}{2}",
        "\\frac{1}{\\sqrt{2}}",
    ]
    assert result.answer == "\\frac{\\sqrt{2}}{2}"


async def test_votes_group_a_list_joined_by_and_with_its_comma_spelling() -> None:
    pytest.importorskip("math_verify")
    from tmas.answer_rules import RuleEquivalence

    equivalence = RuleEquivalence()
    try:
        answers = ["2, 7", "2 \\text{ and } 7", "2 and 7", "7, 2", "2, 8"]
        classes = await answer_classes(answers, equivalence)
    finally:
        await equivalence.aclose()
    assert classes["2 \\text{ and } 7"] == classes["2 and 7"] == classes["2, 7"]
    assert len({classes["2, 7"], classes["7, 2"], classes["2, 8"]}) == 3  # lists in another order stay apart
