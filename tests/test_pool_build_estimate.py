"""``tmas pool build``'s cost estimate (tmas.planning.pool_build): its figures worked by hand from the runs'
transcripts, read without a call."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import scripted_settings, settings_for
from mattrl_runs import hand_worked_transcript, write_run
from test_pool_build import scripted_rules
from tmas.planning.estimate import brief_estimate
from tmas.planning.pool_build import estimate_build
from tmas.pool.build import BuildConfig, build_pool
from tmas.problems import Problem
from tmas.testing import ScriptedModel, SimScript, SimServer

TURNS = hand_worked_transcript()


def _runs(tmp_path: Path) -> list[Path]:
    """Two runs: one with two solved cases and an unlabelled one, one with a single case (5 turns each)."""
    a, b = (Problem(problem_id=p, question=f"What is 6*7 ({p})?", answer="42") for p in ("p1", "p2"))
    unlabelled = Problem(problem_id="p3", question="What is 6*8?")
    first = write_run(
        tmp_path / "first",
        [(a, hand_worked_transcript("p1"), "42"), (b, hand_worked_transcript("p2"), "41"), (unlabelled, None, None)],
    )
    second = write_run(tmp_path / "second", [(a, hand_worked_transcript("p1"), "42")])
    return [first, second]


def test_the_estimate_counts_each_turns_judge_and_summarizer_calls(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    settings = scripted_settings()
    # Naive credit, no retries: one score per turn, 3 cases x 5 turns = 15; the top 0.3 of the 15 turns pooled over
    # every case keeps ceil(4.5) = 5, all 15 where rewards tie.
    naive = estimate_build(runs, tmp_path / "pool", settings, BuildConfig(retries=0, quantile=0.3))
    assert [(p.calls.expected, p.calls.upper) for p in naive.points] == [
        ({"judge": 15}, {"judge": 15}),
        ({"summarizer": 5}, {"summarizer": 15}),
    ]
    assert (naive.calls, naive.upper_calls, naive.stored_calls) == (20, 30, 0)
    # A reply asked again (an unusable score, a summary echoing its instructions) is one of the retries, in the
    # upper counts: the gate's line says no calls come beside them.
    assert naive.most_calls == naive.upper_calls
    assert "asked again the method does not count" not in brief_estimate(naive)
    # The difference scheme adds per case 4 + 3 coalitions (the whole team and each one-out team of turns 1 and 2):
    # 15 + 3 x 7 = 36 judge calls; one retry doubles each bound, and tau keeps anywhere from none to every turn.
    diff = estimate_build(runs, tmp_path / "pool", settings, BuildConfig(scheme="difference", retries=1, tau=0.5))
    assert [(p.calls.total, p.calls.upper_total) for p in diff.points] == [(36, 72), (15, 30)]
    assert diff.upper_calls == 102
    # Every call at max_tokens, a ceiling: 102 calls of the settings' max_tokens each.
    ceiling = settings.sampling.max_tokens
    assert ceiling is not None and diff.completion_tokens == 102 * ceiling


async def test_stored_calls_count_as_replayed_only_for_the_same_runs_options_and_requests(tmp_path: Path) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    first = write_run(tmp_path / "first", [(problem, hand_worked_transcript(), "42")])
    # Another run of the same problem: its calls have the same problem id in the build's store.
    second = write_run(tmp_path / "second", [(problem, hand_worked_transcript(), "42")])
    pool = tmp_path / "pool"
    config = BuildConfig(scheme="difference", grade_mode="rules")
    model = ScriptedModel(SimScript(rules=scripted_rules()), scripted_settings())
    await build_pool([first], pool, model.settings, config, model=model)
    # 12 judge calls and 2 summaries answered (tests/test_pool_cli.py works the figures by hand), all stored.
    assert len(model.calls) == 14
    again = estimate_build([first], pool, model.settings, config)
    assert (again.upper_calls, again.stored_calls, again.calls_to_send) == (51, 14, 37)
    # The second run's calls are none of those stored, though its problem id is the same; nor does another scheme,
    # or another judge model, ask what was stored.
    assert estimate_build([second], pool, model.settings, config).stored_calls == 0
    assert estimate_build([first], pool, model.settings, config.model_copy(update={"lam": 0.5})).stored_calls == 0
    other = scripted_settings(roles={"judge": {"model": "another-judge"}})
    assert estimate_build([first], pool, other, config).stored_calls == 0


class _Stopped(Exception):
    """Stands for an interruption: raised as the build starts its summaries."""


def _stop_at_distil(stage: str, done: int, total: int) -> None:
    if stage == "distil":
        raise _Stopped


async def test_a_resumed_builds_token_ceiling_holds_the_max_tokens_its_requests_send(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [(Problem(problem_id="p1", question="What is 6*7?", answer="42"), TURNS, "42")])
    pool = tmp_path / "pool"
    config = BuildConfig(scheme="difference", grade_mode="rules", quantile=1.0, retries=0)
    with SimServer(SimScript(rules=scripted_rules())) as sim:
        roles = {"judge": {"sampling": {"max_tokens": 50}}, "summarizer": {"sampling": {"max_tokens": 4000}}}
        settings = settings_for(sim, roles=roles)
        fresh = estimate_build([run], pool, settings, config)
        # 12 judge calls at 50 and 5 summaries (every turn kept) at 4000.
        assert fresh.tokens_to_send == 12 * 50 + 5 * 4000
        with pytest.raises(_Stopped):
            await build_pool([run], pool, settings, config, progress=_stop_at_distil)
        stopped = len(sim.requests)
        resumed = estimate_build([run], pool, settings, config)
        await build_pool([run], pool, settings, config)
        sent = [r.body["max_tokens"] for r in sim.requests[stopped:] if r.endpoint == "chat"]
    # The judge's 12 calls are stored; the 5 summaries are what is left. Their share of the ceiling by calls was
    # 20,600 x 5 / 17, about 6,059 tokens, below the 20,000 the summaries ask.
    assert (resumed.stored_calls, resumed.calls_to_send) == (12, 5)
    assert sent == [4000] * 5
    assert resumed.tokens_to_send == sum(sent) == 20000
