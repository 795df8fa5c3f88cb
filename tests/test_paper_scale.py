"""benchmarks/paper_scale.py's small version end to end: `tmas run` in a subprocess against simulated vLLM replicas
(their own processes) with thinking-length replies and stalls, cut streams and 503s, killed with SIGKILL half way, then
`tmas run --resume`. Nothing finished before the kill is asked again, every problem finishes, and the store's ratio is
worked out from its files on disk and the text it holds."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark
from tmas.store.run_store import DB_NAME, RunStore


def _benchmark(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("paper_scale", monkeypatch)


@pytest.mark.slow
def test_a_killed_run_resumes_without_sending_a_finished_call_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = _benchmark(monkeypatch)
    # 2 problems, N = M = 2, T = 2: 40 calls. Fault rates raised so that every run meets some (the paper's are 2/2/1 %).
    size = ["--problems", "2", "--iterations", "2", "--n", "2", "--m", "2", "--replicas", "2"]
    pace = ["--tokens-per-s", "100000", "--timeout-s", "0.5", "--faults", "0.06", "0.06", "0.03"]
    args = bench.arguments(["--out", str(tmp_path), *size, *pace])
    bench.write_problems(tmp_path / "problems.jsonl", args.problems)
    with bench.replicas(args) as urls:
        first = bench.first_half(args, urls)
        second = bench.second_half(args, urls)

    # Killed by SIGKILL with part of the run done, not after it.
    assert first["exit"] == -9
    assert first["calls_planned"] == 40
    assert 0 < first["calls_at_kill"] < 40
    # Resumed to the end: every problem, every call, none failed, new calls sent after the resume.
    assert second["exit"] == 0
    assert second["problems_done"] == 2
    assert second["calls"] == 40 and second["failed_calls"] == 0
    assert second["requests_after_resume"] > 0 and second["first_new_call_s"] is not None
    # No finished call was asked again: no request led with a finished call's seed on its prompt, and the samples
    # asked after the resume are exactly the calls stored after it.
    assert second["requests_with_a_finished_calls_seed"] == 0
    assert second["samples_asked_beyond_new_calls"] == 0
    # The faults happened, and the replies were a thinking model's.
    faults = second["replicas"]["faults"]
    assert sum(faults.values()) > 0
    assert second["replicas"]["reasoning_tokens"] >= 40 * 2_000

    store = bench.store_figures(args)
    run = tmp_path / "run"
    assert store["store_bytes"] == sum(p.stat().st_size for p in run.iterdir() if p.name.startswith(DB_NAME))
    with RunStore(run, read_only=True) as held:
        reasoning = sum(len((c.reasoning or "").encode()) for c in held.calls())
    assert reasoning >= 40 * 2_000  # at least 2,000 tokens of reasoning per call, as the store gives them back
    assert store["plain_text_bytes"] > reasoning
    assert store["store_of_plain"] == round(store["store_bytes"] / store["plain_text_bytes"], 4)
    assert 0 < store["store_of_plain"] < 1
