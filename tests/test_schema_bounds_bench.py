"""benchmarks/schema_bounds.py: the prompts it takes from a stored run (MATTRL's reviews and RSE's distillations,
first attempts only; TMAS's verifications, with whether their candidate is right), the schemas it sends as the ones
before the bounds, how it reads replies and its table's figures, worked by hand."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark
from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.agents.mattrl_review import ReviewReply
from tmas.llm.schema import json_schema
from tmas.problems import Problem
from tmas.testing import Rule, ScriptedModel, SimScript


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("schema_bounds", monkeypatch)


def test_the_schema_before_the_bounds_is_the_schema_without_them(bench: ModuleType) -> None:
    shapes = bench.schemas(bench.ROLES["reviewer"], {"max_tokens": 640, "params": {}})
    assert shapes["bounded"] == json_schema(ReviewReply)
    text = json.dumps(shapes["unbounded"])
    assert "maxLength" not in text and "maxItems" not in text
    fields = shapes["unbounded"]["properties"]
    assert fields["analysis"] == {"type": "string"}
    assert fields["validated"] == {"type": "array", "items": {"type": "string"}}
    # Everything else stays: the verdict's enum, the order of what is required.
    assert fields["verdict"] == shapes["bounded"]["properties"]["verdict"]
    assert shapes["unbounded"]["required"] == shapes["bounded"]["required"]


async def test_prompts_are_the_first_attempt_of_each_math_review(bench: ModuleType, tmp_path: Path) -> None:
    # The first review reply is no JSON: the method asks again, and only the first attempt is a prompt here.
    script = SimScript(rules=[Rule(role="reviewer", replies=["No JSON here."], times=1)])
    settings = scripted_settings(
        method={"name": "mattrl", "params": {"team_size": 2, "iterations": 1}}, sampling={"temperature": 0.3}
    )
    model = ScriptedModel(script, settings)
    await scripted_run(model, tmp_path / "run", [Problem(problem_id="p1", question="What is 17*23?", answer="391")])
    reviews = model.calls_of("reviewer")
    assert len(reviews) == 3  # two reviews (a team of two), the first asked twice

    # The two reviews run side by side; the one asked again has a sample moved past the first attempts'.
    firsts = sorted((c for c in reviews if c.key.sample < 1500), key=lambda c: c.messages[-1].content)
    assert len(firsts) == 2

    found = bench.prompts(tmp_path / "run", bench.ROLES["reviewer"], None)
    assert sorted(p["index"] for p in found) == [0, 1]
    found_by_text = sorted(found, key=lambda p: p["messages"][-1]["content"])
    assert [p["messages"][-1]["content"] for p in found_by_text] == [c.messages[-1].content for c in firsts]
    assert [(p["temperature"], p["max_tokens"], p["seed"]) for p in found_by_text] == [
        (c.body["temperature"], c.body.get("max_tokens"), c.body["seed"]) for c in firsts
    ]
    assert {p["problem_id"] for p in found} == {"p1"}
    assert bench.prompts(tmp_path / "run", bench.ROLES["reviewer"], 1) == found[:1]


def test_replies_are_read_as_the_method_reads_them(bench: ModuleType) -> None:
    review = {
        "analysis": "The count is right.",
        "verdict": "revise",
        "validated": ["the recurrence"],
        "issues": [{"type": "logic_gap", "severity": "minor", "note": "n = 0 unchecked", "fix": "check it"}],
        "tests": {"random_checks": 1, "counterexample": {"found": False}},
    }
    assert bench.review_read(json.dumps(review), "stop") == {"usable": True, "verdict": "revise", "issues": 1}
    cut = bench.review_read('{"analysis": "The count', "length")
    assert cut["usable"] is False and "truncated at max_tokens" in cut["why"]
    scored = bench.verification_read('{"analysis": "Checks out.", "score": 0.5}', "stop")
    assert scored == {"usable": True, "score": 0.5}
    assert bench.verification_read('{"analysis": "The second step', "length") == {"usable": False, "score": None}


def _row(index: int, arm: str, usable: bool, *, cut: bool = False, tokens: int = 100, **said: object) -> dict:
    return {
        "index": index,
        "arm": arm,
        "finish_reason": "length" if cut else "stop",
        "completion_tokens": tokens,
        "usable": usable,
        **said,
    }


def test_the_review_summary_by_hand(bench: ModuleType) -> None:
    rows = [
        _row(0, "unbounded", False, cut=True, tokens=640),
        _row(0, "bounded", True, tokens=200, verdict="accept", issues=0),
        _row(1, "unbounded", True, tokens=300, verdict="revise", issues=2),
        _row(1, "bounded", True, tokens=250, verdict="reject", issues=1),
        _row(2, "unbounded", False, cut=True, tokens=640),
        _row(2, "bounded", False, tokens=150),
    ]
    summary = bench.summarize(rows, bench.ROLES["reviewer"])
    unbounded, bounded = summary["arms"]["unbounded"], summary["arms"]["bounded"]
    assert unbounded["replies"] == bounded["replies"] == 3
    assert unbounded["cut"]["share"] == pytest.approx(2 / 3) and bounded["cut"]["share"] == 0
    # sqrt(p (1 - p) / n) with p = 2/3, n = 3: sqrt(2/27).
    assert unbounded["unusable"]["share"] == pytest.approx(2 / 3)
    assert unbounded["unusable"]["stderr"] == pytest.approx((2 / 27) ** 0.5)
    assert bounded["unusable"]["share"] == pytest.approx(1 / 3)
    assert unbounded["verdicts"] == {"accept": 0, "revise": 1, "reject": 0}
    assert bounded["verdicts"] == {"accept": 1, "revise": 0, "reject": 1}
    assert unbounded["issues_per_usable"] == 2 and bounded["issues_per_usable"] == pytest.approx(0.5)
    assert unbounded["completion_tokens_per_reply"] == pytest.approx(1580 / 3)
    # Unreadable, unbounded minus bounded, per prompt: 1, 0, 0. Mean 1/3; sample variance
    # ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3; standard error sqrt((1/3) / 3) = 1/3.
    paired = summary["unusable_paired"]
    assert paired["prompts"] == 3
    assert paired["difference"] == pytest.approx(1 / 3) and paired["stderr"] == pytest.approx(1 / 3)
    assert "+33.3% (± 33.3%)" in bench.table(summary, bench.ROLES["reviewer"])


def test_the_verifier_schemas_follow_the_prompts_max_tokens(bench: ModuleType) -> None:
    shapes = bench.schemas(bench.ROLES["verifier"], {"max_tokens": 400, "params": {}})
    assert shapes["bounded"]["properties"]["analysis"] == {"type": "string", "maxLength": (400 - 24) * 5 // 2}
    assert shapes["unbounded"]["properties"]["analysis"] == {"type": "string"}
    assert shapes["unbounded"]["properties"]["score"] == shapes["bounded"]["properties"]["score"]


async def test_verification_prompts_know_whether_their_candidate_is_right(bench: ModuleType, tmp_path: Path) -> None:
    # Two solutions, the first written wrong: each verification prompt holds one, graded against the reference.
    wrong = "Multiplying, 17*23 = 390.\n\nTherefore, the final answer is \\boxed{390}."
    script = SimScript(rules=[Rule(role="solution", replies=[wrong], times=1)])
    settings = scripted_settings(method={"name": "verify_refine", "params": {"n": 2, "m": 1, "iterations": 1}})
    model = ScriptedModel(script, settings)
    await scripted_run(model, tmp_path / "run", [Problem(problem_id="p1", question="What is 17*23?", answer="391")])
    found = bench.prompts(tmp_path / "run", bench.ROLES["verifier"], None)
    assert len(found) == len(model.calls_of("verifier")) == 2
    by_answer = {("390" in p["messages"][-1]["content"]): p["right"] for p in found}
    assert by_answer == {True: False, False: True}


def test_the_verifier_summary_by_hand(bench: ModuleType) -> None:
    # Prompts 0 and 1 hold right candidates, 2 and 3 wrong ones.
    labels = {0: True, 1: True, 2: False, 3: False}
    rows = [
        _row(0, "unbounded", False, cut=True, tokens=400, score=None),
        _row(1, "unbounded", True, score=1.0),
        _row(2, "unbounded", True, score=0.5),
        _row(3, "unbounded", False, cut=True, tokens=400, score=None),
        _row(0, "bounded", True, score=1.0),
        _row(1, "bounded", True, score=1.0),
        _row(2, "bounded", True, score=0.5),
        _row(3, "bounded", True, score=0.0),
    ]
    summary = bench.summarize(rows, bench.ROLES["verifier"], labels)
    unbounded, bounded = summary["arms"]["unbounded"], summary["arms"]["bounded"]
    assert unbounded["scores"] == {"0.0": 0, "0.5": 1, "1.0": 1}
    assert bounded["scores"] == {"0.0": 1, "0.5": 1, "1.0": 2}
    # Scores used (unusable = 0): right [0, 1] against wrong [0.5, 0]: 0 < 0.5, 0 = 0 (a half), 1 > 0.5, 1 > 0,
    # so 2.5 of 4 pairs; bounded, right [1, 1] against [0.5, 0]: 4 of 4.
    assert unbounded["roc_area"] == pytest.approx(0.625)
    assert bounded["roc_area"] == 1.0
    # Unusable per prompt, unbounded minus bounded: 1, 0, 0, 1. Mean 0.5; sample variance 4 * 0.25 / 3 = 1/3;
    # standard error sqrt(1/3 / 4).
    paired = summary["unusable_paired"]
    assert paired["difference"] == 0.5 and paired["stderr"] == pytest.approx((1 / 12) ** 0.5)
    assert "| bounded | 4 | 0.0% | 0.0% (± 0.0%) | 1 / 1 / 2 | 1.00 | 100 |" in bench.table(
        summary, bench.ROLES["verifier"]
    )


def test_the_distillation_schemas_follow_the_runs_items_and_max_tokens(bench: ModuleType) -> None:
    # ((640 - 16) / (2 * 3) - 3) * 2.5 = 252 characters an item, 3 items a list.
    shapes = bench.schemas(bench.ROLES["distiller"], {"max_tokens": 640, "params": {"items_per_trajectory": 3}})
    bounded = {"type": "array", "items": {"type": "string", "maxLength": 252}, "maxItems": 3}
    assert shapes["bounded"]["properties"] == {"propositions": bounded, "pitfalls": bounded}
    plain = {"type": "array", "items": {"type": "string"}}
    assert shapes["unbounded"]["properties"] == {"propositions": plain, "pitfalls": plain}


async def test_distillation_prompts_are_the_first_attempt_of_each(bench: ModuleType, tmp_path: Path) -> None:
    # The first distillation echoes the prompt's instructions: RSE asks again, under a sample moved past the first.
    echo = json.dumps({"propositions": ["Extract reusable experience from it for later attempts"], "pitfalls": []})
    script = SimScript(rules=[Rule(role="distiller", replies=[echo], times=1)])
    params = {"n": 2, "iterations": 2, "items_per_trajectory": 3}
    settings = scripted_settings(method={"name": "rse", "params": params}, sampling={"temperature": 0.3})
    model = ScriptedModel(script, settings)
    await scripted_run(model, tmp_path / "run", [Problem(problem_id="p1", question="What is 17*23?", answer="391")])
    calls = model.calls_of("distiller")
    assert len(calls) == 3
    firsts = sorted(c.body["seed"] for c in calls if c.key.sample < 2)
    found = bench.prompts(tmp_path / "run", bench.ROLES["distiller"], None)
    assert sorted(p["seed"] for p in found) == firsts and len(found) == 2
    # The run's own parameters travel with each prompt, so the schema is the one the run sent.
    assert all(p["params"]["items_per_trajectory"] == 3 for p in found)
    sent = calls[0].body["response_format"]["json_schema"]["schema"]
    assert bench.schemas(bench.ROLES["distiller"], found[0])["bounded"] == sent


def test_distillations_are_read_as_written(bench: ModuleType) -> None:
    reply = {"propositions": ["a_n = 2^n - 1", "  spaced   out  "], "pitfalls": ["n = 0", "x", "y", "z", "w"]}
    # Every item counts, past the method's cap, at the length the reply wrote it.
    assert bench.distillation_read(json.dumps(reply), "stop") == {
        "usable": True,
        "item_chars": [13, 16, 5, 1, 1, 1, 1],
    }
    cut = bench.distillation_read('{"propositions": ["a_n = 2', "length")
    assert cut["usable"] is False and "truncated at max_tokens" in cut["why"]
    assert bench.distillation_read("[]", "stop")["usable"] is False


def test_the_distillation_summary_by_hand(bench: ModuleType) -> None:
    rows = [
        _row(0, "unbounded", True, item_chars=[100, 200, 300], item_bound=187),
        _row(0, "bounded", True, item_chars=[100, 187], item_bound=187),
        _row(1, "unbounded", False, cut=True, tokens=640),
        _row(1, "bounded", True, item_chars=[50], item_bound=187),
    ]
    summary = bench.summarize(rows, bench.ROLES["distiller"])
    unbounded, bounded = summary["arms"]["unbounded"], summary["arms"]["bounded"]
    # Unbounded: one usable reply of 3 items, mean 200 characters, 2 of them past 187.
    assert unbounded["items_per_usable"] == 3 and unbounded["item_chars_mean"] == 200
    assert unbounded["items_at_bound"]["share"] == pytest.approx(2 / 3)
    # Bounded: 3 items in 2 replies, mean (100 + 187 + 50) / 3, one closed at the bound.
    assert bounded["items_per_usable"] == 1.5 and bounded["item_chars_mean"] == pytest.approx(337 / 3)
    assert bounded["items_at_bound"]["share"] == pytest.approx(1 / 3)
    assert summary["unusable_paired"]["difference"] == 0.5
    assert "| bounded | 2 | 0.0% | 0.0% (± 0.0%) | 1.5 | 112 | 33.3% | 100 |" in bench.table(
        summary, bench.ROLES["distiller"]
    )


async def test_distillation_prompts_from_solutions_are_the_ones_rse_sends(bench: ModuleType, tmp_path: Path) -> None:
    # Built from an RSE run's own first-iteration solutions, they are exactly the distillation prompts it sent, with
    # each solution call's sampling; a TMAS run's first samples give the same prompts for the same replies.
    settings = scripted_settings(
        method={"name": "rse", "params": {"n": 2, "iterations": 2}}, sampling={"temperature": 0.3}
    )
    model = ScriptedModel(SimScript(), settings)
    problem = Problem(problem_id="p1", question="What is 17*23?", answer="391")
    await scripted_run(model, tmp_path / "run", [problem])
    sent = sorted(json.dumps(c.body["messages"]) for c in model.calls_of("distiller"))
    found = bench.prompts(tmp_path / "run", bench.ROLES["distiller"], None, from_solutions=True)
    assert sorted(json.dumps(p["messages"]) for p in found) == sent and len(sent) == 2
    seeds = {c.body["seed"]: c.body for c in model.calls_of("solution") if c.key.iteration == 0}
    for p in found:
        assert (p["temperature"], p["max_tokens"]) == (0.3, seeds[p["seed"]].get("max_tokens"))
        assert p["params"] == {}
