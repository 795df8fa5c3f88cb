"""A run whose store can no longer be written (the disk full, as SQLite meets it: SQLITE_FULL) stops at once with
one line naming the store and how to go on; what was committed before stays, and the resume repeats none of it."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.llm.types import ChatRequest, Completion
from tmas.problems import Problem
from tmas.runner import RunState, StoreFailed, prepare_run, run_problems
from tmas.store import database, run_store
from tmas.store.call_log import CallLog
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript


def filler(seed: int) -> str:
    """Text that does not compress away: each call storing it needs pages the store does not have yet."""
    return "".join(hashlib.sha256(f"{seed}-{i}".encode()).hexdigest() for i in range(300))


PROBLEMS = [
    Problem(problem_id=f"p{i}", question=f"What is {i + 2}*7? Context: {filler(i)}", answer=str((i + 2) * 7))
    for i in range(3)
]


async def test_a_full_store_stops_the_run_with_one_line_and_its_resume_repeats_no_stored_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = scripted_settings(method={"name": "majority", "params": {"k": 2, "iterations": 2}}, problems_in_flight=1)
    model = ScriptedModel(SimScript(), settings)
    run_dir = tmp_path / "run"
    opened: list[sqlite3.Connection] = []

    def open_writable(path: Path) -> tuple[sqlite3.Connection, bool]:
        db, migrate = database.open_writable(path)
        opened.append(db)
        return db, migrate

    # The store opened as it opens it, its connection kept to fill its disk.
    monkeypatch.setattr(run_store, "open_writable", open_writable)

    def fill_the_disk(problem_id: str, iteration: int) -> None:
        # As the second problem starts its second iteration, the store may grow by no page more.
        if (problem_id, iteration) == ("p1", 1):
            db = opened[-1]
            db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")

    store, settings, todo = prepare_run(run_dir, settings, PROBLEMS, resume=False, own_model=True)
    with store, pytest.raises(StoreFailed) as failed:
        await run_problems(settings, todo, store, model=model, state=RunState(on_iteration=fill_the_disk))
    line = str(failed.value)
    assert "\n" not in line
    assert line.startswith(f"{run_dir / 'run.sqlite'}: the run's store failed (database or disk is full)")
    assert line.endswith(f"continue with 'tmas run --resume {run_dir}' once it can be written")
    sent = len(model.calls)
    # The run stopped at the first write it could not make: the last problem was never started.
    assert not any("What is 4*7?" in call.messages[-1].content for call in model.calls)
    monkeypatch.undo()

    with RunStore(run_dir, create=False) as kept:
        # The first problem's result and every call stored before are kept; no problem is stored as failed by the
        # full disk, and the second problem's first iteration is there to replay.
        assert [(r.problem_id, r.status) for r in kept.results()] == [("p0", "done")]
        stored = [c.key.problem_id for c in kept.calls()]
    assert stored[:6] == ["p0"] * 4 + ["p1"] * 2 and set(stored) == {"p0", "p1"}

    resumed = await scripted_run(model, run_dir)
    assert (resumed.done, resumed.skipped, resumed.replayed_calls) == (3, 1, len(stored) - 4)
    # Every call is sent once, but for those whose replies could not be stored.
    assert resumed.calls == len(model.calls) - sent == 3 * 2 * 2 - len(stored)


async def test_a_reply_the_store_cannot_keep_is_no_failure_of_its_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = scripted_settings(method={"name": "majority", "params": {"k": 2, "iterations": 2}}, problems_in_flight=1)
    model = ScriptedModel(SimScript(), settings)
    real_record = CallLog.record

    def record(log: CallLog, completion: Completion, request: ChatRequest) -> int:
        # A long reply meets the full disk; a smaller write after it could still find room.
        if completion.key.problem_id == "p1":
            raise sqlite3.OperationalError("database or disk is full")
        return real_record(log, completion, request)

    monkeypatch.setattr(CallLog, "record", record)
    with pytest.raises(StoreFailed, match=r"the run's store failed \(database or disk is full\)"):
        await scripted_run(model, tmp_path / "run", PROBLEMS)
    # The run stopped there: the problem is not stored as failed, and the next one was not started.
    with RunStore(tmp_path / "run", create=False) as kept:
        assert [(r.problem_id, r.status) for r in kept.results()] == [("p0", "done")]
    assert not any("What is 4*7?" in call.messages[-1].content for call in model.calls)
