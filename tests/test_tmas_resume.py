"""A TMAS run killed mid-iteration and resumed ends in the same state as an uninterrupted run with the same seed."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env, eventually, run_tmas, scripted_settings, settings_for, wait_for
from scripted_runs import scripted_run
from tmas.api import aresume, arun
from tmas.problems import Problem
from tmas.runner import RunState, resume_settings, stored_settings
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript, SimServer

PROBLEMS = [
    {"problem_id": "mult", "question": "What is 17*23?", "answer": "391"},
    {"problem_id": "tiling", "question": "Let T_n count the tilings of a 2 x n board. Compute T_4.", "answer": "12"},
]
ARGS = ["--method", "tmas", "-T", "4", "-p", "n=3", "-p", "m=2", "-p", "epsilon=0.5", "--seed", "3"]


def tmas(*args: str) -> subprocess.CompletedProcess[bytes]:
    return run_tmas(*args, timeout=120)


def progress(run_dir: Path) -> tuple[int, int, int]:
    """(iteration records, calls, results) stored so far."""
    if not (run_dir / "run.sqlite").exists():
        return 0, 0, 0
    db = sqlite3.connect(run_dir / "run.sqlite")
    try:
        return tuple(  # type: ignore[return-value]
            db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in ("iterations", "calls", "results")
        )
    except sqlite3.OperationalError:
        return 0, 0, 0
    finally:
        db.close()


def final_state(run_dir: Path) -> dict[str, Any]:
    """Everything a run decided, without call ids and timings (which differ between runs by nature)."""
    out: dict[str, Any] = {}
    with RunStore(run_dir, create=False) as store:
        for result in store.results():
            iterations = []
            for record in result.iterations:
                candidates = [
                    {
                        "text": c.text,
                        "answer": c.answer,
                        "score": c.score,
                        "mode": c.meta.mode,
                        "summary": c.meta.summary,
                        "verifier_scores": [v.score for v in c.meta.verifications or []],
                    }
                    for c in record.candidates
                ]
                state = {k: record.state[k] for k in ("modes", "experience_bank", "guideline_bank", "mean_score")}
                iterations.append({"candidates": candidates, "state": state, "selected": record.selected})
            out[result.problem_id] = {"answer": result.answer, "iterations": iterations}
    return out


def sent_key(messages: list[dict[str, Any]], seed: object) -> str:
    """What identifies one call's request: its messages and its per-call seed (distinct for every call)."""
    return json.dumps([messages, seed], sort_keys=True)


def finished_keys(run_dir: Path) -> set[str]:
    """The requests of the calls the store holds as finished."""
    with RunStore(run_dir, read_only=True) as store:
        return {
            sent_key(store.call_messages(c.call_id), store.call_sampling(c.call_id).get("seed"))
            for c in store.calls()
            if c.ok and c.call_id is not None
        }


@pytest.mark.slow
def test_killed_three_times_at_random_moments_and_resumed_equals_uninterrupted(tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    rng = random.Random(6)
    with SimServer(SimScript(accuracy=0.6)) as sim:
        base = ["run", str(problems), "--base-url", sim.base_url, *ARGS]
        reference = tmas(*base, "-o", str(tmp_path / "reference"))
        assert reference.returncode == 0, reference.stderr.decode()
        _, calls_reference, _ = progress(tmp_path / "reference")
        sim.reset()

        killed = tmp_path / "killed"
        # Three kills at random numbers of stored calls, spread over the run; each later run resumes the last. The
        # server answers the calls up to the number and holds the later ones: each kill comes while calls of the
        # wave are in flight and the ones answered are stored, whatever the machine's speed.
        thresholds = sorted(rng.sample(range(5, calls_reference - 5), 3))
        # After each kill: the finished calls in the store, and how many requests the server had seen by then.
        finished_at_kills: list[tuple[set[str], int]] = []
        for i, threshold in enumerate(thresholds):
            stored = progress(killed)[1]
            sim.set_script(SimScript(accuracy=0.6, hold_after=threshold - stored))
            args = [*base, "-o", str(killed)] if i == 0 else ["run", "--resume", str(killed)]
            proc = subprocess.Popen(
                [sys.executable, "-m", "tmas", *args],
                env=clean_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

            def held_with_answers_stored(proc: subprocess.Popen[bytes] = proc, threshold: int = threshold) -> bool:
                assert proc.poll() is None, "the run ended before it was killed"
                return sim.stats().held > 0 and progress(killed)[1] == threshold

            wait_for(held_with_answers_stored, f"the run to store {threshold} calls and wait on the next")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            assert progress(killed)[2] < len(PROBLEMS)  # killed before the end
            finished_at_kills.append((finished_keys(killed), len(sim.requests)))
        sim.set_script(SimScript(accuracy=0.6))  # the gate opens for the last run

        resumed = tmas("run", "--resume", str(killed))
        assert resumed.returncode == 0, resumed.stderr.decode()
        summary = json.loads(resumed.stdout)
        assert summary["done"] == 2 and summary["replayed_calls"] >= len(finished_at_kills[-1][0])
        sent = [sent_key(r.body["messages"], r.body.get("seed")) for r in sim.requests]
    # The server saw no finished call twice: a call stored before a kill was replayed after it, never asked again
    # (a call in flight at a kill was not finished, and may be asked again).
    assert finished_at_kills[-1][0]
    for finished, seen_by_then in finished_at_kills:
        assert finished.isdisjoint(sent[seen_by_then:])
    assert Counter(sent).most_common(1)[0][1] <= 1 + len(thresholds)
    assert finished_keys(killed) == finished_keys(tmp_path / "reference")
    assert final_state(killed) == final_state(tmp_path / "reference")
    # The answer is R_T's best, which with accuracy 0.6 may be wrong for a given prompt text (the sim's slips are
    # drawn from the request's hash): the run found the right value somewhere, and answered from its last iteration.
    mult = final_state(killed)["mult"]
    assert any(c["answer"] == "391" for it in mult["iterations"] for c in it["candidates"])
    assert mult["answer"] == mult["iterations"][-1]["selected"]


async def test_resume_with_more_iterations_continues_from_the_stored_ones(tmp_path: Path) -> None:
    problem = Problem.model_validate(PROBLEMS[0])
    run_dir = tmp_path / "run"
    small = scripted_settings(method__name="tmas", method__params={"n": 2, "m": 1, "iterations": 2})
    await scripted_run(ScriptedModel(SimScript(), small), run_dir, [problem])
    settings = resume_settings(stored_settings(run_dir), {}, stored_at=run_dir, params={"iterations": 3})
    resumed = ScriptedModel(SimScript(), settings)
    summary = await scripted_run(resumed, run_dir)
    # Iterations 0-1 are replayed from the store; only iteration 2 (2 + 2 + 2 + 1 + 1 calls) is new.
    assert len(resumed.calls) == 8 and summary.calls == 8 and summary.replayed_calls > 0
    with RunStore(run_dir, create=False) as store:
        assert len(store.results()[0].iterations) == 3


async def test_a_resumed_run_replays_one_problem_at_a_time_each_until_its_first_new_call(tmp_path: Path) -> None:
    """Replays answer at once: started together, the problems would replay in lockstep and the first new call would
    wait for every problem's replays. Each replays in turn instead, until its first new call (here the first call
    of iteration 2, after a run of 2 iterations resumed with 3), and the calls are still the same."""
    problems = [Problem(problem_id=f"p{k}", question=f"What is {k + 2}*7?", answer=str(7 * (k + 2))) for k in range(3)]
    run_dir = tmp_path / "run"
    params = {"n": 2, "m": 1, "iterations": 2, "skip_final_memory": False}
    first = ScriptedModel(
        SimScript(), scripted_settings(method__name="tmas", method__params=params, problems_in_flight=3)
    )
    await scripted_run(first, run_dir, problems)
    stored = len(first.calls)

    begun: list[tuple[str, int]] = []
    state = RunState(on_iteration=lambda problem_id, t: begun.append((problem_id, t)))
    settings = resume_settings(stored_settings(run_dir), {}, stored_at=run_dir, params={"iterations": 3})
    resumed = ScriptedModel(SimScript(), settings)
    summary = await scripted_run(resumed, run_dir, state=state)
    assert begun == [(p.problem_id, t) for p in problems for t in range(3)]
    # Every stored call replayed, none asked again: the model saw iteration 2 alone (2 + 2 + 2 + 1 + 1 per problem).
    assert summary.done == 3 and summary.replayed_calls == stored
    assert len(resumed.calls) == 3 * 8


async def test_a_problem_that_replays_to_its_end_passes_the_turn_on(tmp_path: Path) -> None:
    """A problem killed after its last call but before its result was saved replays to its end without a new call:
    its end passes the turn on (else the next problem would wait for ever)."""
    problems = [Problem(problem_id=f"p{k}", question=f"What is {k + 2}*7?", answer=str(7 * (k + 2))) for k in range(2)]
    run_dir = tmp_path / "run"
    model = ScriptedModel(
        SimScript(), scripted_settings(method__name="tmas", method__params={"n": 2, "m": 1, "iterations": 1})
    )
    await scripted_run(model, run_dir, problems)
    stored = len(model.calls)
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results")
    summary = await asyncio.wait_for(scripted_run(model, run_dir, settings=stored_settings(run_dir)), timeout=60)
    assert summary.done == 2 and summary.replayed_calls == stored and len(model.calls) == stored


async def test_resume_with_fewer_iterations_keeps_only_the_iteration_records_of_its_result(tmp_path: Path) -> None:
    problem = Problem.model_validate(PROBLEMS[0])
    run_dir = tmp_path / "run"
    settings = scripted_settings(method__name="majority", method__params={"k": 2, "iterations": 4})
    await scripted_run(ScriptedModel(SimScript(), settings), run_dir, [problem])
    resumed = ScriptedModel(
        SimScript(), resume_settings(stored_settings(run_dir), {}, stored_at=run_dir, params={"iterations": 2})
    )
    summary = await scripted_run(resumed, run_dir)
    assert summary.done == 1 and resumed.calls == []  # every call of iterations 0-1 replayed
    with RunStore(run_dir, create=False) as store:
        [result] = store.results()
        # Iterations 2 and 3 of the first solve are no part of the run any more (tmas rl build-data, the report's
        # reply counts and the viewer read these records).
        assert [r.iteration for r in result.iterations] == [0, 1]
        assert [r.iteration for r in store.iterations("mult")] == [0, 1]
        assert [r.model_dump() for r in store.iterations("mult")] == [r.model_dump() for r in result.iterations]


# N = 2, M = 1: an iteration is 8 calls a problem, the last 4 (no summaries and memory update) unless
# skip_final_memory is off.
STOPPED_PARAMS = {"n": 2, "m": 1, "iterations": 3, "epsilon": 0.5}
KEEP_LAST_MEMORY = {"skip_final_memory": False}
ONE_AT_A_TIME = {"problems_in_flight": 1}
ON_VLLM = {"persona": "vllm"}


def finished_calls(run_dir: Path) -> Counter[str]:
    """The requests of the calls the store holds as finished, each as often as it was asked (two candidates that
    wrote the same solution ask their verifier the same request)."""
    with RunStore(run_dir, read_only=True) as store:
        return Counter(
            sent_key(store.call_messages(c.call_id), store.call_sampling(c.call_id).get("seed"))
            for c in store.calls()
            if c.ok and c.call_id is not None
        )


def chat_keys(requests: list[Any]) -> list[str]:
    """The calls of the chat requests received, one per sample: a request of ``n`` samples (vLLM's batches) draws its
    choice i with its seed + i, as each is stored."""
    return [
        sent_key(r.body["messages"], r.body["seed"] + i)
        for r in requests
        if r.endpoint == "chat"
        for i in range(r.body.get("n", 1))
    ]


@pytest.mark.parametrize(
    ("stop_after", "params", "server", "settings_extra", "resumed_iterations", "whole_calls"),
    [
        *((stop, {}, {}, {}, None, 40) for stop in (1, 13, 30, 37)),
        # On vLLM the first iteration's solutions and each candidate's verifications go as one request.
        *((stop, {"m": 2}, ON_VLLM, {}, None, 52) for stop in (3, 20)),
        *((stop, KEEP_LAST_MEMORY, {}, {}, None, 48) for stop in (40, 45)),
        (25, {}, {}, ONE_AT_A_TIME, None, 40),
        # Resumed with more iterations: the stopped run's last iteration is one whose memory update is now needed.
        *((stop, {}, {}, {}, 4, 56) for stop in (30, 37)),
        # Resumed with fewer: the memory update the stopped run made of what is now its last iteration is not used.
        *((stop, {"iterations": 4}, {}, {}, 3, 40) for stop in (30, 45)),
    ],
)
async def test_a_run_stopped_mid_way_and_resumed_sends_exactly_the_calls_the_uninterrupted_run_still_needed(
    tmp_path: Path,
    stop_after: int,
    params: dict[str, Any],
    server: dict[str, Any],
    settings_extra: dict[str, Any],
    resumed_iterations: int | None,
    whole_calls: int,
) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    stopped = {**STOPPED_PARAMS, **params}
    target = {**stopped, **({"iterations": resumed_iterations} if resumed_iterations else {})}
    server = {"accuracy": 0.6, **server}
    with SimServer(SimScript(**server)) as sim:

        def settings(params: dict[str, Any]) -> Any:
            method = {"name": "tmas", "params": params}
            return settings_for(sim, method=method, sampling__seed=3, **settings_extra)

        # The uninterrupted run of the iterations the resumed one ends with.
        await arun(problems, tmp_path / "whole", settings(target))
        whole = Counter(chat_keys(sim.requests))
        assert whole.total() == whole_calls
        if server.get("persona") == "vllm":
            assert any(body.get("n") == 2 for body in sim.chat_bodies("verifier"))
        sim.reset()
        # The server answers the first stop_after calls and holds the rest; the run is stopped while it waits, its
        # answered calls stored.
        sim.set_script(SimScript(**server, hold_after=stop_after))
        cut = tmp_path / "cut"
        running = asyncio.create_task(arun(problems, cut, settings(stopped)))

        def answered() -> int:
            return len(chat_keys([r for r in sim.requests if r.endpoint == "chat"][:stop_after]))

        await eventually(lambda: sim.stats().held > 0 and progress(cut)[1] == answered())
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        finished = finished_calls(cut)
        assert finished.total() == answered() and progress(cut)[2] < len(PROBLEMS)
        sim.set_script(SimScript(**server))
        before = len(sim.requests)
        resumed = {"iterations": resumed_iterations} if resumed_iterations else None
        summary = await aresume(cut, params=resumed)
        sent = chat_keys(sim.requests[before:])
    assert summary.done == len(PROBLEMS)
    # Every finished call replayed, every other call of the uninterrupted run sent once, and nothing else.
    assert len(sent) == (whole - finished).total()
    assert Counter(sent) == whole - finished
    assert finished_calls(cut) == whole | finished
    assert final_state(cut) == final_state(tmp_path / "whole")
