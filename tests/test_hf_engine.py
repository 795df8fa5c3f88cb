"""The in-process engine (tmas.llm.hf_engine) on a tiny random model: how many tokens each sample of a prompt's
request draws when one of them leaves early (its caller gave up, it reached a stop string) and when all run to
max_tokens, counted step by step.

Each engine step waits, before it reads its queues, for the event loop to handle what the step before delivered and
what the test does then (:class:`Steps`), so the counts do not depend on how fast either thread runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tmas.config import Budget, Sampling, Settings
from tmas.llm.hf_engine import CHILD_SUFFIX, EngineReply, HFEngine, resolve_options
from tmas.llm.hf_model import HFChatModel
from tmas.llm.hf_sampling import RequestSampling
from tmas.llm.model import ChatModel, ClientStats
from tmas.llm.replay import StoreReplay
from tmas.llm.sampling import DERIVED_SEED, ResolvedSampling
from tmas.llm.types import CallKey, Completion, Message
from tmas.methods.base import MethodParams, ProblemSession
from tmas.problems import Problem
from tmas.rl.tiny import tiny_model, tiny_tokenizer
from tmas.store.run_store import RunStore

# A vocabulary wide enough that a random model's replies rarely draw the end token.
WORDS = [f"w{i}" for i in range(400)]
MESSAGES = [Message(role="user", content="w1 w2 w3")]
MAX_TOKENS = 40
SAMPLES = 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HFEngine]:
    folder: Path = tmp_path_factory.mktemp("tiny")
    tokenizer = tiny_tokenizer([" ".join(WORDS)])
    tiny_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    started = HFEngine.load(folder, resolve_options("cpu", "float32", threads=1, cache_tokens=4096, block_size=16))
    started.start()
    yield started
    started.stop()


class Steps:
    """While inside: the requests that draw a token at each engine step, in order (:attr:`draws`), and ``at_step``
    awaited on the event loop at the start of each step, before the engine reads its queues (:attr:`steps` counts
    them)."""

    def __init__(self, engine: HFEngine, at_step: Callable[[], Awaitable[None]]) -> None:
        self.engine = engine
        self.at_step = at_step
        self.draws: list[str] = []
        self.steps = 0
        self._lock = threading.Lock()
        self._open = True
        self._waited: concurrent.futures.Future[None] | None = None
        self._stepped = asyncio.Condition()

    async def __aenter__(self) -> Steps:
        loop = asyncio.get_running_loop()
        processor = self.engine._manager.batch_processor
        table = self.engine.table
        next_key, prepare = table.next_key, processor.prepare_next_batch

        def drawing(request_id: str) -> int:
            self.draws.append(request_id)
            return next_key(request_id)

        async def step() -> None:
            async with self._stepped:
                self.steps += 1
                self._stepped.notify_all()
            await self.at_step()

        def stepping() -> bool:
            # Outputs are handed to the loop before this runs: they are handled by the time at_step runs.
            with self._lock:
                waited = self._waited = asyncio.run_coroutine_threadsafe(step(), loop) if self._open else None
            if waited is not None:
                waited.result(timeout=60)
            return bool(prepare())

        table.next_key = drawing  # type: ignore[method-assign]
        processor.prepare_next_batch = stepping
        self._undo = lambda: (delattr(table, "next_key"), delattr(processor, "prepare_next_batch"))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        with self._lock:
            self._open, waited = False, self._waited
        self._undo()
        # The engine's thread is not left waiting for this loop.
        if waited is not None:
            await asyncio.wrap_future(waited)

    async def passed(self, count: int) -> None:
        """Until ``count`` more steps have begun (an idle engine begins one every 0.1 s)."""
        target = self.steps + count
        async with self._stepped:
            await self._stepped.wait_for(lambda: self.steps >= target)

    def drawn(self, request_id: str) -> int:
        return self.draws.count(request_id)


def model_on(engine: HFEngine) -> HFChatModel:
    settings = Settings.model_validate({"sampling": {"temperature": 1.0, "max_tokens": MAX_TOKENS}})
    return HFChatModel(settings, engine, "tiny")


def sample_ids(engine: HFEngine) -> list[str]:
    """The latest request's samples' ids, in sample order."""
    lead = engine.submitted[-1].request_id
    return [lead, *(f"{lead}{CHILD_SUFFIX}{i}" for i in range(SAMPLES - 1))]


def calls(llm: ChatModel, stop: list[str] | None = None) -> list[asyncio.Task[Completion]]:
    """The samples of one prompt, started together (their seeds derived per sample, as a session's are): they go as
    one request with children."""
    tasks = []
    for i in range(SAMPLES):
        resolved = llm.resolve_sampling("solution", call=Sampling(seed=10 + i, stop=stop))
        sampling = ResolvedSampling(sampling=resolved.sampling, sources={**resolved.sources, "seed": DERIVED_SEED})
        key = CallKey(role="solution", sample=i)
        tasks.append(asyncio.create_task(llm.chat("solution", MESSAGES, key=key, sampling=sampling)))
    return tasks


async def nothing() -> None:
    pass


async def uncut(engine: HFEngine) -> list[Completion]:
    """The samples run to the end: each draws max_tokens, no more."""
    llm = model_on(engine)
    async with Steps(engine, nothing) as steps:
        done = await asyncio.gather(*calls(llm))
    assert [(c.finish_reason, c.usage.completion_tokens) for c in done] == [("length", MAX_TOKENS)] * SAMPLES
    assert Counter(steps.draws) == dict.fromkeys(sample_ids(engine), MAX_TOKENS)
    return done


def assert_engine_empty(engine: HFEngine) -> None:
    scheduler = engine._manager.batch_processor.scheduler
    assert not scheduler.active_requests and not scheduler.waiting_requests
    assert len(engine.table) == 0


@pytest.mark.parametrize(
    ("gives_up", "when"),
    [
        (1, "after its first token"),
        (0, "after its first token"),
        (1, "before the fork"),
        (0, "before the fork"),
    ],
)
async def test_a_sample_whose_caller_gives_up_leaves_the_engine_while_its_siblings_go_on(
    engine: HFEngine, gives_up: int, when: str
) -> None:
    whole = await uncut(engine)
    llm = model_on(engine)
    tasks = calls(llm)
    seen: list[int] = []

    async def at_step() -> None:
        if seen or engine.submitted[-1].samples[0].seed != 10:
            return
        ids = sample_ids(engine)
        # Before the fork: the request is submitted and no sample has drawn yet (the engine may not hold it yet).
        if when == "before the fork" or steps.drawn(ids[gives_up]) == 1:
            seen.append(steps.drawn(ids[gives_up]))
            tasks[gives_up].cancel()
            await asyncio.wait({tasks[gives_up]})

    before = len(engine.submitted)
    async with Steps(engine, at_step) as steps:
        # A sibling never made (its request cancelled before the fork) would leave the others waiting for good.
        async with asyncio.timeout(120):
            done = await asyncio.gather(*tasks, return_exceptions=True)
    assert len(engine.submitted) == before + 1 and seen == [1 if when == "after its first token" else 0]
    ids = sample_ids(engine)
    # It drew nothing after its caller gave up; its siblings drew what they draw uncut.
    assert steps.drawn(ids[gives_up]) == seen[0]
    assert isinstance(done[gives_up], asyncio.CancelledError)
    for i in range(SAMPLES):
        if i != gives_up:
            assert steps.drawn(ids[i]) == MAX_TOKENS
            kept = done[i]
            assert isinstance(kept, Completion) and kept.content == whole[i].content
    # What it drew, and the prompt where it was the first sample, is counted on a sibling's completion, as the
    # choices of a request with n are on an endpoint: the samples' figures add up to what the engine computed.
    kept_usage = [c.usage for c in done if isinstance(c, Completion)]
    assert sum(u.completion_tokens for u in kept_usage) == (SAMPLES - 1) * MAX_TOKENS + seen[0]
    assert sum(u.prompt_tokens for u in kept_usage) == len(engine.submitted[-1].prompt)
    assert_engine_empty(engine)


async def test_every_caller_giving_up_stops_the_request(engine: HFEngine, tmp_path: Path) -> None:
    with RunStore(tmp_path) as store:
        tasks = calls(StoreReplay(model_on(engine), store))

        async def at_step() -> None:
            if steps.draws and not all(t.done() for t in tasks):
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks)

        async with Steps(engine, at_step) as steps:
            await asyncio.wait(tasks)
            assert all(t.cancelled() for t in tasks)
            # The engine ends them as it begins its next step; the one after begins once it has.
            await steps.passed(2)
        # What they drew is spent: one of the callers carries it (tmas.llm.batching), and the store keeps it.
        [spent] = store.calls()
    assert Counter(steps.draws) == dict.fromkeys(sample_ids(engine), 1)
    assert spent.error_cause == "cancelled" and spent.usage.completion_tokens == SAMPLES
    assert_engine_empty(engine)


async def test_a_sample_cut_at_a_stop_string_draws_nothing_after_it(engine: HFEngine) -> None:
    prompt = engine.prompt_ids([m.model_dump() for m in MESSAGES])
    samples = [RequestSampling(temperature=1.0, seed=10 + i) for i in range(SAMPLES)]
    async with Steps(engine, nothing) as steps:
        whole = await engine.generate(prompt, samples, MAX_TOKENS)
    assert Counter(steps.draws) == dict.fromkeys(sample_ids(engine), MAX_TOKENS)
    replies = [reply for reply in whole if reply is not None]
    assert [len(reply.tokens) for reply in replies] == [MAX_TOKENS] * SAMPLES
    # Two tokens of sample 1's reply that neither sibling's reply holds: sample 1 alone is cut there.
    tokens = replies[1].tokens
    stop = next(
        text
        for i in range(2, MAX_TOKENS - 1)
        if len(text := engine.text(tokens[i : i + 2])) > 3 and all(text not in replies[j].text for j in (0, 2))
    )
    cut_at = next(n for n in range(1, MAX_TOKENS + 1) if stop in engine.text(tokens[:n]))
    async with Steps(engine, nothing) as steps:
        cut = await engine.generate(prompt, samples, MAX_TOKENS, [stop])
    ids = sample_ids(engine)
    assert steps.drawn(ids[1]) == cut_at < MAX_TOKENS
    assert cut[1] == EngineReply(
        tokens=tokens[:cut_at],
        text=replies[1].text[: replies[1].text.index(stop)],
        finish_reason="stop",
        cached_prompt_tokens=replies[1].cached_prompt_tokens,
    )
    assert [steps.drawn(ids[i]) for i in (0, 2)] == [MAX_TOKENS] * 2
    assert [cut[0], cut[2]] == [replies[0], replies[2]]
    assert_engine_empty(engine)


async def test_a_call_cancelled_midway_counts_the_tokens_it_generated(engine: HFEngine, tmp_path: Path) -> None:
    # A call sent alone and cancelled (a run interrupted, a sibling's failure, a budget spent) after it drew five
    # tokens: they were generated, and count in the run's stats, its store and the problem's spend, as a cancelled
    # call's streamed tokens do on an endpoint. The engine waits at each step's start while the test cancels, so the
    # five are all it drew.
    drawn = 5
    stats = ClientStats()
    before = len(engine.submitted)
    with RunStore(tmp_path) as store:
        llm = StoreReplay(model_on(engine), store, on_replay=stats.count_replay, on_sent=stats.count)
        problem = Problem(problem_id="p", question="w1 w2 w3")
        session = ProblemSession(problem, llm, None, budget=Budget(tokens=10_000), params=MethodParams())
        task = asyncio.create_task(session.chat("solution", MESSAGES))

        async def at_step() -> None:
            started = len(engine.submitted) > before and not task.done()
            if started and steps.drawn(engine.submitted[-1].request_id) == drawn:
                task.cancel()
                await asyncio.wait({task})

        async with Steps(engine, at_step) as steps:
            await asyncio.wait({task})
            await steps.passed(2)
        assert task.cancelled()
        assert steps.drawn(engine.submitted[-1].request_id) == drawn
        [stored] = store.calls()
    assert stored.error_cause == "cancelled" and stored.usage.completion_tokens == drawn
    assert stats.usage.completion_tokens == drawn and stats.calls == 1 and stats.failed == 1
    assert session.spent_usage.completion_tokens == drawn and session.spent_failed == 0
    assert_engine_empty(engine)
