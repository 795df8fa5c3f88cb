"""What a server refuses is learnt and recorded per endpoint and model: one URL (a router, a hosted API, vLLM with
several served models) may refuse a field for one model and take it for another. Each model's requests keep what
only another model refused, and the run's records name the model each refusal was for; records stored by an earlier
version, which name none, stay readable under their URL alone."""

from __future__ import annotations

from pathlib import Path

from conftest import settings_for
from tmas.llm.factory import open_model
from tmas.llm.model import ClientStats
from tmas.llm.types import CallKey, user
from tmas.store.run_store import RunStore
from tmas.testing import SimScript, SimServer

QUESTION = [user("What is 17*23?")]


async def test_a_sampling_refusal_of_one_model_is_recorded_for_it_alone(tmp_path: Path) -> None:
    # The solver's reasoning model refuses temperature and max_tokens; the refiner's chat model at the same URL
    # takes both, before and after the solver's refusals.
    script = SimScript(persona="openai", reasoning=True, model="o3-mini", also_serves=["gpt-4.1"])
    roles = {"refiner": {"model": "gpt-4.1", "sampling": {"temperature": 0.2}}}
    stats = ClientStats()
    async with SimServer(script) as sim:
        settings = settings_for(sim, endpoint={"model": "o3-mini", "base_url": [sim.base_url]}, roles=roles)
        with RunStore(tmp_path) as store:
            async with open_model(settings, store, stats=stats) as llm:
                assert (await llm.chat("refiner", QUESTION)).ok
                assert (await llm.chat("solution", QUESTION)).ok
                assert (await llm.chat("refiner", QUESTION, key=CallKey(role="refiner", sample=1))).ok
            recorded = store.downgrades("sampling")
            messages = store.downgrade_messages()
        refiner = sim.chat_bodies("refiner")
    assert [b["temperature"] for b in refiner] == [0.2, 0.2] and all("max_tokens" in b for b in refiner)
    assert list(recorded) == [sim.base_url] and list(recorded[sim.base_url]) == ["o3-mini"]
    assert recorded[sim.base_url]["o3-mini"]["model"] == "o3-mini"
    assert list(messages["sampling"]) == [f"{sim.base_url} (model o3-mini)"]
    assert list(stats.downgrades["sampling"][sim.base_url]) == ["o3-mini"]


async def test_two_models_at_one_url_that_both_refuse_are_each_recorded(tmp_path: Path) -> None:
    # Neither model streams: each learns it from its own refusal, and each refusal is kept (before, the first
    # model's record stood for the URL and the second went unrecorded).
    script = SimScript(stream="refuse", model="big", also_serves=["small"])
    roles = {"verifier": {"model": "small"}}
    async with SimServer(script) as sim:
        settings = settings_for(sim, endpoint={"model": "big", "base_url": [sim.base_url]}, roles=roles)
        with RunStore(tmp_path) as store:
            async with open_model(settings, store) as llm:
                assert (await llm.chat("solution", QUESTION)).ok
                assert (await llm.chat("verifier", QUESTION)).ok
                assert (await llm.chat("verifier", QUESTION, key=CallKey(role="verifier", sample=1))).ok
            recorded = store.downgrades("stream")
        sent = [(b["model"], b.get("stream", False)) for b in sim.chat_bodies()]
    assert sent == [("big", True), ("big", False), ("small", True), ("small", False), ("small", False)]
    assert {model: f["role"] for model, f in recorded[sim.base_url].items()} == {"big": "solution", "small": "verifier"}


def test_a_refusal_stored_without_a_model_is_read_under_its_url(tmp_path: Path) -> None:
    # An earlier version stored one refusal per URL, naming no model: it is read as the run's, shown under the URL
    # alone, and a refusal recorded now for a named model is kept beside it.
    with RunStore(tmp_path) as store:
        old = {"role": "solution", "message": "no SSE", "at": 1.0}
        store.set_meta("stream_downgrades", {"http://a/v1": old})
        assert store.downgrades("stream") == {"http://a/v1": {"": old}}
        store.record_downgrade("stream", "http://a/v1", "verifier", "no SSE either", "small")
        assert store.downgrade_messages() == {
            "stream": {"http://a/v1": "no SSE", "http://a/v1 (model small)": "no SSE either"}
        }
