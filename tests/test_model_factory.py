"""The one model factory (tmas.llm.factory.open_model): the HTTP client with store replay wrapped around it."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from conftest import isolate, scripted_settings, settings_for
from tmas.api import aresume, arun
from tmas.llm.client import LLMClient
from tmas.llm.factory import open_model
from tmas.llm.model import ClientStats
from tmas.llm.replay import StoreReplay
from tmas.llm.types import CallKey, user
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer

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


README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readmes_model_of_ones_own_runs_as_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The README's example, as a user copies it: a model that sets no request hash; the run's store hashes the
    # requests itself, so a resume finds every call.
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### Runs on a model of your own") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("```\n\nIt prints")]
    assert "request_hash" not in code
    isolate(monkeypatch, tmp_path)
    Path("problems.jsonl").write_text('{"problem_id": "p1", "question": "What is 17*23?", "answer": "391"}\n')
    module = types.ModuleType("readme_example")  # a module of its own, as a user's script is (dataclasses need one)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, "README.md", "exec"), module.__dict__)
    assert capsys.readouterr().out == "391\n1 1\n"
    with RunStore(Path("runs/mine"), create=False) as store:
        [call] = store.calls()
        assert len(call.request_hash) == 64 and store.lookup_call(call.request_hash, 0, call.key.iteration) is not None


async def test_a_model_of_ones_own_gets_the_runs_sampling_not_its_own(tmp_path: Path) -> None:
    """The run's settings (config, flags, a resume's overrides) decide each call's sampling, as for an endpoint, even
    where the caller's model was built on other settings: a configured value never stops short of the model."""
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 17*23?", "answer": "391"}\n')
    method = {"name": "self_refine", "params": {"n": 1, "iterations": 1}}
    model = ScriptedModel(SimScript(), scripted_settings(method=method))  # temperature 0.7
    run = scripted_settings(method=method, sampling__temperature=0.2, sampling__max_tokens=300)
    await arun(problems, tmp_path / "run", run, model=model)
    [first] = model.calls
    assert (first.sampling.temperature, first.sampling.max_tokens) == (0.2, 300)
    assert first.sources["temperature"] != "built-in"
    # Resumed with one more iteration and another temperature: the calls it sends (the problem solved again under the
    # new sampling, then its refinement) go with it.
    await aresume(tmp_path / "run", {"sampling.temperature": 0.4}, params={"iterations": 2}, model=model)
    assert [c.sampling.temperature for c in model.calls] == [0.2, 0.4, 0.4]
    assert [c.key.role for c in model.calls] == ["solution", "solution", "refiner"]
