"""Equal-compute budgets: a problem stops at the first call past its token or call budget, keeps what finished, and
its record says so; for the baselines (handled in the method) and TMAS (handled by the runner) alike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import settings_for
from tmas.api import asolve
from tmas.config import Budget
from tmas.methods.base import ProblemResult
from tmas.testing import SimServer

Q = "What is 17*23?"


async def solve(sim: SimServer, method: str, budget: dict[str, int], **params: Any) -> ProblemResult:
    settings = settings_for(sim, method={"name": method, "params": params}, budget=budget)
    return await asolve(Q, settings)


@pytest.mark.parametrize("method", ["self_refine", "rse", "pacore"])
async def test_call_budget_is_never_exceeded_and_partial_iteration_is_kept(sim: SimServer, method: str) -> None:
    params = {"responses_per_round": 2} if method == "pacore" else {"n": 2}
    result = await solve(sim, method, {"calls": 5}, iterations=10, **params)
    chat = [r for r in sim.requests if r.endpoint == "chat"]
    assert len(chat) == 5 and result.calls == 5
    assert result.stopped_reason == "budget" and result.status == "done" and result.answer == "391"
    assert result.counters == {"budget_stops": 1}
    last = result.iterations[-1]
    assert any(note.startswith("stopped: budget spent (5 calls of a budget of 5)") for note in last.notes)


async def test_token_budget_stops_at_the_first_call_past_it(sim: SimServer) -> None:
    # One call per iteration, so the spend before each call is known exactly.
    budget = 1000
    result = await solve(sim, "majority", {"tokens": budget}, k=1, iterations=50)
    spends = [r.usage.total_tokens for r in result.iterations]
    assert result.stopped_reason == "budget" and len(spends) < 50
    # Every call but the last was sent with the spend below the budget; after the last, it was reached.
    assert sum(spends[:-1]) < budget <= sum(spends)
    assert len(sim.requests) == len(spends)


async def test_tmas_is_stopped_by_the_runner_with_its_finished_iterations(sim: SimServer) -> None:
    # n=2, m=1: an iteration is 2 solutions + 2 verifications + 2 summaries + experience + guideline = 8 calls.
    result = await solve(sim, "tmas", {"calls": 10}, n=2, m=1, iterations=5)
    assert len(sim.requests) == 10
    assert result.stopped_reason == "budget" and result.status == "done"
    assert [r.iteration for r in result.iterations] == [0] and result.answer == "391"
    assert "stopped: budget spent" in result.iterations[-1].notes[-1]


async def test_budget_before_any_iteration_is_a_failed_problem(sim: SimServer) -> None:
    result = await solve(sim, "tmas", {"calls": 3}, n=2, m=1, iterations=5)
    assert result.status == "failed" and result.stopped_reason == "budget" and not result.iterations
    assert result.error is not None and "before any iteration finished" in result.error


async def test_no_budget_means_no_stop(sim: SimServer) -> None:
    result = await solve(sim, "self_refine", {}, n=2, iterations=3)
    assert result.stopped_reason is None and len(result.iterations) == 3 and Budget().limited is False


def test_cli_budget_flags(sim: SimServer, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tmas",
            "solve",
            Q,
            "--json",
            "--method",
            "majority",
            "--param",
            "k=2",
            "--iterations",
            "9",
            "--budget-calls",
            "3",
            "--base-url",
            sim.base_url,
            "--run-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        check=True,
    )
    result = ProblemResult.model_validate_json(out.stdout)
    assert result.stopped_reason == "budget" and result.calls == 3
    assert [len(r.candidates) for r in result.iterations] == [2, 1]
