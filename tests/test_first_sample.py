"""Fair floors and small-model robustness: every method's first sample is the same request; the output style is
chosen per role; replies per role are counted (no answer, truncated, fallback) into the records and the report. The
methods run in process on the scripted model; the report reads a run stored through the simulated server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from scripted_runs import solve_in_process
from tmas.agents.solution import generation_prompt
from tmas.api import asolve
from tmas.errors import ConfigError
from tmas.grading.grades import GradeConfig
from tmas.methods import METHODS, create_method
from tmas.methods.base import ProblemResult, ReplyTally
from tmas.methods.style_params import StyledParams
from tmas.reports.reply_quality import role_replies
from tmas.reports.report import build_report
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript

Q = "What is 17*23?"
# The smallest run of each method whose first call is its first sample.
SMALLEST: dict[str, dict[str, Any]] = {
    "cot": {},
    "majority": {"k": 1},
    "self_refine": {"n": 1, "iterations": 1},
    "verify_refine": {"n": 1, "iterations": 1},
    "pacore": {"responses_per_round": 1, "iterations": 1, "synthesis": False},
    "rse": {"n": 1, "iterations": 1},
    "tmas": {"n": 1, "m": 1, "iterations": 1},
}
PAPER_LAYOUT = "Give only your final version"
CONCISE_LAYOUT = "Keep it short: the key steps only"


async def solve(method: str, rules: list[Rule] | None = None, **params: Any) -> tuple[ProblemResult, ScriptedModel]:
    model = ScriptedModel(SimScript(rules=rules or []), scripted_settings(method={"name": method, "params": params}))
    return await solve_in_process(model, Q), model


def first_solution_messages(model: ScriptedModel) -> list[dict[str, Any]]:
    return [m.model_dump() for m in model.calls_of("solution")[0].messages]


@pytest.mark.parametrize("style", ["paper", "concise"])
async def test_every_method_starts_from_the_same_first_sample(style: str) -> None:
    # Every method but MATTRL, whose first call is its coordinator recruiting a team, not a solution.
    assert set(SMALLEST) == set(METHODS) - {"mattrl"}
    sent: dict[str, list[dict[str, Any]]] = {}
    for name, params in SMALLEST.items():
        result, model = await solve(name, **params, style=style)
        assert result.status == "done" and result.answer == "391", name
        sent[name] = first_solution_messages(model)
    expected = [m.model_dump() for m in generation_prompt(Q, "numeric", style)]  # type: ignore[arg-type]
    assert all(messages == expected for messages in sent.values()), {k: v[-1]["content"][:80] for k, v in sent.items()}
    assert expected[0]["role"] == "system" and "Do not write code" in expected[0]["content"]
    assert (PAPER_LAYOUT if style == "paper" else CONCISE_LAYOUT) in expected[1]["content"]


async def test_style_is_chosen_per_role() -> None:
    _, model = await solve("tmas", n=1, m=1, iterations=1, style={"verifier": "concise"})
    by_role = {c.role: c.messages[-1].content for c in model.calls}
    assert PAPER_LAYOUT in by_role["solution"] and CONCISE_LAYOUT not in by_role["solution"]
    assert "A short analysis, a few sentences at most" in by_role["verifier"]
    assert "## Analysis" not in by_role["verifier"]


def test_style_for_a_role_the_method_lacks_is_an_error() -> None:
    with pytest.raises(ConfigError) as raised:
        create_method("majority", {"style": {"verifier": "concise"}})
    assert str(raised.value) == "method 'majority': style for unknown roles ['verifier'] (roles with a style: solution)"
    with pytest.raises(ConfigError, match="style"):
        create_method("cot", {"style": "terse"})


def test_presets_and_the_embedded_model_choose_the_style() -> None:
    for name, cls in METHODS.items():
        if name not in SMALLEST:
            continue
        params = create_method(name, {}, embedded=True).params
        assert isinstance(params, StyledParams) and params.style == "concise", name
        assert cls.Params.model_validate({}).style == "paper", name  # type: ignore[attr-defined]
    assert create_method("tmas", {"preset": "paper"}, embedded=True).params.style == "paper"  # type: ignore[attr-defined]
    assert create_method("tmas", {"preset": "local", "style": "paper"}).params.style == "paper"  # type: ignore[attr-defined]


async def test_cot_reads_an_unboxed_final_answer_as_a_fallback() -> None:
    result, _ = await solve("cot", [Rule(role="solution", replies=["17*23 = 391.\nThe answer is 391."])])
    [candidate] = result.iterations[0].candidates
    assert result.answer == "391" and candidate.meta.extraction == "stated"
    assert result.iterations[0].replies == {"solution": ReplyTally(replies=1, stated=1)}


async def test_reply_counts_per_role_reach_the_records_and_the_report(tmp_path: Path) -> None:
    replies = ["So \\boxed{391}.", "Final answer: 391", "I would write a Python program for this."]
    script = SimScript(
        rules=[
            Rule(role="solution", replies=["It is \\boxed{391}"], finish_reason="length", times=1),
            Rule(role="solution", replies=replies),
        ]
    )
    model = ScriptedModel(script, scripted_settings(method={"name": "majority", "params": {"k": 4}}))
    result = await asolve(Q, model=model, run_dir=tmp_path / "run")
    [record] = result.iterations
    assert record.replies == {"solution": ReplyTally(replies=4, truncated=1, unusable=1, stated=1)}
    assert sorted(c.meta.extraction for c in record.candidates) == ["boxed", "boxed", "none", "stated"]
    assert any("no extractable answer" in n for n in record.notes)
    with RunStore(tmp_path / "run", create=False) as store:
        assert role_replies(store) == record.replies
    paths = await build_report([tmp_path / "run"], tmp_path / "report", GradeConfig(), None, grade=False)
    markdown = paths["markdown"].read_text(encoding="utf-8")
    assert "#### Replies per role" in markdown
    assert "| solution | 4 | 25.0% (1) | 25.0% (1) | 25.0% (1) |" in markdown


async def test_tmas_counts_unreadable_verifier_scores() -> None:
    rules = [Rule(role="verifier", replies=["Looks plausible to me."])]
    # The last iteration's summaries run too (skip_final_memory off), so every reply kind is tallied.
    params = {"n": 2, "m": 2, "iterations": 1, "no_experience": True, "no_guideline": True}
    result, _ = await solve("tmas", rules, **params, skip_final_memory=False)
    replies = result.iterations[0].replies
    assert replies["verifier"] == ReplyTally(replies=4, unusable=4)
    assert replies["solution"] == ReplyTally(replies=2)
    assert replies["summary"].replies == 2
    assert result.counters["verification_unparseable"] == 4
