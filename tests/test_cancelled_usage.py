"""What a call cancelled part way had the server generate still counts: a call sent alone (a run interrupted, a
sibling's failure cancelling the problem's other calls, a caller's own timeout) keeps the completion tokens its reply
streamed before the cancel, in the client's stats, in the run store and in the problem's spend, as a call's failed
attempts keep theirs and a batched sample's choice does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conftest import eventually, settings_for
from tmas.config import Budget, Settings
from tmas.llm.client import LLMClient
from tmas.llm.factory import open_model
from tmas.llm.model import ClientStats
from tmas.llm.replay import StoreReplay
from tmas.llm.tokens import TokenCounter
from tmas.llm.types import CallKey, user
from tmas.methods.base import MethodParams, ProblemSession, gather_all
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing import Rule, SimScript, SimServer
from tmas.testing.responders import cut_tokens

QUESTION = [user("What is 17*23?")]
# 20 simulator tokens, streamed in deltas of 5, 4, 6 and 5; the stream sends the first two (HEAD tokens), then nothing
# until the call is cancelled.
LONG = "The product of seventeen and twenty three is worked out below , step by step , and the result is 391 ."
HEAD = 9


def frozen(persona: str = "sim", **script: object) -> SimScript:
    rule = Rule(replies=[LONG], fault="freeze", fault_after_tokens=HEAD)
    return SimScript(persona=persona, rules=[rule], hang_s=3600, **script)


async def cancelled_midway(settings: Settings, store: RunStore | None = None) -> ClientStats:
    """One call whose stream stops after HEAD tokens, cancelled once they arrived; the client's stats."""
    stats = ClientStats()
    async with open_model(settings, store, stats=stats) as llm:
        client = llm.inner if isinstance(llm, StoreReplay) else llm
        assert isinstance(client, LLMClient)
        vitals = client.route("solution").replicas[0].vitals
        seen = vitals.seen_at
        call = asyncio.ensure_future(llm.chat("solution", QUESTION, key=CallKey(role="solution", problem_id="p")))
        await eventually(lambda: vitals.seen_at != seen)  # the stream's first part arrived (one write)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    return stats


async def test_a_cancelled_call_counts_the_tokens_its_stream_reported(sim: SimServer, tmp_path: Path) -> None:
    # vLLM's continuous_usage_stats: each chunk says the tokens generated so far.
    sim.set_script(frozen("vllm"))
    extra = {"stream_options": {"continuous_usage_stats": True}}
    with RunStore(tmp_path) as store:
        stats = await cancelled_midway(settings_for(sim, sampling__extra_body=extra), store)
        [stored] = store.calls()
        counts = store.call_counts()
    assert stats.usage.completion_tokens == HEAD and not stats.usage.estimated
    assert stats.calls == 1 and stats.failed == 1
    assert stored.error_cause == "cancelled" and stored.content == "" and stored.usage.completion_tokens == HEAD
    assert counts["completion_tokens"] == HEAD and counts["failed"] == 1


async def test_a_cancelled_call_without_usage_counts_the_text_it_received(sim: SimServer, tmp_path: Path) -> None:
    # The simulator's own stream reports usage only in its last chunk: the text received is counted, as for an
    # attempt whose stream was cut.
    sim.set_script(frozen())
    with RunStore(tmp_path) as store:
        stats = await cancelled_midway(settings_for(sim), store)
        [stored] = store.calls()
    expected = TokenCounter().count(cut_tokens(LONG, HEAD))
    assert expected > 0
    assert stats.usage.completion_tokens == stored.usage.completion_tokens == expected
    assert stats.usage.estimated and stored.usage.estimated


async def test_a_problem_counts_what_its_cancelled_call_spent_without_counting_it_failed(sim: SimServer) -> None:
    # A sibling's failure cancels the problem's other calls (gather_all): the problem's spend, what its result and
    # budget read, keeps what they streamed; no reply is missing, so none counts as a failed call.
    sim.set_script(frozen("vllm"))
    extra = {"stream_options": {"continuous_usage_stats": True}}
    settings = settings_for(sim, sampling__extra_body=extra)
    problem = Problem(problem_id="p", question="What is 17*23?")
    async with open_model(settings) as llm:
        assert isinstance(llm, LLMClient)
        session = ProblemSession(problem, llm, None, budget=Budget(tokens=1000), params=MethodParams())
        vitals = llm.route("solution").replicas[0].vitals
        seen = vitals.seen_at
        call = asyncio.ensure_future(session.chat("solution", QUESTION))
        await eventually(lambda: vitals.seen_at != seen)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    assert session.spent_usage.completion_tokens == HEAD and session.spent_tokens == HEAD
    assert session.spent_calls == 1 and session.spent_failed == 0 and session.calls_in_flight == 0


@pytest.mark.parametrize("usage", ["running", "none"])
async def test_samples_of_one_request_all_cancelled_keep_what_it_streamed(
    sim: SimServer, tmp_path: Path, usage: str
) -> None:
    # Every caller of a request with n = 3 leaves (a run interrupted, the problem's other call failed): the request is
    # closed, and what it streamed is carried by one of them, as a lone call's is. The engine's generated tokens are
    # what its stream sent (a frozen engine does no other work).
    sim.set_script(frozen("vllm"))
    extra = {"stream_options": {"continuous_usage_stats": True}} if usage == "running" else {}
    settings = settings_for(sim, endpoint__batch_samples="on", endpoint__stream="on", sampling__extra_body=extra)
    stats = ClientStats()
    with RunStore(tmp_path) as store:
        async with open_model(settings, store, stats=stats) as llm:
            assert isinstance(llm, StoreReplay) and isinstance(llm.inner, LLMClient)
            vitals = llm.inner.route("solution").replicas[0].vitals
            seen = vitals.seen_at
            keys = [CallKey(role="solution", problem_id="p", sample=i) for i in range(3)]
            callers = [asyncio.ensure_future(llm.chat("solution", QUESTION, key=k)) for k in keys]
            await eventually(lambda: vitals.seen_at != seen)
            for caller in callers:
                caller.cancel()
            await asyncio.gather(*callers, return_exceptions=True)
        [stored] = store.calls()
    generated = sim.stats().engine_generated_tokens
    # Without a running usage, the text received is counted (the first choice's first delta: nothing else came).
    spent = generated if usage == "running" else TokenCounter().count(cut_tokens(LONG, generated))
    assert [b.get("n") for b in sim.chat_bodies("solution")] == [3] and all(c.cancelled() for c in callers)
    assert generated > 0 and stored.error_cause == "cancelled" and stored.usage.completion_tokens == spent
    assert stats.usage.completion_tokens == spent and stats.calls == 1


async def test_samples_gathered_by_a_cancelled_step_keep_what_their_request_streamed(
    sim: SimServer, tmp_path: Path
) -> None:
    # A run cut at its time cancels the step that gathered a request's samples (gather_all): the first sample to end
    # cancelled ends the gather, and gather_all cancels the others again, the one carrying what the request streamed
    # among them while it waits for the request to stop. It still carries it.
    sim.set_script(frozen("vllm"))
    extra = {"stream_options": {"continuous_usage_stats": True}}
    settings = settings_for(sim, endpoint__batch_samples="on", endpoint__stream="on", sampling__extra_body=extra)
    with RunStore(tmp_path) as store:
        async with open_model(settings, store) as llm:
            assert isinstance(llm, StoreReplay) and isinstance(llm.inner, LLMClient)
            vitals = llm.inner.route("solution").replicas[0].vitals
            seen = vitals.seen_at
            keys = [CallKey(role="solution", problem_id="p", sample=i) for i in range(3)]
            step = asyncio.ensure_future(gather_all(llm.chat("solution", QUESTION, key=k) for k in keys))
            await eventually(lambda: vitals.seen_at != seen)
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
        [stored] = store.calls()
    generated = sim.stats().engine_generated_tokens
    assert [b.get("n") for b in sim.chat_bodies("solution")] == [3]
    assert generated > 0 and stored.error_cause == "cancelled" and stored.usage.completion_tokens == generated


async def test_a_call_cancelled_while_its_retry_waits_keeps_what_its_cut_attempt_streamed(
    sim: SimServer, tmp_path: Path
) -> None:
    # The first attempt's stream is cut after HEAD tokens; the retry waits in the server's queue (held silent) when
    # the call is cancelled: what the cut attempt generated is the call's cost, as it would be had the retry answered.
    cut = Rule(replies=[LONG], fault="cut", fault_after_tokens=HEAD, times=1)
    sim.set_script(SimScript(persona="vllm", rules=[cut, Rule(replies=[LONG])], hold_after=1))
    extra = {"stream_options": {"continuous_usage_stats": True}}
    stats = ClientStats()
    with RunStore(tmp_path) as store:
        async with open_model(settings_for(sim, sampling__extra_body=extra), store, stats=stats) as llm:
            call = asyncio.ensure_future(llm.chat("solution", QUESTION, key=CallKey(role="solution", problem_id="p")))
            await eventually(lambda: sim.stats().held == 1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        [stored] = store.calls()
    assert stored.error_cause == "cancelled" and stored.retry_causes == ["cut"] and stored.attempts == 2
    assert stored.usage.completion_tokens == stats.usage.completion_tokens == HEAD
