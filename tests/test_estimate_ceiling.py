"""The estimate's ceiling holds every reply asked again: a run whose replies all repeat their instructions, and whose
retries give no answer, sends as many calls as the ceiling says and no more (against the simulated server)."""

from __future__ import annotations

import re
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from conftest import run_tmas, settings_for
from tmas.api import aresume
from tmas.config import Settings
from tmas.errors import InputError
from tmas.grading.grades import GradeConfig
from tmas.methods import create_method
from tmas.planning.estimate import (
    Estimate,
    PointEstimate,
    TokenRates,
    brief_estimate,
    calls_said,
    estimate_point,
    format_estimate,
    stored_ceiling,
    stored_over_points,
)
from tmas.problems import Problem
from tmas.reports.report import evaluate_run
from tmas.runner import prepare_run, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import LongReplies, Rule, SimScript, SimServer
from tmas.testing.script import ScriptedUsage

PROBLEM = [Problem(problem_id="q0", question="What is 2*7?", answer="14")]
# The answer reminder's prompt (answer_reminder.j2), as the rules tell it from the first ask.
REMINDED = r"Your reply above states no final answer"


def instructions(body: dict[str, Any]) -> str:
    """A request's prompt without its tagged data blocks: what an echoing reply repeats."""
    text = "\n".join(m["content"] for m in body["messages"])
    return re.sub(r"^<(\w+)>\n.*?^</\1>$", "", text, flags=re.M | re.S)


def roles_sent(sim: SimServer) -> dict[str, int]:
    sent: dict[str, int] = {}
    for r in sim.requests:
        if r.endpoint == "chat":
            sent[r.role] = sent.get(r.role, 0) + 1
    return sent


@pytest.mark.parametrize(
    ("method", "params", "guarded", "most"),
    [
        # One trajectory, two iterations: the solution echoes, its retry has no answer (2 calls); the refinement
        # echoes, its retry has no answer, and the reminder is asked (3 calls). The structure says 2.
        ("self_refine", {"n": 1, "iterations": 2}, ["solution", "refiner"], {"solution": 2, "refiner": 3}),
        # The same with a verification of each (never asked again): 2 + 3 + 2 = 7 calls; the structure says 4.
        (
            "verify_refine",
            {"n": 1, "m": 1, "iterations": 2},
            ["solution", "corrector"],
            {"solution": 2, "corrector": 3, "verifier": 2},
        ),
        # Chain of thought: the solution echoes, its retry has no answer (no reminder): 2 calls; the structure says 1.
        ("cot", {}, ["solution"], {"solution": 2}),
    ],
)
async def test_a_run_whose_every_reply_is_asked_again_reaches_the_ceiling_and_no_further(
    sim: SimServer, tmp_path: Path, method: str, params: dict[str, Any], guarded: list[str], most: dict[str, int]
) -> None:
    settings = settings_for(sim, method={"name": method, "params": params})
    # A first run with usable replies, for each role's prompt.
    store, settings, todo = prepare_run(tmp_path / "probe", settings, PROBLEM, resume=False)
    with store:
        await run_problems(settings, todo, store)
    echoes = {role: instructions(sim.chat_bodies(role)[0]) for role in guarded}
    sim.reset()
    rules = [Rule(role=role, pattern=REMINDED, replies=["Still working on it."]) for role in guarded]
    # Each role's first ask echoes its instructions; the retry comes back with no answer.
    rules += [Rule(role=role, replies=[echoes[role], "Nothing to box yet."]) for role in guarded]
    sim.set_script(SimScript(rules=rules))
    store, settings, todo = prepare_run(tmp_path / "run", settings, PROBLEM, resume=False)
    with store:
        summary = await run_problems(settings, todo, store)
    point = estimate_point(method, create_method(method, params), settings, 1, None)
    assert roles_sent(sim) == point.calls.most == most
    assert summary.calls == point.most_calls == sum(most.values()) > point.upper_calls
    # The line printed before a run says that most, beside the calls of usable replies the old line said.
    said = f"{calls_said(point.upper_calls)} ({point.most_calls} at most, with replies asked again), <="
    assert brief_estimate(Estimate([point])).startswith(said)


@pytest.mark.parametrize(
    ("method", "params", "max_tokens", "ceiling"),
    [
        # One trajectory, two iterations; solutions at 1,000 tokens, refinements at 100. Iteration 0's solution
        # echoes twice (2 x 1,000), so iteration 1 starts afresh with a solution call in place of the refinement and
        # echoes twice again (2 x 1,000): 4,000 sent. The ceiling: 2,000 for iteration 0, and iteration 1 at the
        # dearer of a refinement asked three times (300) and a solution asked twice (2,000): 4,000. Counting the
        # afresh calls as refinements said 2,300.
        ("self_refine", {"n": 1, "iterations": 2}, {"solution": 1000, "refiner": 100}, 4000),
        # The same with corrections at 100 and a verification of each solution at 50 (none here: no solution is
        # usable): 4,000 sent; the ceiling 2 x 1,000 + 2 x 50 + the dearer of 300 and 2,000 = 4,100 (was 2,400).
        (
            "verify_refine",
            {"n": 1, "m": 1, "iterations": 2},
            {"solution": 1000, "corrector": 100, "verifier": 50},
            4100,
        ),
    ],
)
async def test_a_trajectory_that_starts_afresh_stays_under_the_token_ceiling(
    sim: SimServer,
    tmp_path: Path,
    method: str,
    params: dict[str, Any],
    max_tokens: dict[str, int],
    ceiling: int,
) -> None:
    roles = {role: {"sampling": {"max_tokens": n}} for role, n in max_tokens.items()}
    settings = settings_for(sim, method={"name": method, "params": params}, roles=roles)
    store, settings, todo = prepare_run(tmp_path / "probe", settings, PROBLEM, resume=False)
    with store:
        await run_problems(settings, todo, store)
    echo = instructions(sim.chat_bodies("solution")[0])
    sim.reset()
    # Every solution reply echoes its instructions: asked again, it echoes again and is unusable.
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=[echo])]))
    store, settings, todo = prepare_run(tmp_path / "run", settings, PROBLEM, resume=False)
    with store:
        await run_problems(settings, todo, store)
    bodies = sim.chat_bodies()
    assert [b["max_tokens"] for b in bodies] == [1000] * 4 == [b["max_tokens"] for b in sim.chat_bodies("solution")]
    point = estimate_point(method, create_method(method, params), settings, 1, None)
    assert point.basis == "max_tokens" and point.completion_tokens == ceiling >= 4000
    assert sum(b["max_tokens"] for b in bodies) <= ceiling


async def test_a_call_budget_caps_the_token_ceiling_at_its_dearest_calls(sim: SimServer, tmp_path: Path) -> None:
    # V-R, one trajectory, two iterations: solutions and corrections at 1,000 tokens, verifications at 100, and a call
    # budget of 2 a problem. Every solution reply echoes its instructions: the solution and its retry, 2 x 1,000 =
    # 2,000 sent before the budget stops the problem. The ceiling is the budget's 2 calls at the dearest, 2,000; a
    # share of the uncapped 5,200 (7 calls: 2 solutions, 3 corrections, 2 verifications) said 2/7 of it, 1,486.
    params = {"n": 1, "m": 1, "iterations": 2}
    roles = {role: {"sampling": {"max_tokens": n}} for role, n in (("solution", 1000), ("corrector", 1000))}
    roles["verifier"] = {"sampling": {"max_tokens": 100}}
    settings = settings_for(sim, method={"name": "verify_refine", "params": params}, roles=roles)
    store, probe, todo = prepare_run(tmp_path / "probe", settings, PROBLEM, resume=False)
    with store:
        await run_problems(probe, todo, store)
    echo = instructions(sim.chat_bodies("solution")[0])
    sim.reset()
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=[echo])]))
    capped = settings.model_copy(update={"budget": settings.budget.model_copy(update={"calls": 2})})
    store, capped, todo = prepare_run(tmp_path / "run", capped, PROBLEM, resume=False)
    with store:
        await run_problems(capped, todo, store)
    assert [b["max_tokens"] for b in sim.chat_bodies()] == [1000, 1000]
    point = estimate_point("vr", create_method("verify_refine", params), capped, 1, None)
    assert point.most_calls == 2 and point.completion_tokens == 2000


async def test_logprob_verifications_count_at_the_max_tokens_they_send(sim: SimServer, tmp_path: Path) -> None:
    # TMAS N = 1, M = 2, T = 1 with logprob scoring: each verification asks score_max_tokens (500), over the
    # verifier's own max_tokens (100). Sent: the solution at 256 (the settings' max_tokens) and 2 x 500 = 1,256. The
    # ceiling: the solution and its echo's retry, 2 x 256, and 2 verifications (never asked again) x 500 = 1,512; at
    # the verifier's max_tokens it said 2 x 256 + 2 x 100 = 712.
    params = {"n": 1, "m": 2, "iterations": 1, "verifier_score": "logprob", "score_max_tokens": 500}
    roles = {"verifier": {"sampling": {"max_tokens": 100}}}
    settings = settings_for(sim, method={"name": "tmas", "params": params}, roles=roles)
    store, settings, todo = prepare_run(tmp_path / "run", settings, PROBLEM, resume=False)
    with store:
        await run_problems(settings, todo, store)
    assert [b["max_tokens"] for b in sim.chat_bodies("verifier")] == [500, 500]
    assert sum(b["max_tokens"] for b in sim.chat_bodies()) == 1256
    point = estimate_point("tmas", create_method("tmas", params), settings, 1, None)
    assert point.completion_tokens == 1512


async def _stopped_at_its_correction(sim: SimServer, tmp_path: Path) -> tuple[Path, str]:
    """V-R, one trajectory of two iterations, 8 verifications a solution: solutions and corrections at 4,000 tokens,
    verifications at 100. The run stops at its correction (a server error, not retried), its solution and 8
    verifications stored. Its directory, and the correction's instructions (from a first run's) for a reply to
    echo."""
    params = {"n": 1, "m": 8, "iterations": 2}
    roles = {role: {"sampling": {"max_tokens": 4000}} for role in ("solution", "corrector")}
    roles["verifier"] = {"sampling": {"max_tokens": 100}}
    settings = settings_for(sim, method={"name": "verify_refine", "params": params}, roles=roles)
    store, probe, todo = prepare_run(tmp_path / "probe", settings, PROBLEM, resume=False)
    with store:
        await run_problems(probe, todo, store)
    echo = instructions(sim.chat_bodies("corrector")[0])
    sim.reset()
    sim.set_script(SimScript(rules=[Rule(role="corrector", fault="http_500")]))
    once = settings.model_copy(update={"retry": settings.retry.model_copy(update={"max_attempts": 1})})
    store, once, todo = prepare_run(tmp_path / "run", once, PROBLEM, resume=False)
    with store:
        await run_problems(once, todo, store)
    assert [b["max_tokens"] for b in sim.chat_bodies()] == [4000] + [100] * 8 + [4000]
    sim.reset()
    sim.set_script(SimScript())
    return tmp_path / "run", echo


async def test_a_resumed_runs_token_ceiling_holds_the_max_tokens_its_requests_send(
    sim: SimServer, tmp_path: Path
) -> None:
    # The resume's correction echoes, its retry has no answer and is reminded (3 x 4,000), and its 8 verifications
    # follow (8 x 100): 12,800 sent. The ceiling is 5 x 4,000 + 16 x 100 = 21,600 over 21 calls; less the stored
    # calls at their max_tokens (4,000 + 8 x 100) it is 16,800. Their share by calls, 12/21 of it, said 12,343, under
    # what the resume sends: it went ahead under a limit of 12,799.
    run, echo = await _stopped_at_its_correction(sim, tmp_path)
    rules = [Rule(role="corrector", pattern=REMINDED, replies=["Still working on it."])]
    sim.set_script(SimScript(rules=[*rules, Rule(role="corrector", replies=[echo, "Nothing to box yet."])]))
    said = r"the estimate is 17k completion tokens \(threshold 17k\): up to 12 calls to send \(9 stored"
    with pytest.raises(InputError, match=said):
        await aresume(run, max_completion_tokens=16_799)
    assert sim.chat_bodies() == []
    await aresume(run, max_completion_tokens=16_800)
    assert [b["max_tokens"] for b in sim.chat_bodies("corrector")] == [4000] * 3
    assert sum(b["max_tokens"] for b in sim.chat_bodies()) == 12_800


async def test_tmas_run_resume_takes_stored_calls_off_at_their_max_tokens(sim: SimServer, tmp_path: Path) -> None:
    # The same stopped run through `tmas run --resume`: 16,800 tokens still to send, over a --confirm-tokens of
    # 16,799 (the share by calls, 12,343, went ahead) and within one of 16,800.
    run, _ = await _stopped_at_its_correction(sim, tmp_path)
    refused = run_tmas("run", "--resume", str(run), "--confirm-tokens", "16799", text=True)
    assert refused.returncode == 2
    assert "the estimate is 17k completion tokens (threshold 17k)" in refused.stderr.splitlines()[-1]
    assert sim.chat_bodies() == []
    went = run_tmas("run", "--resume", str(run), "--confirm-tokens", "16800", text=True)
    assert "tmas: estimate: up to 12 calls to send (9 stored, replayed), <=17k completion tokens" in went.stderr
    assert [b["max_tokens"] for b in sim.chat_bodies()] == [4000] + [100] * 8


def test_a_mean_or_a_cut_ceiling_takes_stored_calls_off_by_their_share() -> None:
    # Majority k = 4 on 10 problems, 40 calls, 80 at most. With a mean per call (a pilot's or a given one) or a token
    # budget cutting the ceiling, no role's max_tokens bounds what a stored call spent: 30 stored take 3/8 off.
    method = create_method("majority", {"k": 4})
    settings = Settings.model_validate({"sampling": {"max_tokens": 100}})
    ceiling = estimate_point("mv", method, settings, 10, None)
    assert ceiling.ceilings == {"solution": 100.0}
    assert stored_ceiling(ceiling, 30, {"solution": 30}) == 3000.0
    mean = estimate_point("mv", method, settings, 10, TokenRates(completion={"solution": 60.0}, default_completion=60))
    assert mean.basis == "given" and stored_ceiling(mean, 30, {"solution": 30}) is None
    estimate = Estimate([mean], stored_calls=30)
    assert estimate.tokens_to_send == 2400 * 50 / 80
    cut = Settings.model_validate({"sampling": {"max_tokens": 100}, "budget": {"tokens": 250}})
    assert stored_ceiling(estimate_point("mv", method, cut, 10, None), 30, {"solution": 30}) is None
    # Given what the replayed calls spent of each problem's budget, that comes off, each problem's no more than the
    # 350 it may spend (the budget and the call that passes it).
    spent = {"q0": 50, "q1": 400}
    assert stored_ceiling(estimate_point("mv", method, cut, 10, None), 30, {"solution": 30}, spent) == 50 + 350


def test_the_stored_calls_of_several_points_come_off_each_points_own_tokens() -> None:
    # Majority k = 4 on 10 problems at 100 tokens a call: 80 calls at most, a ceiling of 8,000; 30 stored take 3,000
    # off it. The same under a token budget of 250 a problem: 350 each (the budget and the call that passes it),
    # 3,500, no ceiling by role: its 20 stored take their share, 20/80 of it, 875. Left: 11,500 - 3,875 = 7,625. The
    # share over both, 110/160 of 11,500, said 7,906.25.
    method = create_method("majority", {"k": 4})
    ceiling = estimate_point("a", method, Settings.model_validate({"sampling": {"max_tokens": 100}}), 10, None)
    cut = Settings.model_validate({"sampling": {"max_tokens": 100}, "budget": {"tokens": 250}})
    budgeted = estimate_point("b", method, cut, 10, None)
    assert (ceiling.completion_tokens, budgeted.completion_tokens) == (8000, 3500)
    taken = stored_over_points([(ceiling, 30, {"solution": 30}, None), (budgeted, 20, {"solution": 20}, None)])
    assert taken == 3000 + 875
    estimate = Estimate([ceiling, budgeted], stored_calls=50, stored_tokens=taken)
    assert estimate.tokens_to_send == 7625
    # A point with no calls stored takes nothing off; one of unknown tokens leaves the figure unknown.
    assert stored_over_points([(ceiling, 0, {}, None), (budgeted, 20, {"solution": 20}, None)]) == 875
    unknown = PointEstimate("c", "majority", 10, method.calls_per_problem())
    assert stored_over_points([(ceiling, 30, {"solution": 30}, None), (unknown, 5, {"solution": 5}, None)]) is None


def test_a_sweep_run_again_takes_each_points_stored_calls_off_its_own_ceiling(sim: SimServer, tmp_path: Path) -> None:
    # Solutions at 100 tokens, refinements at 1,000; two problems. Majority k = 2 is finished (skipped); self-refine
    # (one trajectory, two iterations) stopped after q1's solution; majority k = 3 was never reached.
    problems = tmp_path / "p.jsonl"
    problems.write_text(
        "".join(f'{{"problem_id": "q{i}", "question": "What is {i}*3?", "answer": "{3 * i}"}}\n' for i in range(2))
    )
    (tmp_path / "grid.toml").write_text(
        '[[study]]\nmethod = "majority"\ngrid = { k = [2, 3] }\n\n'
        '[[study]]\nmethod = "self_refine"\nparams = { n = 1, iterations = 2 }\n'
    )
    (tmp_path / "config.toml").write_text(
        "[sampling]\nmax_tokens = 100\n\n[roles.refiner.sampling]\nmax_tokens = 1000\n"
    )
    out = tmp_path / "sw"
    made = [
        "sweep",
        str(tmp_path / "grid.toml"),
        "--config",
        str(tmp_path / "config.toml"),
        "--problems",
        str(problems),
    ]
    made += ["--out", str(out), "--base-url", sim.base_url, "--no-report"]
    first = run_tmas(*made, "--yes", text=True)
    assert first.returncode == 0, first.stderr
    refine = out / "runs" / "self_refine__iterations=2__n=1"
    with sqlite3.connect(refine / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'q1'")
        db.execute("DELETE FROM calls WHERE problem_id = 'q1' AND role = 'refiner'")
    shutil.rmtree(out / "runs" / "majority__k=3")
    sim.reset()
    # Still to send: k = 3's 2 x 6 samples (each asked again) at 100, 1,200; q1's solution asked again at 100 and
    # its refinement asked three times at 1,000, 3,200, less its stored solution at 100: 4,300 in all. The share by
    # calls over the grid, 16/17 of 4,400, said 4,141.
    refused = run_tmas("sweep", "--resume", str(out), "--no-report", "--confirm-tokens", "4299", text=True)
    assert refused.returncode == 2
    assert "the estimate is 4.3k completion tokens (threshold 4.3k)" in refused.stderr.splitlines()[-1]
    assert sim.chat_bodies() == []
    went = run_tmas("sweep", "--resume", str(out), "--no-report", "--confirm-tokens", "4300", text=True)
    assert went.returncode == 0, went.stderr
    assert "tmas: estimate: up to 16 calls to send (1 stored, replayed), <=4.3k completion tokens" in went.stderr
    assert sorted(b["max_tokens"] for b in sim.chat_bodies()) == [100] * 6 + [1000]


def test_a_pilot_run_again_takes_its_stored_calls_off_at_their_max_tokens(sim: SimServer, tmp_path: Path) -> None:
    # Self-refine's pilot (one trajectory, two iterations) on one problem, solutions at 100 tokens and refinements at
    # 1,000, stopped after its solution. Still to send: the solution asked again (100) and the refinement asked three
    # times (3,000), 3,100: the ceiling of 3,200 less the stored solution. Its share by calls, 4/5, said 2,560.
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "q0", "question": "What is 2*7?", "answer": "14"}\n')
    (tmp_path / "config.toml").write_text(
        "[sampling]\nmax_tokens = 100\n\n[roles.refiner.sampling]\nmax_tokens = 1000\n"
    )
    base = ["run", str(problems), "--out", str(tmp_path / "run"), "--config", str(tmp_path / "config.toml")]
    base += ["--base-url", sim.base_url, "--method", "self_refine", "-p", "n=1", "-p", "iterations=2"]
    base += ["--pilot", "1", "--dry-run"]
    first = run_tmas(*base, "--yes", text=True)
    assert first.returncode == 0, first.stderr
    with sqlite3.connect(tmp_path / "run" / "pilot" / "run" / "run.sqlite") as db:
        db.execute("DELETE FROM results")
        db.execute("DELETE FROM calls WHERE role = 'refiner'")
    sim.reset()
    refused = run_tmas(*base, "--confirm-tokens", "3099", text=True)
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1].startswith(
        "tmas: error: the pilot is 3.1k completion tokens (threshold 3.1k)"
    )
    assert sim.chat_bodies() == []
    went = run_tmas(*base, "--confirm-tokens", "3100", text=True)
    assert went.returncode == 0, went.stderr
    assert [b["max_tokens"] for b in sim.chat_bodies()] == [1000]


async def test_a_resumed_pooled_budget_counts_what_its_finished_problems_left(sim: SimServer, tmp_path: Path) -> None:
    # Majority k = 8 on three problems at 100 tokens a call, under a pooled budget of 150 a problem. The first run's
    # replies are 10 tokens: each problem spends 80 and leaves 70. With q2 taken out of the store, a resume solves it
    # alone, its bank holding q0's and q1's 140: it may spend its 150, the 140, and the call that passes them (100):
    # 390 (the structure's 16 x 100 is more). Its own share alone said 250; at 100 tokens a reply it spends 300.
    settings = settings_for(
        sim,
        method={"name": "majority", "params": {"k": 8}},
        sampling={"max_tokens": 100},
        budget={"tokens": 150, "pool": True},
    )
    problems = [Problem(problem_id=f"q{i}", question=f"What is {i}*3?", answer=str(3 * i)) for i in range(3)]
    sim.set_script(SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=5, completion_tokens=10))]))
    store, settings, todo = prepare_run(tmp_path / "run", settings, problems, resume=False)
    with store:
        await run_problems(settings, todo, store)
        assert [r.usage.completion_tokens for r in store.results()] == [80, 80, 80]
    with sqlite3.connect(tmp_path / "run" / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'q2'")
        db.execute("DELETE FROM calls WHERE problem_id = 'q2'")
    sim.reset()
    sim.set_script(SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=5, completion_tokens=100))]))
    with pytest.raises(InputError, match=r"the estimate is 390 completion tokens \(threshold 389\)"):
        await aresume(tmp_path / "run", max_completion_tokens=389)
    refused = run_tmas("run", "--resume", str(tmp_path / "run"), "--confirm-tokens", "389", text=True)
    assert refused.returncode == 2
    assert "the estimate is 390 completion tokens (threshold 389)" in refused.stderr.splitlines()[-1]
    assert sim.chat_bodies() == []
    summary = await aresume(tmp_path / "run", max_completion_tokens=390)
    assert len(sim.chat_bodies()) == 3 and summary.done == 3
    with RunStore(tmp_path / "run", create=False) as store:
        assert {r.problem_id: r.usage.completion_tokens for r in store.results()}["q2"] == 300


def test_a_resumes_hours_are_those_of_the_tokens_it_has_still_to_send() -> None:
    # Majority k = 4 on 10 problems at 100 tokens a call: 80 calls at most, 8,000 tokens; 30 stored take 3,000 off,
    # 5,000 still to send: 2,500 s at 2 tokens/s, 0.7 hours (the whole 8,000 said 1.1).
    method = create_method("majority", {"k": 4})
    point = estimate_point("mv", method, Settings.model_validate({"sampling": {"max_tokens": 100}}), 10, None)
    estimate = Estimate([point], throughput=2.0, stored_calls=30, stored_tokens=3000.0)
    assert estimate.tokens_to_send == 5000 and estimate.hours == 5000 / 2 / 3600
    table = format_estimate(estimate)
    assert (
        "  stored: 30 answered calls, replayed rather than sent; at most 50 still to send, <=5.0k completion tokens"
        in table
    )
    assert "  time: 0.7 hours at 2.0 completion tokens/s (given)" in table


async def test_a_resume_under_a_token_budget_takes_off_what_its_replayed_calls_spent(
    sim: SimServer, tmp_path: Path
) -> None:
    # Majority k = 16 at 100 tokens a call, under a budget of 300 completion tokens: a problem spends at most 400 (the
    # budget and the call that passes it), replayed calls included. Its first run's samples are 10 tokens each; with
    # its result and its last 4 samples taken out of the store, a resume replays 12 (120 tokens) and may spend 280
    # more. Their share by calls, 20 of the 32 the structure allows at most, said 250.
    settings = settings_for(
        sim, method={"name": "majority", "params": {"k": 16}}, sampling={"max_tokens": 100}, budget={"tokens": 300}
    )
    sim.set_script(SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=5, completion_tokens=10))]))
    store, settings, todo = prepare_run(tmp_path / "run", settings, PROBLEM, resume=False)
    with store:
        await run_problems(settings, todo, store)
        assert [r.usage.completion_tokens for r in store.results()] == [160]
    with sqlite3.connect(tmp_path / "run" / "run.sqlite") as db:
        db.execute("DELETE FROM results")
        db.execute("DELETE FROM calls WHERE id IN (SELECT id FROM calls ORDER BY id DESC LIMIT 4)")
    sim.reset()
    with pytest.raises(InputError, match=r"the estimate is 280 completion tokens \(threshold 279\)"):
        await aresume(tmp_path / "run", max_completion_tokens=279)
    refused = run_tmas("run", "--resume", str(tmp_path / "run"), "--confirm-tokens", "279", text=True)
    assert refused.returncode == 2
    assert "the estimate is 280 completion tokens (threshold 279)" in refused.stderr.splitlines()[-1]
    assert sim.chat_bodies() == []
    await aresume(tmp_path / "run", max_completion_tokens=280)
    assert len(sim.chat_bodies()) == 4


async def test_the_token_ceiling_says_that_attempts_cut_and_retried_cost_beside_it(
    sim: SimServer, tmp_path: Path
) -> None:
    # Chain of thought at max_tokens 256: a call and its reminder, 512 tokens at most. Two attempts of the call are
    # cut after 250 tokens and retried: the call is charged what they had the server generate (docs: "What a call
    # costs"), so the run spends more than the ceiling counts, and the estimate must say so rather than call it one.
    long = LongReplies(
        reasoning_min_tokens=2000,
        reasoning_median_tokens=2000,
        reasoning_max_tokens=2000,
        answer_min_tokens=0,
        chunk_tokens=10,
        answer_max_tokens=10,
    )
    cut = Rule(role="solution", fault="cut", fault_after_tokens=250, times=2)
    sim.set_script(SimScript(long_replies=long, rules=[cut]))
    settings = settings_for(sim, method={"name": "cot"})
    point = estimate_point("cot", create_method("cot", {}), settings, 1, None)
    assert (point.basis, point.completion_tokens) == ("max_tokens", 512)
    store, settings, todo = prepare_run(tmp_path / "run", settings, PROBLEM, resume=False)
    with store:
        await run_problems(settings, todo, store)
        spent = store.role_costs()["solution"]
    assert len(sim.chat_bodies("solution")) == 3 and spent["calls"] == 1
    assert spent["completion_tokens"] > 512
    # The whole estimate and its one line both say so, in the same words.
    said = "an attempt cut part way and retried adds what it had generated"
    assert said in format_estimate(Estimate([point]))
    brief = f"1 call (2 at most, with replies asked again), <=512 completion tokens ({said})"
    assert brief_estimate(Estimate([point])) == brief


async def test_a_resume_under_a_token_budget_takes_off_what_its_failed_calls_spent(
    sim: SimServer, tmp_path: Path
) -> None:
    # Majority k = 16 at 100 tokens a call, under a budget of 300 completion tokens: a problem spends at most 400.
    # Its first two samples are cut part way, not retried: they fail, having generated tokens, and a resume counts
    # those against the budget from the start (as the run's spend counts every stored call). None of its answered
    # calls is a sure replay (each comes after a failed one), so the estimate is 400 less what the failed calls spent.
    settings = settings_for(
        sim,
        method={"name": "majority", "params": {"k": 16}},
        sampling={"max_tokens": 100},
        budget={"tokens": 300},
        retry={"max_attempts": 1},
        # One call at a time: the two cut are the first two stored, whichever order replies would come back in.
        concurrency=1,
    )
    cut = Rule(fault="cut", fault_after_tokens=20, times=2)
    sim.set_script(SimScript(rules=[cut, Rule(usage=ScriptedUsage(prompt_tokens=5, completion_tokens=10))]))
    store, settings, todo = prepare_run(tmp_path / "run", settings, PROBLEM, resume=False)
    with store:
        await run_problems(settings, todo, store)
        failed = store.failed_spend(PROBLEM[0].problem_id)
        assert failed.calls == 2 and store.sure_replays() == {}
    assert sim.stats().max_in_flight == 1
    # Each generated 17 tokens before it was cut (the simulator's chunks fall so): 400 - 34 = 366 are left.
    assert failed.usage.completion_tokens == 34
    left = 366
    sim.reset()
    sim.set_script(SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=5, completion_tokens=10))]))
    with pytest.raises(InputError, match=rf"the estimate is {left} completion tokens \(threshold {left - 1}\)"):
        await aresume(tmp_path / "run", max_completion_tokens=left - 1)
    refused = run_tmas("run", "--resume", str(tmp_path / "run"), "--confirm-tokens", str(left - 1), text=True)
    assert refused.returncode == 2
    assert f"the estimate is {left} completion tokens (threshold {left - 1})" in refused.stderr.splitlines()[-1]
    assert sim.chat_bodies() == []
    await aresume(tmp_path / "run", max_completion_tokens=left)
    # The two failed samples asked again at 10 tokens each: within what the estimate said was left.
    with RunStore(tmp_path / "run", create=False) as store:
        assert store.results()[0].status == "done"
    assert len(sim.chat_bodies()) == 2


async def test_a_resume_under_a_call_budget_asks_its_failed_calls_again_in_their_place(
    sim: SimServer, tmp_path: Path
) -> None:
    # Majority k = 16 under a budget of 8 calls, 100 tokens a call at most. The first run sends 8: three are cut part
    # way and not retried (they fail), five answer, and the budget stops the problem. A resume asks the three again
    # and replays the five: the budget counts each failed call once, as the call asked in its place, so the problem
    # ends with the 8 samples a run without failures has and the server receives 3 calls. Counted beside their new
    # calls, the failed ones left it 5 samples (3 asked again, 2 replayed). No answered call is a sure replay (each
    # follows a failed one), so the estimate says 8 calls to send, 800 tokens, and takes nothing off for the failures.
    run_dir = tmp_path / "run"
    settings = settings_for(
        sim,
        method={"name": "majority", "params": {"k": 16}},
        sampling={"max_tokens": 100},
        budget={"calls": 8},
        retry={"max_attempts": 1},
        # One call at a time: the three cut are the first three stored, whichever order replies would come back in.
        concurrency=1,
    )
    cut = Rule(fault="cut", fault_after_tokens=20, times=3)
    sim.set_script(SimScript(rules=[cut, Rule(usage=ScriptedUsage(prompt_tokens=5, completion_tokens=10))]))
    store, settings, todo = prepare_run(run_dir, settings, PROBLEM, resume=False)
    with store:
        await run_problems(settings, todo, store)
        assert store.failed_spend("q0").calls == 3 and store.sure_replays() == {}
    assert sim.stats().max_in_flight == 1
    sim.reset()
    sim.set_script(SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=5, completion_tokens=10))]))
    with pytest.raises(InputError, match=r"the estimate is 8 calls \(threshold 7\)"):
        await aresume(run_dir, max_calls=7)
    dry = run_tmas("run", "--resume", str(run_dir), "--dry-run", text=True)
    assert dry.returncode == 0, dry.stderr
    assert "failed calls" not in dry.stderr and "  total: 8 calls\n" in dry.stderr
    assert "  completion tokens: 800 (every call" in dry.stderr
    assert sim.chat_bodies() == []
    await aresume(run_dir, max_calls=8)
    assert len(sim.chat_bodies()) == 3
    with RunStore(run_dir, create=False) as store:
        [result] = store.results()
    [record] = result.iterations
    assert sorted(c.index for c in record.candidates if c.error is None) == list(range(8))
    # The result counts every call spent (the 3 failed beside the 8); the budget's stop and the report's budget
    # table count 8 of a budget of 8.
    assert (result.calls, result.failed_calls, result.stopped_reason) == (11, 0, "budget")
    assert "(8 calls of a budget of 8)" in record.notes[-1]
    e = await evaluate_run(run_dir, GradeConfig(mode="rules"), None)
    assert e.budget is not None and (e.budget.calls, e.budget.stopped) == ([8], 1)
