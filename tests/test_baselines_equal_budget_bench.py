"""benchmarks/baselines_equal_budget.py copies the combined report's frontier plot into the docs: the plot the report
writes, found among what it wrote."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark
from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.grading.grades import GradeConfig
from tmas.problems import Problem
from tmas.reports.report import build_report
from tmas.testing import ScriptedModel, SimScript

pytest.importorskip("matplotlib")


async def test_the_plot_copied_to_the_docs_is_the_report_s_frontier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_benchmark("baselines_equal_budget", monkeypatch)
    run_dir = tmp_path / "run"
    model = ScriptedModel(SimScript(), scripted_settings(method__name="cot"))
    await scripted_run(model, run_dir, [Problem(problem_id="q", question="What is 17*23?", answer="391")])
    written = await build_report([run_dir], tmp_path / "report", GradeConfig(mode="rules"), None)
    plot = bench.frontier_plot(written)
    assert plot.parent == tmp_path / "report" and plot.name.startswith("frontier_") and plot.suffix == ".png"
    assert plot.is_file()
    # A report without one (nothing graded) is refused rather than leaving the docs' plot as it was.
    with pytest.raises(SystemExit, match="0 frontier plots"):
        bench.frontier_plot({"markdown": tmp_path / "report" / "report.md"})


def test_the_script_prints_the_combined_report_and_copies_its_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("baselines_equal_budget", monkeypatch)
    monkeypatch.setattr(bench, "STUDIES", [bench.Study(name="equal-budget", method="cot")])
    monkeypatch.setattr(bench, "DOCS", tmp_path / "docs")
    (tmp_path / "docs").mkdir()
    out = tmp_path / "out"
    monkeypatch.setattr("sys.argv", ["baselines_equal_budget.py", "--out", str(out), "--problems", "1"])
    asyncio.run(bench.main())
    printed = capsys.readouterr().out
    assert printed.startswith("# tmas evaluation report")
    assert printed.strip() == (out / "sweep" / "report" / "report.md").read_text(encoding="utf-8").strip()
    assert (tmp_path / "docs" / "baselines_equal_budget_sim.png").is_file()
