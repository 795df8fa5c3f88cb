"""The one model factory (tmas.llm.factory.open_model): the HTTP client with store replay wrapped around it."""

from __future__ import annotations

from pathlib import Path

from conftest import settings_for
from tmas.llm.client import LLMClient
from tmas.llm.factory import open_model
from tmas.llm.model import ClientStats
from tmas.llm.replay import StoreReplay
from tmas.llm.types import CallKey, user
from tmas.store.run_store import RunStore
from tmas.testing import Rule, SimScript, SimServer

QUESTION = [user("What is 17*23?")]
KEY = CallKey(problem_id="p", role="solution")


async def test_with_a_store_calls_are_recorded_and_replayed_and_counted(sim: SimServer, tmp_path: Path) -> None:
    stats = ClientStats()
    with RunStore(tmp_path) as store:
        async with open_model(settings_for(sim), store, stats=stats) as llm:
            assert isinstance(llm, StoreReplay) and isinstance(llm.inner, LLMClient)
            first = await llm.chat("solution", QUESTION, key=KEY)
            again = await llm.chat("solution", QUESTION, key=KEY)
        [stored] = store.calls()
    assert sim.stats().total_requests == 1
    assert stored.content == first.content and first.call_id == stored.call_id
    assert again.replayed and not first.replayed
    assert (stats.calls, stats.replayed) == (1, 1)
    assert stats.usage == first.usage + again.usage


async def test_without_a_store_every_call_goes_over_the_wire(sim: SimServer) -> None:
    async with open_model(settings_for(sim)) as llm:
        assert isinstance(llm, LLMClient)
        first = await llm.chat("solution", QUESTION, key=KEY)
        again = await llm.chat("solution", QUESTION, key=KEY)
    assert sim.stats().total_requests == 2
    assert not first.replayed and not again.replayed


async def test_the_client_alone_records_only_what_an_endpoint_refused(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(stream="refuse", rules=[Rule(replies=["\\boxed{391}"])]))
    with RunStore(tmp_path) as store:
        async with LLMClient(settings_for(sim, endpoint__stream="auto"), downgrade_log=store) as llm:
            reply = await llm.chat("solution", QUESTION, key=KEY)
        assert reply.ok
        assert list(store.calls()) == []
        assert list(store.downgrades("stream")) == [sim.base_url]
