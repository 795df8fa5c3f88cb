"""Online stopping of weak streamed traces (DeepConf's online mode, methods/online_stop.py): the threshold the warm-up
samples set and the watch, worked by hand; then majority vote against the simulated server: a sample whose streamed
log-probabilities fall below the threshold is cut (the server sees the client go, the stored call is marked stopped,
its partial text gives no answer, a resumed run replays it), a confident one runs to its end, and unstreamed calls
degrade with one notice; the warm-up samples' notices in process on the scripted model."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import scripted_settings, settings_for
from scripted_runs import run_scripted, solve_in_process
from test_settle import evaluation_of
from tmas.api import aresume, arun, asolve
from tmas.cli.main import app
from tmas.config import Sampling
from tmas.grading.run_results import load_results
from tmas.llm.client import LLMClient
from tmas.llm.types import TokenLogprob, TopLogprob, user
from tmas.llm.watch import UNWATCHED_NOTICE, WatchStop
from tmas.methods.base import ProblemResult
from tmas.methods.online_stop import (
    CONFIDENCE_STOP,
    ONLINE_STOP_NOTICE,
    SHORT_WARMUP_NOTICE,
    ConfidenceWatch,
    stopping_threshold,
)
from tmas.reports.analysis import stopping_summary
from tmas.reports.document import Document
from tmas.reports.report import _run_section
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript, SimServer
from tmas.testing.responders import count_tokens

Q = "What is 17*23?"


def position(confidence: float) -> dict[str, Any]:
    """A logprobs entry whose DeepConf token confidence is ``confidence``: the chosen token is certain and its one
    alternative has log-probability -2 x confidence (mean -confidence)."""
    alternatives = [{"token": "t", "logprob": 0.0}, {"token": "alt", "logprob": -2.0 * confidence}]
    return {"token": "t", "logprob": 0.0, "top_logprobs": alternatives}


def of(*confidences: float) -> list[TokenLogprob]:
    return [TokenLogprob.model_validate(position(c)) for c in confidences]


# ---------------------------------------------------------------------------------------------- by hand
def test_the_threshold_is_a_quantile_of_the_warm_up_lowest_groups() -> None:
    # Sorted 1..5; keep 0.9: position 0.1 x 4 = 0.4, so 1 + 0.4 x (2 - 1) = 1.4; keep 0.1: 3.6, so 4 + 0.6 = 4.6.
    assert stopping_threshold([4.0, 1.0, 5.0, 3.0, 2.0], 0.9) == pytest.approx(1.4)
    assert stopping_threshold([4.0, 1.0, 5.0, 3.0, 2.0], 0.1) == pytest.approx(4.6)
    assert stopping_threshold([4.0, 1.0, 5.0, 3.0, 2.0], 0.5) == 3.0
    # DeepConf-low's 90th percentile of 16 warm-up traces 1..16: position 13.5, between 14 and 15.
    assert stopping_threshold([float(v) for v in range(16, 0, -1)], 0.1) == pytest.approx(14.5)
    # Keeping every trace puts the threshold at the lowest; one trace is its own threshold.
    assert stopping_threshold([2.0, 3.0], 1.0) == 2.0 and stopping_threshold([2.5], 0.1) == 2.5
    with pytest.raises(ValueError, match="at least one warm-up trace"):
        stopping_threshold([], 0.9)


def test_the_watch_stops_at_the_first_group_below_the_threshold() -> None:
    watch = ConfidenceWatch(threshold=2.0, window=4)
    watch.begin()
    # Groups of 4: tokens 1-4 give 3, token 7 (3, 3, 3, 0.5) 2.375, token 8 (3, 3, 0.5, 0.5) 1.75 < 2: stop there.
    assert watch.observe(of(3.0, 3.0, 3.0)) is None
    assert watch.observe(of(3.0, 3.0, 3.0, 0.5)) is None
    stop = watch.observe(of(0.5, 0.5, 0.5))
    assert stop is not None and stop.finish_reason == CONFIDENCE_STOP
    assert stop.detail == "group confidence 1.750 of the last 4 tokens fell below the threshold 2.000 after 8 tokens"
    # A retried stream starts again: three weak tokens are no full window yet.
    watch.begin()
    assert watch.observe(of(0.1, 0.1, 0.1)) is None
    # A position listing one alternative says nothing of confidence and is skipped.
    lone = TokenLogprob(token="t", logprob=0.0, top_logprobs=[TopLogprob(token="t", logprob=0.0)])
    assert watch.observe([lone]) is None
    assert watch.observe(of(0.1)) is not None


# ---------------------------------------------------------------------------------------------- on the wire
class Recorder:
    """A watch that stops nothing and counts what it was told."""

    def __init__(self) -> None:
        self.began, self.begins, self.tokens = False, 0, 0

    def begin(self) -> None:
        self.began, self.begins, self.tokens = True, self.begins + 1, 0

    def observe(self, tokens: Sequence[TokenLogprob]) -> WatchStop | None:
        self.tokens += len(tokens)
        return None


async def test_a_retried_stream_is_watched_afresh(sim: SimServer) -> None:
    # The first stream is cut after its first delta; the retry's tokens are all the watch counts.
    sim.set_script(SimScript(rules=[Rule(fault="cut", times=1)], seed=3))
    watch = Recorder()
    async with LLMClient(settings_for(sim)) as llm:
        reply = await llm.chat("solution", [user(Q)], sampling=Sampling(extra_body={"logprobs": True}), watch=watch)
    assert reply.ok and reply.retry_causes == ["cut"] and reply.stopped_early is None
    assert reply.logprobs is not None and (watch.begins, watch.tokens) == (2, len(reply.logprobs))


def boxed(answer: str) -> str:
    return f"Working it out by hand.\n\n\\boxed{{{answer}}}"


WARM = boxed("391")
CONFIDENT = boxed("391")
# A weak trace that boxes a guess first: it is stopped after 8 tokens, when "\boxed{9} first guess," has arrived.
WEAK = "\\boxed{9} first guess, then a long check of every step that goes on and on and on " * 3 + "\\boxed{9}"
WEAK_PART = "\\boxed{9} first guess,"
WEAK_TOKENS = count_tokens(WEAK)


def script(**overrides: Any) -> SimScript:
    """Two warm-up samples at token confidence 2 (their lowest group: 2, so the threshold is 2 whatever the keep), a
    weak sample (6 tokens at 3, then 0.5: stopped at token 8) and a confident one at 3. Watched samples stream one
    token per delta, 0.01 s apart; the warm-up replies report 100 completion tokens each."""
    warm = ScriptedUsage(prompt_tokens=20, completion_tokens=100)
    weak = [position(3.0)] * 6 + [position(0.5)] * (WEAK_TOKENS - 6)
    rules = [
        Rule(
            role="solution",
            times=2,
            replies=[WARM],
            logprobs=[position(2.0)] * count_tokens(WARM),
            latency_s=0,
            usage=warm,
        ),
        Rule(role="solution", times=1, replies=[WEAK], logprobs=weak),
        Rule(role="solution", replies=[CONFIDENT], logprobs=[position(3.0)] * count_tokens(CONFIDENT)),
    ]
    return SimScript(**{"rules": rules, "latency_per_token_s": 0.01, **overrides})


PARAMS: dict[str, Any] = {"k": 4, "online_stop": True, "warmup": 2, "confidence_window": 4}


def settings(sim: SimServer, **params: Any) -> Any:
    return settings_for(sim, method={"name": "majority", "params": {**PARAMS, **params}}, endpoint__batch_samples="on")


async def server_saw(sim: SimServer, **expected: int) -> dict[str, int]:
    """The server's counters named in ``expected`` once they reach those values (or after 10 s, ample on a loaded
    machine): the server counts a stream once its handler ends, a moment after the client has read it or gone."""
    for _ in range(1000):
        stats = sim.stats()
        if all(getattr(stats, name) >= value for name, value in expected.items()):
            break
        await asyncio.sleep(0.01)
    return {name: getattr(sim.stats(), name) for name in expected}


def stopped_of(result: ProblemResult) -> list[Any]:
    return [c for r in result.iterations for c in r.candidates if c.meta.stopped_early]


async def test_a_weak_trace_is_cut_and_a_confident_one_runs_to_its_end(sim: SimServer, tmp_path: Path) -> None:
    assert WEAK_TOKENS > 50  # long enough to be still streaming when it is stopped
    sim.set_script(script())
    result = await asolve(Q, settings(sim), run_dir=tmp_path / "run")
    assert result.answer == "391"
    # The warm-up samples went together (n = 2) and ran unwatched; each watched sample went alone, streamed, asking
    # for log-probabilities.
    warm, *watched = sim.chat_bodies("solution")
    assert warm["n"] == 2 and len(watched) == 2
    for body in [warm, *watched]:
        assert body["stream"] is True and (body["logprobs"], body["top_logprobs"]) == (True, 5)
    assert all("n" not in body for body in watched)
    # The server saw the weak sample's client go before its end: the warm-up request and the confident one completed.
    assert await server_saw(sim, disconnected=1, completed=2) == {"disconnected": 1, "completed": 2}

    [cut] = stopped_of(result)
    assert cut.answer is None and cut.text == WEAK_PART and cut.finish_reason == CONFIDENCE_STOP
    detail = "group confidence 1.750 of the last 4 tokens fell below the threshold 2.000 after 8 tokens"
    assert cut.error == f"stopped early: {detail}" and cut.meta.online_stop == "watched"
    # No usage from a stream cut by its client: 8 log-probabilities arrived (more than ceil(22 chars / 4) = 6).
    assert cut.usage.completion_tokens == 8 and cut.usage.estimated
    record = result.iterations[0]
    assert f"candidate {cut.index}: stopped early: {detail}" in record.notes
    kept = [c for c in record.candidates if c is not cut]
    assert [c.answer for c in kept] == ["391"] * 3
    assert sorted(c.meta.online_stop for c in kept) == ["warmup", "warmup", "watched"]
    # Saved: the warm-up samples' mean of 100 completion tokens less the 8 spent.
    assert record.state["online_stop"] == {
        "rule": "deepconf_online",
        "threshold": 2.0,
        "keep": 0.9,
        "window": 4,
        "warmup": 2,
        "watched": 2,
        "stopped": 1,
        "tokens_saved": 92,
    }
    assert (result.stopped_traces, result.stopped_tokens_saved) == (1, 92)
    with RunStore(tmp_path / "run", create=False) as store:
        stored = store.call(cut.call_id)
    assert stored is not None and stored.stopped_early == detail and stored.finish_reason == CONFIDENCE_STOP
    assert stored.content == WEAK_PART and stored.ok


async def test_a_resumed_run_replays_the_stopped_call_and_a_run_without_watch_sends_it(
    sim: SimServer, tmp_path: Path
) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem_id": "q", "question": Q, "answer": "391"}) + "\n")
    run_dir = tmp_path / "run"
    sim.set_script(script())
    # confidence = true keeps the requests (and so their hashes) the same when online_stop is turned off below.
    await arun(problems, run_dir, settings(sim, confidence=True))
    assert await server_saw(sim, disconnected=1) == {"disconnected": 1}

    def unfinish() -> None:
        db = sqlite3.connect(run_dir / "run.sqlite")
        db.execute("DELETE FROM results")
        db.commit()
        db.close()

    unfinish()
    sim.reset()
    await aresume(run_dir)
    assert sim.stats().total_requests == 0  # every call replayed, the stopped one still stopped
    with RunStore(run_dir, create=False) as store:
        [resumed] = load_results(store)
    assert resumed.stopped_traces == 1 and resumed.answer == "391"

    unfinish()
    sim.reset()
    await aresume(run_dir, params={"online_stop": False})
    # Unwatched, the stopped call is no reply to replay: it alone is sent again, and runs to its end.
    assert sim.stats().total_requests == 1 and sim.stats().disconnected == 0
    with RunStore(run_dir, create=False) as store:
        [full] = load_results(store)
    assert full.stopped_traces == 0
    assert all(c.answer is not None for c in full.iterations[0].candidates)


@pytest.mark.parametrize(
    ("endpoint", "server"),
    [({"endpoint__stream": "off"}, {}), ({}, {"stream": "ignore"})],
    ids=["stream-off", "server-cannot-stream"],
)
async def test_unstreamed_calls_run_to_their_end_with_one_notice(
    sim: SimServer, tmp_path: Path, endpoint: dict[str, Any], server: dict[str, Any]
) -> None:
    sim.set_script(script(latency_per_token_s=0.0, **server))
    params = {**PARAMS, "k": 5}
    run = settings_for(sim, method={"name": "majority", "params": params}, **endpoint)
    result = await asolve(Q, run, run_dir=tmp_path / "run")
    # The weak sample could not be watched: it ran to its end, its box counted (9 against four 391s).
    assert not stopped_of(result) and result.stopped_traces == 0 and result.answer == "391"
    assert sorted(c.answer or "" for c in result.iterations[0].candidates) == ["391"] * 4 + ["9"]
    assert result.iterations[0].state["online_stop"]["threshold"] == 2.0
    assert result.notices == [UNWATCHED_NOTICE]
    with RunStore(tmp_path / "run", create=False) as store:
        assert store.notices()["unwatched"] == UNWATCHED_NOTICE


async def test_warm_up_samples_without_log_probabilities_set_no_threshold() -> None:
    settings = scripted_settings(method={"name": "majority", "params": {**PARAMS, "k": 3}})
    result = await solve_in_process(ScriptedModel(SimScript(logprobs=False), settings), Q)
    assert result.answer == "391" and result.stopped_traces == 0
    state = result.iterations[0].state["online_stop"]
    assert state["threshold"] is None and (state["warmup"], state["watched"]) == (2, 0)
    assert ONLINE_STOP_NOTICE in result.notices


async def test_warm_up_samples_shorter_than_the_window_raise_one_notice_naming_both_lengths() -> None:
    result, _ = await run_scripted("majority", script=script(), **{**PARAMS, "confidence_window": 1000})
    warm = [c for c in result.iterations[0].candidates if c.meta.online_stop == "warmup"]
    longest = max(c.confidence.tokens for c in warm if c.confidence is not None)
    assert len(warm) == 2 and 4 <= longest < 1000
    # In process every reply comes whole, so the watched samples also raise the unstreamed notice.
    assert result.notices == [SHORT_WARMUP_NOTICE.format(window=1000, longest=longest), UNWATCHED_NOTICE]
    # A window the replies fill (4 tokens) raises no warm-up notice.
    short, _ = await run_scripted("majority", script=script(), **PARAMS)
    assert short.notices == [UNWATCHED_NOTICE]


async def test_the_report_counts_the_stopped_samples(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(script())
    result = await asolve(Q, settings(sim), run_dir=tmp_path / "run")
    summary = stopping_summary([result])
    assert (summary.stopped, summary.stopped_traces, summary.stopped_tokens_saved) == (0, 1, 92)
    doc = Document("report")
    evaluation = evaluation_of(tmp_path / "run")
    _run_section(doc, evaluation)
    said = "1 samples stopped while streaming (online_stop), saving about 92 completion tokens"
    assert said in doc.markdown()
    # ... and says where they count: nowhere, neither as a rollout nor as a vote.
    assert "no rollouts, they are left out of Pass@1, MV@all and the frontier's MV@k." in doc.markdown()
    # The stopped sample is no rollout: Pass@1 is over the three that ran to their end, all 391 (3/4 if it counted).
    assert evaluation.metrics.iterations[0].pass1 == 1.0


def test_run_help_lists_the_online_parameters_and_their_source() -> None:
    out = CliRunner().invoke(app, ["run", "--help"])
    text = " ".join(out.output.split())
    assert out.exit_code == 0 and "online_stop=false, warmup=16, online_keep=0.9" in text
    assert (
        "online_stop (majority): stop a streamed sample once its running group confidence falls below the threshold"
        " the problem's first samples set (DeepConf's online mode, Fu et al. 2025)" in text
    )
    assert "warmup (majority): online_stop: a problem's first samples, run to their end" in text
    assert "(1 - keep) quantile of their lowest group confidence (DeepConf: 0.9 and 0.1)" in text
