"""Compute that stops when the answer is settled: in process on the scripted model, the log-probabilities solution
calls ask for (and no other role does), confidence-weighted votes read from the payloads the model sent, a run's one
notice against a model that sends none, the votes' logic, the samples majority vote's Beta stop saves, TMAS's
settled stop and the report of them; the command line's one notice against a simulated server that sends none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import isolate, scripted_settings, settings_for
from scripted_runs import by_role, solve_in_process
from tmas.api import arun, asolve
from tmas.cli.main import app
from tmas.grading.grades import Grades
from tmas.grading.run_results import load_results
from tmas.methods import stored_params
from tmas.methods.base import ProblemResult
from tmas.methods.confidence_params import ANSWER_ONLY_NOTICE, CONFIDENCE_NOTICE
from tmas.methods.majority import VOTE_DECIDED
from tmas.methods.tmas import SETTLED
from tmas.reports.analysis import stopping_summary
from tmas.reports.document import Document
from tmas.reports.metrics import compute_metrics
from tmas.reports.report import RunEvaluation, _run_section
from tmas.reports.roc import confidence_separation
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer
from tmas.testing.personas import PERSONAS
from tmas.testing.replies import certain_logprobs

Q = "What is 17*23?"


def payload(confidence: float, tokens: int = 4) -> list[dict[str, Any]]:
    """A logprobs payload whose every token has DeepConf token confidence ``confidence``: the chosen token is
    certain and its one alternative has log-probability -2 x confidence (mean -confidence)."""
    return [
        {
            "token": f"t{i}",
            "logprob": 0.0,
            "top_logprobs": [{"token": f"t{i}", "logprob": 0.0}, {"token": "alt", "logprob": -2.0 * confidence}],
        }
        for i in range(tokens)
    ]


def boxed(answer: str) -> str:
    return f"Working it out by hand.\n\n\\boxed{{{answer}}}"


# Two samples box 7 with token confidence 1 each, one boxes 9 with confidence 3: a plain vote returns 7, a
# confidence-weighted vote 9 (V(7) = 2 < V(9) = 3). Each rule's reply and payload go together, whatever the order.
SPLIT = [
    Rule(role="solution", times=2, replies=[boxed("7")], logprobs=payload(1.0)),
    Rule(role="solution", times=1, replies=[boxed("9")], logprobs=payload(3.0)),
]


async def in_process(
    method: str, rules: list[Rule] | None = None, **params: Any
) -> tuple[ProblemResult, ScriptedModel]:
    model = ScriptedModel(SimScript(rules=rules or []), scripted_settings(method={"name": method, "params": params}))
    return await solve_in_process(model, Q), model


# ---------------------------------------------------------------------------------------------- confidence
async def test_confidence_vote_asks_solution_calls_for_logprobs_and_weighs_the_votes(tmp_path: Path) -> None:
    params = {"k": 3, "select": "confidence_vote", "confidence_top_logprobs": 3}
    model = ScriptedModel(SimScript(rules=SPLIT), scripted_settings(method={"name": "majority", "params": params}))
    result = await asolve(Q, model=model, run_dir=tmp_path / "run")
    bodies = [call.body for call in model.calls_of("solution")]
    assert len(bodies) == 3 and all((b["logprobs"], b["top_logprobs"]) == (True, 3) for b in bodies)
    assert result.answer == "9" and result.notices == []
    tails = sorted((c.answer, c.confidence.tail) for c in result.iterations[0].candidates if c.confidence)
    assert tails == [("7", 1.0), ("7", 1.0), ("9", 3.0)]
    # The measures are part of the stored iteration record.
    with RunStore(tmp_path / "run", create=False) as store:
        stored = store.iterations("question")[0].candidates
    assert sorted(c.confidence.tail for c in stored if c.confidence) == [1.0, 1.0, 3.0]


async def test_plain_vote_asks_for_no_logprobs() -> None:
    result, model = await in_process("majority", SPLIT, k=3)
    assert result.answer == "7" and all(c.confidence is None for c in result.iterations[0].candidates)
    assert all("logprobs" not in c.body and "top_logprobs" not in c.body for c in model.calls)


async def test_filtered_vote_lets_the_most_confident_share_vote() -> None:
    # Three samples box 7 at confidence 1 (V = 3), one boxes 9 at 2.5: the weighted vote returns 7; with eta = 0.25
    # only the most confident ceil(0.25 x 4) = 1 sample votes: 9.
    rules = [
        Rule(role="solution", times=3, replies=[boxed("7")], logprobs=payload(1.0)),
        Rule(role="solution", times=1, replies=[boxed("9")], logprobs=payload(2.5)),
    ]
    assert (await in_process("majority", rules, k=4, select="confidence_vote"))[0].answer == "7"
    filtered, _ = await in_process("majority", rules, k=4, select="filtered_vote", confidence_share=0.25)
    assert filtered.answer == "9"


async def test_tmas_confidence_asks_only_the_solution_role() -> None:
    params = {"n": 2, "m": 1, "iterations": 2, "select": "confidence_vote", "skip_final_memory": False}
    result, model = await in_process("tmas", **params)
    assert set(by_role(model)) == {"solution", "verifier", "summary", "experience", "guideline"}
    assert all(c.body["logprobs"] is True and c.body["top_logprobs"] == 5 for c in model.calls_of("solution"))
    for role in ("verifier", "summary", "experience", "guideline"):
        bodies = [c.body for c in model.calls_of(role)]
        assert bodies and all("logprobs" not in b and "top_logprobs" not in b for b in bodies), role
    # The simulator's own payload (the scripted model's too) lists one alternative per token: no confidence can be
    # read from it, so the rule votes plainly and says so once.
    assert result.answer == "391" and result.notices == [CONFIDENCE_NOTICE]
    assert result.counters["confidence_missing"] == 2


async def test_a_model_without_logprobs_gets_one_notice_per_run(tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(json.dumps({"problem_id": f"q{i}", "question": Q}) + "\n" for i in range(2)))
    settings = scripted_settings(method={"name": "majority", "params": {"k": 2, "select": "confidence_vote"}})
    model = ScriptedModel(SimScript(logprobs=False), settings)
    summary = await arun(problems, tmp_path / "run", model=model)
    assert summary.done == 2 and summary.notices == [CONFIDENCE_NOTICE]
    assert all(call.body["logprobs"] is True for call in model.calls_of("solution"))
    with RunStore(tmp_path / "run", create=False) as store:
        assert list(store.notices().values()) == [CONFIDENCE_NOTICE]
        for result in store.results():
            assert result.notices == [CONFIDENCE_NOTICE]
            assert "confidence rules vote plainly" in " ".join(result.iterations[0].notes)


def test_the_cli_prints_the_notice_once(sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate(monkeypatch, tmp_path)
    sim.set_script(SimScript(logprobs=False))
    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(json.dumps({"problem_id": f"q{i}", "question": Q}) + "\n" for i in range(3)))
    args = ["run", str(problems), "-o", str(tmp_path / "run"), "--base-url", sim.base_url, "-m", "majority"]
    out = CliRunner().invoke(app, [*args, "-p", "k=2", "-p", "select=filtered_vote"])
    assert out.exit_code == 0, out.output
    assert [line for line in out.stderr.splitlines() if line.startswith("notice:")] == [f"notice: {CONFIDENCE_NOTICE}"]
    # tmas solve says it as well, after the answer.
    solve = ["solve", Q, "--base-url", sim.base_url, "-m", "majority", "-p", "k=2", "-p", "select=confidence_vote"]
    out = CliRunner().invoke(app, solve)
    assert out.exit_code == 0 and out.stdout.strip() == "391", out.output
    assert out.stderr.splitlines()[-1] == f"tmas: notice: {CONFIDENCE_NOTICE}"


def test_run_help_lists_the_rules_and_their_sources() -> None:
    out = CliRunner().invoke(app, ["run", "--help"])
    assert out.exit_code == 0
    text = " ".join(out.output.split())  # as wrapped for any terminal width
    assert "majority: iterations=1, mode=numeric, confidence=false," in text
    assert "k=64, select=vote, stop=fixed, stop_threshold=0.95, round_size=4" in text
    assert "early_stop=false, early_stop_patience=2, early_stop_score=0.9, early_stop_agreement=1.0" in text
    assert "stop (majority): fixed: k samples; beta: rounds until the leader cannot be overtaken" in text
    assert "(Adaptive-Consistency, Aggarwal et al. 2023)" in text
    assert (
        "select (tmas): best_score (Algorithm 1), vote, score_weighted_vote, confidence_vote or filtered_vote" in text
    )
    assert "the candidates agree and every verification passes (beyond the TMAS paper; on in the local preset)" in text
    assert "confidence_share (majority, tmas): filtered_vote: the most confident share eta that votes" in text


# ---------------------------------------------------------------------------------------------- stopping
async def test_beta_stop_saves_the_samples_a_decided_vote_does_not_need() -> None:
    fixed, model = await in_process("majority", k=16)
    assert by_role(model) == {"solution": 16} and fixed.stopped_reason is None
    # Every sample boxes 391: after the first round of 4, P(leader stays ahead) = 31/32 >= 0.95.
    adaptive, model = await in_process("majority", k=16, stop="beta", round_size=4)
    assert by_role(model) == {"solution": 4} and adaptive.calls == 4
    assert adaptive.answer == fixed.answer == "391" and adaptive.stopped_reason == VOTE_DECIDED
    stop = adaptive.iterations[0].state["stop"]
    assert (stop["drawn"], stop["k"], stop["leading"], stop["runner_up"], stop["stopped"]) == (4, 16, 4, 0, True)
    assert stop["probability"] == 31 / 32 and stop["reason"].startswith("after 4 of 16 samples")
    assert any(n.startswith("stopped: after 4 of 16 samples") for n in adaptive.iterations[0].notes)


async def test_beta_stop_never_draws_past_k() -> None:
    # Alternating answers never decide the vote: every round is drawn, up to k, then the next iteration's k.
    rules = [Rule(role="solution", replies=[boxed("7"), boxed("9")])]
    result, model = await in_process("majority", rules, k=6, stop="beta", round_size=4, iterations=2)
    assert by_role(model) == {"solution": 12} and result.stopped_reason is None
    stops = [r.state["stop"] for r in result.iterations]
    assert [(s["drawn"], s["stopped"]) for s in stops] == [(6, False), (6, False)]
    assert stops[0]["reason"].startswith("all 6 samples drawn")
    # The same samples as a fixed run draws: indices (and so seeds) 0..5 each iteration.
    assert sorted(c.index for c in result.iterations[1].candidates) == list(range(6))


async def test_tmas_stops_when_settled() -> None:
    # Both candidates box 391 and the verifier passes both: settled after iteration 0. The memory update and the
    # later iterations are not asked for: 2 solutions + 2 verifications + 2 summaries = 6 calls instead of 8 + 8 + 4.
    settled, model = await in_process("tmas", n=2, m=1, iterations=3, early_stop=True, early_stop_patience=1)
    assert by_role(model) == {"solution": 2, "verifier": 2, "summary": 2}
    assert settled.calls == 6 and settled.stopped_reason == SETTLED and settled.answer == "391"
    record = settled.iterations[0].state["early_stop"]
    assert record["iteration"] == 0 and record["agreement"] == 1.0 and record["lowest_verification"] == 1.0
    assert "settled for 1 consecutive iteration(s)" in record["reason"]
    assert any(n.startswith("early stop: after iteration 0") for n in settled.iterations[0].notes)
    full, _ = await in_process("tmas", n=2, m=1, iterations=3)
    assert full.calls == 20 and full.stopped_reason is None and len(full.iterations) == 3


@pytest.mark.parametrize(
    ("rules", "why"),
    [
        ([Rule(role="solution", replies=[boxed("391"), boxed("390")])], "the candidates disagree"),
        ([Rule(role="verifier", times=1, replies=["## Analysis\nA gap.\n\n## Score\nScore: 0.5"])], "a 0.5 verdict"),
    ],
)
async def test_tmas_does_not_stop_unless_settled(rules: list[Rule], why: str) -> None:
    result, _ = await in_process("tmas", rules, n=2, m=1, iterations=2, early_stop=True, early_stop_patience=1)
    assert len(result.iterations) == 2 and result.stopped_reason is None, why
    assert "early_stop" not in result.iterations[0].state


# ---------------------------------------------------------------------------------------------- report
async def test_the_report_shows_confidence_stops_and_notices(tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem_id": "q", "question": Q, "answer": "391"}) + "\n")
    # Run 1: two right samples at confidence 3, two wrong at 1, weighted by confidence.
    rules = [
        Rule(role="solution", times=2, replies=[boxed("391")], logprobs=payload(3.0)),
        Rule(role="solution", times=2, replies=[boxed("390")], logprobs=payload(1.0)),
    ]
    params: dict[str, Any] = {"k": 4, "select": "confidence_vote"}
    weighted = ScriptedModel(SimScript(rules=rules), scripted_settings(method={"name": "majority", "params": params}))
    await arun(problems, tmp_path / "weighted", model=weighted)
    # Run 2: a model without log-probabilities; every sample right, so the Beta stop ends it after one round.
    params = {"k": 8, "select": "confidence_vote", "stop": "beta"}
    stopped = ScriptedModel(SimScript(logprobs=False), scripted_settings(method={"name": "majority", "params": params}))
    await arun(problems, tmp_path / "stopped", model=stopped)
    doc = Document("report")
    for name in ("weighted", "stopped"):
        _run_section(doc, evaluation_of(tmp_path / name))
    markdown = doc.markdown()
    assert "ROC area of candidate confidence" in markdown
    assert (
        "ROC area 1.000 over 2 right and 2 wrong measured candidates; mean tail confidence (DeepConf) right 3.000"
        in (markdown)
    )
    assert f"1 problems stopped early ({{'{VOTE_DECIDED}': 1}})" in markdown
    assert "mean calls of a stopped problem 4.0" in markdown
    assert markdown.count(f"notice: {CONFIDENCE_NOTICE}") == 1


def evaluation_of(run_dir: Path) -> RunEvaluation:
    """What ``evaluate_run`` computes for the sections under test, with answers graded by hand (391 is right)."""
    with RunStore(run_dir, create=False) as store:
        results = load_results(store)
        notices = store.notices()
    grades = Grades(runs=1)
    for r in results:
        for rec in r.iterations:
            for c in rec.candidates:
                grades.verdicts[(r.problem_id, rec.iteration, c.index)] = [c.answer == "391"]
    e = RunEvaluation(
        run_dir=run_dir,
        label="majority",
        benchmark="b",
        method="majority",
        params=stored_params("majority", {}),
        model=None,
        problems=1,
        done=1,
        failed=0,
        metrics=compute_metrics(results, grades, mv_k=None),
        grades=grades,
    )
    e.confidence = confidence_separation(results, grades, "tail")
    e.confidence = e.confidence if e.confidence.available else None
    e.stopping, e.notices = stopping_summary(results), notices
    return e


THOUGHT = "Seventeen times twenty is three hundred and forty, and seventeen times three is fifty-one."


def traced(text: str) -> list[dict[str, Any]]:
    """A payload at token confidence 1 whose tokens spell ``text`` as the simulator cuts it."""
    alternatives = [{"token": "t", "logprob": 0.0}, {"token": "alt", "logprob": -2.0}]
    return [{**entry, "top_logprobs": alternatives} for entry in certain_logprobs(text, 0, PERSONAS["vllm"])]


@pytest.mark.parametrize(("persona", "answer_only"), [("vllm", False), ("sglang", False), ("sim", True)])
async def test_a_server_without_the_reasoning_log_probabilities_gives_the_answer_confidence(
    sim: SimServer, tmp_path: Path, persona: str, answer_only: bool
) -> None:
    """DeepConf scores the whole trace: vLLM and SGLang stream the reasoning's log-probabilities before the answer's;
    a server that streams the answer's alone leaves the answer's confidence, said per candidate and once per run."""
    reply = boxed("391")
    rule = Rule(role="solution", replies=[reply], reasoning=THOUGHT, logprobs=traced(THOUGHT + reply))
    sim.set_script(SimScript(persona=persona, reasoning=True, rules=[rule]))
    params = {"k": 2, "select": "confidence_vote"}
    settings = settings_for(sim, method={"name": "majority", "params": params}, endpoint__stream="on")
    result = await asolve(Q, settings, run_dir=tmp_path / "run")
    assert all(body["stream"] is True for body in sim.chat_bodies("solution"))
    [record] = result.iterations
    assert [c.confidence.answer_only for c in record.candidates if c.confidence] == [answer_only] * 2
    expected = [ANSWER_ONLY_NOTICE] if answer_only else []
    assert result.answer == "391" and result.notices == expected
    said = "2 candidates' confidence covers their answer alone: no log-probabilities of the reasoning"
    assert (said in record.notes) is answer_only
    with RunStore(tmp_path / "run", create=False) as store:
        assert list(store.notices().values()) == expected
        [stored] = store.iterations("question")
        assert all(c.confidence.answer_only is answer_only for c in stored.candidates if c.confidence)
