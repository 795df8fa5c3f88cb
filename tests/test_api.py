"""The Python API (tmas.solve, tmas.asolve, tmas.api.arun) as a user of the library meets it: reached from
``import tmas`` alone, called where an event loop already runs, and retried in the same directory once the server is
up."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import warnings
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tmas
import tmas.api
from conftest import clean_env, dead_url, scripted_settings, settings_for
from tmas.errors import ConfigError, InputError
from tmas.llm.types import Completion, Message
from tmas.runner import Unreachable
from tmas.store.run_lock import LockHeld, running
from tmas.store.run_store import RunStore
from tmas.testing import SimServer
from tmas.testing.scripted_model import ScriptedModel

PROBLEM = '{"problem_id": "p1", "question": "What is 17*23?", "answer": "391"}\n'


async def test_an_endpoint_not_up_leaves_no_run_directory_and_the_same_call_works_once_it_is(
    tmp_path: Path, sim: SimServer
) -> None:
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM)
    with dead_url() as url:
        down = settings_for(sim, method={"name": "cot"}).model_copy(deep=True)
        down.endpoint.base_url = [url]
        with pytest.raises(Unreachable, match=f"cannot connect to {url}") as caught:
            await tmas.api.arun(problems, tmp_path / "run", down)
        assert "--resume" not in str(caught.value)
        with pytest.raises(Unreachable, match=f"cannot connect to {url}"):
            await tmas.api.asolve("What is 17*23?", down, run_dir=tmp_path / "question")
    assert not (tmp_path / "run").exists() and not (tmp_path / "question").exists()
    assert sim.chat_bodies() == []
    up = settings_for(sim, method={"name": "cot"})
    summary = await tmas.api.arun(problems, tmp_path / "run", up)
    result = await tmas.api.asolve("What is 17*23?", up, run_dir=tmp_path / "question")
    assert (summary.done, result.answer) == (1, "391")
    assert len(sim.chat_bodies()) == 2


def test_the_api_module_is_reached_from_import_tmas_alone() -> None:
    # As the README writes it: `import tmas`, then tmas.api.arun(...), with nothing of tmas.api imported before.
    code = (
        "import sys, tmas\n"
        "assert 'tmas.api' not in sys.modules\n"
        "print(tmas.api.arun.__name__, tmas.api.aresume.__name__)\n"
        "try:\n"
        "    tmas.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["arun aresume", "module 'tmas' has no attribute 'no_such_name'"]


async def test_the_blocking_solve_inside_a_running_loop_says_to_await_asolve(sim: SimServer) -> None:
    # A notebook's cell runs inside an event loop: the blocking call cannot start another there, and says what to use.
    settings = settings_for(sim, method={"name": "cot"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no coroutine left never awaited
        with pytest.raises(RuntimeError, match=r"^tmas.solve cannot run inside a running event loop; .*tmas.asolve"):
            tmas.solve("What is 17*23?", settings)
    assert sim.chat_bodies() == []
    assert (await tmas.asolve("What is 17*23?", settings)).answer == "391"


async def test_settings_given_as_a_mapping_reach_the_wire_as_a_configuration_file_does(sim: SimServer) -> None:
    # As tmas.toml's tables: a [sampling] field given counts as set, even at its built-in default (0.7), so a preset's
    # sampling (the paper's temperature 1.0) does not replace it.
    given = {
        "endpoint": {"base_url": sim.base_url, "model": "sim-model"},
        "sampling": {"temperature": 0.7, "max_tokens": 300},
        "seed": 5,
    }
    params = {"preset": "paper", "n": 1, "m": 1, "iterations": 1}
    result = await tmas.asolve("What is 17*23?", given, method="tmas", params=params)
    assert result.answer == "391"
    bodies = sim.chat_bodies("solution")
    assert bodies and {(b["model"], b["temperature"], b["max_tokens"]) for b in bodies} == {("sim-model", 0.7, 300)}
    with pytest.raises(ConfigError, match=r"^settings: bad value for 'sampling.temperature'"):
        await tmas.asolve("What is 17*23?", {**given, "sampling": {"temperature": "hot"}})
    with pytest.raises(ConfigError, match=r"^settings: unknown config key 'endpont'"):
        await tmas.api.arun("problems.jsonl", "run", {"endpont": {}})


async def test_the_api_refuses_a_run_over_its_cost_limits_before_any_call_as_the_cli_asks_first(
    tmp_path: Path, sim: SimServer
) -> None:
    # Majority voting over 8 samples, one round: 8 calls a problem, 16 at most with every sample asked again once,
    # at most 256 completion tokens each.
    settings = settings_for(sim, method={"name": "majority", "params": {"k": 8, "iterations": 1}})
    with pytest.raises(InputError, match=r"^tmas.solve: the estimate is 16 calls \(threshold 5\): .* max_calls=N"):
        await tmas.asolve("What is 17*23?", settings, run_dir=tmp_path / "question", max_calls=5)
    tokens = r"^tmas.solve: the estimate is 4.1k completion tokens \(threshold 1.0k\): .* max_completion_tokens=N"
    with pytest.raises(InputError, match=tokens):
        await tmas.asolve("What is 17*23?", settings, max_completion_tokens=1000)
    # The paper's TMAS on one question, with no limit given: over the 500 calls `tmas solve` asks about.
    with pytest.raises(InputError, match=r"^tmas.solve: the estimate is 2,000 calls \(threshold 500\)"):
        await tmas.asolve("What is 17*23?", settings, method="tmas", params={"preset": "paper"})
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM + PROBLEM.replace("p1", "p2"))
    with pytest.raises(InputError, match=r"^tmas.api.arun: the estimate is 32 calls \(threshold 10\)"):
        await tmas.api.arun(problems, tmp_path / "run", settings, max_calls=10)
    assert sim.chat_bodies() == []
    assert not (tmp_path / "question").exists() and not (tmp_path / "run").exists()

    # Within the limits (or with none), as asked.
    assert (await tmas.asolve("What is 17*23?", settings, max_calls=None)).answer == "391"
    assert len(sim.chat_bodies()) == 8
    summary = await tmas.api.arun(problems, tmp_path / "run", settings, max_calls=32)
    assert summary.done == 2 and len(sim.chat_bodies()) == 8 + 16


async def test_a_resume_through_the_api_counts_only_the_calls_it_has_still_to_send(
    tmp_path: Path, sim: SimServer
) -> None:
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM + PROBLEM.replace("p1", "p2"))
    settings = settings_for(sim, method={"name": "majority", "params": {"k": 4, "iterations": 1}})
    await tmas.api.arun(problems, tmp_path / "run", settings)
    with sqlite3.connect(tmp_path / "run" / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'p2'")
        db.execute("DELETE FROM calls WHERE problem_id = 'p2'")
    sim.reset()
    # p1 finished and is skipped: p2's 4 calls, 8 with every sample asked again. (Over both problems less p1's 4
    # stored calls it would be 12: p1's samples asked again, which it never sends.)
    with pytest.raises(InputError, match=r"^tmas.api.aresume: the estimate is 8 calls \(threshold 7\)"):
        await tmas.api.aresume(tmp_path / "run", max_calls=7)
    assert sim.chat_bodies() == []
    summary = await tmas.api.aresume(tmp_path / "run", max_calls=8)
    assert summary.done == 2 and len(sim.chat_bodies()) == 4


async def test_a_run_directory_in_use_is_refused_with_advice_for_the_api(tmp_path: Path, sim: SimServer) -> None:
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM)
    settings = settings_for(sim, method={"name": "cot"})
    await tmas.api.arun(problems, tmp_path / "run", settings)
    # A second arun into it: the call that continues the run, not the command's flag.
    with pytest.raises(InputError) as caught:
        await tmas.api.arun(problems, tmp_path / "run", settings)
    resume = f"tmas.api.aresume({str(tmp_path / 'run')!r})"
    assert (
        str(caught.value)
        == f"{tmp_path / 'run'}: already holds a run; continue it with {resume} or choose another directory"
    )
    # A call on it still going on in this process (its store holds the lock): said so, not another process.
    with running(tmp_path / "run"), pytest.raises(LockHeld) as held:
        await tmas.api.aresume(tmp_path / "run")
    said = str(held.value)
    assert said.startswith(f"{tmp_path / 'run'}: this process is running this run already")
    assert "another" not in said and "stop it" not in said
    assert len(sim.chat_bodies()) == 1


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        ({"sampling.temperature": -1}, "{'sampling.temperature': -1}: Input should be greater than or equal to 0"),
        # A check across keys names the override under the key it checks.
        ({"budget.pool": True}, "{'budget.pool': True}: budget.pool moves unused tokens between problems: it needs"),
    ],
)
async def test_a_bad_override_to_aresume_names_the_argument_not_a_command_line(
    tmp_path: Path, sim: SimServer, overrides: dict[str, object], said: str
) -> None:
    # Before: "command line: bad value for 'sampling.temperature': ...", of a call that had no command line.
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM)
    await tmas.api.arun(problems, tmp_path / "run", settings_for(sim, method={"name": "cot"}))
    sim.reset()
    with pytest.raises(ConfigError) as caught:
        await tmas.api.aresume(tmp_path / "run", {**overrides, "seed": 7})
    assert str(caught.value).startswith(f"tmas.api.aresume: bad value for overrides={said}")
    assert sim.chat_bodies() == []


async def test_iterations_given_to_a_method_of_one_round_through_the_api_is_refused_before_any_call(
    tmp_path: Path, sim: SimServer
) -> None:
    # Before, cot ran its one call as without them: params= and settings' [method] params dropped without a word.
    said = "does not apply to method 'cot': it runs one round; leave it out"
    settings = settings_for(sim, method={"name": "cot"})
    with pytest.raises(InputError) as caught:
        await tmas.asolve("What is 17*23?", settings, params={"iterations": 3})
    assert str(caught.value) == f"tmas.solve: params['iterations'] {said}"
    with pytest.raises(InputError) as caught:
        await tmas.asolve("What is 17*23?", settings_for(sim), method="cot", params={"iterations": 2})
    assert str(caught.value) == f"tmas.solve: params['iterations'] {said}"
    given = {"endpoint": {"base_url": sim.base_url}, "method": {"name": "cot", "params": {"iterations": 3}}}
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM)
    for call in [
        tmas.asolve("What is 17*23?", given),
        tmas.api.arun(problems, tmp_path / "new", given),
        tmas.api.arun(problems, tmp_path / "new", settings_for(sim, method=given["method"])),
    ]:
        with pytest.raises(ConfigError) as refused:
            await call
        assert str(refused.value) == f"settings: method.params.iterations {said}"
    assert sim.chat_bodies() == [] and not (tmp_path / "new").exists()

    await tmas.api.arun(problems, tmp_path / "run", settings)
    sim.reset()
    with pytest.raises(InputError) as caught:
        await tmas.api.aresume(tmp_path / "run", params={"iterations": 4})
    assert str(caught.value) == f"tmas.api.aresume: params['iterations'] {said}"
    config = tmp_path / "again.toml"
    config.write_text('[method]\nname = "cot"\nparams = { iterations = 4 }\n', encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        await tmas.api.aresume(tmp_path / "run", config=config)
    assert str(refused.value) == f"{config}: method.params.iterations {said}"
    assert sim.chat_bodies() == []
    # One round is what it runs: said so, it is no contradiction.
    assert (await tmas.asolve("What is 17*23?", settings, params={"iterations": 1})).answer == "391"


async def test_a_cost_limit_that_cannot_be_one_is_refused_before_any_call(tmp_path: Path, sim: SimServer) -> None:
    # NaN compares false with every estimate: taken as given, it let a run of any size through unasked.
    settings = settings_for(sim, method={"name": "majority", "params": {"k": 8, "iterations": 1}})
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM)
    nan = float("nan")
    with pytest.raises(InputError, match=r"^tmas.solve: max_completion_tokens must be a number 0 or more, or None"):
        await tmas.asolve("What is 17*23?", settings, max_calls=None, max_completion_tokens=nan)
    with pytest.raises(
        InputError, match=r"^tmas.api.arun: max_calls must be a number 0 or more, or None .*\(got nan\)$"
    ):
        await tmas.api.arun(problems, tmp_path / "run", settings, max_calls=nan)
    # Below 0 every run would be refused, its message naming a threshold of -1.
    with pytest.raises(InputError, match=r"^tmas.solve: max_calls must be a number 0 or more, or None .*\(got -1\)$"):
        await tmas.asolve("What is 17*23?", settings, max_calls=-1)
    assert sim.chat_bodies() == []
    assert not (tmp_path / "run").exists()
    await tmas.api.arun(problems, tmp_path / "run", settings)
    count = len(sim.chat_bodies())
    with pytest.raises(InputError, match=r"^tmas.api.aresume: max_completion_tokens must be .*\(got nan\)$"):
        await tmas.api.aresume(tmp_path / "run", max_completion_tokens=nan)
    assert len(sim.chat_bodies()) == count


@pytest.mark.parametrize(
    ("call", "said"),
    [
        ({"settings": 42}, "tmas.solve: settings must be a tmas.config.Settings or a mapping of tmas.toml's keys"),
        ({"params": ["k", 8]}, "tmas.solve: params must be a mapping of parameter names to values (got list"),
        ({"method": 3}, "tmas.solve: method must be a method's name (str) (got int 3)"),
        ({"run_dir": 3}, "tmas.solve: run_dir must be a path (str or pathlib.Path) (got int 3)"),
        ({"model": "gpt"}, "tmas.solve: model must be a tmas.llm.model.ChatModel"),
        ({"max_calls": "5"}, "tmas.solve: max_calls must be a number 0 or more, or None for no limit (got '5')"),
        ({"arun": {"problems": 42}}, "tmas.api.arun: problems must be a path (str or pathlib.Path) of a JSONL"),
        ({"arun": {"problems": [{"question": "q"}]}}, "tmas.api.arun: problems must be a path"),
        ({"arun": {"out": None}}, "tmas.api.arun: out must be a path (str or pathlib.Path) (got NoneType None)"),
        ({"arun": {"settings": 42}}, "tmas.api.arun: settings must be a tmas.config.Settings or a mapping"),
        ({"aresume": {"run_dir": 42}}, "tmas.api.aresume: run_dir must be a path (str or pathlib.Path) (got int"),
        ({"aresume": {"overrides": ["a=1"]}}, "tmas.api.aresume: overrides must be a mapping of dotted settings"),
        ({"aresume": {"params": [1]}}, "tmas.api.aresume: params must be a mapping of parameter names to values"),
        # Before, an AttributeError ('int' object has no attribute 'startswith').
        ({"aresume": {"overrides": {1: 2}}}, "tmas.api.aresume: overrides must be a mapping of dotted settings keys"),
    ],
)
async def test_an_argument_of_the_wrong_kind_is_refused_in_one_line_naming_it(
    tmp_path: Path, sim: SimServer, call: dict[str, Any], said: str
) -> None:
    # Before, settings=42 or params=[...] failed deep inside with an AttributeError or a TypeError.
    settings = settings_for(sim, method={"name": "cot"})
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM)
    asked: Coroutine[Any, Any, object]
    if "arun" in call:
        given = {"problems": problems, "out": tmp_path / "run", "settings": settings, **call["arun"]}
        asked = tmas.api.arun(given.pop("problems"), given.pop("out"), **given)
    elif "aresume" in call:
        await tmas.api.arun(problems, tmp_path / "run", settings)
        given = {"run_dir": tmp_path / "run", **call["aresume"]}
        asked = tmas.api.aresume(given.pop("run_dir"), **given)
    else:
        asked = tmas.asolve("What is 17*23?", **{"settings": settings, **call})
    with pytest.raises(InputError) as caught:
        await asked
    assert str(caught.value).startswith(said) and "\n" not in str(caught.value)
    assert len(sim.chat_bodies()) == (1 if "aresume" in call else 0)  # the first run's call alone


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"path": 42}, "tmas.load_settings: path must be a path (str or pathlib.Path) (got int)"),
        ({"overrides": [("sampling.temperature", 0.6)]}, "tmas.load_settings: overrides must be a mapping of dotted"),
        ({"overrides": {1: 2}}, "tmas.load_settings: overrides must be a mapping of dotted settings keys (str)"),
    ],
)
def test_load_settings_given_the_wrong_kind_says_so_in_one_line(given: dict[str, Any], said: str) -> None:
    # Before, a TypeError from pathlib, or an AttributeError from the overrides' keys.
    with pytest.raises(InputError) as caught:
        tmas.load_settings(**given)
    assert str(caught.value).startswith(said) and "\n" not in str(caught.value)


async def test_a_run_limited_to_no_problem_or_fewer_is_refused_rather_than_run_whole(
    tmp_path: Path, sim: SimServer
) -> None:
    # limit=0 read as no limit at all solved every problem of the file; a negative one failed inside islice.
    settings = settings_for(sim, method={"name": "cot"})
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM + PROBLEM.replace("p1", "p2"))
    for limit in (0, -1):
        with pytest.raises(
            InputError, match=rf"^tmas.api.arun: limit must be a whole number of problems, 1 or more \(got {limit}\)$"
        ):
            await tmas.api.arun(problems, tmp_path / "run", settings, limit=limit, max_calls=None)
    assert sim.chat_bodies() == []
    assert not (tmp_path / "run").exists()
    summary = await tmas.api.arun(problems, tmp_path / "run", settings, limit=1)
    assert (summary.done, len(sim.chat_bodies())) == (1, 1)


@dataclass
class CancellingModel(ScriptedModel):  # type: ignore[misc]
    """A scripted model that cancels ``task`` as its ``at``-th call starts (that call, and any after it, then go
    unanswered): a caller's cancel landing mid-run, at a point fixed by the calls made rather than by time."""

    at: int = 1
    started: int = 0
    task: asyncio.Future[Any] | None = None

    async def chat(self, role: str, messages: Sequence[Message], **kw: Any) -> Completion:
        self.started += 1
        if self.started == self.at and self.task is not None:
            self.task.cancel()
        return await super().chat(role, messages, **kw)


async def test_a_run_cancelled_mid_way_keeps_its_finished_calls_and_resumes_from_them(tmp_path: Path) -> None:
    # TMAS with N = 2, M = 1, T = 2 on one problem: 6 calls in iteration 0 (2 solutions, 2 verifications, 2
    # summaries) and 2 memory calls before iteration 1's 4 (no memory after the last): 12 calls.
    settings = scripted_settings(method={"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 2}})
    problems = tmp_path / "problems.jsonl"
    problems.write_text(PROBLEM)
    model = CancellingModel(settings=settings, at=8)
    model.task = asyncio.ensure_future(tmas.api.arun(problems, tmp_path / "run", settings, model=model))
    with pytest.raises(asyncio.CancelledError):
        await model.task
    with RunStore(tmp_path / "run", create=False) as store:
        kept = store.call_counts()
    assert 0 < kept["calls"] < 12 and kept["failed"] == 0
    again = ScriptedModel(settings=settings)
    summary = await tmas.api.aresume(tmp_path / "run", model=again)
    assert (summary.done, summary.replayed_calls, summary.calls) == (1, kept["calls"], 12 - kept["calls"])
    assert len(again.calls) == 12 - kept["calls"]
