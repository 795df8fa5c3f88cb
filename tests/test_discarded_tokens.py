"""What a call costs when the server generated text that is not kept: an attempt whose stream was cut part way (and
retried), a call that gave up after such attempts, a request of several choices that failed. The server reports no
usage for that text, so it is counted from what arrived (estimated: about 4 characters a token) and charged to the
call, so a token budget sees it and a resumed run replays the same cost."""

from __future__ import annotations

import pytest

from conftest import settings_for
from tmas.llm.client import LLMClient
from tmas.llm.replies import discarded
from tmas.llm.tokens import TokenCounter
from tmas.llm.types import Usage, user
from tmas.problems import Problem
from tmas.runner import problem_solver, run_method
from tmas.testing import Rule, ScriptedUsage, SimScript, SimServer

QUESTION = [user("What is 17*23?")]
# 100 words of thinking: the simulator streams them as 100 tokens; 500 characters, estimated as 125 tokens.
THOUGHT = "step " * 100
CUT = Rule(fault="cut", fault_after_tokens=100, reasoning=THOUGHT, replies=["So 391.\n\n\\boxed{391}"])
REPORTED = ScriptedUsage(prompt_tokens=10, completion_tokens=40, reasoning_tokens=30)
ANSWER = Rule(reasoning="step", replies=["So 391.\n\n\\boxed{391}"], usage=REPORTED)


async def test_a_cut_attempt_s_tokens_are_charged_to_the_call_that_retried_it() -> None:
    script = SimScript(persona="vllm", rules=[CUT.model_copy(update={"times": 1}), ANSWER])
    with SimServer(script) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            reply = await llm.chat("solution", QUESTION)
    assert reply.ok and reply.retry_causes == ["cut"]
    # 40 reported by the answering attempt + 125 counted from the cut one's 500 characters of reasoning.
    assert reply.usage == Usage(prompt_tokens=10, completion_tokens=165, reasoning_tokens=155, estimated=True)


async def test_a_call_that_gave_up_costs_what_its_attempts_streamed() -> None:
    with SimServer(SimScript(persona="vllm", rules=[CUT])) as sim:
        async with LLMClient(settings_for(sim, retry__max_attempts=2)) as llm:
            reply = await llm.chat("solution", QUESTION)
    assert not reply.ok and reply.error_cause == "cut" and len(sim.chat_bodies()) == 2
    assert reply.usage == Usage(completion_tokens=250, reasoning_tokens=250, estimated=True)


async def test_a_token_budget_stops_at_the_call_whose_cut_attempt_spent_it() -> None:
    # Majority vote of 4 under 150 completion tokens (max_tokens 256 > 150: the samples go one at a time). Each
    # answer reports 40 tokens: without the cut attempt's 125 the problem would send all 4 (40, 80, 120 < 150). The
    # first sample's first attempt is cut after streaming 125 estimated tokens: 165 after one call, and no more go.
    script = SimScript(persona="llama-server", rules=[CUT.model_copy(update={"times": 1}), ANSWER])
    with SimServer(script) as sim:
        settings = settings_for(sim, method={"name": "majority", "params": {"k": 4}}, budget={"tokens": 150})
        async with LLMClient(settings) as llm, problem_solver(settings, llm, run_method(settings)) as solver:
            result = await solver.solve(Problem(problem_id="q", question="What is 17*23?"))
    assert (result.calls, result.usage.completion_tokens, result.stopped_reason) == (1, 165, "budget")
    assert result.answer == "391"


def test_a_running_usage_the_stream_reported_before_it_broke_is_taken_as_it_is() -> None:
    # Some servers report usage on every chunk: the last one that arrived counts the tokens generated so far.
    texts = ("x" * 400, "y" * 40)  # 100 + 10 tokens estimated from the characters
    running = {"prompt_tokens": 9, "completion_tokens": 70, "completion_tokens_details": {"reasoning_tokens": 20}}
    assert discarded(texts, TokenCounter(), running) == Usage(completion_tokens=70, reasoning_tokens=20)
    assert discarded(texts, TokenCounter()) == Usage(completion_tokens=110, reasoning_tokens=10, estimated=True)
    assert discarded(("", ""), TokenCounter()) == Usage()


def test_a_running_usage_without_a_reasoning_count_has_the_reasoning_received_counted() -> None:
    # vLLM's continuous_usage_stats count no reasoning (nor did its usage before 2026-08): as for a whole reply whose
    # usage says nothing of reasoning, the reasoning text is counted, at most the completion tokens.
    texts = ("x" * 400, "y" * 40)
    assert discarded(texts, TokenCounter(), {"prompt_tokens": 9, "completion_tokens": 70}) == Usage(
        completion_tokens=70, reasoning_tokens=10, estimated=True
    )
    assert discarded(texts, TokenCounter(), {"completion_tokens": 6}) == Usage(
        completion_tokens=6, reasoning_tokens=6, estimated=True
    )
    assert discarded(("x" * 400, ""), TokenCounter(), {"completion_tokens": 70}) == Usage(completion_tokens=70)


async def test_a_cut_attempt_s_reasoning_counts_where_the_running_usage_had_no_reasoning_count() -> None:
    # The cut attempt's running usage says 100 tokens, none of them reasoning: its 500 characters of reasoning count
    # (125 estimated, at most those 100); the answer's one word of reasoning is counted likewise (1).
    answer = Rule(reasoning="step", replies=["So 391.\n\n\\boxed{391}"])
    script = SimScript(
        persona="vllm", rules=[CUT.model_copy(update={"times": 1}), answer], reports_reasoning_tokens=False
    )
    extra = {"stream_options": {"continuous_usage_stats": True}}
    with SimServer(script) as sim:
        async with LLMClient(settings_for(sim, sampling__extra_body=extra)) as llm:
            reply = await llm.chat("solution", QUESTION)
    assert reply.ok and reply.retry_causes == ["cut"] and reply.usage.completion_tokens > 100
    assert reply.usage.reasoning_tokens == 100 + 1 and reply.usage.estimated


def test_thinking_inside_the_content_counts_as_reasoning() -> None:
    # A server without a reasoning parser streams the thinking in the content: its think block is the reasoning, as
    # in a whole reply. 95 characters (24 tokens estimated), 40 of them thinking (10).
    closed = "<think>" + "y" * 40 + "</think>" + "x" * 40
    assert discarded((closed, ""), TokenCounter()) == Usage(completion_tokens=24, reasoning_tokens=10, estimated=True)
    # Cut while thinking: the block is open (47 characters, 12 tokens).
    opened = "<think>" + "y" * 40
    assert discarded((opened, ""), TokenCounter()) == Usage(completion_tokens=12, reasoning_tokens=10, estimated=True)
    assert discarded((opened, ""), TokenCounter(), {"completion_tokens": 9}) == Usage(
        completion_tokens=9, reasoning_tokens=9, estimated=True
    )
    # A model known to think inside its content, its think block opened in the prompt: text without a tag is thinking.
    assert discarded(("y" * 40, ""), TokenCounter(), thinks_inline=True) == Usage(
        completion_tokens=10, reasoning_tokens=10, estimated=True
    )
    assert discarded(("y" * 40, ""), TokenCounter()) == Usage(completion_tokens=10, estimated=True)


@pytest.mark.parametrize("think_in_prompt", [False, True])
async def test_a_cut_attempt_thinking_in_its_content_counts_its_reasoning(think_in_prompt: bool) -> None:
    # The model thinks inside its content (no reasoning parser). With its think block opened in the prompt the text of
    # a stream cut while thinking holds no tag: it is thinking once an earlier reply of the replica showed the model
    # thinks inline.
    answer = Rule(reasoning=THOUGHT, replies=["So 391.\n\n\\boxed{391}"])
    cut = Rule(**answer.model_dump(exclude_unset=True), fault="cut", fault_after_tokens=60, pattern="again")
    script = SimScript(rules=[cut, answer], think_tags=True, think_in_prompt=think_in_prompt)
    with SimServer(script) as sim:
        async with LLMClient(settings_for(sim, retry__max_attempts=1)) as llm:
            first = await llm.chat("solution", QUESTION)
            reply = await llm.chat("solution", [user("What is 17*23? Once again.")])
    assert first.ok and first.usage.reasoning_tokens > 0
    assert not reply.ok and reply.error_cause == "cut"
    assert 0 < reply.usage.reasoning_tokens <= reply.usage.completion_tokens
