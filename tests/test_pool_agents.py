"""The experience judge's and summarizer's parsers (paper 003, Eq. 9 and 14), and their prompts as data."""

from __future__ import annotations

import json

import pytest

from tmas.agents.output import AgentOutputError
from tmas.agents.pool_summarizer import (
    parse_summarizer,
    parse_teaching_summarizer,
    summarizer_prompt,
    teaching_summarizer_prompt,
)
from tmas.agents.utterance_judge import (
    RoundView,
    TeachingView,
    TurnView,
    parse_judge_score,
    parse_rubric_score,
    utterance_score_prompt,
)


def test_judge_score_normalised_to_unit_interval() -> None:
    score = parse_judge_score('{"analysis": "decisive factoring", "score": 4}')
    assert score.score == 4 and score.normalised == pytest.approx(0.8)
    assert score.analysis == "decisive factoring"
    fenced = 'Here you go:\n```json\n{"analysis": "x", "score": "5"}\n```'
    assert parse_judge_score(fenced).normalised == pytest.approx(1.0)


@pytest.mark.parametrize(("raw", "score"), [("2.6", 3), ("2.4", 2), ("2.5", 3), ("0.5", 1), ("3.5", 4), ('"4.5"', 5)])
def test_a_fractional_judge_score_is_the_nearest_integer_halves_up(raw: str, score: int) -> None:
    # B.6 asks for an integer 0-5; off format, the nearest one, a half rounding up as C.4.6's "Round to nearest
    # integer" does (Python's round would give 2.5 -> 2, 0.5 -> 0, 4.5 -> 4).
    assert parse_judge_score(f'{{"score": {raw}}}').score == score


@pytest.mark.parametrize(
    ("reply", "truncated", "why"),
    [
        ("I think it deserves a 4.", False, "no valid JSON"),
        ('{"analysis": "fine"}', False, "no numeric 'score'"),
        ('{"score": 7}', False, "outside 0-5"),
        ('{"score": -1}', False, "outside 0-5"),
        ('{"score": "high"}', False, "not a number"),
        ('{"score": true}', False, "no numeric"),
        ('{"score": 3}', True, "truncated"),
        ("", False, "empty"),
    ],
)
def test_judge_score_failures_say_why(reply: str, truncated: bool, why: str) -> None:
    with pytest.raises(AgentOutputError, match=why):
        parse_judge_score(reply, truncated=truncated)


def test_summarizer_entries_scopes_and_dropped_items() -> None:
    reply = (
        '{"entries": [{"action": "Check small cases", "experience": "Good practice: try n=1,2,3.", "scope": "general"},'
        ' {"action": "Factor the product", "experience": "Pitfall:  guessing.", "scope": "case-specific"},'
        ' {"action": "", "experience": "empty action"}]}'
    )
    entries, dropped = parse_summarizer(reply)
    assert [(e.action, e.scope) for e in entries] == [("Check small cases", "general"), ("Factor the product", "case")]
    assert entries[1].experience == "Pitfall: guessing."
    assert len(dropped) == 1 and "entry 3" in dropped[0]
    with pytest.raises(AgentOutputError, match="no 'entries' list"):
        parse_summarizer('{"result": []}')
    with pytest.raises(AgentOutputError, match="none of the 1"):
        parse_summarizer('{"entries": [{"action": "x"}]}')


def test_a_summarizer_entry_of_runaway_length_is_dropped_and_said() -> None:
    # Retrieved K at a time into every specialist's hints, a runaway entry would crowd out the case itself.
    runaway = " ".join(["Good practice: split a factor."] * 100)  # 3,099 characters
    entries = [
        {"action": "Split a factor", "experience": runaway, "scope": "general"},
        {"action": "Check small cases " * 60, "experience": "Good practice: try n=1.", "scope": "general"},
        {"action": "Check small cases", "experience": "Good practice: try n=1,2,3.", "scope": "general"},
    ]
    kept, dropped = parse_summarizer(json.dumps({"entries": entries}))
    assert [e.action for e in kept] == ["Check small cases"]
    assert dropped == [
        "entry 1: experience: Value error, 3099 characters, over the 2000 it may hold",
        "entry 2: action: Value error, 1079 characters, over the 1000 it may hold",
    ]


def test_problem_text_is_data_not_template() -> None:
    evil = "Compute {{ 6*7 }} and {% if true %}x{% endif %}"
    turn = TurnView(agent="S1", specialty="algebra", text="{{ gold }}")
    messages = utterance_score_prompt(
        question=evil,
        gold="42",
        final_answer=None,
        history=[RoundView(number=1, turns=[turn])],
        target=turn,
        round_number=2,
    )
    text = messages[-1].content
    assert evil in text and "{{ gold }}" in text and "(none)" in text
    summary = summarizer_prompt(
        question=evil,
        gold="42",
        outcome=1.0,
        history=[],
        target=turn,
        round_number=1,
        reward=0.61234,
        judge_analysis="",
    )[-1].content
    assert evil in summary and 'credit="0.612"' in summary and "was correct" in summary


def test_c46_rubric_score_is_the_weighted_sum_rounded_half_up() -> None:
    # C.4.6: 0.30 correctness + 0.25 information gain + 0.25 relevance + 0.20 clarity, rounded to an integer.
    # 0.30*4 + 0.25*3 + 0.25*3 + 0.20*2 = 1.2 + 0.75 + 0.75 + 0.4 = 3.1 -> 3.
    reply = (
        '{"correctness_score": 4, "information_gain_score": 3, "relevance_score": "3", "clarity_score": 2,'
        ' "analysis": "Accurate but dense.", "global_score": 5}'
    )
    score = parse_rubric_score(reply)
    assert score.score == 3 and score.normalised == pytest.approx(0.6)  # the judge's own global_score is ignored
    assert score.analysis.startswith("Accurate but dense. (correctness 4; information gain 3; relevance 3")
    # 0.30*3 + 0.25*2 + 0.25*2 + 0.20*3 = 2.5 -> 3 (half up, not Python's half to even).
    half = '{"correctness_score": 3, "information_gain_score": 2, "relevance_score": 2, "clarity_score": 3}'
    assert parse_rubric_score(half).score == 3
    for bad, why in (
        ('{"correctness_score": 4, "information_gain_score": 3, "relevance_score": 3}', "no numeric 'clarity_score'"),
        ('{"correctness_score": 6, "information_gain_score": 3, "relevance_score": 3, "clarity_score": 2}', "outside"),
        ('{"score": 4}', "no numeric 'correctness_score'"),
    ):
        with pytest.raises(AgentOutputError, match=why):
            parse_rubric_score(bad)


def test_c47_teaching_entries_need_a_class_and_map_subject_scope() -> None:
    reply = json.dumps(
        {
            "entries": [
                {"class": "guidance", "action": "k1", "experience": "Good practice: e1 [helpful]", "scope": "general"},
                {"class": "STRATEGY", "action": "k2", "experience": "Pitfall: e2", "scope": "subject"},
                {"action": "k3", "experience": "no class"},
            ]
        }
    )
    entries, malformed = parse_teaching_summarizer(reply)
    assert [(e.category, e.action, e.scope) for e in entries] == [
        ("GUIDANCE", "k1", "general"),
        ("STRATEGY", "k2", "case"),
    ]
    assert malformed == ["entry 3: class: Field required"]
    view = TeachingView(subject="Physics", difficulty="easy", pre_answer="A", pre_reasoning="r", role="Diagnostician")
    text = teaching_summarizer_prompt(
        question="Q?",
        gold="B",
        outcome=1.0,
        view=view,
        target=TurnView(agent="S1", text="Why did you pick A?"),
        round_number=1,
        reward=0.75,
        judge_analysis="clear",
    )[-1].content
    assert '<question subject="Physics" difficulty="easy">' in text and "post-test: correct" in text
    assert "GUIDANCE" in text and "STRATEGY" in text and "math" not in text
    assert text.rstrip().endswith("into an experience.")
