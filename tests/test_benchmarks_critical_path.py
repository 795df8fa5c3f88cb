"""benchmarks/tmas_critical_path.py and benchmarks/orchestrator_scale.py run TMAS as Algorithm 1 writes it: every
iteration, the last included, makes its summaries and memory update, so each has the chain the scripts measure
(solution, verification, summary, memory agent) and N + N x M + N + 2 calls."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark
from tmas.store.run_store import RunStore
from tmas.testing import SimScript, SimServer


@pytest.fixture
def scale(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("orchestrator_scale", monkeypatch)


def test_every_iteration_makes_its_summaries_and_memory_update(scale: ModuleType, tmp_path: Path) -> None:
    n, m, iterations = scale.N, scale.M, 2
    with SimServer(SimScript(log_limit=0)) as sim:
        summary, _ = asyncio.run(scale.solve(tmp_path / "run", sim.url, 1, iterations, 64))
    assert summary.calls == scale.calls_per_problem(iterations) == iterations * (n + n * m + n + 2)
    with RunStore(tmp_path / "run", create=False) as store:
        calls = list(store.calls("p0"))
        roles = Counter((call.key.iteration, call.key.role) for call in calls)
        for iteration in range(iterations):
            assert roles[(iteration, "summary")] == n
            assert roles[(iteration, "experience")] == roles[(iteration, "guideline")] == 1
        # The chain of each iteration, read from the stored latencies (what the scripts report as the measured one).
        latency = {(c.key.iteration, c.key.role, c.key.sample): c.latency_s for c in calls}
        by_hand = sum(
            max(
                latency[(t, "solution", i)]
                + max(latency[(t, "verifier", i * m + j)] for j in range(m))
                + latency[(t, "summary", i)]
                for i in range(n)
            )
            + max(latency[(t, "experience", 0)], latency[(t, "guideline", 0)])
            for t in range(iterations)
        )
        assert scale.measured_chain(store, n, m, "p0") == pytest.approx(by_hand)


def test_the_critical_path_script_measures_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    critical = load_benchmark("tmas_critical_path", monkeypatch)
    # A latency long enough that the N x M verifications are in flight together (the script checks that nothing
    # capped the fan-out).
    nominal, chain, wall = asyncio.run(critical.measure(0.05, 2, 2, 2, True))
    assert nominal == pytest.approx(2 * 4 * 0.05) and chain > 0.0 and wall > 0.0
