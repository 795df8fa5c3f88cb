"""The cost estimate: call counts worked by hand from each method's structure, checked against what a run really
sends (in process on the scripted model), and the CLI's --dry-run and confirmation gate (against the simulated
server)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import run_tmas, scripted_settings, settings_for
from scripted_runs import by_role, run_scripted_problems
from tmas.api import aresume
from tmas.config import Settings
from tmas.errors import InputError
from tmas.methods import METHODS, create_method, question_params
from tmas.planning.estimate import (
    Estimate,
    TokenRates,
    brief_estimate,
    calls_per_problem,
    estimate_point,
    format_estimate,
    rates_from_role_costs,
    role_max_tokens,
)
from tmas.planning.pilot import run_pilot
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript, SimServer


def count(method: str, **params: Any) -> dict[str, int]:
    return calls_per_problem(create_method(method, params)).expected


def test_tmas_paper_setting_is_164000_calls_on_100_problems() -> None:
    # Algorithm 1, per iteration: N = 8 solutions, N x M = 64 verifications, N = 8 summaries, 1 experience and
    # 1 guideline update: 82 calls; T = 20 iterations: 1,640 per problem; 100 problems: 164,000.
    tmas = create_method("tmas", {"preset": "paper"})
    c = calls_per_problem(tmas)
    assert c.expected == {"solution": 160, "verifier": 1280, "summary": 160, "experience": 20, "guideline": 20}
    assert c.total == 1640 and c.exact
    point = estimate_point("tmas", tmas, Settings(), 100, None)
    assert point.total_calls == 164_000


def test_tmas_ablations_drop_the_memory_agent_calls() -> None:
    # w/o guideline: 8 + 64 + 8 + 1 = 81 per iteration; w/o both: 80; the last iteration 8 + 64 = 72 either way (no
    # summaries, no bank updates: skip_final_memory). 19 x 81 + 72 = 1611; 11 x 80 + 72 = 952.
    assert sum(count("tmas", n=8, m=8, iterations=20, no_guideline=True).values()) == 1611
    assert sum(count("tmas", n=8, m=8, iterations=12, no_guideline=True, no_experience=True).values()) == 952
    # Algorithm 1 as written (the paper preset's setting): 20 x 81 and 12 x 80.
    full = {"skip_final_memory": False}
    assert sum(count("tmas", n=8, m=8, iterations=20, no_guideline=True, **full).values()) == 1620
    assert sum(count("tmas", n=8, m=8, iterations=12, no_guideline=True, no_experience=True, **full).values()) == 960


def test_early_stop_makes_tmas_a_range() -> None:
    c = calls_per_problem(create_method("tmas", {"n": 2, "m": 1, "iterations": 3, "early_stop": True}))
    # At most: two iterations of 2 solutions, 2 verifications, 2 summaries and 2 memory updates, then 2 + 2 calls.
    assert not c.exact and c.upper_total == c.total == 2 * (2 * 3 + 2) + 2 * 2
    # At the fewest, settled after patience = 2 iterations: the first one whole, the second without its memory update.
    assert c.fewest == {"solution": 4, "verifier": 4, "summary": 4, "experience": 1, "guideline": 1}
    assert c.fewest_total == 14
    # Stopping needs a later iteration to save: patience >= T leaves the count exact.
    assert calls_per_problem(create_method("tmas", {"n": 2, "iterations": 2, "early_stop": True})).fewest is None


def test_the_local_preset_ranges_from_a_settled_first_iteration() -> None:
    # N = 2, M = 1, T = 2, settled after iteration 0: 2 + 2 + 2 = 6 calls; at most 8 + 4 = 12 (the demo's count).
    local = create_method("tmas", {"preset": "local"})
    count = calls_per_problem(local)
    assert (count.fewest_total, count.upper_total) == (6, 12)
    # Every call at the preset's max_tokens: 2 x 640 + 2 x 400 + 2 x 220 = 2,520 at the fewest; by the structure
    # 2,520 + 450 + 300 (memory) + 2 x 640 + 2 x 400 (iteration 1) = 5,350, and at most, every reply but the
    # verifications' asked again (the 4 solutions once, iteration 1's 2 reminded once more: 6 x 640; 2 summaries x 220;
    # the memory updates once): 5,350 + 3,840 + 440 + 450 + 300 = 10,380.
    assert count.again == {"solution": 6, "summary": 2, "experience": 1, "guideline": 1} and count.most_total == 22
    point = estimate_point("local", local, Settings(), 1, None)
    assert (point.fewest_completion_tokens, point.completion_tokens) == (2520, 10_380)
    text = format_estimate(Estimate([point]))
    assert "6-12" in text and "2.5k-10k" in text and "total: 6 to 12 calls" in text
    assert "at most: 22 calls with every reply asked again" in text
    assert "completion tokens: 2.5k to 10k" in text
    assert Estimate([point]).to_dict()["fewest_calls"] == 6


def test_a_call_budget_under_the_fewest_calls_leaves_one_count() -> None:
    # The local preset's problem sends 6 calls at the fewest and 12 by its structure; under a budget of 5 calls it
    # sends 5 at most either way: 5 a problem and 70 on 14 problems, not a range of 5-5 and 70-70.
    local = create_method("tmas", {"preset": "local"})
    capped = Settings.model_validate({"budget": {"calls": 5}})
    text = format_estimate(Estimate([estimate_point("local", local, capped, 14, None)]))
    row = text.splitlines()[2].split()
    assert row[:4] == ["local", "14", "<=5", "70"], text
    assert "total: 70 calls\n" in text
    # A problem stopping as early as it can sends 5 of its fewest calls (2 solutions at 640 tokens, 2 verifications
    # at 400, 2 summaries at 220): 2 x 640 + 2 x 400 + 220 = 2,300 at most, 32k over 14 problems; the most, 5
    # solutions at 640, 45k. Its 6 fewest calls said 35k.
    assert row[4] == "<=32k-45k", text
    # Under a budget of 8 the range stays: 6 to 8 a problem.
    wider = Settings.model_validate({"budget": {"calls": 8}})
    row = format_estimate(Estimate([estimate_point("local", local, wider, 14, None)])).splitlines()[2].split()
    assert row[:4] == ["local", "14", "6-8", "84-112"]


@pytest.mark.parametrize(
    ("params", "fewest"),
    [
        # Four agreeing samples decide at 0.95: one round of 4.
        ({"k": 16, "round_size": 4}, 4),
        # Rounds of 3: the first check with 4 or more samples comes after 6.
        ({"k": 16, "round_size": 3}, 6),
        # k = 2 per iteration: the second iteration's round brings the vote to 4.
        ({"k": 2, "iterations": 3, "round_size": 4}, 4),
        # 0.99 needs 6 agreeing samples (1 - 2^-7): two rounds of 4.
        ({"k": 16, "round_size": 4, "stop_threshold": 0.99}, 8),
    ],
)
def test_majority_beta_stop_ranges_from_the_first_decisive_round(params: dict[str, Any], fewest: int) -> None:
    c = calls_per_problem(create_method("majority", {"stop": "beta", **params}))
    assert c.fewest == {"solution": fewest} and not c.exact
    assert c.upper_total == params["k"] * params.get("iterations", 1)


def test_majority_beta_stop_that_cannot_decide_stays_exact() -> None:
    # k = 3 in one iteration: never the 4 agreeing samples 0.95 needs.
    c = calls_per_problem(create_method("majority", {"stop": "beta", "k": 3}))
    assert c.exact and c.fewest is None and c.total == 3


def test_online_stop_keeps_the_calls_and_makes_their_tokens_a_range() -> None:
    # k = 8 at 600 tokens a call: 4,800 at most; at the fewest the 2 warm-up samples run to their end and the 6
    # watched ones stop at their first full window of 64 tokens: 2 x 600 + 6 x 64 = 1,584.
    method = create_method("majority", {"k": 8, "online_stop": True, "warmup": 2, "confidence_window": 64})
    count = calls_per_problem(method)
    assert count.exact and count.total == 8 and count.fewest is None
    assert count.stoppable == {"solution": 6} and count.stoppable_tokens == 64
    point = estimate_point("mv", method, Settings(), 1, TokenRates(default_completion=600))
    assert (point.fewest_completion_tokens, point.completion_tokens) == (1584, 4800)
    text = format_estimate(Estimate([point]))
    assert "1.6k-4.8k" in text and "completion tokens: 1.6k to 4.8k" in text and "total: 8 calls" in text
    assert "online_stop: the samples after the first 2 may stop once 64 tokens arrived (DeepConf)" in text
    # Warm-up samples never stop: with warmup >= k nothing is watched, and the estimate is a point.
    assert calls_per_problem(create_method("majority", {"k": 8, "online_stop": True})).stoppable is None


def test_online_stop_with_the_beta_stop_ends_a_round_where_the_warm_up_does() -> None:
    # Rounds of 4 with 3 warm-up samples end at 3, 7, 11, ...: four agreeing votes first come after 7 samples,
    # 3 warm-up (600 each) and 4 watched (64 each at the fewest): 1,800 + 256 = 2,056.
    params = {"k": 16, "stop": "beta", "round_size": 4, "online_stop": True, "warmup": 3, "confidence_window": 64}
    method = create_method("majority", params)
    count = calls_per_problem(method)
    assert count.fewest == {"solution": 7} and count.stoppable == {"solution": 4} and count.upper_total == 16
    point = estimate_point("mv", method, Settings(), 1, TokenRates(default_completion=600))
    assert (point.fewest_completion_tokens, point.completion_tokens) == (2056, 9600)


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("tmas", {"preset": "local"}),
        ("majority", {"k": 16, "stop": "beta", "round_size": 4}),
        ("majority", {"k": 16, "stop": "beta", "round_size": 4, "online_stop": True, "warmup": 3}),
    ],
)
async def test_a_settled_run_sends_the_fewest_calls(method: str, params: dict[str, Any]) -> None:
    # The simulator's script answers every sample right, and here its verifier passes them all: each problem stops
    # as early as it can.
    passed = Rule(role="verifier", replies=["## Analysis\nEvery step checks out.\n\n## Score\nScore: 1"])
    results, model = await run_scripted_problems(method, PROBLEMS, [passed], **params)
    fewest = calls_per_problem(create_method(method, params)).fewest
    assert all(r.stopped_reason is not None for r in results)
    assert fewest is not None and by_role(model) == {role: n * len(PROBLEMS) for role, n in fewest.items()}


@pytest.mark.parametrize(
    ("method", "params", "expected"),
    [
        ("cot", {}, {"solution": 1}),
        # MV@64: 64 samples, one iteration.
        ("majority", {"k": 64, "iterations": 1}, {"solution": 64}),
        # 8 trajectories: 8 first solutions, then 8 refinements in each of 19 later iterations = 160.
        ("self_refine", {"n": 8, "iterations": 20}, {"solution": 8, "refiner": 152}),
        # 8 x 20 solutions (8 fresh, 152 corrected) and one verification each: 320.
        ("verify_refine", {"n": 8, "m": 1, "iterations": 20}, {"solution": 8, "corrector": 152, "verifier": 160}),
        # 8 responses x 20 rounds + 1 synthesis = 161.
        ("pacore", {"responses_per_round": 8, "iterations": 20}, {"solution": 160, "synthesis": 1}),
        # 8 x 20 samples, 8 x 19 distillations (the last iteration is not distilled) = 312.
        ("rse", {"n": 8, "iterations": 20}, {"solution": 160, "distiller": 152}),
        # 3 specialists, 3 rounds: recruit + decision, 3 opinions and 3 x 2 reviews a round: 2 + 9 + 18 = 29.
        ("mattrl", {"team_size": 3, "iterations": 3}, {"coordinator": 2, "specialist": 9, "reviewer": 18}),
        # Medicine: the same opinions; 3 x 2 critiques in each round but the last (A.4: none to feed): 2 + 9 + 12.
        (
            "mattrl",
            {"team_size": 3, "iterations": 3, "domain": "medicine"},
            {"coordinator": 2, "specialist": 9, "reviewer": 12},
        ),
        # Education, one teacher, 2 rounds: pre-test, 2 replies, post-test (student 4); 2 questions + guidance (3).
        ("mattrl", {"domain": "education", "teaching": "single", "iterations": 2}, {"student": 4, "specialist": 3}),
    ],
)
def test_calls_per_problem_by_hand(method: str, params: dict[str, Any], expected: dict[str, int]) -> None:
    assert count(method, **params) == expected


def test_mattrl_upper_bound_counts_retries() -> None:
    # retries = 1: recruit twice, decision and its rewrite (4); 9 opinions; 18 reviews, each possibly twice (36).
    c = calls_per_problem(create_method("mattrl", {"team_size": 3, "iterations": 3, "retries": 1}))
    assert not c.exact
    assert c.upper == {"coordinator": 4, "specialist": 9, "reviewer": 36} and c.upper_total == 49
    # The fewest: a team of one converged after its first opinion (recruit, opinion, decision); a right pre-test.
    assert c.fewest_total == 3
    teaching = calls_per_problem(create_method("mattrl", {"domain": "education", "iterations": 2}))
    assert teaching.fewest_total == 1


PROBLEMS = [Problem(problem_id=f"p{i}", question=f"What is {i + 3}*7?", answer=str((i + 3) * 7)) for i in range(2)]


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("cot", {}),
        ("majority", {"k": 3, "iterations": 2}),
        ("self_refine", {"n": 2, "iterations": 3}),
        ("verify_refine", {"n": 2, "m": 2, "iterations": 2}),
        ("pacore", {"responses_per_round": 2, "iterations": 2}),
        ("rse", {"n": 2, "iterations": 3}),
        ("tmas", {"n": 2, "m": 2, "iterations": 2}),
        ("tmas", {"n": 3, "m": 1, "iterations": 2, "no_guideline": True}),
    ],
)
async def test_estimate_equals_a_runs_calls(method: str, params: dict[str, Any]) -> None:
    results, model = await run_scripted_problems(method, PROBLEMS, **params)
    assert [r.status for r in results] == ["done"] * len(PROBLEMS)
    expected = calls_per_problem(create_method(method, params)).expected
    # Exactly those chat calls (RSE's embedding requests are not chat calls), and as many as each result counts.
    assert by_role(model) == {role: n * len(PROBLEMS) for role, n in expected.items()}
    assert [r.calls for r in results] == [sum(expected.values())] * len(PROBLEMS)


@pytest.mark.parametrize("method", sorted(METHODS))
async def test_every_registered_method_is_estimated_as_it_runs(method: str) -> None:
    """Each method with its own example parameters: an exact count equals the calls a run sends; a range holds
    them."""
    params = METHODS[method].example_params
    if params is None:
        pytest.skip(f"{method} declares no example_params")
    results, model = await run_scripted_problems(method, PROBLEMS, **params)
    sent = by_role(model)
    assert [r.status for r in results] == ["done"] * len(PROBLEMS) and sent
    count = calls_per_problem(create_method(method, params))
    if count.exact:
        assert sent == {role: n * len(PROBLEMS) for role, n in count.expected.items()}
    else:
        assert all(sent[role] <= count.upper.get(role, 0) * len(PROBLEMS) for role in sent), (sent, count.upper)


async def test_mattrl_run_stays_within_its_upper_bound() -> None:
    params = {"team_size": 2, "iterations": 2}
    _, model = await run_scripted_problems("mattrl", PROBLEMS[:1], **params)
    sent = by_role(model)
    bound = calls_per_problem(create_method("mattrl", params)).upper
    assert sent and all(sent[role] <= bound.get(role, 0) for role in sent)


def test_tokens_from_pilot_rates_by_role_and_hours() -> None:
    # A pilot measured 1,000 completion tokens per solution call and 200 per verifier call (others: the mean).
    costs = [
        {
            "solution": {"calls": 4, "failed": 0, "prompt_tokens": 400, "completion_tokens": 4000},
            "verifier": {"calls": 6, "failed": 0, "prompt_tokens": 1200, "completion_tokens": 1200},
        }
    ]
    rates = rates_from_role_costs(costs, wall_s=10.0)
    assert rates.completion == {"solution": 1000.0, "verifier": 200.0}
    assert rates.default_completion == 520.0  # 5,200 tokens over 10 calls
    assert rates.throughput == 520.0  # tokens per second over the pilot's wall time
    # verify_refine n=2, m=1, T=1 on 10 problems: 2 solutions (2,000) + 2 verifications (400) = 2,400 per problem.
    method = create_method("verify_refine", {"n": 2, "m": 1, "iterations": 1})
    point = estimate_point("vr", method, Settings(), 10, rates)
    assert point.completion_tokens == 24_000 and point.basis == "pilot"
    estimate = Estimate([point], rates, throughput=2.0)
    assert estimate.hours == pytest.approx(24_000 / 2.0 / 3600)
    assert "3.3 hours" in format_estimate(estimate)


def test_max_tokens_gives_a_ceiling_without_rates() -> None:
    # TMAS N = M = 8, T = 20, 1 problem, every call at max_tokens = 1000: 1,640 calls less the last iteration's 8
    # summaries and 2 memory updates = 1,630 calls; with every reply asked again (160 solutions once, the 152 after
    # the first iteration reminded once more, 152 summaries and 2 x 19 memory updates once) 2,132 -> 2.132M at most.
    settings = Settings.model_validate({"sampling": {"max_tokens": 1000}})
    tmas = create_method("tmas", {"n": 8, "m": 8, "iterations": 20})
    point = estimate_point("tmas", tmas, settings, 1, None)
    assert point.upper_calls == 1630 and point.most_calls == 2132
    assert point.basis == "max_tokens" and point.completion_tokens == 2_132_000
    given = estimate_point("tmas", tmas, settings, 1, TokenRates(default_completion=10))
    assert given.completion_tokens == 16_300 and given.basis == "given"


def test_threshold() -> None:
    point = estimate_point("tmas", create_method("tmas", {"preset": "paper"}), Settings(), 100, None)
    estimate = Estimate([point])
    # 1,640 calls a problem, and at most 360 more asked again (the paper's setting reminds no answer): 2,000.
    assert estimate.over(200_000, None) is None
    assert estimate.over(100_000, None) == "200,000 calls (threshold 100,000)"


def test_a_resume_is_gated_on_what_it_has_still_to_send() -> None:
    # Majority k = 4 on 10 problems, max_tokens 100: 40 calls, 80 with every sample asked again once, 8,000
    # completion tokens at most. With 30 answered calls stored, 50 are still to send at most, and 5/8 of the tokens.
    settings = Settings.model_validate({"sampling": {"max_tokens": 100}})
    estimate = Estimate([estimate_point("mv", create_method("majority", {"k": 4}), settings, 10, None)])
    estimate.stored_calls = 30
    assert (estimate.calls_to_send, estimate.tokens_to_send) == (50, 5000.0)
    assert estimate.over(50, None) is None and estimate.over(5, None) == "50 calls (threshold 5)"
    assert estimate.over(None, 5000) is None and estimate.over(None, 500) == "5.0k completion tokens (threshold 500)"
    assert brief_estimate(estimate) == (
        "up to 50 calls to send (30 stored, replayed), <=5.0k completion tokens (an attempt cut part way and"
        " retried adds what it had generated)"
    )
    assert "stored: 30 answered calls, replayed rather than sent; at most 50 still to send" in format_estimate(estimate)


async def test_a_problem_that_stored_more_calls_takes_nothing_off_another_ones_calls_to_send(
    sim: SimServer, tmp_path: Path
) -> None:
    # Majority k = 4 on 3 problems: q0 answers its 4 samples, every call of q1 and q2 fails.
    problems = [Problem(problem_id=f"q{i}", question=f"What is {i + 2}*7?", answer=str((i + 2) * 7)) for i in range(3)]
    settings = settings_for(sim, method={"name": "majority", "params": {"k": 4}}, retry={"max_attempts": 1})
    sim.set_script(SimScript(rules=[Rule(pattern=r"What is [34]\*7", fault="http_500")]))
    store, settings, todo = prepare_run(tmp_path / "run", settings, problems, resume=False)
    with store:
        await run_problems(settings, todo, store)
    sim.reset()
    sim.set_script(SimScript())
    # Resumed with k = 2: q0 replays 2 of its 4 stored samples, and q1 and q2 send 2 each: 4 calls, 10 at most with
    # every sample asked again (q0's 2 replayed samples' retries among them). Its 4 stored calls taken off the 12 of
    # the whole run would say 8.
    with pytest.raises(InputError, match=r"the estimate is 10 calls \(threshold 3\): up to 10 calls to send \(2 st"):
        await aresume(tmp_path / "run", params={"k": 2}, max_calls=3)
    assert sim.chat_bodies() == []
    await aresume(tmp_path / "run", params={"k": 2}, max_calls=10)
    assert len(sim.chat_bodies()) == 4


def test_the_brief_estimate_of_a_bounded_count_holds_replies_asked_again() -> None:
    # MATTRL's default count is a bound (its retries of unusable replies): 2 problems, 98 calls at most by its
    # structure; its 9 opinions and its decision may each be asked again once: 118 at most. Resumed with 8 stored,
    # 110 are still to send at most.
    point = estimate_point("m", create_method("mattrl", {}), Settings(), 2, None)
    estimate = Estimate([point])
    assert brief_estimate(estimate).startswith("6 to 98 calls (118 at most, with replies asked again), <=")
    estimate.stored_calls = 8
    assert (estimate.calls, estimate.upper_calls, estimate.most_calls, estimate.calls_to_send) == (58, 98, 118, 110)
    assert brief_estimate(estimate).startswith("up to 110 calls to send (8 stored, replayed), <=")


async def test_the_brief_estimate_of_an_exact_count_holds_replies_asked_again(sim: SimServer, tmp_path: Path) -> None:
    # CoT is one call a problem, max_tokens (256 here) of completion. A reply that is nothing but its prompt's
    # instructions is asked again: the problem sends 2 calls, twice the tokens, the most the line says.
    settings = settings_for(sim, method={"name": "cot", "params": {}})
    problem = [Problem(problem_id="q0", question="What is 2*7?", answer="14")]
    store, settings, todo = prepare_run(tmp_path / "probe", settings, problem, resume=False)
    with store:
        await run_problems(settings, todo, store)
    messages = sim.chat_bodies()[0]["messages"]
    instructions = re.sub(r"^<(\w+)>\n.*?^</\1>$", "", "\n".join(m["content"] for m in messages), flags=re.M | re.S)
    sim.reset()
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=[instructions], times=1)]))
    store, settings, todo = prepare_run(tmp_path / "run", settings, problem, resume=False)
    with store:
        summary = await run_problems(settings, todo, store)
    assert len(sim.chat_bodies()) == summary.calls == 2
    estimate = Estimate([estimate_point("cot", create_method("cot", {}), settings, 1, None)])
    assert (estimate.upper_calls, estimate.most_calls) == (1, 2)
    # The one line the command prints before it starts says the most the run sends, calls and tokens.
    assert brief_estimate(estimate) == (
        "1 call (2 at most, with replies asked again), <=512 completion tokens (an attempt cut part way and"
        " retried adds what it had generated)"
    )


def test_the_whole_estimate_says_the_most_with_replies_asked_again() -> None:
    # verify_refine states an exact count, 8 calls, but its 2 solutions and 2 corrections may repeat their
    # instructions and be asked again, and a correction with no answer is reminded once more: 14 at most.
    point = estimate_point("vr", create_method("verify_refine", {"n": 2, "m": 1, "iterations": 2}), Settings(), 1, None)
    shown = format_estimate(Estimate([point]))
    assert "total: 8 calls\n" in shown
    assert "  at most: 14 calls with every reply asked again as often as it can be (one that repeats its" in shown


def test_one_question_runs_tmas_quick_preset_where_no_parameter_is_given() -> None:
    # N = 4, M = 2, T = 3: an iteration is 4 solutions, 8 verifications, 4 summaries and 2 memory updates (18 calls),
    # the last one without its summaries and memory updates (12): 48 at most; a first iteration that settles: 16.
    count = create_method("tmas", question_params("tmas", {})).calls_per_problem()
    assert (count.fewest_total, count.upper_total) == (16, 48)
    assert question_params("tmas", {"n": 2}) == {"n": 2}  # given parameters are run as given
    assert question_params("majority", {}) == {}


def tmas_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    # stdin is a pipe, never a terminal: the confirmation gate must fail rather than wait.
    return run_tmas(*args, cwd=cwd, timeout=120)


def write_problems(path: Path, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"problem_id": f"q{i}", "question": f"What is {i}*3?", "answer": str(3 * i)}) + "\n"
            for i in range(n)
        )
    )
    return path


@pytest.mark.slow
def test_sweep_dry_run_prints_the_estimate_and_sends_nothing(sim: SimServer, tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl", 100)
    out = tmas_cli(
        "sweep", "--method", "tmas", "--param", "preset=paper", "--problems", str(problems),
        "--out", str(tmp_path / "sw"), "--base-url", sim.base_url, "--dry-run", "--throughput", "1000",
        "--max-tokens", "1000",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()
    err = out.stderr.decode()
    assert "total: 164,000 calls" in err and "at most: 200,000 calls" in err
    assert "200M" in err and "hours" in err
    assert sim.stats().total_requests == 0
    assert not (tmp_path / "sw" / "runs").exists()


@pytest.mark.slow
def test_a_sweep_run_again_is_gated_on_the_calls_its_unfinished_points_send(sim: SimServer, tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl", 2)
    base = ["sweep", "--method", "majority", "--problems", str(problems), "--out", str(tmp_path / "sw")]
    base += ["--base-url", sim.base_url, "--no-report"]
    first = tmas_cli(*base, "--grid", "k=2,4", "--yes")
    assert first.returncode == 0, first.stderr.decode()
    assert sim.stats().total_requests == 12
    sim.reset()
    # Again with a third point: k = 2 and k = 4 are finished and skipped (no problem left to solve), k = 8 sends
    # 2 x 8 = 16 calls, 32 with every sample asked again. The whole grid's 56 at most are over the threshold of 40;
    # the 32 still to send are not.
    again = tmas_cli(*base, "--grid", "k=2,4,8", "--confirm-calls", "40")
    assert again.returncode == 0, again.stderr.decode()
    assert "tmas: estimate: 16 calls (32 at most, with replies asked again)" in again.stderr.decode()
    assert sim.stats().total_requests == 16


@pytest.mark.slow
def test_a_resumed_sweep_counts_only_the_problems_its_points_have_still_to_solve(
    sim: SimServer, tmp_path: Path
) -> None:
    import sqlite3

    problems = write_problems(tmp_path / "p.jsonl", 2)
    out = tmp_path / "sw"
    made = ["sweep", "--method", "majority", "--grid", "k=2,3", "--problems", str(problems), "--out", str(out)]
    first = tmas_cli(*made, "--base-url", sim.base_url, "--no-report", "--yes")
    assert first.returncode == 0, first.stderr.decode()
    # Stopped after k = 3's calls for q1, before its result: k = 2 is finished and q0 of k = 3 too, both skipped.
    with sqlite3.connect(out / "runs" / "majority__k=3" / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'q1'")
    sim.reset()
    # k = 3 solves q1 alone: 3 samples, 6 with each asked again, its 3 stored calls replayed: 3 still to send. Over
    # both problems of both points it would be 4 + 12 at most, less k = 2's 4 + 4 and k = 3's 6 stored: 6 to send.
    table = tmas_cli("sweep", "--resume", str(out), "--no-report", "--dry-run")
    assert table.returncode == 0, table.stderr.decode()
    rows = {line.split()[0]: line.split()[1:4] for line in table.stderr.decode().splitlines() if "majority__" in line}
    assert rows == {"majority__k=2": ["0", "2", "0"], "majority__k=3": ["1", "3", "3"]}
    assert "stored: 3 answered calls, replayed rather than sent; at most 3 still to send" in table.stderr.decode()
    # Under a threshold of 5 it starts without asking, and replays q1's calls rather than sending them.
    again = tmas_cli("sweep", "--resume", str(out), "--no-report", "--confirm-calls", "5")
    assert again.returncode == 0, again.stderr.decode()
    assert "tmas: estimate: up to 3 calls to send (3 stored, replayed)" in again.stderr.decode()
    assert sim.chat_bodies() == []
    with RunStore(out / "runs" / "majority__k=3", create=False) as store:
        assert sorted(r.problem_id for r in store.results()) == ["q0", "q1"]


@pytest.mark.slow
def test_a_sweep_run_again_pilots_only_the_points_it_has_still_to_run(sim: SimServer, tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl", 2)
    base = ["sweep", "--method", "majority", "--problems", str(problems), "--out", str(tmp_path / "sw")]
    base += ["--base-url", sim.base_url, "--no-report", "--yes"]
    first = tmas_cli(*base, "--grid", "k=2")
    assert first.returncode == 0, first.stderr.decode()
    sim.reset()
    # k = 2 is finished and skipped: the pilot runs k = 3 alone on q0 (3 samples), then k = 3 runs (6 more).
    again = tmas_cli(*base, "--grid", "k=2,3", "--pilot", "1")
    assert again.returncode == 0, again.stderr.decode()
    assert f"tmas: pilot: 1 configuration(s) on 1 problem(s) into {tmp_path / 'sw' / 'pilot'}" in again.stderr.decode()
    assert sorted(path.name for path in (tmp_path / "sw" / "pilot").iterdir()) == ["majority__k=3"]
    assert len(sim.chat_bodies()) == 3 + 6


@pytest.mark.slow
def test_eval_over_the_threshold_without_a_terminal_asks_for_yes(sim: SimServer, tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl", 3)
    base = ["eval", str(problems), "--out", str(tmp_path / "run"), "--base-url", sim.base_url, "--grade", "rules"]
    out = tmas_cli(*base, "--method", "majority", "-p", "k=4", "--confirm-calls", "5")
    assert out.returncode != 0
    last = out.stderr.decode().strip().splitlines()[-1]
    why = "the estimate is 24 calls (threshold 5)"  # 12 samples, each of which may be asked again
    said = "pass --yes to start it without a terminal to confirm on (or --confirm-calls N, --dry-run to see it whole)"
    assert last == f"tmas: error: {why}: {said}"
    assert sim.stats().total_requests == 0
    ok = tmas_cli(*base, "--method", "majority", "-p", "k=4", "--confirm-calls", "5", "--yes")
    assert ok.returncode == 0, ok.stderr.decode()
    # 3 problems x 4 samples, as estimated (none asked again).
    with RunStore(tmp_path / "run", create=False) as store:
        assert store.call_counts()["calls"] == 12


@pytest.mark.slow
def test_eval_says_its_estimate_leaves_out_the_judges_calls(sim: SimServer, tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl", 2)
    base = ["eval", str(problems), "--out", str(tmp_path / "run"), "--base-url", sim.base_url, "--method", "majority"]
    out = tmas_cli(*base, "-p", "k=2", "--grade", "judge", "--judge-runs", "2")
    assert out.returncode == 0, out.stderr.decode()
    # 2 problems x 2 samples for the run; the report's judge asks 2 runs per distinct answer on top.
    roles = [r.role for r in sim.requests if r.endpoint == "chat"]
    assert roles.count("solution") == 4 and roles.count("judge") > 0
    said = next(line for line in out.stderr.decode().splitlines() if line.startswith("tmas: estimate: "))
    assert said.startswith("tmas: estimate: 4 calls (8 at most, with replies asked again), ")
    assert said.endswith(
        "; not counted: the report's judge calls, 2 per distinct answer (each unreadable reply asked again up to 2"
        " times; --grade rules sends none)"
    )


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--tokens-per-call", "nan", "--tokens-per-call must be a positive number"),
        ("--tokens-per-call", "inf", "--tokens-per-call must be a positive number"),
        ("--throughput", "nan", "--throughput must be a positive number"),
        ("--confirm-tokens", "nan", "--confirm-tokens must be a number of tokens, not nan"),
    ],
)
def test_a_nan_or_infinite_estimate_flag_is_refused_in_one_line(
    sim: SimServer, tmp_path: Path, flag: str, value: str, said: str
) -> None:
    # An estimate of nan tokens, or a threshold of nan, compares false: the token threshold would never ask.
    problems = write_problems(tmp_path / "p.jsonl", 2)
    out = tmas_cli("run", str(problems), "-o", str(tmp_path / "run"), "--base-url", sim.base_url, flag, value)
    assert out.returncode == 2
    assert out.stderr.decode().strip().splitlines() == [f"tmas: error: {said}"]
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()


def test_a_pilot_and_a_given_tokens_per_call_are_refused_together_before_any_call(
    sim: SimServer, tmp_path: Path
) -> None:
    # Both gave the tokens per call: the pilot's mean was used and --tokens-per-call dropped without a word, after
    # the pilot had sent its calls.
    problems = write_problems(tmp_path / "p.jsonl", 2)
    base = ["run", str(problems), "-o", str(tmp_path / "run"), "--base-url", sim.base_url, "-m", "cot", "--dry-run"]
    out = tmas_cli(*base, "--pilot", "1", "--tokens-per-call", "1000")
    assert out.returncode == 2
    assert out.stderr.decode().strip().splitlines() == [
        "tmas: error: --pilot measures the tokens per call that --tokens-per-call gives: give one of them"
    ]
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()
    # Either alone is taken: the given mean, 1,000 tokens for each of the 2 calls.
    out = tmas_cli(*base, "--tokens-per-call", "1000")
    assert out.returncode == 0 and "completion tokens: 2.0k (the given tokens per call)" in out.stderr.decode()


def test_a_pilot_over_the_threshold_asks_before_it_sends(sim: SimServer, tmp_path: Path) -> None:
    # The pilot of MV@64 on 2 problems is 128 calls, 256 at most: over --confirm-calls 50 it is refused before any
    # call, as the run it measures would be, rather than sent and the run refused after it.
    problems = write_problems(tmp_path / "p.jsonl", 10)
    base = ["run", str(problems), "--out", str(tmp_path / "run"), "--base-url", sim.base_url, "--method", "majority"]
    base += ["-p", "k=64", "--pilot", "2", "--confirm-calls", "50", "--dry-run"]
    out = tmas_cli(*base)
    assert out.returncode == 2
    err = out.stderr.decode()
    assert "the pilot's cost estimate:" in err and "total: 128 calls" in err
    assert err.strip().splitlines()[-1] == (
        "tmas: error: the pilot is 256 calls (threshold 50): pass --yes to start it without a terminal to confirm on"
        " (or a smaller --pilot N, --confirm-calls N)"
    )
    assert sim.stats().total_requests == 0 and not (tmp_path / "run" / "pilot").exists()
    # With --yes the pilot runs (and the dry run stops after it): its 128 calls, none asked again.
    ran = tmas_cli(*base, "--yes")
    assert ran.returncode == 0, ran.stderr.decode()
    assert sim.stats().total_requests == 128


def test_run_dry_run_with_a_pilot_measures_tokens(sim: SimServer, tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl", 10)
    out = tmas_cli(
        "run", str(problems), "--out", str(tmp_path / "run"), "--base-url", sim.base_url, "--method", "tmas",
        "-p", "n=2", "-p", "m=1", "-T", "3", "--dry-run", "--pilot", "1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()
    err = out.stderr.decode()
    # 3 x (2 x 3 + 2) - 4 = 20 calls per problem (the last iteration has no summaries or memory updates), 200 in
    # all; the pilot ran 2 iterations of 1 problem: 8 + 4 = 12 calls.
    assert "total: 200 calls" in err and "measured by the pilot" in err
    with RunStore(tmp_path / "run" / "pilot" / "run", create=False) as pilot:
        assert pilot.call_counts()["calls"] == 12
    assert not (tmp_path / "run" / "run.sqlite").exists()


def test_budgets_cap_the_estimate() -> None:
    # V-R at the paper's setting is 320 calls a problem; a call budget of 100 stops each problem there.
    method = create_method("verify_refine", {"n": 8, "m": 1, "iterations": 20})
    capped = Settings.model_validate({"budget": {"calls": 100}})
    point = estimate_point("vr", method, capped, 10, TokenRates(default_completion=10))
    assert point.total_calls == 1000 and point.completion_tokens == 10_000  # 100 calls x 10 tokens x 10 problems
    assert not point.calls.exact and "call budget" in point.calls.note
    # As a ceiling, every call at max_tokens (2,048 by default): the 100 calls the budget lets a problem send, replies
    # asked again among them.
    ceiling = estimate_point("vr", method, capped, 10, None)
    assert ceiling.most_calls == 1000 and ceiling.completion_tokens == 10 * 100 * 2048
    # A completion-token budget of 500 a problem: with measured rates, 320 calls x 10 tokens = 3,200 would pass it,
    # and the estimate stops at the budget and the one call (10 tokens) that may pass it.
    tokens = Settings.model_validate({"budget": {"tokens": 500}})
    point = estimate_point("vr", method, tokens, 10, TokenRates(default_completion=10))
    assert point.completion_tokens == 10 * (500 + 10) and "token budget" in point.calls.note
    # As a ceiling (every call at max_tokens, 2,048 by default): the budget plus the one call that may pass it.
    point = estimate_point("vr", method, tokens, 10, None)
    assert point.completion_tokens == 10 * (500 + 2048) and point.basis == "max_tokens"


def test_a_budget_of_prompt_and_completion_tokens_caps_the_estimates_completion_tokens() -> None:
    # V-R at the paper's setting, 320 calls a problem, on 10 problems under 500 prompt + completion tokens a problem.
    # A problem's completion tokens are no more than what the budget counts: as a ceiling (max_tokens 2,048 by
    # default) the budget plus the one call that may pass it, 10 x (500 + 2,048), as under a completion budget, where
    # the count of prompts left the estimate at every call's max_tokens (10 x 2,048 x 320 at the least).
    method = create_method("verify_refine", {"n": 8, "m": 1, "iterations": 20})
    total = Settings.model_validate({"budget": {"tokens": 500, "count": "total"}})
    point = estimate_point("vr", method, total, 10, None)
    assert point.completion_tokens == 10 * (500 + 2048) and point.problem_cap == 500 + 2048
    assert "the token budget stops each problem near 500 prompt + completion tokens" in point.calls.note
    assert "), <=25k completion tokens (an attempt cut" in brief_estimate(Estimate([point]))
    # At a mean of 10 completion and 30 prompt tokens a call, a problem's 320 calls would spend 3,200 + 9,600; the
    # budget stops it at 500 and the one call (40) that may pass it, of which the completion tokens are their share:
    # 540 x 3,200 / 12,800 = 135.
    point = estimate_point("vr", method, total, 10, TokenRates(default_completion=10, default_prompt=30))
    assert point.completion_tokens == 10 * 135
    assert "), ~1.4k completion tokens" in brief_estimate(Estimate([point]))
    # Under what the calls spend, nothing is cut: at 1 prompt token a call, 320 x 11 = 3,520 of a budget of 4,000.
    wide = Settings.model_validate({"budget": {"tokens": 4000, "count": "total"}})
    point = estimate_point("vr", method, wide, 10, TokenRates(default_completion=10, default_prompt=1))
    assert point.completion_tokens == 10 * 3200 and "token budget" not in point.calls.note


def test_a_refinement_that_may_go_out_as_a_solution_counts_at_the_dearer_max_tokens() -> None:
    # Self-Refine N = 2, T = 3: 2 solutions and 4 refinements, each asked at most twice, a refinement three times. A
    # trajectory starting afresh sends a solution (twice at most) in a refinement's place. Solutions at 100 tokens,
    # refinements at 1,000: 2 x 2 x 100 + 4 x 3 x 1,000 = 12,400 (a solution in their place is cheaper).
    method = create_method("self_refine", {"n": 2, "iterations": 3})

    def ceiling(solution: int, refiner: int) -> float | None:
        roles = {"solution": {"sampling": {"max_tokens": solution}}, "refiner": {"sampling": {"max_tokens": refiner}}}
        return estimate_point("sr", method, Settings.model_validate({"roles": roles}), 1, None).completion_tokens

    assert ceiling(100, 1000) == 12_400
    # Solutions at 1,000, refinements at 100: 2 x 2 x 1,000 + 4 places x max(3 x 100, 2 x 1,000) = 12,000.
    assert ceiling(1000, 100) == 12_000


def test_max_tokens_per_role_follow_what_tmas_sends() -> None:
    # The local preset asks 640 tokens for solutions and 400 for verifications where the user set no max_tokens...
    local = create_method("tmas", {"preset": "local"})
    assert role_max_tokens(Settings(), local, "solution") == 640
    assert role_max_tokens(Settings(), local, "verifier") == 400
    # ... and a max_tokens the user set wins over the preset's, as on the wire.
    assert role_max_tokens(Settings.model_validate({"sampling": {"max_tokens": 900}}), local, "solution") == 900


async def test_a_pilot_measures_tokens_per_role_and_a_second_one_resumes_it(tmp_path: Path) -> None:
    # Solutions report 40 completion tokens on 30 prompt tokens, verifications 10 on 50: the pilot's means by role.
    rules = [
        Rule(role="solution", usage=ScriptedUsage(prompt_tokens=30, completion_tokens=40)),
        Rule(role="verifier", usage=ScriptedUsage(prompt_tokens=50, completion_tokens=10)),
    ]
    settings = scripted_settings(method={"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 3}})
    problems = [Problem(problem_id="p0", question="What is 2*7?", answer="14")]
    model = ScriptedModel(SimScript(rules=rules), settings)
    rates = await run_pilot([("tmas", settings)], problems, tmp_path / "pilot", model=model)
    # Two iterations of the three: 8 + 4 = 12 calls, 8 of them solutions or verifications.
    assert len(model.calls) == 12 and (by_role(model)["solution"], by_role(model)["verifier"]) == (4, 4)
    assert rates.source == "pilot"
    assert (rates.completion["solution"], rates.prompt["solution"]) == (40, 30)
    assert (rates.completion["verifier"], rates.prompt["verifier"]) == (10, 50)
    with RunStore(tmp_path / "pilot" / "tmas", create=False) as store:
        assert store.get_meta("method")["params"]["iterations"] == 2
        assert store.call_counts()["calls"] == 12
    # A second pilot resumes the first: no call, the same rates, and no throughput from replayed calls.
    again = ScriptedModel(SimScript(rules=rules), settings)
    resumed = await run_pilot([("tmas", settings)], problems, tmp_path / "pilot", model=again)
    assert again.calls == [] and resumed.throughput is None
    assert (resumed.completion, resumed.prompt) == (rates.completion, rates.prompt)


def test_one_call_is_said_in_the_singular() -> None:
    # Chain of thought on one problem: one call; the same resumed with it stored: none to send, one stored.
    estimate = Estimate([estimate_point("cot", create_method("cot", {}), Settings(), 1, None)])
    assert brief_estimate(estimate).startswith("1 call (2 at most, with replies asked again), <=")
    assert "  total: 1 call\n" in format_estimate(estimate) and estimate.over(2, None) is None
    estimate.stored_calls = 1
    assert brief_estimate(estimate).startswith("up to 1 call to send (1 stored, replayed)")
    assert "stored: 1 answered call, replayed rather than sent; at most 1 still to send" in format_estimate(estimate)
    assert estimate.over(0, None) == "1 call (threshold 0)"
    estimate.stored_calls = 2
    assert brief_estimate(estimate).startswith("up to 0 calls to send (2 stored, replayed)")
    budget = Settings.model_validate({"budget": {"calls": 1}})
    capped = estimate_point("mv", create_method("majority", {"k": 4}), budget, 1, None)
    assert capped.calls.note is not None and capped.calls.note.endswith("the call budget stops each problem at 1 call")
