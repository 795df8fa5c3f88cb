"""`tmas report` on scripted runs (in process): the frontier (checked by the data it plots), the equal-budget
table, the selection-rule table and ROC area, and a run whose problems are all mid-way."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.grading.grades import GradeConfig
from tmas.reports.report import build_report, evaluate_run, write_report
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript
from tmas.testing.responders import count_tokens
from tmas.view.cache import RunCache
from tmas.view.runs import RunReader
from web_helpers import run_ref_for

pytest.importorskip("math_verify")
pytest.importorskip("matplotlib")

PROBLEMS = [("p1", "What is 2+3?", "5"), ("p2", "What is 4+4?", "8")]
FILLER = "step " * 595  # 595 tokens for the simulator; "\boxed{5}" adds five more: 600 per sample


def write_problems(path: Path) -> Path:
    path.write_text("".join(json.dumps({"problem_id": i, "question": q, "answer": a}) + "\n" for i, q, a in PROBLEMS))
    return path


async def run(problems: Path, out: Path, script: SimScript, method: str, **params: Any) -> ScriptedModel:
    """A run of ``method`` with ``params`` on the problem file, in process on a model answering with ``script`` (its
    replies whole: room for 600 tokens)."""
    settings = scripted_settings(method__name=method, method__params=params, sampling__max_tokens=4096)
    model = ScriptedModel(script, settings)
    await scripted_run(model, out, problems)
    return model


async def report_here(out: Path, *runs: Path) -> str:
    """`tmas report RUN... -o OUT --grade rules`, built in this process."""
    written = await build_report(list(runs), out, GradeConfig(mode="rules"), None)
    return written["markdown"].read_text()


@pytest.mark.slow
async def test_frontier_and_equal_budget_of_a_scripted_majority_run(tmp_path: Path) -> None:
    boxed = [f"{FILLER}\\boxed{{{a}}}" for a in ("5", "5", "6", "7", "8", "9", "9")]
    script = SimScript(
        rules=[
            # p1: 5, 5 (right), 6, 7. p2: 8 (right), 9, 9 and one reply with no answer (600 tokens).
            Rule(role="solution", pattern=r"2\+3", replies=boxed[:4]),
            Rule(role="solution", pattern=r"4\+4", replies=[*boxed[4:], "step " * 600]),
        ]
    )
    problems = write_problems(tmp_path / "p.jsonl")
    model = await run(problems, tmp_path / "mv", script, "majority", k=4)
    assert len(model.calls_of("solution")) == 8
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
    assert "| majority [sim-model] | 37.50 | 41.67 | 50.00 | 50.00 | 50.00 |" in markdown
    assert (tmp_path / "report" / "frontier_p.png").stat().st_size > 1000
    # The old mix of per-sample Pass@1 and other methods' rollouts against tokens is gone.
    assert not list((tmp_path / "report").glob("pass1_vs_tokens*"))


@pytest.mark.slow
async def test_selection_rules_and_roc_area_in_the_report(tmp_path: Path) -> None:
    # Verify-Refine, one iteration of three trajectories per problem: two wrong answers the verifier scores 0 and
    # one right answer it scores 1.
    script = SimScript(
        rules=[
            Rule(role="solution", pattern=r"2\+3", replies=["\\boxed{4}", "\\boxed{4}", "\\boxed{5}"]),
            Rule(role="solution", pattern=r"4\+4", replies=["\\boxed{7}", "\\boxed{7}", "\\boxed{8}"]),
            Rule(role="verifier", pattern=r"boxed\{[58]\}", replies=["Score: 1"]),
            Rule(role="verifier", replies=["Score: 0"]),
        ]
    )
    problems = write_problems(tmp_path / "p.jsonl")
    await run(problems, tmp_path / "vr", script, "verify_refine", n=3, iterations=1)
    markdown = await report_here(tmp_path / "report", tmp_path / "vr")
    # Best score returns the right answer on both problems; the plurality goes to the wrong one; the weighted vote
    # (1 against 0 + 0) to the right one.
    assert "| best_score / last (this run's rule) | 100.00 |" in markdown
    assert "| vote / last | 0.00 |" in markdown and "| score_weighted_vote / all | 100.00 |" in markdown
    # Right candidates all score 1, wrong ones 0: a perfect separation.
    assert "ROC area 1.000 over 2 right and 4 wrong scored candidates" in markdown
    assert "mean score right 1.000, wrong 0.000" in markdown


@pytest.mark.slow
async def test_a_run_stopped_mid_way_is_reported_from_its_finished_iterations(tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "tmas"
    await run(problems, run_dir, SimScript(), "tmas", n=2, m=1, iterations=3)
    # What a run killed mid-way leaves: finished iterations, no results (p1 got through two, p2 through one).
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results")
        db.execute("DELETE FROM iterations WHERE iteration > (CASE problem_id WHEN 'p1' THEN 1 ELSE 0 END)")
        db.execute("DELETE FROM grades")
    markdown = await report_here(tmp_path / "report", run_dir)
    assert "problems: 2 (0 done, 0 failed, 2 mid-way: reported from their finished iterations)" in markdown
    assert "| It0 | 2 | 100.00 |" in markdown and "| It1 | 1 | 100.00 |" in markdown and "| It2 |" not in markdown
    series = next(iter(json.loads((tmp_path / "report" / "frontier_p.json").read_text()).values()))
    assert [(p["label"], p["problems"]) for p in series["points"]] == [("It0", 2), ("It1", 1)]
    assert series["y"] == [100.0, 100.0]


@pytest.mark.slow
async def test_runs_of_one_benchmark_on_other_problems_share_no_table(tmp_path: Path) -> None:
    # Both files are named p.jsonl (the benchmark "p"): one holds both problems, the other the first alone.
    whole = write_problems(tmp_path / "p.jsonl")
    (tmp_path / "first").mkdir()
    first = tmp_path / "first" / "p.jsonl"
    first.write_text(whole.read_text().splitlines()[0] + "\n")
    await run(whole, tmp_path / "both", SimScript(), "cot")
    await run(first, tmp_path / "one", SimScript(), "cot")
    markdown = await report_here(tmp_path / "report", tmp_path / "both", tmp_path / "one")
    assert "## Benchmark: p (2 problems)" in markdown and "## Benchmark: p (1 problem)" in markdown
    # The same problems share one table.
    await run(whole, tmp_path / "again", SimScript(), "cot")
    markdown = await report_here(tmp_path / "report2", tmp_path / "both", tmp_path / "again")
    assert markdown.count("## Benchmark:") == 1 and "## Benchmark: p\n" in markdown


@pytest.mark.slow
async def test_benchmark_names_of_any_script_or_sign_get_plots_of_their_own(tmp_path: Path) -> None:
    names = ["αβ", "γδ", "cost_$5_or_$6"]
    for name in names:
        (tmp_path / name).mkdir()
        problems = tmp_path / name / f"{name}.jsonl"
        problems.write_text(write_problems(tmp_path / "p.jsonl").read_text(), encoding="utf-8")
        await run(problems, tmp_path / name / "run", SimScript(), "cot")
    await report_here(tmp_path / "report", *(tmp_path / name / "run" for name in names))
    frontiers = sorted(p.name for p in (tmp_path / "report").glob("frontier_*.json"))
    # "αβ" and "γδ" (as any name in another script) both slug to "benchmark": each gets a digest of its name; "$" is
    # text in a plot's title, not the start of a formula.
    assert len(frontiers) == 3 and "frontier_cost__5_or__6.json" in frontiers
    assert all(name.startswith("frontier_benchmark-") for name in frontiers if "cost" not in name)


@pytest.mark.slow
async def test_problems_a_run_never_started_are_named_as_left_out(tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "mv"
    await run(problems, run_dir, SimScript(), "majority", k=2)
    # What a run stopped before its second problem began leaves: p1 finished, nothing of p2.
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        for table in ("results", "iterations", "grades"):
            db.execute(f"DELETE FROM {table} WHERE problem_id = 'p2'")
    markdown = await report_here(tmp_path / "report", run_dir)
    # The run holds two problems; its figures stand on p1 alone (the simulator answers 2+3 right: 100 %).
    assert "problems: 2 (1 done, 0 failed, 1 not started: left out of every figure)" in markdown
    assert "| It0 | 1 | 100.00 |" in markdown


@pytest.mark.slow
async def test_a_run_short_of_problems_says_so_beside_a_finished_one(tmp_path: Path) -> None:
    # p1 (2+3 = 5) is answered right, p2 (4+4, its reference 9 here) wrong: over both, 50 %. The second run was
    # stopped before p2 began: it stands on p1 alone, 100 %, which is no comparison with the first's 50 %.
    problems = tmp_path / "p.jsonl"
    rows = [("p1", "What is 2+3?", "5"), ("p2", "What is 4+4?", "9")]
    problems.write_text("".join(json.dumps({"problem_id": i, "question": q, "answer": a}) + "\n" for i, q, a in rows))
    for name in ("full", "part"):
        await run(problems, tmp_path / name, SimScript(), "cot")
    with sqlite3.connect(tmp_path / "part" / "run.sqlite") as db:
        for table in ("results", "iterations"):
            db.execute(f"DELETE FROM {table} WHERE problem_id = 'p2'")
    markdown = await report_here(tmp_path / "report", tmp_path / "full", tmp_path / "part")
    # Both Pass@1 tables (one column: It0).
    assert markdown.count("| cot [sim-model] <full> | 50.00 |\n") == 2
    assert markdown.count("| cot [sim-model] <part> | 100.00 (1 of 2 problems) |\n") == 2
    # So do its cells in the equal-budget table (a reply of the simulator costs under 1k tokens: It0 in every column),
    # as the viewer's comparison marks them.
    assert "| cot [sim-model] <full> | 50.00 | 50.00 | 50.00 | 50.00 | 50.00 |" in markdown
    assert "| cot [sim-model] <part> |" + " 100.00 (1 of 2 problems) |" * 5 in markdown
    assert (
        "Not every run stands on every problem: cot [sim-model] <part> holds 2 problems (1 done, 0 failed, 1 not "
        "started: left out of every figure)."
    ) in markdown
    # Two finished runs stand on every problem: nothing to say.
    await run(problems, tmp_path / "again", SimScript(), "cot")
    markdown = await report_here(tmp_path / "report2", tmp_path / "full", tmp_path / "again")
    assert "Not every run" not in markdown and "of 2 problems" not in markdown


@pytest.mark.slow
async def test_a_majority_runs_table_votes_as_the_method_and_its_frontier_do(tmp_path: Path) -> None:
    # Majority vote, k=2, two iterations. p1 (5): It0 draws 5, 6; It1 5, 7. p2 (8): It0 8, 8; It1 9, 10.
    boxed = [f"{FILLER}\\boxed{{{a}}}" for a in ("5", "6", "5", "7", "8", "8", "9", "10")]
    script = SimScript(
        rules=[
            Rule(role="solution", pattern=r"2\+3", replies=boxed[:4]),
            Rule(role="solution", pattern=r"4\+4", replies=boxed[4:]),
        ]
    )
    problems = write_problems(tmp_path / "p.jsonl")
    await run(problems, tmp_path / "mv", script, "majority", k=2, iterations=2)
    markdown = await report_here(tmp_path / "report", tmp_path / "mv")
    # It0: p1's 5 and 6 tie, split evenly (1/2), p2's 8 wins (1): MV@all 75. The method returns the earlier of the
    # tied answers, 5: Selected 100. Pass@1 1/2 and 1: mean 3/4, std. error (sqrt(1/8) / sqrt(2)) = 1/4.
    assert "| It0 | 2 | 75.00 | 25.00 | 75.00-75.00 | 75.00 | 100.00 | 4 |" in markdown
    # It1 votes over every sample drawn, as the method does: p1 5, 6, 5, 7 -> 5; p2 8, 8, 9, 10 -> 8: MV@all 100
    # (over It1's samples alone it would be 1/2 and 0). Pass@1 1/2 and 0: mean 1/4, std. error 1/4.
    assert "| It1 | 2 | 25.00 | 25.00 | 25.00-25.00 | 100.00 | 100.00 | 4 |" in markdown
    # The frontier's MV@4, over the same four samples, reads the same.
    (series,) = json.loads((tmp_path / "report" / "frontier_p.json").read_text()).values()
    assert series["points"][-1]["label"] == "MV@4" and series["y"][-1] == pytest.approx(100.0)


def confident(c: float, reply: str) -> list[dict[str, Any]]:
    """Log-probabilities of ``reply`` whose DeepConf token confidence is ``c`` at every token (the chosen token
    certain, its one alternative at -2c: mean -c)."""
    alternatives = [{"token": "t", "logprob": 0.0}, {"token": "alt", "logprob": -2.0 * c}]
    return [{"token": "t", "logprob": 0.0, "top_logprobs": alternatives}] * count_tokens(reply)


@pytest.mark.slow
async def test_a_confidence_weighted_vote_is_charted_by_the_answer_it_returned(tmp_path: Path) -> None:
    # Majority vote, k=3, select=confidence_vote. p1 (5): 5 at confidence 5, then 6 twice at 1. p2 (8): 8 three times
    # at 1. The weighted vote returns 5 on p1 (V(5) = 5 > V(6) = 2) and 8 on p2: Selected 100. A plain vote of all
    # three samples returns 6 on p1: MV@3 would be (0 + 1) / 2 = 50, which the frontier showed as the run's accuracy
    # at its 1,800 completion tokens (3 samples of 600). Its frontier is now the answer it returned: It0 at 100%.
    right, wrong, other = (f"{FILLER}\\boxed{{{a}}}" for a in ("5", "6", "8"))
    script = SimScript(
        rules=[
            Rule(role="solution", pattern=r"2\+3", times=1, replies=[right], logprobs=confident(5.0, right)),
            Rule(role="solution", pattern=r"2\+3", replies=[wrong], logprobs=confident(1.0, wrong)),
            Rule(role="solution", pattern=r"4\+4", replies=[other], logprobs=confident(1.0, other)),
        ]
    )
    problems = write_problems(tmp_path / "p.jsonl")
    await run(problems, tmp_path / "mv", script, "majority", k=3, select="confidence_vote")
    markdown = await report_here(tmp_path / "report", tmp_path / "mv")
    # Pass@1 1/3 and 1: 2/3; plain MV@all 0 and 1: 50; Selected 100.
    assert "| It0 | 2 | 66.67 | 33.33 | 66.67-66.67 | 50.00 | 100.00 | 6 |" in markdown
    (series,) = json.loads((tmp_path / "report" / "frontier_p.json").read_text()).values()
    assert [(p["label"], p["tokens"], p["accuracy"]) for p in series["points"]] == [("It0", 1800.0, 1.0)]
    # Read off the frontier: nothing at 1k, It0 from 2k on.
    assert "| majority [sim-model] | - | 100.00 | 100.00 | 100.00 | 100.00 |" in markdown
    # The viewer charts the same point.
    ref = run_ref_for([tmp_path / "mv"], tmp_path / "mv")
    assert ref is not None
    with RunReader(ref, RunCache()) as reader:
        points = reader.overview().frontier
    assert [(p.label, p.tokens, p.accuracy) for p in points] == [("It0", 1800.0, 1.0)]


@pytest.mark.slow
async def test_frontier_points_at_no_tokens_are_named_where_the_log_axis_cannot_draw_them(tmp_path: Path) -> None:
    from tmas.testing.script import ScriptedUsage

    problems = write_problems(tmp_path / "p.jsonl")
    # Majority vote, k=2, on a server that counts tokens (600 a sample); CoT on one that reports 0 tokens.
    await run(problems, tmp_path / "mv", SimScript(), "majority", k=2)
    none = ScriptedUsage(prompt_tokens=0, completion_tokens=0)
    await run(problems, tmp_path / "cot", SimScript(rules=[Rule(role="solution", usage=none)]), "cot")
    markdown = await report_here(tmp_path / "report", tmp_path / "mv", tmp_path / "cot")
    frontier = json.loads((tmp_path / "report" / "frontier_p.json").read_text())
    # The log axis has no place for 0: CoT's one point is not drawn, and the series says so (no x, no y) while
    # keeping the point; the report names it.
    cot = frontier["cot [sim-model]"]
    assert (cot["x"], cot["y"]) == ([], [])
    assert [(p["label"], p["tokens"], p["accuracy"]) for p in cot["points"]] == [("It0", 0.0, 1.0)]
    assert len(frontier["majority [sim-model]"]["x"]) == 2
    assert "the plot's logarithmic axis has no place for: cot [sim-model]: It0." in markdown


@pytest.mark.slow
async def test_a_failed_call_is_a_wrong_rollout_and_the_run_says_so(tmp_path: Path) -> None:
    # Majority vote, k=3, one problem: the first call fails, the other two answer 5 (right). Pass@1 = 2/3 (the
    # failed call is one of n_i = 3 rollouts); MV@all = 1 (it has no vote, the two 5s win).
    script = SimScript(rules=[Rule(role="solution", fault="http_500", times=1)])
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem_id": "p1", "question": "What is 2+3?", "answer": "5"}) + "\n")
    await run(problems, tmp_path / "mv", script, "majority", k=3)
    markdown = await report_here(tmp_path / "report", tmp_path / "mv")
    assert "| It0 | 1 | 66.67 | 0.00 | 66.67-66.67 | 100.00 | 100.00 | 3 |" in markdown
    assert (
        "- candidates whose call failed: 1 (Pass@1 counts each as a wrong rollout, one of its problem's n_i; MV@all "
        "gives it no vote; 'tmas run --resume' asks them again)"
    ) in markdown


@pytest.mark.slow
async def test_where_a_run_loses_its_answers_reads_the_iterations_its_grades_cover(tmp_path: Path) -> None:
    # Verify-Refine, n=2, m=1, T=2, both problems right at every iteration (the simulator's arithmetic). A run still
    # going: graded while p1 had finished It0 alone, its It1 finishing before the report was written. The section
    # stands on what was graded, as every other figure: both problems returned right, no step that changed an answer.
    # Before, it read the run again as it wrote the report: p1's ungraded It1 counted wrong, a right answer passed
    # over "only earlier" and a step for the worse.
    problems = write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "vr"
    await run(problems, run_dir, SimScript(), "verify_refine", n=2, m=1, iterations=2)
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results")
        db.execute("DELETE FROM grades")
        db.execute("CREATE TABLE later AS SELECT * FROM iterations WHERE problem_id = 'p1' AND iteration = 1")
        db.execute("DELETE FROM iterations WHERE problem_id = 'p1' AND iteration = 1")
    evaluation = await evaluate_run(run_dir, GradeConfig(mode="rules"), None)
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("INSERT INTO iterations SELECT * FROM later")
    markdown = write_report([evaluation], tmp_path / "report")["markdown"].read_text()
    part = markdown.split("### Where the runs lose their answers")[1].split("\n### ")[0]
    label = "verify_refine [sim-model]"
    assert f"| {label} | 2 | 100.0% (2) | 0.0% (0) | 0.0% (0) | 0.0% (0) | 0.0% (0) |" in part
    assert "passed over" not in part
    # One step (p2's It0 to It1), no change.
    assert f"| {label} | 1 | 0.0% (0) | 0.0% (0) | 0.0% (0) | 0.0% (0) |" in part


def table_row(markdown: str, start: str) -> str:
    """The one line of ``markdown`` beginning with ``start``."""
    (line,) = [line for line in markdown.splitlines() if line.startswith(start)]
    return line


@pytest.mark.slow
async def test_a_problem_that_stopped_early_keeps_its_answer_to_the_last_iteration(tmp_path: Path) -> None:
    # Majority vote with the Beta stop, rounds of 4, three iterations of 4. p1 draws 5 every time: its first four
    # agree and it stops after It0, right. p2 draws 8, 9 by turns: never decided, it runs all three iterations.
    boxed = [f"{FILLER}\\boxed{{{a}}}" for a in ("5", "8", "9")]
    stop = {"k": 4, "iterations": 3, "stop": "beta", "round_size": 4}
    problems = write_problems(tmp_path / "p.jsonl")
    some = SimScript(
        rules=[
            Rule(role="solution", pattern=r"2\+3", replies=boxed[:1]),
            Rule(role="solution", pattern=r"4\+4", replies=boxed[1:]),
        ]
    )
    await run(problems, tmp_path / "some", some, "majority", **stop)
    markdown = await report_here(tmp_path / "report", tmp_path / "some")
    # p1 keeps its 5 (Pass@1 1) at It1 and It2; p2's Pass@1 is 1/2 at each: 75 % at every iteration, at no more calls
    # for p1 (4 calls at It1 and It2 are p2's).
    for t in range(3):
        assert table_row(markdown, f"| It{t} | 2 | 75.00 |")
    assert table_row(markdown, "| It1 | 2 | 75.00 |").split(" | ")[7] == "4"
    # Every problem stops after It0: p2 now draws 9 every time (wrong). Each keeps its answer to It2, the method's
    # last iteration, as the paper's per-iteration curves count a stopped problem: 50 % at It0, It1 and It2 (std.
    # error sqrt(1/2) / sqrt(2)), at no call after It0; beside the first run its cells are no "-" after It0.
    every = SimScript(
        rules=[
            Rule(role="solution", pattern=r"2\+3", replies=boxed[:1]),
            Rule(role="solution", pattern=r"4\+4", replies=boxed[2:]),
        ]
    )
    await run(problems, tmp_path / "every", every, "majority", **stop)
    markdown = await report_here(tmp_path / "report2", tmp_path / "some", tmp_path / "every")
    assert "2 problems stopped early" in markdown
    for t in range(3):
        assert f"| It{t} | 2 | 50.00 | 50.00 | 50.00-50.00 | 50.00 | 50.00 | {8 if t == 0 else 0} |" in markdown
    # Both Pass@1 tables (It0 to It2 in each).
    assert markdown.count("| majority [sim-model] <every> | 50.00 | 50.00 | 50.00 |\n") == 2
    # The viewer's run page reads the same three iterations, graded live by the rules.
    ref = run_ref_for([tmp_path / "every"], tmp_path / "every")
    assert ref is not None
    with RunReader(ref, RunCache()) as reader:
        metrics = reader.overview().metrics
    assert metrics is not None
    assert [(m.iteration, m.pass1, m.calls) for m in metrics.iterations] == [(0, 0.5, 8), (1, 0.5, 0), (2, 0.5, 0)]


@pytest.mark.slow
async def test_pass1_lost_to_stopping_is_over_the_problems_both_runs_finished(tmp_path: Path) -> None:
    # Majority vote, two iterations of 4, with the Beta stop and without. p1 draws 5 every time (right): the stopping
    # run decides it after It0's 4 samples, the full run draws 8. p2 draws 8, 9 by turns: a tie, never decided, 8
    # samples in both, Pass@1 1/2. Every sample is 887 tokens (287 prompt, 600 completion).
    boxed = [f"{FILLER}\\boxed{{{a}}}" for a in ("5", "8", "9")]
    script = SimScript(
        rules=[
            Rule(role="solution", pattern=r"2\+3", replies=boxed[:1]),
            Rule(role="solution", pattern=r"4\+4", replies=boxed[1:]),
        ]
    )
    problems = write_problems(tmp_path / "p.jsonl")
    await run(problems, tmp_path / "stop", script, "majority", k=4, iterations=2, stop="beta", round_size=4)
    await run(problems, tmp_path / "full", script, "majority", k=4, iterations=2)
    # The full run was stopped before p2 began: it stands on p1 alone (Pass@1 100, 8 samples). Over both runs' last
    # rows the stopping run would lose 25 points (75 on two problems against 100 on one) and save 2 samples a
    # problem; over p1, the one problem both finished, it loses nothing and saves 4 samples of 8.
    with sqlite3.connect(tmp_path / "full" / "run.sqlite") as db:
        for table in ("results", "iterations"):
            db.execute(f"DELETE FROM {table} WHERE problem_id = 'p2'")
    markdown = await report_here(tmp_path / "report", tmp_path / "stop", tmp_path / "full")
    assert (
        "against the full run, over the 1 of 2 problems both finished: 3548 prompt + completion tokens saved per "
        "problem (50.0%), Pass@1 lost 0.00."
    ) in markdown
    # Every token column says what it counts: 887 prompt + completion tokens a sample, 4 samples a problem at It0.
    assert (
        "| Completion tokens/problem | Prompt + completion tokens/problem | Judge calls | Judge prompt + " in markdown
    )
    assert "| Reasoning tokens | Cum. prompt + completion tokens/problem |\n" in markdown
    assert "| 0 | 3548 |\n" in markdown


@pytest.mark.slow
async def test_the_mv_frontier_counts_a_samples_echo_retry_in_its_tokens(tmp_path: Path) -> None:
    # Majority vote, 2 samples a problem, every call 600 completion tokens. p1's first reply echoes the prompt's
    # instructions and is asked again: 3 calls, 1800 tokens for its 2 samples (900 a sample); p2 draws 2, 1200
    # (600 a sample). Both vote right. MV@1 at (900 + 600) / 2 = 750, MV@2 at (1800 + 1200) / 2 = 1500: what the
    # problems spent. Read from the samples' own calls (the echo's left out) they were 600 and 1200.
    echo = "Finish with one last line that holds nothing but the final answer you computed.\n\\boxed{5}"
    spent = ScriptedUsage(prompt_tokens=100, completion_tokens=600)
    script = SimScript(
        rules=[
            Rule(role="solution", pattern=r"2\+3", replies=[echo], times=1, usage=spent),
            Rule(role="solution", pattern=r"2\+3", replies=["\\boxed{5}"], usage=spent),
            Rule(role="solution", pattern=r"4\+4", replies=["\\boxed{8}"], usage=spent),
        ]
    )
    problems = write_problems(tmp_path / "p.jsonl")
    model = await run(problems, tmp_path / "mv", script, "majority", k=2, style="concise")
    assert len(model.calls_of("solution")) == 5
    evaluation = await evaluate_run(tmp_path / "mv", GradeConfig(mode="rules"), None)
    assert evaluation.cost.usage.completion_tokens == 3000
    assert [(p.label, p.tokens, p.accuracy) for p in evaluation.frontier] == [
        ("MV@1", 750.0, 1.0),
        ("MV@2", 1500.0, 1.0),
    ]


def test_the_frontiers_log_axis_labels_its_ticks_as_plain_token_counts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Titles and names are plain text ("$" no formula); the log axis's tick labels are token counts, not the
    # formula source matplotlib's log formatter writes ("$\mathdefault{2^{5}}$"), which plain text would print as is.
    import matplotlib.pyplot as plt

    from tmas.reports.frontier import FrontierPoint
    from tmas.reports.plots import plot_frontier

    drawn: list[Any] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: drawn.append(fig) or close(fig))
    points = [FrontierPoint(f"MV@{k}", 32.0 * k, 0.5, 0.1, 4) for k in (1, 2, 4, 8, 16)]
    plot_frontier([("cost $5", points)], "runs at $1 a call", tmp_path / "f.png")
    [fig] = drawn
    [ax] = fig.axes
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels and not any("$" in label or "mathdefault" in label for label in labels)
    assert {"32", "64", "128", "256", "512"} <= set(labels)
    assert ax.get_title() == "runs at $1 a call"
