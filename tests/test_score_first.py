"""Logprob verifier scoring: the expected score from a scripted ``logprobs`` payload (values worked by hand), the
fallback to the text when the server sends none and the default payload's score (in process on the scripted model),
the request body, and logprobs carried through client and store."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings, settings_for
from scripted_runs import solve_in_process
from tmas.agents.score_first import expected_score, parse_score_first
from tmas.api import asolve
from tmas.config import Sampling
from tmas.llm.factory import open_model
from tmas.llm.types import CallKey, TokenLogprob, user
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer
from tmas.testing.script import PersonaName


def position(token: str, p: float, alternatives: dict[str, float]) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": math.log(p),
        "top_logprobs": [{"token": t, "logprob": math.log(q)} for t, q in alternatives.items()],
    }


# "Score: 2" then a reason; at the digit, p(2) = 0.6, p(1) = 0.3, p(0) = 0.05 and a non-digit token 0.05.
PAYLOAD = [
    position("Score", 1.0, {"Score": 1.0}),
    position(":", 1.0, {":": 1.0}),
    position(" 2", 0.6, {" 2": 0.6, " 1": 0.3, " 0": 0.05, " The": 0.05}),
    position("\n", 1.0, {"\n": 1.0}),
]
# Worked by hand: the digits hold 0.6 + 0.3 + 0.05 = 0.95 of the mass; renormalised,
# E[s] = (0.6 * 1 + 0.3 * 0.5 + 0.05 * 0) / 0.95 = 0.75 / 0.95 = 0.78947...
EXPECTED = 0.75 / 0.95


def tokens(payload: list[dict[str, Any]]) -> list[TokenLogprob]:
    return [TokenLogprob.model_validate(p) for p in payload]


def test_expected_score_from_the_score_token() -> None:
    found = expected_score(tokens(PAYLOAD))
    assert found is not None
    score, probabilities = found
    assert score == pytest.approx(EXPECTED)
    assert probabilities == pytest.approx({"0": 0.05 / 0.95, "1": 0.3 / 0.95, "2": 0.6 / 0.95})


def test_spacing_variants_of_a_digit_add_up_and_digits_before_the_score_are_ignored() -> None:
    payload = [
        position("Step", 1.0, {}),
        position(" 1", 1.0, {" 1": 1.0}),  # a digit, but not after "Score:": not the score
        position(" **Score:**", 1.0, {}),
        position(" 2", 0.4, {" 2": 0.4, "2": 0.2, " 0": 0.2, " x": 0.2}),
    ]
    # Hand: p(2) = 0.4 + 0.2 = 0.6, p(0) = 0.2, mass 0.8: E[s] = 0.6 * 1 / 0.8 = 0.75.
    found = expected_score(tokens(payload))
    assert found is not None and found[0] == pytest.approx(0.75)


def test_sampled_token_counts_even_when_not_listed_among_the_alternatives() -> None:
    payload = [position("Score: ", 1.0, {}), position("1", 0.5, {"0": 0.5})]
    # Hand: p(1) = 0.5 (the sampled token), p(0) = 0.5: E[s] = 0.5 * 0.5 + 0.5 * 0 = 0.25.
    found = expected_score(tokens(payload))
    assert found is not None and found[0] == pytest.approx(0.25)


def test_text_fallback_and_no_score() -> None:
    assert parse_score_first("Score: 2\nAll good.", None).model_dump(include={"score", "source"}) == {
        "score": 1.0,
        "source": "text",
    }
    no_digit_after_score = tokens([position("Looks", 1.0, {}), position(" fine", 1.0, {})])
    assert parse_score_first("Score: 1\nA gap.", no_digit_after_score).source == "text"
    assert parse_score_first("Score: 0.5", None).score is None  # the other scale is not this prompt's answer
    assert parse_score_first("It is correct.", None).source == "none"


@pytest.mark.parametrize(
    ("text", "score"),
    [
        # The scale restated in the label: its digits are not the grade.
        ("Score (0-2): 2\nEvery step holds.", 1.0),
        ("**Score [0, 1 or 2]:** 1\nA gap in step 2.", 0.5),
        ("Score (0-2): 1/2", None),
        # After "Score", only spacing, emphasis, ':', '=' or '$' stand before the digit.
        ("Score: -1", None),
        ("Score in words: two", None),
    ],
)
def test_a_restated_scale_after_score_is_not_the_grade(text: str, score: float | None) -> None:
    assert parse_score_first(text, None).score == score


def test_the_score_token_follows_the_label_not_the_scale_it_restates() -> None:
    # "Score (0-2): 1": the "0" after "Score (" copies the scale; the score token is the "1" after the label.
    payload = [
        position("Score", 1.0, {}),
        position(" (", 1.0, {}),
        position("0", 0.9, {"0": 0.9, "2": 0.1}),
        position("-", 1.0, {}),
        position("2", 1.0, {}),
        position("):", 1.0, {}),
        position(" 1", 0.5, {" 1": 0.5, " 2": 0.5}),
    ]
    # Hand: p(1) = p(2) = 0.5: E[s] = 0.5 * 0.5 + 0.5 * 1 = 0.75.
    found = expected_score(tokens(payload))
    assert found is not None and found[0] == pytest.approx(0.75)


async def test_tmas_logprob_scoring_sends_logprobs_and_reads_the_payload(sim: SimServer) -> None:
    reply = "Score: 2\nEvery step checks out."
    sim.set_script(SimScript(rules=[Rule(role="verifier", replies=[reply], logprobs=PAYLOAD)]))
    params = {"iterations": 1, "n": 1, "m": 2, "verifier_score": "logprob", "top_logprobs": 5, "score_max_tokens": 16}
    settings = settings_for(sim, method={"name": "tmas", "params": params})
    result = await asolve("What is 17*23?", settings)
    [candidate] = result.iterations[0].candidates
    assert candidate.score == pytest.approx(EXPECTED)
    assert [v.source for v in candidate.meta.verifications] == ["logprob", "logprob"]
    bodies = [r.body for r in sim.app.requests() if r.role == "verifier"]
    assert len(bodies) == 2
    for body in bodies:
        assert (body["logprobs"], body["top_logprobs"], body["max_tokens"]) == (True, 5, 16)
        assert "Reply with the grade first" in body["messages"][-1]["content"]
    # The solution's own call asks for no logprobs.
    solutions = [r.body for r in sim.app.requests() if r.role == "solution"]
    assert len(solutions) == 1 and all("logprobs" not in body for body in solutions)
    assert "verifier_logprob_missing" not in result.counters


@pytest.mark.parametrize("persona", ["vllm", "llama-server"])
@pytest.mark.parametrize("stream", ["auto", "off"])
async def test_a_thinking_verifiers_score_is_read_from_its_answer_not_its_thinking(
    sim: SimServer, stream: str, persona: PersonaName
) -> None:
    # vLLM and llama-server give log-probabilities for every generated token, the thinking's first, though their
    # reasoning parser puts the thinking in a field of its own: the grade the thinking weighed ("Score: 0") is not the
    # reply's ("Score: 2").
    thought = "At first sight I would write Score: 0 for the last step, but the step holds after all."
    rule = Rule(role="verifier", replies=["Score: 2\nEvery step checks out."], reasoning=thought)
    sim.set_script(SimScript(persona=persona, reasoning=True, rules=[rule]))
    params = {"iterations": 1, "n": 1, "m": 1, "verifier_score": "logprob", "top_logprobs": 5, "score_max_tokens": 64}
    settings = settings_for(sim, method={"name": "tmas", "params": params}, endpoint__stream=stream)
    result = await asolve("What is 17*23?", settings)
    [candidate] = result.iterations[0].candidates
    [verification] = candidate.meta.verifications
    assert (verification.source, verification.score) == ("logprob", 1.0)
    assert candidate.score == 1.0


def test_a_score_is_read_only_where_the_tokens_show_the_answer() -> None:
    thinking = [position("Score", 1.0, {}), position(": ", 1.0, {}), position("0", 1.0, {}), position(". ", 1.0, {})]
    answer = [position("Score", 1.0, {}), position(": ", 1.0, {}), position("2", 0.5, {"1": 0.5})]
    # Hand: at the answer's digit p(2) = p(1) = 0.5: E[s] = 0.5 * 1 + 0.5 * 0.5 = 0.75.
    read = parse_score_first("Score: 2", tokens(thinking + answer), "Score: 0.")
    assert (read.source, read.score) == ("logprob", pytest.approx(0.75))
    # Tokens shown as bytes do not spell the answer: its text gives the score, never the thinking's tokens.
    garbled = [position("bytes:\\x53", 1.0, {}), *answer[1:]]
    read = parse_score_first("Score: 2", tokens(thinking + garbled), "Score: 0.")
    assert (read.source, read.score) == ("text", 1.0)
    # A reply without thinking reads its tokens as before.
    assert parse_score_first("Score: 2", tokens(thinking + answer)).score == 0.0


def logprob_scoring(script: SimScript) -> ScriptedModel:
    params = {"iterations": 1, "n": 2, "m": 1, "verifier_score": "logprob"}
    return ScriptedModel(script, scripted_settings(method={"name": "tmas", "params": params}))


async def test_tmas_logprob_scoring_falls_back_to_the_text_when_the_server_sends_none() -> None:
    model = logprob_scoring(SimScript(logprobs=False))  # a server that ignores the logprobs request
    result = await solve_in_process(model, "What is 17*23?")
    candidates = result.iterations[0].candidates
    # The simulated verifier grades a right 391 "Score: 2" (or "1" for a minor gap): read from the text.
    assert all(c.score in (0.5, 1.0) for c in candidates)
    assert [v.source for c in candidates for v in c.meta.verifications] == ["text", "text"]
    assert result.counters["verifier_logprob_missing"] == 2
    assert sum("no log-probabilities at the score" in n for n in result.iterations[0].notes) == 2
    # Asked for all the same (what is sent is the test above's).
    assert all(c.sampling.extra_body.get("logprobs") is True for c in model.calls_of("verifier"))


async def test_the_default_simulated_payload_gives_the_sampled_score() -> None:
    result = await solve_in_process(logprob_scoring(SimScript()), "What is 17*23?")
    entries = [v for c in result.iterations[0].candidates for v in c.meta.verifications]
    assert [v.source for v in entries] == ["logprob", "logprob"]
    assert all(v.score in (0.5, 1.0) and max(v.probabilities.values()) == 1.0 for v in entries)


async def test_logprobs_reach_the_completion_and_are_replayed_from_the_store(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(rules=[Rule(replies=["Score: 2"], logprobs=PAYLOAD[:3])]))
    asked = Sampling(max_tokens=8, extra_body={"logprobs": True, "top_logprobs": 3})
    key = CallKey(problem_id="p", role="verifier")
    with RunStore(tmp_path) as store:
        async with open_model(settings_for(sim), store) as llm:
            first = await llm.chat("verifier", [user("Grade it.")], key=key, sampling=asked)
            plain = await llm.chat("verifier", [user("Grade it again.")], key=key)
        async with open_model(settings_for(sim), store) as llm:
            replayed = await llm.chat("verifier", [user("Grade it.")], key=key, sampling=asked)
    assert first.logprobs == tokens(PAYLOAD[:3])
    assert plain.logprobs is None  # not asked for, not sent
    assert replayed.replayed and replayed.logprobs == first.logprobs
    assert sim.stats().total_requests == 2


def test_a_store_from_before_the_logprobs_column_opens_and_keeps_its_calls(tmp_path: Path) -> None:
    with RunStore(tmp_path):
        pass
    db = sqlite3.connect(tmp_path / "run.sqlite")
    db.execute("ALTER TABLE calls DROP COLUMN logprobs")  # the schema as it was before
    db.execute(
        "INSERT INTO calls (request_hash, sample, problem_id, iteration, role, endpoint, model, messages, sampling,"
        " content, reasoning, prompt_tokens, completion_tokens, reasoning_tokens, usage_estimated, latency_s,"
        " attempts, created_at) VALUES ('h', 0, 'p', 0, 'solution', 'e', 'm', '[]', '{}', 'old', '', 1, 2, 0, 0,"
        " 0.1, 1, 0)"
    )
    db.commit()
    db.close()
    with RunStore(tmp_path, create=False) as store:
        [old] = store.calls()
    assert old.content == "old" and old.logprobs is None
