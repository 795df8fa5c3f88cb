"""A resume repairs what a failing server cost: a finished problem with a call that failed after its retries is solved
again, every replied call replayed from the store and only the failed call (and what depends on its reply) sent, on
the simulated server, for every method; a problem without one is left as it is."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import run_tmas, settings_for
from tmas.config import Settings
from tmas.problems import Problem
from tmas.runner import RunSummary, prepare_run, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import Rule, SimScript, SimServer

PROBLEMS = [Problem(problem_id=f"q{i}", question=f"What is {i + 2}*7?", answer=str((i + 2) * 7)) for i in range(2)]


def one_failure(role: str) -> SimScript:
    """q0's first call of ``role`` fails (the run sends each call once: a failed call is one request)."""
    return SimScript(rules=[Rule(role=role, pattern=r"What is 2\*7", fault="http_500", times=1)])


def wire(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True)


async def run(sim: SimServer, settings: Settings, run_dir: Path, *, resume: bool) -> RunSummary:
    store, settings, todo = prepare_run(run_dir, settings, None if resume else PROBLEMS, resume=resume)
    with store:
        return await run_problems(settings, todo, store)


@pytest.mark.parametrize(
    ("method", "params", "role"),
    [
        ("cot", {}, "solution"),
        ("majority", {"k": 3}, "solution"),
        ("self_refine", {"n": 2, "iterations": 2}, "solution"),
        ("verify_refine", {"n": 2, "m": 1, "iterations": 2}, "verifier"),
        ("rse", {"n": 2, "iterations": 2}, "solution"),
        ("pacore", {"responses_per_round": 2, "iterations": 2}, "solution"),
        # A failed verification of iteration 0: its summary, the banks and iteration 1 depend on its reply.
        ("tmas", {"n": 2, "m": 1, "iterations": 2}, "verifier"),
        ("tmas", {"n": 2, "m": 1, "iterations": 2}, "experience"),
        ("mattrl", {}, "specialist"),
    ],
)
async def test_a_resume_asks_only_the_failed_calls_and_what_depends_on_them(
    sim: SimServer, tmp_path: Path, method: str, params: dict[str, Any], role: str
) -> None:
    settings = settings_for(sim, method={"name": method, "params": params}, retry={"max_attempts": 1})
    run_dir = tmp_path / "run"
    sim.set_script(one_failure(role))
    first = await run(sim, settings, run_dir, resume=False)
    # A problem whose one sample failed failed; any other went on without the failed call's reply.
    status = "failed" if method == "cot" else "done"
    assert first.failed == (status == "failed") and first.failed_calls == 1
    assert first.problems_with_failed_calls == (status == "done")
    with RunStore(run_dir, create=False) as store:
        assert [(r.problem_id, r.status, r.failed_calls) for r in store.results()] == [
            ("q0", status, 1),
            ("q1", "done", 0),
        ]
    sent = [wire(r.body) for r in sim.requests if r.endpoint == "chat"]
    failed = next(wire(r.body) for r in sim.requests if r.role == role and r.problem_id == "q0")
    replied = set(sent) - {failed}
    assert sent.count(failed) == 1

    # The server still fails that call: it alone is asked again, and everything after it replays as before.
    sim.reset()
    sim.set_script(one_failure(role))
    still = await run(sim, settings, run_dir, resume=True)
    assert [wire(b) for b in sim.chat_bodies()] == [failed]
    assert (still.skipped, still.calls, still.problems_with_failed_calls) == (1, 1, status == "done")
    with RunStore(run_dir, create=False) as store:
        kept = store.result("q0")
        assert kept is not None and (kept.status, kept.failed_calls) == (status, 1)

    # The server healthy: the failed call is asked first, then only calls whose requests changed with its reply; no
    # call that was replied before reaches the server, and q1 (no failed call) sends nothing.
    sim.reset()
    sim.set_script(SimScript())
    repaired = await run(sim, settings, run_dir, resume=True)
    asked = [r for r in sim.requests if r.endpoint == "chat"]
    assert wire(asked[0].body) == failed
    assert not {wire(r.body) for r in asked} & replied
    assert {r.problem_id for r in asked} == {"q0"}
    assert (repaired.done, repaired.failed, repaired.skipped, repaired.problems_with_failed_calls) == (2, 0, 1, 0)
    with RunStore(run_dir, create=False) as store:
        result = store.result("q0")
        assert result is not None and (result.status, result.failed_calls) == ("done", 0)
        assert not any(c.error for record in store.iterations("q0") for c in record.candidates)

    # Nothing failed any more: a resume sends nothing.
    sim.reset()
    again = await run(sim, settings, run_dir, resume=True)
    assert sim.chat_bodies() == [] and again.skipped == 2


def test_the_command_resumes_a_finished_run_asking_only_its_failed_sample(sim: SimServer, tmp_path: Path) -> None:
    # A majority vote of 3 samples per problem, calls sent once (no retry): q0's first sample fails, the run ends with
    # every problem done.
    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(json.dumps(p.model_dump(include={"problem_id", "question"})) + "\n" for p in PROBLEMS))
    config = tmp_path / "tmas.toml"
    config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "sim-model"\n[retry]\nmax_attempts = 1\n')
    run_dir = tmp_path / "run"
    sim.set_script(one_failure("solution"))
    first = run_tmas("run", str(problems), "-o", str(run_dir), "--config", str(config), "-m", "majority", "-p", "k=3")
    assert first.returncode == 0, first.stderr.decode()
    assert json.loads(first.stdout)["problems_with_failed_calls"] == 1
    assert (
        "notice: 1 finished problem holds calls that failed after their retries (solved without their replies):"
        f" 'tmas run --resume {run_dir}' asks them again" in first.stderr.decode()
    )
    failed = next(wire(r.body) for r in sim.requests if r.problem_id == "q0")
    with RunStore(run_dir, create=False) as store:
        assert [r.failed_calls for r in store.results()] == [1, 0]

    # The server healthy: the resume sends that one request, and q0 votes over its three samples.
    sim.reset()
    sim.set_script(SimScript())
    again = run_tmas("run", "--resume", str(run_dir))
    assert again.returncode == 0, again.stderr.decode()
    assert [wire(b) for b in sim.chat_bodies()] == [failed]
    summary = json.loads(again.stdout)
    assert (summary["done"], summary["skipped"], summary["calls"], summary["replayed_calls"]) == (2, 1, 1, 2)
    # The call that failed stays in the run's history, as a call asked again: no failure of the run, and no result
    # holds it any more.
    assert (summary["failed_calls"], summary["asked_again_calls"], summary["problems_with_failed_calls"]) == (0, 1, 0)
    assert "finished problem" not in again.stderr.decode()
    with RunStore(run_dir, create=False) as store:
        assert [r.failed_calls for r in store.results()] == [0, 0]
        assert [len(r.iterations[0].candidates) for r in store.results()] == [3, 3]
        assert not any(c.error for r in store.results() for c in r.iterations[0].candidates)


def test_a_resume_gates_on_every_call_a_failed_one_may_change(sim: SimServer, tmp_path: Path) -> None:
    # TMAS, 2 iterations: one verification of q0 fails. Asked again, its reply changes q0's summary, banks and second
    # iteration: the calls stored after it are not replayed, and the gate's count of what is still to send holds them.
    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(json.dumps(p.model_dump(include={"problem_id", "question"})) + "\n" for p in PROBLEMS))
    config = tmp_path / "tmas.toml"
    config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "sim-model"\n[retry]\nmax_attempts = 1\n')
    run_dir = tmp_path / "run"
    sim.set_script(one_failure("verifier"))
    params = ["-m", "tmas", "-p", "n=2", "-p", "m=1", "--iterations", "2"]
    first = run_tmas("run", str(problems), "-o", str(run_dir), "--config", str(config), *params)
    assert first.returncode == 0, first.stderr.decode()
    sim.reset()
    sim.set_script(SimScript())
    dry = run_tmas("run", "--resume", str(run_dir), "--dry-run")
    assert dry.returncode == 0, dry.stderr.decode()
    found = re.search(
        r"stored: (\d+) answered calls, replayed rather than sent; at most (\d+) still to send", dry.stderr.decode()
    )
    assert found is not None and sim.chat_bodies() == []
    to_send = int(found[2])
    again = run_tmas("run", "--resume", str(run_dir))
    assert again.returncode == 0, again.stderr.decode()
    summary = json.loads(again.stdout)
    # More than the failed call is sent, and no more than the gate was told.
    assert 1 < summary["calls"] == len(sim.chat_bodies()) <= to_send
