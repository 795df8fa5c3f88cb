"""Reports built from runs (in process, and as a user runs them on the simulated server); dataset aliases."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import run_tmas, scripted_settings
from scripted_runs import scripted_run
from tmas.api import arun
from tmas.errors import InputError
from tmas.grading.grades import GradeConfig
from tmas.grading.runs import grade_run
from tmas.problems import DATASET_ALIASES, dataset_name, resolve_dataset
from tmas.reports.metrics import RunMetrics
from tmas.reports.report import RunEvaluation, _calls_lines, build_report
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer

pytest.importorskip("math_verify")
pytest.importorskip("matplotlib")


def tmas(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_tmas(*args, text=True, env=env, timeout=180)


def write_problems(path: Path) -> None:
    rows = [{"problem_id": f"p{i}", "question": f"What is {i + 3}*7?", "answer": str((i + 3) * 7)} for i in range(5)]
    rows.append({"problem_id": "free", "question": "What is 2*2?"})  # unlabeled: solved, not graded
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


async def test_report_from_simulated_runs(tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    write_problems(problems)
    for name, script in (("good", SimScript()), ("sloppy", SimScript(accuracy=0.4, seed=3))):
        await scripted_run(ScriptedModel(script, scripted_settings(method__name="cot")), tmp_path / name, problems)
    report_dir = tmp_path / "report"
    runs = [tmp_path / "good", tmp_path / "sloppy"]
    written = await build_report(runs, report_dir, GradeConfig(mode="rules"), None)
    markdown = (report_dir / "report.md").read_text()
    html = (report_dir / "report.html").read_text()
    assert "Pass@1 (%) at selected iterations" in markdown and "Pass@1 (%) at every iteration" in markdown
    assert "| Method | It0 |" in markdown
    # The good run is right on all 5 labeled problems; the unlabeled one is said to be ungraded.
    assert "100.00" in markdown
    assert "1 problems have no reference answer" in markdown
    assert "Benchmark: p" in markdown and "Cost" in markdown
    pngs = sorted(p.name for p in report_dir.glob("*.png"))
    assert pngs == ["frontier_p.png", "pass1_vs_iteration_p.png"]
    assert all((report_dir / name).stat().st_size > 1000 for name in pngs)
    assert "<table>" in html and 'img src="pass1_vs_iteration_p.png"' in html
    assert set(written) >= {"markdown", "html"}
    # CoT has no verifier and no banks: the analyses say so instead of inventing numbers.
    assert "Not available: the method records no candidate scores" in markdown
    assert "no guideline bank" in markdown


@pytest.mark.slow
async def test_eval_runs_grades_and_reports_in_one_step(tmp_path: Path) -> None:
    # What `tmas eval p.jsonl --judge-runs 2 -m tmas -p n=2 -p m=2 -T 3` does, in process: the run, then its report
    # graded by the combined rules and judge.
    problems = tmp_path / "p.jsonl"
    write_problems(problems)
    params = {"n": 2, "m": 2, "iterations": 3}
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "tmas", "params": params}))
    await arun(problems, tmp_path / "run", model=model)
    grading = GradeConfig(mode="combined", judge_runs=2)
    with RunStore(tmp_path / "run", create=False) as store:
        await grade_run(store, grading, None, model=model)
    # Every answer is numeric and the rules decide all of them: the judge is never asked.
    assert model.calls_of("judge") == []
    # The report reads the grades stored in the run.
    await build_report([tmp_path / "run"], tmp_path / "run" / "report", grading, None)
    markdown = (tmp_path / "run" / "report" / "report.md").read_text()
    assert "grading: combined, the rules decided every answer: no judge asked (2 judge runs configured)" in markdown
    assert "| Method | It0 | It1 | It2 |" in markdown
    # TMAS records verifier scores and its banks: the B.4 and B.3 analyses have something to show.
    assert "Verification-score dynamics (B.4)" in markdown and "ever-correct: 5 problems" in markdown
    assert "mean unique guidelines per problem" in markdown and "epsilon = " in markdown


def test_report_on_a_missing_run_is_a_clear_error(tmp_path: Path) -> None:
    out = tmas("report", str(tmp_path / "nope"), "-o", str(tmp_path / "r"))
    assert out.returncode == 2 and "not a run directory" in out.stderr


@pytest.mark.slow
def test_data_generate_cli(tmp_path: Path) -> None:
    out = tmas(
        "data",
        "generate",
        "--family",
        "all",
        "--n",
        "2",
        "--seed",
        "5",
        "--level",
        "2",
        "-o",
        str(tmp_path / "g.jsonl"),
    )
    assert out.returncode == 0, out.stderr
    assert len((tmp_path / "g.jsonl").read_text().splitlines()) >= 12
    out = tmas("data", "generate", "--family", "nope", "-o", str(tmp_path / "x.jsonl"))
    assert out.returncode == 2 and "unknown family" in out.stderr and not (tmp_path / "x.jsonl").exists()


def test_dataset_aliases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / DATASET_ALIASES["hmmt25"]).write_text('{"question_id": 1, "question": "Q", "answer": "1"}\n')
    monkeypatch.setenv("TMAS_BENCHMARKS_DIR", str(folder))
    assert resolve_dataset("hmmt25") == folder / DATASET_ALIASES["hmmt25"]
    assert dataset_name("HMMT25") == "hmmt25"
    monkeypatch.setenv("TMAS_BENCHMARKS_DIR", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="not a named benchmark"):
        resolve_dataset("no-such-thing")


@pytest.mark.slow
def test_the_report_lists_retries_by_cause_and_where_the_calls_time_went(tmp_path: Path) -> None:
    # Two 503s and a queue: six problems, two requests generate at a time, each held 0.2 s before its first chunk.
    problems = tmp_path / "p.jsonl"
    write_problems(problems)
    script = SimScript(persona="vllm", max_running=2, rules=[Rule(fault="http_503", times=2), Rule(latency_s=0.2)])
    with SimServer(script) as sim:
        run = ("run", str(problems), "-o", str(tmp_path / "run"), "--method", "cot", "--base-url", sim.base_url)
        out = tmas(*run, "--model", "sim-model")
        assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    # vLLM had sent its stream's headers while the requests queued: the 503s came as error events in the streams,
    # counted as the 503s they carry.
    assert summary["retries_by_cause"] == {"http_503": 2}
    out = tmas("report", str(tmp_path / "run"), "-o", str(tmp_path / "report"), "--grade", "rules")
    assert out.returncode == 0, out.stderr
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "attempts sent again: 2 (http_503 2)" in markdown
    assert "time to the first chunk (the server's queue and prefill): median" in markdown
    assert "time waiting inside tmas for a slot: median" in markdown


def test_the_wait_times_median_and_p95_by_hand(tmp_path: Path) -> None:
    # 20 first-chunk waits of 1..20 s: the median is the mean of the 10th and 11th, 10.5; p95 by nearest rank the
    # ceil(0.95 x 20) = 19th, 19 (not the upper middle 11 and the 20th, the longest). Three queue waits: 2, and the
    # ceil(2.85) = 3rd, 5.
    e = RunEvaluation(
        run_dir=tmp_path,
        label="cot",
        benchmark="b",
        method="cot",
        params={},
        model=None,
        problems=1,
        done=1,
        failed=0,
        metrics=RunMetrics(),
        grades=None,
        waits={"first_token": [float(s) for s in range(20, 0, -1)], "queued": [5.0, 1.0, 2.0]},
    )
    assert _calls_lines(e) == [
        "time to the first chunk (the server's queue and prefill): median 10.50 s, p95 19.00 s, longest 20.00 s",
        "time waiting inside tmas for a slot: median 2.00 s, p95 5.00 s, longest 5.00 s",
    ]


async def test_the_report_says_where_each_run_lost_its_answers(tmp_path: Path) -> None:
    # The scripted Verify-Refine run of test_where_lost.py (every figure worked out there by hand) and a CoT run of
    # the same four problems, right on all of them: one benchmark, one section.
    from test_where_lost import PROBLEMS, verify_refine_run

    await verify_refine_run(tmp_path / "vr")
    await scripted_run(ScriptedModel(SimScript(), scripted_settings(method__name="cot")), tmp_path / "cot", PROBLEMS)
    await build_report([tmp_path / "vr", tmp_path / "cot"], tmp_path / "report", GradeConfig(mode="rules"), None)
    markdown = (tmp_path / "report" / "report.md").read_text()
    part = markdown.split("### Where the runs lose their answers")[1].split("\n### ")[0]
    vr, cot = "verify_refine [sim-model]", "cot [sim-model]"
    # CoT selects nothing and has no verifier; its one iteration changes nothing: it is in the replies part alone.
    assert part.count(cot) == 1 and f"| {cot} | solution | 4 | 0.0% (0) | 0.0% (0) |" in part
    assert f"| {vr} | 4 | 25.0% (1) | 50.0% (2) | 25.0% (1) | 25.0% (1) | 25.0% (1) |" in part
    # p1 had 391 (right) in its last round and returned 390; p2's right 144 was refined into 141 after It0: the rule
    # never passed it over, refinement lost it.
    assert (
        f"{vr}: a right candidate in the last iteration, another returned: p1; right candidates only in earlier "
        "iterations: p2." in part
    )
    assert "Shares of the run's graded problems (Problems)." in part
    assert f"| {vr} | 50.0% (2 of 4) | 27.3% (3 of 11) | 0.614 | 0 | 1 |" in part
    assert f"| {vr} | 4 | 75.0% (3) | 25.0% (1) | 25.0% (1) | 25.0% (1) |" in part
    assert f"| {vr} | solution | 8 | 12.5% (1) | 12.5% (1) |" in part
    assert f"| {vr} | verifier | 16 | 0.0% (0) | 0.0% (0) |" in part


def reports_page() -> str:
    """docs/reports.md with its line breaks read as spaces."""
    return " ".join((Path(__file__).resolve().parents[1] / "docs" / "reports.md").read_text().split())


async def test_docs_reports_md_names_each_table_of_a_report_as_the_report_titles_it(tmp_path: Path) -> None:
    # Before, the page named the selection table "Accuracy of every selection rule" (the report titles it "Accuracy
    # (%) of every selection rule, from the stored scores"), and the frontier's, the equal-budget, the Pass@1, the
    # cost and the ROC tables by names of its own: a reader could not find them in a report by their titles.
    from test_where_lost import verify_refine_run

    await verify_refine_run(tmp_path / "vr")
    await build_report([tmp_path / "vr"], tmp_path / "report", GradeConfig(mode="rules"), None)
    lines = (tmp_path / "report" / "report.md").read_text().splitlines()
    titles = [line.lstrip("#").strip() for line in lines if line.startswith("## ") or line.startswith("###")]
    titles = [title for title in titles if not title.startswith(("Benchmark: ", "Run: "))]
    assert len(titles) >= 10
    page = reports_page()
    assert [title for title in titles if f'"{title}"' not in page and f"**{title}**" not in page] == []
