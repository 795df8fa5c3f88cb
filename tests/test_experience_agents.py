"""The experience judge's and summarizer's parsers (paper 003, Eq. 9 and 14), and their prompts as data."""

from __future__ import annotations

import pytest

from tmas.agents.experience_summarizer import parse_summarizer, summarizer_prompt
from tmas.agents.output import AgentOutputError
from tmas.agents.utterance_judge import RoundView, TurnView, parse_judge_score, utterance_score_prompt


def test_judge_score_normalised_to_unit_interval() -> None:
    score = parse_judge_score('{"analysis": "decisive factoring", "score": 4}')
    assert score.score == 4 and score.normalised == pytest.approx(0.8)
    assert score.analysis == "decisive factoring"
    fenced = 'Here you go:\n```json\n{"analysis": "x", "score": "5"}\n```'
    assert parse_judge_score(fenced).normalised == pytest.approx(1.0)
    assert parse_judge_score('{"score": 2.6}').score == 3  # rounded, as B.6 rounds its weighted sum


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
