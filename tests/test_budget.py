"""Equal-compute budgets: a problem stops at the first call past its token or call budget, keeps what finished, and
its record says so; for the baselines and TMAS alike. What a budget stops is worked in process on the scripted model;
the flags, the run summary and the pooled budget of a run against the simulated server."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import scripted_settings
from scripted_runs import run_scripted, scripted_run
from tmas.cli.main import app
from tmas.config import Budget, Settings, load_settings
from tmas.errors import ConfigError, InputError
from tmas.llm.types import Usage
from tmas.methods.base import ProblemResult
from tmas.problems import Problem
from tmas.runner import stored_settings
from tmas.store.run_store import RunStore
from tmas.sweep import point_name
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript, SimServer

Q = "What is 17*23?"


async def solve(method: str, budget: dict[str, int], **params: Any) -> tuple[ProblemResult, ScriptedModel]:
    return await run_scripted(method, settings={"budget": budget}, **params)


@pytest.mark.parametrize("method", ["self_refine", "rse", "pacore"])
async def test_call_budget_is_never_exceeded_and_partial_iteration_is_kept(method: str) -> None:
    params = {"responses_per_round": 2} if method == "pacore" else {"n": 2}
    result, model = await solve(method, {"calls": 5}, iterations=10, **params)
    assert len(model.calls) == 5 and result.calls == 5
    assert result.stopped_reason == "budget" and result.status == "done" and result.answer == "391"
    assert result.counters == {"budget_stops": 1}
    last = result.iterations[-1]
    assert any(note.startswith("stopped: budget spent (5 calls of a budget of 5)") for note in last.notes)


async def test_token_budget_stops_at_the_first_call_past_it() -> None:
    # One call per iteration, so the spend before each call is known exactly.
    budget = 300
    result, model = await solve("majority", {"tokens": budget}, k=1, iterations=50)
    spends = [r.usage.completion_tokens for r in result.iterations]  # completion tokens: the default count
    assert result.stopped_reason == "budget" and len(spends) < 50
    # Every call but the last was sent with the spend below the budget; after the last, it was reached.
    assert sum(spends[:-1]) < budget <= sum(spends)
    assert len(model.calls) == len(spends)


async def test_tmas_stopped_by_its_budget_keeps_the_solutions_of_the_iteration_it_cut() -> None:
    # n=2, m=1: an iteration is 2 solutions + 2 verifications + 2 summaries + experience + guideline = 8 calls.
    # Iteration 1's two solutions are the 9th and 10th calls; their verifications are refused.
    result, model = await solve("tmas", {"calls": 10}, n=2, m=1, iterations=5)
    assert len(model.calls) == 10
    assert result.stopped_reason == "budget" and result.status == "done"
    assert [r.iteration for r in result.iterations] == [0, 1] and result.answer == "391"
    assert [(c.index, c.meta.unverified, c.score) for c in result.iterations[1].candidates] == [
        (0, True, None),
        (1, True, None),
    ]
    assert result.iterations[-1].notes[-1] == (
        "stopped: budget spent (10 calls of a budget of 10) in iteration 1; 2 of 2 candidates finished"
    )


async def test_tmas_stopped_in_its_first_iteration_answers_from_the_solutions_that_came_back() -> None:
    # Both solutions, then candidate 0's verification; candidate 1's is refused. The first iteration is recorded with
    # both candidates, and the problem is answered from it.
    result, model = await solve("tmas", {"calls": 3}, n=2, m=1, iterations=5)
    assert [c.role for c in model.calls] == ["solution", "solution", "verifier"]
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "391")
    [record] = result.iterations
    assert [(c.score is None, c.meta.unverified) for c in record.candidates] == [(False, None), (True, True)]


async def test_no_budget_means_no_stop() -> None:
    result, model = await solve("self_refine", {}, n=2, iterations=3)
    assert result.stopped_reason is None and len(result.iterations) == 3 and Budget().limited is False
    assert len(model.calls) == result.calls


def test_cli_budget_flags(sim: SimServer, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tmas",
            "solve",
            Q,
            "--json",
            "--method",
            "majority",
            "--param",
            "k=2",
            "--iterations",
            "9",
            "--budget-calls",
            "3",
            "--base-url",
            sim.base_url,
            "--run-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        check=True,
    )
    result = ProblemResult.model_validate_json(out.stdout)
    assert result.stopped_reason == "budget" and result.calls == 3
    assert [len(r.candidates) for r in result.iterations] == [2, 1]


# ---------------------------------------------------------------------------------------------- what a budget counts
# Every reply reports 100 prompt, 30 completion (10 of them reasoning) tokens, so spends are worked by hand.
SCRIPTED = SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=100, completion_tokens=30, reasoning_tokens=10))])


@pytest.mark.parametrize(
    ("count", "tokens", "calls", "spent"),
    [
        # TMAS n=1, m=1: solution, verifier, summary, then experience and guideline together (both checked at 90).
        # Completion tokens: iteration 0 spends 30, 60, 90, then 150; iteration 1's solution (checked at 150) and
        # verifier (at 180) go, its summary (at 210 >= 200) is refused: 7 calls.
        ("completion", 200, 7, 210),
        # Total tokens: 130, 260, 390, then 650 (both memory calls checked at 390); iteration 1's solution goes
        # (at 650 < 700), its verifier (at 780) is refused: 6 calls.
        ("total", 700, 6, 780),
    ],
)
async def test_token_budget_counts_completion_or_total_tokens(count: str, tokens: int, calls: int, spent: int) -> None:
    params = {"n": 1, "m": 1, "iterations": 5}
    budget = {"tokens": tokens, "count": count}
    result, model = await run_scripted("tmas", script=SCRIPTED, settings={"budget": budget}, **params)
    assert len(model.calls) == calls and result.calls == calls
    # Iteration 1's solution came back: the iteration is kept with it, as its record's last note says.
    assert result.stopped_reason == "budget" and [r.iteration for r in result.iterations] == [0, 1]
    note = f"stopped: budget spent ({spent} {count} tokens of a budget of {tokens}) in iteration 1"
    assert result.iterations[-1].notes[-1] == f"{note}; 1 of 1 candidates finished"
    # The three counts stay apart whatever the budget counted; the result includes the cut iteration's calls.
    assert result.usage == Usage(prompt_tokens=100 * calls, completion_tokens=30 * calls, reasoning_tokens=10 * calls)
    assert result.iterations[0].usage == Usage(prompt_tokens=500, completion_tokens=150, reasoning_tokens=50)


def test_completion_is_the_default_count_and_env_and_flags_set_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./tmas.toml
    assert Budget().count == "completion" and Settings().budget.count == "completion"
    env = {"TMAS_BUDGET_TOKENS": "500", "TMAS_BUDGET_COUNT": "total"}
    assert load_settings(None, environ=env).budget == Budget(tokens=500, count="total")
    flagged = load_settings(None, overrides={"budget.count": "completion"}, environ=env)
    assert flagged.budget == Budget(tokens=500, count="completion")
    with pytest.raises(ConfigError, match=r"^environment \(TMAS_BUDGET_COUNT\): bad value for 'budget.count'"):
        load_settings(None, environ={**env, "TMAS_BUDGET_COUNT": "prompt"})


def test_budget_count_is_part_of_a_token_budgets_identity() -> None:
    assert Budget(tokens=10, count="total").identity() == {"tokens": 10, "count": "total"}
    # Without a token limit the count changes nothing: runs without one keep their fingerprints.
    assert Budget(calls=3, count="total").identity() == {"calls": 3} and Budget().identity() == {}
    assert point_name("cot", {}, Budget(tokens=10, count="total")) == "cot__budget_tokens=10_total"
    assert point_name("cot", {}, Budget(tokens=10)) == "cot__budget_tokens=10"
    # A pooled budget is another run; an unpooled one keeps the identity it had before pooling existed.
    assert Budget(tokens=10, pool=True).identity() == {"tokens": 10, "count": "completion", "pool": True}
    assert point_name("cot", {}, Budget(tokens=10, pool=True)) == "cot__budget_tokens=10_pooled"
    with pytest.raises(ValueError, match=r"budget\.pool .* needs budget\.tokens"):
        Budget(pool=True)


async def test_run_summary_splits_prompt_completion_and_reasoning_tokens(tmp_path: Path) -> None:
    model = ScriptedModel(SCRIPTED, scripted_settings(method={"name": "cot", "params": {}}))
    problems = [Problem(problem_id=f"p{i}", question=Q) for i in range(2)]
    summary = await scripted_run(model, tmp_path / "run", problems)
    data = summary.to_dict()
    assert (data["prompt_tokens"], data["completion_tokens"], data["reasoning_tokens"]) == (200, 60, 20)
    assert data["budget_count"] == "completion"


def test_sweep_budget_flags_and_environment(sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMAS_BUDGET_TOKENS", "90")  # from the environment; the flag sets the count
    sim.set_script(SCRIPTED)
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 17*23?"}\n')
    args = ["sweep", "--out", str(tmp_path / "sw"), "--problems", str(problems), "-m", "majority", "-p", "k=1"]
    args += ["-p", "iterations=9", "--budget-count", "total", "--base-url", sim.base_url, "--no-report"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    run_dir = tmp_path / "sw" / "runs" / "majority__iterations=9__k=1__budget_tokens=90_total"
    with RunStore(run_dir, create=False) as store:
        [row] = list(store.results())
    # 130 total tokens a call: the first call reaches 90, the second is refused.
    assert row.calls == 1 and row.stopped_reason == "budget"


def test_solve_prints_the_token_split(sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    sim.set_script(SCRIPTED)
    out = CliRunner().invoke(app, ["solve", Q, "-m", "majority", "-p", "k=2", "--base-url", sim.base_url])
    assert out.exit_code == 0, out.output
    assert "tmas: 2 calls; tokens: prompt 200, completion 60 (reasoning 20)" in out.output


def test_sweep_resume_refuses_a_new_budget(tmp_path: Path) -> None:
    # The budget names a sweep's points: a flag that cannot apply on resume is an error, not silently dropped.
    out = CliRunner().invoke(app, ["sweep", "--resume", str(tmp_path), "--budget-count", "total"])
    assert isinstance(out.exception, InputError) and "--resume keeps the sweep's budget" in str(out.exception)


# ---------------------------------------------------------------------------------------------- a pooled budget
# Every reply reports 10 completion tokens. "a" is settled by majority vote's Beta stop after two rounds of 2 (four
# agreeing samples); "b"'s samples alternate between two answers, so only its budget stops it.
TEN = ScriptedUsage(prompt_tokens=5, completion_tokens=10)
POOLED = SimScript(
    rules=[
        Rule(pattern=r"12\*12", replies=["So 144.\n\n\\boxed{144}", "So 145.\n\n\\boxed{145}"], usage=TEN),
        Rule(usage=TEN),
    ]
)
SETTLED_AND_OPEN = [Problem(problem_id="a", question=Q), Problem(problem_id="b", question="What is 12*12?")]
POOLED_PARAMS = {"k": 4, "stop": "beta", "round_size": 2, "iterations": 9}


def pooled_model(pool: bool) -> ScriptedModel:
    """A majority vote under a token budget of 90 per problem (pooled or not), answering with POOLED in process."""
    settings = scripted_settings(
        method={"name": "majority", "params": POOLED_PARAMS},
        budget={"tokens": 90, "pool": pool},
        problems_in_flight=1,  # "a" finishes before "b" starts: the hand-worked order
    )
    return ScriptedModel(POOLED, settings)


async def pooled_run(run_dir: Path, pool: bool) -> dict[str, ProblemResult]:
    await scripted_run(pooled_model(pool), run_dir, SETTLED_AND_OPEN)
    with RunStore(run_dir, create=False) as store:
        return {r.problem_id: r for r in store.results()}


async def test_a_pooled_budget_gives_what_a_settled_problem_left_to_an_open_one(tmp_path: Path) -> None:
    # A call may cost its max_tokens (256), more than the whole budget, so each problem's calls go one at a time
    # (ProblemSession._admit), each checked at the spend before it. "a" stops after 40 tokens and leaves 50 of its 90.
    # Alone, "b" sends calls at 0, 10, ..., 80 and is refused at 90: 9 calls, its budget exactly. Pooled, at 90 it
    # draws the 50 "a" left (limit 140), sends calls at 90, ..., 130 and is refused at 140, halfway through iteration
    # 3: 14 calls. The run spends 40 + 140 = 180, its two shares.
    alone = await pooled_run(tmp_path / "alone", pool=False)
    assert (alone["a"].calls, alone["b"].calls, alone["b"].budget_drawn) == (4, 9, 0)
    assert alone["b"].usage.completion_tokens == 90
    pooled = await pooled_run(tmp_path / "pooled", pool=True)
    a, b = pooled["a"], pooled["b"]
    assert (a.calls, a.stopped_reason, a.budget_drawn) == (4, "vote decided (Beta stopping criterion)", 0)
    assert (b.calls, b.usage.completion_tokens, b.stopped_reason, b.budget_drawn) == (14, 140, "budget", 50)
    last = b.iterations[-1]
    assert last.iteration == 3 and len(last.candidates) == 2
    stop = last.state["stop"]
    assert (stop["drawn"], stop["stopped"], stop["reason"]) == (
        2,
        False,
        "the budget stopped sampling after 2 of 4 samples",
    )
    assert last.notes[-1] == (
        "stopped: budget spent (140 completion tokens of a budget of 90 and 50 drawn from the run's pool) in"
        " iteration 3; 2 of 4 candidates finished"
    )


async def test_a_resumed_pooled_run_banks_what_finished_problems_left(tmp_path: Path) -> None:
    await pooled_run(tmp_path / "run", pool=True)
    db = sqlite3.connect(tmp_path / "run" / "run.sqlite")
    db.execute("DELETE FROM results WHERE problem_id = 'b'")  # "b" did not finish
    db.commit()
    db.close()
    resumed = pooled_model(pool=True)
    await scripted_run(resumed, tmp_path / "run")
    with RunStore(tmp_path / "run", create=False) as store:
        b = store.result("b")
    assert b is not None
    # The 50 tokens "a" left are banked again from its stored result: "b" replays its 14 calls and sends none.
    assert (b.calls, b.budget_drawn) == (14, 50) and resumed.calls == []


async def test_a_resumed_pooled_run_does_not_bank_again_what_finished_problems_drew(tmp_path: Path) -> None:
    # "a" leaves 50 of its 90; "b" draws them and spends 140; "c" finds the pool empty and stops at its own 90 (the
    # run: 40 + 140 + 90 = 270, its three shares). Resumed with "c" unfinished, the pool holds a's 90 - 40 and b's
    # 90 - 140: nothing, as before, so "c" again draws nothing (banking b's draw again gave "c" 50 more).
    problems = [*SETTLED_AND_OPEN, Problem(problem_id="c", question="What is 12*12? Once more.")]
    await scripted_run(pooled_model(pool=True), tmp_path / "run", problems)
    with RunStore(tmp_path / "run", create=False) as store:
        first = {r.problem_id: (r.usage.completion_tokens, r.budget_drawn) for r in store.results()}
    assert first == {"a": (40, 0), "b": (140, 50), "c": (90, 0)}
    with sqlite3.connect(tmp_path / "run" / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'c'")
    await scripted_run(pooled_model(pool=True), tmp_path / "run")
    with RunStore(tmp_path / "run", create=False) as store:
        c = store.result("c")
    assert c is not None and (c.usage.completion_tokens, c.budget_drawn) == (90, 0)


async def test_a_problem_its_call_budget_stops_draws_nothing_from_the_pool(tmp_path: Path) -> None:
    # Budget 90 tokens and 9 calls a problem, pooled; each sample sent once the one before it is answered. "a" stops
    # after 4 calls and 40 tokens, leaving 50. "b" sends 9 calls at 0, 10, ..., 80 and reaches both limits at once:
    # its 10th call is refused by the call budget, which no draw lifts, so it takes nothing from the pool (before, it
    # drew the 50 there and recorded them as drawn though it spent only its own share, and held them from the
    # problems still open until it finished). "c"'s replies cost 20: at 100 it draws the 50, sends calls at 100 and
    # 120, and is refused at 140 after 7 calls.
    twenty = ScriptedUsage(prompt_tokens=5, completion_tokens=20)
    script = SimScript(rules=[Rule(pattern="Once more", replies=POOLED.rules[0].replies, usage=twenty), *POOLED.rules])
    problems = [*SETTLED_AND_OPEN, Problem(problem_id="c", question="What is 12*12? Once more.")]
    settings = scripted_settings(
        method={"name": "majority", "params": {**POOLED_PARAMS, "round_size": 1}},
        budget={"tokens": 90, "calls": 9, "pool": True},
        problems_in_flight=1,
    )
    await scripted_run(ScriptedModel(script, settings), tmp_path / "run", problems)
    with RunStore(tmp_path / "run", create=False) as store:
        results = {r.problem_id: r for r in store.results()}
    spent = {p: (r.calls, r.usage.completion_tokens, r.budget_drawn) for p, r in results.items()}
    assert spent == {"a": (4, 40, 0), "b": (9, 90, 0), "c": (7, 140, 50)}
    stop = results["b"].iterations[-1].notes[-1]
    assert stop.startswith("stopped: budget spent (9 calls of a budget of 9; 90 completion tokens of a budget of 90")


async def test_a_budget_counting_prompts_is_passed_by_one_call_at_most_whatever_the_prompts_cost(
    tmp_path: Path,
) -> None:
    # Each reply reports a 500-token prompt (a long context, a template the server adds, text of few characters a
    # token) for a question of a few characters: guessed from its characters the prompt would cost far less. The
    # first call goes alone and shows the price; every later call is reserved at it. Budget 4,000 total tokens; a
    # call costs 520: at most 4,000 + 520 may be spent (16 samples would cost 8,320).
    costly = SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=500, completion_tokens=20))])
    settings = scripted_settings(
        method={"name": "majority", "params": {"k": 16}},
        budget={"tokens": 4000, "count": "total"},
        sampling={"max_tokens": 32},
    )
    await scripted_run(ScriptedModel(costly, settings), tmp_path / "run", [Problem(problem_id="a", question=Q)])
    with RunStore(tmp_path / "run", create=False) as store:
        [result] = store.results()
    spent = result.usage.prompt_tokens + result.usage.completion_tokens
    assert 4000 <= spent <= 4000 + 520 and result.stopped_reason == "budget"


# ------------------------------------------------------------------------------- --budget-count without a token budget
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_budget_count_without_a_token_budget_is_refused_before_any_call(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    # It says how a token budget counts: with no token budget it would change nothing, without a word.
    monkeypatch.chdir(tmp_path)
    sim.set_script(SCRIPTED)
    problems = tmp_path / "p.jsonl"
    problems.write_text(f'{{"problem_id": "a", "question": "{Q}"}}\n')
    if command == "run":
        args = ["run", str(problems), "--out", str(tmp_path / "out")]
    else:
        args = ["sweep", "--out", str(tmp_path / "out"), "--problems", str(problems), "--no-report"]
    args += [
        "-m",
        "majority",
        "-p",
        "k=1",
        "--budget-calls",
        "3",
        "--budget-count",
        "total",
        "--base-url",
        sim.base_url,
    ]
    out = CliRunner().invoke(app, args)
    assert isinstance(out.exception, InputError), out.output
    assert str(out.exception) == (
        "--budget-count says which tokens a token budget counts, and there is no token budget: give --budget-tokens"
        " (or budget.tokens in the config file), or leave --budget-count out"
    )
    assert sim.chat_bodies() == [] and not (tmp_path / "out").exists()


def test_budget_count_reaches_the_token_budget_a_grid_study_sets(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A grid whose study sets its own token budget: --budget-count is no mistake, and counts that study's tokens.
    monkeypatch.chdir(tmp_path)
    sim.set_script(SCRIPTED)
    problems = tmp_path / "p.jsonl"
    problems.write_text(f'{{"problem_id": "a", "question": "{Q}"}}\n')
    grid = tmp_path / "grid.toml"
    grid.write_text(
        f'problems = "{problems}"\n[[study]]\nmethod = "majority"\nparams = {{k = 1, iterations = 9}}\n'
        "budget = {tokens = 90}\n"
    )
    args = ["sweep", str(grid), "--out", str(tmp_path / "sw"), "--budget-count", "total", "--base-url", sim.base_url]
    out = CliRunner().invoke(app, [*args, "--no-report"])
    assert out.exit_code == 0, out.output
    run_dir = tmp_path / "sw" / "runs" / "majority__iterations=9__k=1__budget_tokens=90_total"
    with RunStore(run_dir, create=False) as store:
        [row] = list(store.results())
    # 130 total tokens a call: the first call reaches 90, the second is refused.
    assert row.calls == 1 and row.stopped_reason == "budget"


def test_budget_pool_pools_the_token_budget_of_a_grid_file(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The grid file gives the token budget, the flag pools it: no token budget in the config is no mistake.
    monkeypatch.chdir(tmp_path)
    sim.set_script(SCRIPTED)
    problems = tmp_path / "p.jsonl"
    problems.write_text(f'{{"problem_id": "a", "question": "{Q}"}}\n')
    grid = tmp_path / "grid.toml"
    grid.write_text(f'problems = "{problems}"\nbudget = {{tokens = 90}}\n[[study]]\nmethod = "cot"\n')
    out = CliRunner().invoke(app, ["sweep", str(grid), "--out", "sw", "--budget-pool", "--base-url", sim.base_url])
    assert out.exit_code == 0, out.output
    assert stored_settings(tmp_path / "sw" / "runs" / "cot__budget_tokens=90_pooled").budget == Budget(
        tokens=90, pool=True
    )


@pytest.mark.parametrize("command", ["solve", "run", "eval", "resume", "sweep"])
def test_budget_pool_with_no_token_budget_is_the_same_line_on_every_command(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    # Before, every command but a grid-file sweep said it as a bad settings value: "bad value for --budget-pool:
    # budget.pool ... needs budget.tokens", naming a settings key the user never typed.
    monkeypatch.chdir(tmp_path)
    sim.set_script(SCRIPTED)
    problems = tmp_path / "p.jsonl"
    problems.write_text(f'{{"problem_id": "a", "question": "{Q}"}}\n')
    endpoint = ["--base-url", sim.base_url]
    if command == "resume":
        made = CliRunner().invoke(app, ["run", str(problems), "-o", "run", "-m", "cot", *endpoint])
        assert made.exit_code == 0, made.output
        sim.reset()
        args = ["run", "--resume", "run"]
    else:
        args = {
            "solve": ["solve", Q, "-m", "cot", *endpoint],
            "run": ["run", str(problems), "-o", "out", "-m", "cot", *endpoint],
            "eval": ["eval", str(problems), "-o", "out", "-m", "cot", *endpoint],
            "sweep": ["sweep", "-o", "out", "--problems", str(problems), "-m", "cot", "--budget-calls", "5", *endpoint],
        }[command]
    out = CliRunner().invoke(app, [*args, "--budget-pool"])
    assert isinstance(out.exception, InputError), out.output
    assert str(out.exception) == (
        "--budget-pool moves unused tokens between problems, and there is no token budget: give --budget-tokens"
        " (or budget.tokens in the config file), or leave --budget-pool out"
    )
    assert sim.chat_bodies() == [] and not (tmp_path / "out").exists()


def test_budget_pool_with_no_token_budget_in_a_sweep_is_one_line(tmp_path: Path) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text('problems = "p.jsonl"\nbudget = {calls = 5}\n[[study]]\nmethod = "cot"\n')
    out = CliRunner().invoke(app, ["sweep", str(grid), "--out", str(tmp_path / "sw"), "--budget-pool"])
    assert isinstance(out.exception, InputError), out.output
    assert str(out.exception) == (
        "--budget-pool moves unused tokens between problems, and there is no token budget: give --budget-tokens"
        " (or budget.tokens in the config file), or leave --budget-pool out"
    )
