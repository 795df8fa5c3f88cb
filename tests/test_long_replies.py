"""The simulator's thinking-length replies (tmas.testing.long_replies): reasoning and answer lengths within the
script's bounds, counted as the simulator counts tokens, streamed in large deltas whose gaps, not the whole reply,
the client's timeout_s bounds; the role's own reply kept at the end so the agents parse it; a request log of digests."""

from __future__ import annotations

from conftest import settings_for
from tmas.llm.client import LLMClient
from tmas.llm.types import user
from tmas.testing import LongReplies, SimScript, SimServer
from tmas.testing.long_replies import corpus, prompt_digest
from tmas.testing.responders import count_tokens

# Reasoning of 2,000-3,000 tokens and an answer of 300-400, in deltas of 250 tokens; at 4,000 tokens a second a reply
# streams for 0.6-0.85 s, its deltas 0.06 s apart.
SHORT_LONG = LongReplies(
    reasoning_median_tokens=2_500,
    reasoning_min_tokens=2_000,
    reasoning_max_tokens=3_000,
    answer_min_tokens=300,
    answer_max_tokens=400,
    chunk_tokens=250,
    corpus_tokens=50_000,
)


def test_slices_are_cut_at_token_starts_and_counted_as_the_simulator_counts() -> None:
    text = corpus(50_000, 0.78)
    pieces = text.slice(1_234, 1_001, 250)
    assert [tokens for _, tokens in pieces] == [250, 250, 250, 250, 1]
    assert [count_tokens(piece) for piece, _ in pieces] == [250, 250, 250, 250, 1]
    assert count_tokens("".join(piece for piece, _ in pieces)) == 1_001


async def test_a_thinking_reply_longer_than_timeout_s_arrives_whole(sim: SimServer) -> None:
    sim.set_script(
        SimScript(persona="vllm", long_replies=SHORT_LONG, latency_per_token_s=1 / 4000, seed=1, log_digests=True)
    )
    messages = [user("What is 17*23?")]
    async with LLMClient(
        settings_for(sim, endpoint__timeout_s=0.3, endpoint__stream="on", sampling__max_tokens=8192)
    ) as llm:
        reply = await llm.chat("solution", messages)
    assert reply.ok, reply.error
    assert reply.attempts == 1 and reply.retry_causes == []
    # More tokens than 0.3 s of streaming at 4,000 a second: the reply outlasted timeout_s, its gaps did not.
    assert 2_000 <= count_tokens(reply.reasoning) <= 3_000
    assert 300 <= count_tokens(reply.content) <= 400
    assert reply.usage.reasoning_tokens == count_tokens(reply.reasoning)
    assert reply.usage.completion_tokens == count_tokens(reply.reasoning) + count_tokens(reply.content)
    assert reply.content.endswith("the final answer is \\boxed{391}.")
    # The log keeps the prompt's digest, the seed and n, not the body.
    [logged] = sim.requests
    assert logged.body == {
        "prompt": prompt_digest([{"role": "user", "content": "What is 17*23?"}]),
        "seed": None,
        "n": 1,
    }


async def test_roles_keep_their_own_reply_at_the_end(sim: SimServer) -> None:
    sim.set_script(SimScript(persona="vllm", long_replies=SHORT_LONG.model_copy(update={"roles": ["verifier"]})))
    solution = "We compute 17*23 = 391.\n\nTherefore, the final answer is \\boxed{391}."
    prompt = f"<problem>\nWhat is 17*23?\n</problem>\n\n<solution>\n{solution}\n</solution>"
    async with LLMClient(settings_for(sim, endpoint__stream="on", sampling__max_tokens=8192)) as llm:
        verification = await llm.chat("verifier", [user(prompt)])
        short = await llm.chat("solution", [user("What is 17*23?")])
    assert count_tokens(verification.reasoning) >= 2_000
    assert verification.content.endswith("Score: 1") or verification.content.endswith("Score: 0.5")
    # A role the script does not name answers as before: short, with no reasoning.
    assert not short.reasoning and count_tokens(short.content) < 100


async def test_max_tokens_cuts_the_reasoning_first(sim: SimServer) -> None:
    sim.set_script(SimScript(persona="vllm", long_replies=SHORT_LONG))
    async with LLMClient(settings_for(sim, endpoint__stream="on", sampling__max_tokens=1_000)) as llm:
        reply = await llm.chat("solution", [user("What is 17*23?")])
    assert reply.finish_reason == "length"
    assert count_tokens(reply.reasoning) == 1_000 and reply.content == ""
