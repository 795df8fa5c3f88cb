"""benchmarks/lm_eval_vs_tmas_eval.py on the simulated upstream: lm-eval through the proxy and the in-process run ask
the upstream the very same calls, and the per-problem table tells a grading difference from a sampling one."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark
from conftest import settings_for
from tmas.data.lm_eval_task import write_task
from tmas.problems import Problem
from tmas.serve.launch import ServeOptions
from tmas.testing import Rule, SimScript, SimServer
from web_helpers import ProxyThread

PROBLEMS = [
    Problem(problem_id="a", question="What is 6*20?", answer="120"),
    Problem(problem_id="b", question="What is 7*8?", answer="56"),
    Problem(problem_id="c", question="What is 9*9?", answer="81"),
]
# The same number written two ways: lm-eval's exact match says no, Math-Verify says yes.
WRITTEN_AS_DECIMAL = "Multiplying, 7*8 = 56.\n\nTherefore, the final answer is \\boxed{56.0}."


def calls(bodies: list[dict[str, object]]) -> Counter[str]:
    return Counter(json.dumps({k: b[k] for k in ("messages", "seed", "temperature", "max_tokens")}) for b in bodies)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["cot", "tmas"])
async def test_both_paths_ask_the_same_calls_and_the_table_shows_the_grading_difference(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    bench = load_benchmark("lm_eval_vs_tmas_eval", monkeypatch)
    sim.set_script(SimScript(rules=[Rule(role="solution", pattern=r"7\*8", replies=[WRITTEN_AS_DECIMAL])]))
    args = argparse.Namespace(upstream="sim", temperature=0.4, max_tokens=300, concurrency=4)
    write_task(PROBLEMS, tmp_path / "task", bench.TASK, max_gen_toks=args.max_tokens, temperature=args.temperature)
    live = settings_for(sim)
    with ProxyThread(live, ServeOptions(serve_dir=tmp_path / "served", max_problems=4)) as proxy:
        rows = await bench.compare_method(method, live, proxy, PROBLEMS, tmp_path, args)

    # The upstream was asked every call twice: once through lm-eval and the proxy, once by the in-process run.
    bodies = sim.chat_bodies()
    served, in_process = bodies[: len(bodies) // 2], bodies[len(bodies) // 2 :]
    assert len(served) == {"cot": 3, "tmas": 12}[method]
    assert calls(served) == calls(in_process)
    assert all(b["temperature"] == 0.4 and b["max_tokens"] == 300 for b in bodies)

    by_question = {row.question: row for row in rows}
    assert all(row.same_text for row in rows)
    right = by_question["What is 6*20?"]
    assert (right.lm_eval_answer, right.lm_eval_correct, right.tmas_answer, right.tmas_correct) == (
        "120",
        True,
        "120",
        True,
    )
    decimal = by_question["What is 7*8?"]
    assert (decimal.lm_eval_answer, decimal.lm_eval_correct) == ("56.0", False)
    assert decimal.tmas_correct is True
    table = bench.report(method, rows, 1.0)
    assert table.splitlines()[0] == f"| {method} | 3 | 2/3 | 3/3 | 2/3 | 3/3 | 1 |"
    assert "gold '56'" in table and "lm-eval '56.0' (0)" in table
