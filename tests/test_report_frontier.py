"""`tmas report` on scripted simulated-server runs: the frontier (checked by the data it plots), the equal-budget
table, the selection-rule table and ROC area, and a run whose problems are all mid-way."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from conftest import run_tmas
from tmas.grading.grades import GradeConfig
from tmas.reports.report import build_report
from tmas.testing import Rule, SimScript, SimServer

pytest.importorskip("math_verify")
pytest.importorskip("matplotlib")

PROBLEMS = [("p1", "What is 2+3?", "5"), ("p2", "What is 4+4?", "8")]
FILLER = "step " * 595  # 595 tokens for the simulator; "\boxed{5}" adds five more: 600 per sample


def tmas(*args: str) -> subprocess.CompletedProcess[str]:
    return run_tmas(*args, text=True, timeout=180)


def write_problems(path: Path) -> Path:
    path.write_text("".join(json.dumps({"problem_id": i, "question": q, "answer": a}) + "\n" for i, q, a in PROBLEMS))
    return path


def run(problems: Path, out: Path, sim: SimServer, *args: str) -> None:
    done = tmas("run", str(problems), "-o", str(out), "--base-url", sim.base_url, *args)
    assert done.returncode == 0, done.stderr


def report(out: Path, *runs: Path) -> str:
    """`tmas report RUN... -o OUT --grade rules`, as a user runs it."""
    done = tmas("report", *map(str, runs), "-o", str(out), "--grade", "rules")
    assert done.returncode == 0, done.stderr
    return (out / "report.md").read_text()


async def report_here(out: Path, *runs: Path) -> str:
    """The same report built in this process (one interpreter start less on a busy machine)."""
    written = await build_report(list(runs), out, GradeConfig(mode="rules"), None)
    return written["markdown"].read_text()


@pytest.mark.slow
async def test_frontier_and_equal_budget_of_a_scripted_majority_run(sim: SimServer, tmp_path: Path) -> None:
    boxed = [f"{FILLER}\\boxed{{{a}}}" for a in ("5", "5", "6", "7", "8", "9", "9")]
    sim.set_script(
        SimScript(
            rules=[
                # p1: 5, 5 (right), 6, 7. p2: 8 (right), 9, 9 and one reply with no answer (600 tokens).
                Rule(role="solution", pattern=r"2\+3", replies=boxed[:4]),
                Rule(role="solution", pattern=r"4\+4", replies=[*boxed[4:], "step " * 600]),
            ]
        )
    )
    problems = write_problems(tmp_path / "p.jsonl")
    run(problems, tmp_path / "mv", sim, "--method", "majority", "-p", "k=4")
    assert sim.stats().by_role["solution"] == 8
    markdown = await report_here(tmp_path / "report", tmp_path / "mv")
    frontier = json.loads((tmp_path / "report" / "frontier_p.json").read_text())
    (series,) = frontier.values()
    # p1: MV@1 1/2, MV@2 1/2, MV@4 1. p2: MV@1 1/4; MV@2 over 6 pairs: {8,9} x2 ties (1/2 each), {8,-} right,
    # the rest wrong -> 2/6; MV@4: 9 wins -> 0. Every sample costs 600 completion tokens.
    assert series["x"] == pytest.approx([600, 1200, 2400])
    assert series["y"] == pytest.approx([100 * 0.375, 100 * (0.5 + 1 / 3) / 2, 50.0])
    assert [p["label"] for p in series["points"]] == ["MV@1", "MV@2", "MV@4"]
    assert [p["problems"] for p in series["points"]] == [2, 2, 2]
    # Read off the frontier: <= 1k MV@1, <= 2k MV@2, from 4k on MV@4.
    assert "| majority | 37.50 | 41.67 | 50.00 | 50.00 | 50.00 |" in markdown
    assert (tmp_path / "report" / "frontier_p.png").stat().st_size > 1000
    # The old mix of per-sample Pass@1 and other methods' rollouts against tokens is gone.
    assert not list((tmp_path / "report").glob("pass1_vs_tokens*"))


@pytest.mark.slow
async def test_selection_rules_and_roc_area_in_the_report(sim: SimServer, tmp_path: Path) -> None:
    # Verify-Refine, one iteration of three trajectories per problem: two wrong answers the verifier scores 0 and
    # one right answer it scores 1.
    sim.set_script(
        SimScript(
            rules=[
                Rule(role="solution", pattern=r"2\+3", replies=["\\boxed{4}", "\\boxed{4}", "\\boxed{5}"]),
                Rule(role="solution", pattern=r"4\+4", replies=["\\boxed{7}", "\\boxed{7}", "\\boxed{8}"]),
                Rule(role="verifier", pattern=r"boxed\{[58]\}", replies=["Score: 1"]),
                Rule(role="verifier", replies=["Score: 0"]),
            ]
        )
    )
    problems = write_problems(tmp_path / "p.jsonl")
    run(problems, tmp_path / "vr", sim, "--method", "verify_refine", "-p", "n=3", "-T", "1")
    markdown = await report_here(tmp_path / "report", tmp_path / "vr")
    # Best score returns the right answer on both problems; the plurality goes to the wrong one; the weighted vote
    # (1 against 0 + 0) to the right one.
    assert "| best_score / last (this run's rule) | 100.00 |" in markdown
    assert "| vote / last | 0.00 |" in markdown and "| score_weighted_vote / all | 100.00 |" in markdown
    # Right candidates all score 1, wrong ones 0: a perfect separation.
    assert "ROC area 1.000 over 2 right and 4 wrong scored candidates" in markdown
    assert "mean score right 1.000, wrong 0.000" in markdown


@pytest.mark.slow
def test_a_run_stopped_mid_way_is_reported_from_its_finished_iterations(sim: SimServer, tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "tmas"
    run(problems, run_dir, sim, "--method", "tmas", "-p", "n=2", "-p", "m=1", "-T", "3")
    # What a run killed mid-way leaves: finished iterations, no results (p1 got through two, p2 through one).
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results")
        db.execute("DELETE FROM iterations WHERE iteration > (CASE problem_id WHEN 'p1' THEN 1 ELSE 0 END)")
        db.execute("DELETE FROM grades")
    markdown = report(tmp_path / "report", run_dir)
    assert "problems: 2 (0 done, 0 failed, 2 mid-way: reported from their finished iterations)" in markdown
    assert "| It0 | 2 | 100.00 |" in markdown and "| It1 | 1 | 100.00 |" in markdown and "| It2 |" not in markdown
    series = next(iter(json.loads((tmp_path / "report" / "frontier_p.json").read_text()).values()))
    assert [(p["label"], p["problems"]) for p in series["points"]] == [("It0", 2), ("It1", 1)]
    assert series["y"] == [100.0, 100.0]
