"""A silent call judged by what its replica shows (tmas.llm.vitals), against the personas as each server behaves: a
wedged replica's calls go to another replica (or fail, named) once it showed no progress for progress_timeout_s, and
it leaves routing; calls queued behind others that progress, and a preempted stream's pause, are waited out; a replica
whose /health fails leaves routing until it answers again."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from conftest import eventually, settings_for
from tmas.llm.client import LLMClient
from tmas.llm.model import ClientStats, EndpointUnreachable
from tmas.llm.replica import Replica
from tmas.llm.types import Completion, user
from tmas.llm.vitals import load_counters, prometheus_counters
from tmas.testing import FaultRates, Rule, SimScript, SimServer

# Checks of a silence come timeout_s after it began, then every min(timeout_s, progress_timeout_s).
FAST = {"endpoint__timeout_s": 0.3, "endpoint__progress_timeout_s": 1.0}
PATIENT = {"endpoint__timeout_s": 1.0, "endpoint__progress_timeout_s": 3.0}


async def _calls(llm: LLMClient, count: int) -> list[Completion]:
    return list(await asyncio.gather(*(llm.chat("solution", [user(f"What is {i}*7?")]) for i in range(count))))


# ------------------------------------------------------------------------------------------------ wedged
@pytest.mark.parametrize(
    ("persona", "cause"),
    # vLLM's /health reads an error flag only (200), its counters stand still; SGLang's /health answers 503 once its
    # scheduler gave nothing for its timeout; llama-server's /health answers 200 while /metrics waits for its main loop.
    [("vllm", "no_progress"), ("sglang", "dead"), ("llama-server", "no_progress")],
)
async def test_a_wedged_replica_s_calls_are_answered_by_another_and_it_leaves_routing(persona: str, cause: str) -> None:
    # 64 calls over two replicas, one of them wedged (it accepts requests and never answers). Each call routed to it
    # is closed once the replica showed no progress for progress_timeout_s (or failed /health) and goes to the other
    # one; none is sent to the wedged one twice.
    # Under a loaded machine the good replica's 64 calls can also sit silent for a while: its silences are judged at
    # these longer timeouts, so that only the wedged replica shows none of its counters moving.
    wedged = SimScript(persona=persona, wedged=True, health_check_timeout_s=0.1, hang_s=15)  # type: ignore[arg-type]
    with SimServer(SimScript(persona=persona)) as good, SimServer(wedged) as bad:  # type: ignore[arg-type]
        stats = ClientStats()
        settings = settings_for(good, bad, concurrency=64, endpoint__batch_samples="off", **PATIENT)
        async with asyncio.timeout(90), LLMClient(settings, stats=stats) as llm:
            done = await _calls(llm, 64)
        at_bad = bad.stats()
    assert all(c.ok for c in done), [c.error for c in done if not c.ok]
    moved = [c for c in done if c.retry_causes]
    causes = [r for c in moved for r in c.retry_causes]
    # On a loaded machine a connection can also take longer than timeout_s to open: retried as "connect", its own
    # cause, never the wedged replica's.
    assert moved and cause in causes and set(causes) <= {cause, "connect"}, [c.retry_causes for c in moved]
    assert stats.retries_by_cause == dict(Counter(causes))
    # None reached the wedged replica twice (each call that reached it was moved), and it aborted each request when
    # the client closed it.
    assert 0 < at_bad.total_requests <= len(moved) and at_bad.completed == 0, (at_bad, [c.retry_causes for c in moved])
    await eventually(lambda: bad.stats().disconnected == at_bad.total_requests)


async def test_a_call_is_not_sent_again_to_the_replica_that_showed_no_progress_once_it_is_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The call's prompt draws its retry to the replica holding its prefix (routing = "cache"), and a wedged replica
    # can be back in routing by then (another call's look brings it back after progress_timeout_s out). Here it never
    # leaves: the retry still goes to the other replica, and the call is answered after one wait.
    monkeypatch.setattr(Replica, "leave", lambda self, cause: None)
    with SimServer(SimScript()) as good, SimServer(SimScript(wedged=True)) as bad:
        settings = settings_for(good, bad, endpoint__batch_samples="off", **FAST)
        async with asyncio.timeout(30), LLMClient(settings) as llm:
            reply = await llm.chat("solution", [user("What is 6*7?")])
        at_good, at_bad = good.stats(), bad.stats()
    # Its first attempt went to the wedged replica (the only one that can end an attempt with no_progress).
    assert reply.ok and reply.retry_causes == ["no_progress"], (reply.retry_causes, reply.error)
    assert at_bad.total_requests == 1 and at_good.total_requests == 1


async def test_calls_on_a_lone_wedged_replica_fail_with_a_named_cause() -> None:
    # Nowhere else to go: each attempt is closed once the replica showed no progress (a replica already found stuck
    # closes a later attempt at its first check), and the call fails naming why.
    with SimServer(SimScript(persona="vllm", wedged=True)) as sim:
        settings = settings_for(sim, retry__max_attempts=2, endpoint__batch_samples="off", **FAST)
        async with asyncio.timeout(30), LLMClient(settings) as llm:
            done = await _calls(llm, 4)
        served = sim.stats()
    assert all(not c.ok and c.error_cause == "no_progress" for c in done)
    assert all(c.retry_causes == ["no_progress"] and c.attempts == 2 for c in done)
    assert "showed no progress (progress_timeout_s = 1s)" in (done[0].error or "")
    assert served.total_requests == 8 and served.completed == 0


# ------------------------------------------------------------------------------------------------ waiting on work
@pytest.mark.parametrize(
    ("persona", "metrics"),
    # Progress read at /metrics, at SGLang's /get_load (started without --enable-metrics), and, from llama-server
    # without --metrics, from the client's own calls' chunks.
    [("vllm", True), ("sglang", False), ("llama-server", True), ("llama-server", False)],
)
async def test_calls_queued_behind_progressing_ones_wait_past_progress_timeout_s(persona: str, metrics: bool) -> None:
    # One request generates at a time, for 0.5 s each: the fourth waits 1.5 s, past timeout_s and progress_timeout_s
    # (0.6 s), silent, while the replica works on the others. Nothing is closed or sent again.
    rules = [Rule(replies=["The product of the two numbers is worked out step by step ."])]
    script = SimScript(persona=persona, max_running=1, metrics=metrics, latency_per_token_s=0.04, rules=rules)  # type: ignore[arg-type]
    with SimServer(script) as sim:
        stats = ClientStats()
        settings = settings_for(
            sim, concurrency=8, endpoint__batch_samples="off", endpoint__timeout_s=0.2, endpoint__progress_timeout_s=0.6
        )
        async with LLMClient(settings, stats=stats) as llm:
            done = await _calls(llm, 4)
        served = sim.stats()
    assert all(c.ok for c in done), [c.error for c in done]
    assert stats.retries == 0 and served.total_requests == 4 and served.aborted == 0
    assert max(c.first_token_s or 0.0 for c in done) > 0.6


async def test_a_preempted_stream_s_pause_past_timeout_s_is_waited_out() -> None:
    # vLLM preempts the request after its first delta and computes it again 1.2 s later, working on other sequences
    # meanwhile: the client asks the replica past timeout_s, sees it progress, and keeps the stream.
    script = SimScript(persona="vllm", rules=[Rule(fault="stall", times=1)], hang_s=1.2)
    with SimServer(script) as sim:
        async with LLMClient(settings_for(sim, **FAST)) as llm:
            reply = await llm.chat("solution", [user("What is 17*23?")])
        served = sim.stats()
    assert reply.ok and reply.attempts == 1 and reply.retry_causes == []
    assert "\\boxed{391}" in reply.content
    assert served.total_requests == 1 and served.faults == {"stall": 1}


async def test_a_stream_whose_replica_stops_progressing_is_sent_again() -> None:
    script = SimScript(persona="vllm", rules=[Rule(fault="freeze", times=1)], hang_s=5)
    with SimServer(script) as sim:
        async with LLMClient(settings_for(sim, **FAST)) as llm:
            reply = await llm.chat("solution", [user("What is 17*23?")])
        served = sim.stats()
    assert reply.ok and reply.retry_causes == ["stall"] and served.total_requests == 2


async def test_freezes_drawn_as_a_rate_end_each_attempt_as_a_stall() -> None:
    script = SimScript(persona="vllm", faults=FaultRates(freeze=1.0), hang_s=5)
    with SimServer(script) as sim:
        async with LLMClient(settings_for(sim, retry__max_attempts=2, **FAST)) as llm:
            reply = await llm.chat("solution", [user("What is 17*23?")])
        served = sim.stats()
    assert not reply.ok and reply.error_cause == "stall" and reply.retry_causes == ["stall"]
    assert served.total_requests == 2 and served.faults == {"freeze": 2}


# ------------------------------------------------------------------------------------------------ routing
async def test_a_replica_failing_its_health_probe_leaves_routing_until_it_answers_again() -> None:
    # Two SGLang replicas, calls one at a time to the least loaded in turn. The second replica's scheduler is wedged:
    # its /health answers 503. The call that went there is closed and answered by the first one; the next calls all go
    # to the first one; once the second one answers /health again, calls reach it again.
    with (
        SimServer(SimScript(persona="sglang")) as good,
        SimServer(SimScript(persona="sglang", wedged=True, health_check_timeout_s=0.05)) as bad,
    ):
        settings = settings_for(good, bad, endpoint__routing="load", endpoint__batch_samples="off", **FAST)
        async with asyncio.timeout(60), LLMClient(settings) as llm:
            first = [await llm.chat("solution", [user(f"What is {i}*3?")]) for i in range(6)]
            assert bad.stats().total_requests == 1  # while it is out, no call goes there
            bad.set_script(SimScript(persona="sglang"))
            bad.reset()
            # A call made a timeout_s or more after the replica's last look starts another in the background.
            later: list[Completion] = []
            for i in range(40):
                later.append(await llm.chat("solution", [user(f"What is {i}*5?")]))
                if bad.stats().completed:
                    break
                await asyncio.sleep(0.1)
    assert all(c.ok for c in first + later)
    assert sum(c.retry_causes == ["dead"] for c in first) == 1
    assert bad.stats().completed == 1 and all(c.retry_causes == [] for c in later)


async def test_a_replica_that_takes_no_new_connection_while_it_finishes_a_stream_stays_out_of_routing() -> None:
    # The second replica shuts down as uvicorn does: it closes its port and finishes the stream it holds. The calls
    # made meanwhile and after share that stream's prompt, so the router prefers that replica: the first is refused
    # and answered by the other; the stream's later chunks and its end (a request sent before the refusal) do not
    # bring the replica back, so no other call is refused (brought back, the calls would each be refused again, twice
    # at most, and then end the run). Once it listens again and answers /health, calls reach it again.
    # Each of the stream's chunks comes past timeout_s: its silences are judged while /health is refused, and the
    # stream is waited out (the server finishes it), not closed and sent again.
    tokens = " ".join(["step"] * 4)
    script = SimScript(persona="vllm", latency_per_token_s=0.8, rules=[Rule(pattern="long", replies=[tokens])])
    long_prompt = [user("A long question, the same prefix in every call. " * 20 + "long")]
    with SimServer(SimScript(persona="vllm")) as good, SimServer(script) as leaving:
        stats = ClientStats()
        # Of two idle replicas the first call goes to the second; a replica out of routing is looked at again once
        # timeout_s passed since its last look.
        settings = settings_for(
            good,
            leaving,
            endpoint__batch_samples="off",
            endpoint__timeout_s=0.5,
            retry__max_attempts=2,
            retry__backoff_base_s=0.05,
        )
        async with asyncio.timeout(60), LLMClient(settings, stats=stats) as llm:
            stream = asyncio.ensure_future(llm.chat("solution", long_prompt))
            await eventually(lambda: leaving.stats().in_flight == 1)
            await asyncio.to_thread(leaving.stop_listening)
            meanwhile = [await llm.chat("solution", [*long_prompt, user("and 0")])]
            assert (await stream).endpoint == leaving.base_url
            meanwhile += [await llm.chat("solution", [*long_prompt, user(f"and {i}")]) for i in range(1, 6)]
            await asyncio.to_thread(leaving.stop)
            await asyncio.to_thread(leaving.start)
            later: list[Completion] = []
            for i in range(40):
                later.append(await llm.chat("solution", [user(f"What is {i}*5?")]))
                if leaving.stats().completed > 1:
                    break
                await asyncio.sleep(0.1)
    assert all(c.ok for c in meanwhile + later), [c.error for c in meanwhile]
    assert stream.result().retry_causes == [] and stream.result().attempts == 1
    assert [c.retry_causes for c in meanwhile] == [["connect"]] + [[]] * 5
    assert {c.endpoint for c in meanwhile} == {good.base_url}
    assert stats.retries_by_cause == {"connect": 1}
    assert leaving.stats().completed == 2


async def test_a_refused_connection_sends_the_call_to_another_replica_without_spending_an_attempt() -> None:
    # One attempt per call: the first call (and the first embedding) goes to the second of two idle replicas, which
    # takes no connection. Nothing was generated there, so the call goes at once to the first, costing no attempt,
    # instead of failing as an unreachable endpoint while a replica serves.
    with SimServer(SimScript()) as good, SimServer(SimScript()) as gone:
        await asyncio.to_thread(gone.stop_listening)
        stats = ClientStats()
        settings = settings_for(good, gone, retry__max_attempts=1, endpoint__batch_samples="off")
        async with asyncio.timeout(60), LLMClient(settings, stats=stats) as llm:
            done = [await llm.chat("solution", [user(f"What is {i}*5?")]) for i in range(3)]
        async with asyncio.timeout(60), LLMClient(settings) as llm:
            embedded = await llm.embed(["one", "two"])
        served = good.stats()
    assert all(c.ok for c in done), [c.error for c in done]
    assert [c.retry_causes for c in done] == [["connect"], [], []]
    assert [c.attempts for c in done] == [1, 1, 1] and {c.endpoint for c in done} == {good.base_url}
    assert stats.retries_by_cause == {"connect": 1}
    assert len(embedded) == 2 and served.completed == 4  # the 3 chat calls and the embedding


async def test_a_call_every_replica_refuses_is_unreachable() -> None:
    with SimServer(SimScript()) as first, SimServer(SimScript()) as second:
        for server in (first, second):
            await asyncio.to_thread(server.stop_listening)
        settings = settings_for(first, second, retry__max_attempts=1, endpoint__batch_samples="off")
        async with asyncio.timeout(60), LLMClient(settings) as llm:
            with pytest.raises(EndpointUnreachable, match="unreachable for role 'solution'"):
                await llm.chat("solution", [user("What is 2*5?")])
            with pytest.raises(EndpointUnreachable, match="unreachable for role 'embedding'"):
                await llm.embed(["one"])


# ------------------------------------------------------------------------------------------------ the readings
def test_progress_counters_are_read_from_each_server_s_metrics() -> None:
    text = "\n".join(
        [
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            'vllm:generation_tokens_total{engine="0",model_name="m"} 120.0',
            'vllm:generation_tokens_total{engine="1",model_name="m"} 30.0',
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 4000.0 1712345678',
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            "llamacpp:n_decode_total 17",
        ]
    )
    # Summed over engines, in name order; gauges left out.
    assert prometheus_counters(text) == (17.0, 150.0, 4000.0)
    assert prometheus_counters("# nothing\nprocess_cpu_seconds_total 3.5\n") is None
    assert load_counters('[{"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 800}, {"num_reqs": 1}]') == (
        4.0,
        1.0,
        800.0,
    )
    assert load_counters('{"detail": "Not Found"}') is None
