"""How `tmas view` grades, against how `tmas report` grades the same run: scripted runs read by both, the figures
compared; and how both read the grades a run stores (`tmas report --no-grade`, the viewer's run page)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from conftest import run_tmas, scripted_settings
from scripted_runs import scripted_run
from tmas.grading.grades import GradeConfig, Grades
from tmas.grading.run_results import load_results
from tmas.grading.runs import GRADING_META, GradingRecord, grade_run, last_grading, load_grades
from tmas.problems import Problem
from tmas.reports.metrics import compute_metrics
from tmas.reports.report import evaluate_run
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript
from tmas.view.app import Viewer, view_app
from tmas.view.cache import RunCache
from tmas.view.runs import PROOF_NOT_GRADED, UNLABELED_NOT_GRADED, RunOverview, RunReader
from web_helpers import AppThread, get, run_ref_for

PROBLEMS = [
    Problem(problem_id="p1", question="What is 17*23?", answer="391"),
    Problem(problem_id="p2", question="What is 12*12?", answer="144"),
]


def _verdict(score: float) -> str:
    return json.dumps({"analysis": "Checked each step of the computation.", "score": score})


def _overview(run_dir: Path) -> RunOverview:
    ref = run_ref_for([run_dir], run_dir)
    assert ref is not None
    with RunReader(ref, RunCache()) as reader:
        return reader.overview()


def _report_no_grade(run_dir: Path, out: Path, *flags: str) -> tuple[str, str]:
    """What `tmas report --no-grade FLAGS` says it read the grades as, and the Pass@1 (%) it shows."""
    done = run_tmas("report", str(run_dir), "-o", str(out), "--no-grade", *flags, text=True)
    assert done.returncode == 0, done.stderr
    markdown = (out / "report.md").read_text()
    pass1 = markdown.split("| cot [sim-model] | ")[1].split(" |")[0]
    return markdown.split("grading: ")[1].split(";")[0], pass1


async def _report(run_dir: Path, config: GradeConfig, judge: ScriptedModel | None = None) -> tuple[Grades, Any]:
    """What `tmas report --grade MODE` grades and shows: its verdicts and metrics."""
    with RunStore(run_dir, create=False) as store:
        grades = await grade_run(store, config, model=judge)
        return grades, compute_metrics(load_results(store), grades)


async def test_no_page_grades_a_proof_mode_run_as_the_report_leaves_it_ungraded(tmp_path: Path) -> None:
    # A proof-mode TMAS run of problems that carry reference answers: its candidates hold proofs, no answers.
    # tmas report leaves it ungraded; graded against the references, every proof read as wrong on the run page, the
    # problem and iteration pages, and in the run's accuracy (0% at every iteration).
    run_dir = tmp_path / "proof"
    proof = "## Solution\nMultiplying it out term by term gives the product, as required."
    params = {"n": 2, "m": 1, "iterations": 1, "mode": "proof"}
    settings = scripted_settings(method={"name": "tmas", "params": params})
    rules = [Rule(role="solution", replies=[proof]), Rule(role="verifier", replies=[_verdict(1)])]
    await scripted_run(ScriptedModel(SimScript(rules=rules), settings), run_dir, PROBLEMS)
    overview = _overview(run_dir)
    assert overview.grades is None and overview.metrics is None and "proof mode" in overview.not_graded
    assert [(p.status, p.correct, p.grade_source) for p in overview.problems] == [("done", None, None)] * 2
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        base = f"{viewer.url}/run/{ref.key}"
        pages = [get(base), get(f"{base}/problem?id=p1"), get(f"{base}/iteration?id=p1&t=0")]
        chart_status, chart = get(f"{base}/chart/iteration.png")
    assert [status for status, _ in pages] == [200, 200, 200]
    for _, body in pages:
        page = body.decode()
        assert 'class="tag wrong"' not in page and 'class="tag correct"' not in page and 'class="grader"' not in page
    assert 'id="not-graded"' in pages[0][1].decode() and "proof mode" in pages[0][1].decode()
    assert chart_status == 404 and "proof mode" in chart.decode()


def _judged(student: str, equivalent: bool) -> Rule:
    reply = json.dumps({"reasoning": "Compared the student's value with the reference.", "equivalent": equivalent})
    return Rule(role="judge", pattern=f"<student>\n{student}\n</student>", replies=[reply])


async def test_the_viewer_and_report_no_grade_read_stored_grades_as_the_last_grading(tmp_path: Path) -> None:
    # A chain-of-thought run: "5" against the reference \text{five} (the rules cannot decide it; the judge calls it
    # right), and 391 against 391 (the rules call it right; this judge calls it wrong). Undecided shows as None.
    pytest.importorskip("math_verify")
    problems = [
        Problem(problem_id="five", question="What is 2+3, in words?", answer="\\text{five}"),
        Problem(problem_id="mult", question="What is 17*23?", answer="391"),
    ]
    solutions = [
        Rule(role="solution", pattern=r"2\+3", replies=["Two and three make \\boxed{5}"]),
        Rule(role="solution", pattern=r"17\*23", replies=["It is \\boxed{391}"]),
    ]
    run_dir = tmp_path / "cot"
    await scripted_run(
        ScriptedModel(SimScript(rules=solutions), scripted_settings(method__name="cot")), run_dir, problems
    )
    judge = ScriptedModel(SimScript(rules=[_judged("5", True), _judged("391", False)]), scripted_settings())
    expected = {
        "combined": {"five": True, "mult": True},
        "rules": {"five": None, "mult": True},
        "judge": {"five": True, "mult": False},
    }

    async def graded(config: GradeConfig) -> None:
        """Grade as `tmas report --grade` does; the viewer then shows the figures that report showed."""
        grades, metrics = await _report(run_dir, config, judge)
        overview = _overview(run_dir)
        assert overview.grades is not None and not overview.grades.live
        assert overview.grades.grades.mode == config.mode and overview.grades.grades.runs == grades.runs
        assert overview.grades.grades.verdicts == grades.verdicts
        assert overview.metrics == metrics
        shown = {p.problem_id: p.correct for p in overview.problems}
        assert shown == expected[config.mode], config
        assert {p.grade_source for p in overview.problems} == {config.mode}

    # Graded by the judge with two runs, then with one: read as the judge's first run alone. Before, report --no-grade
    # read every run as combined over every stored judge run, both problems right: 100%.
    await graded(GradeConfig(mode="judge", judge_runs=2))
    await graded(GradeConfig(mode="judge", judge_runs=1))
    assert _report_no_grade(run_dir, tmp_path / "r1") == ("judge, 1 judge run", "50.00")  # five right alone
    # A grader named on the command line is read as named, with as many stored judge runs as it asks for (the run
    # holds no rules rows yet: combined reads the judge's verdicts throughout).
    assert _report_no_grade(run_dir, tmp_path / "r2", "--grade", "judge") == ("judge, 2 judge runs", "50.00")
    assert _report_no_grade(run_dir, tmp_path / "r3", "--judge-runs", "1") == ("combined, 1 judge run", "50.00")
    # The run page says which grading its verdicts are read as.
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, body = get(f"{viewer.url}/run/{ref.key}")
    grading = body.decode().split('id="grading"')[1].split("</p>")[0]
    assert status == 200 and "as its last grading of this run read them" in grading
    assert " ".join(grading.split()).endswith("the judge grader with 1 judge run.")

    # Then by the default (combined, two judge runs), then by the rules alone: read as the rules', "five" undecided.
    await graded(GradeConfig(mode="combined", judge_runs=2))
    await graded(GradeConfig(mode="rules"))
    assert _report_no_grade(run_dir, tmp_path / "r4") == ("rules only, no judge", "50.00")  # mult right alone
    assert _report_no_grade(run_dir, tmp_path / "r5", "--grade", "combined") == ("combined, 2 judge runs", "100.00")


async def test_grades_stored_before_gradings_were_recorded_are_read_with_the_default_grader(tmp_path: Path) -> None:
    run_dir = tmp_path / "cot"
    solutions = [Rule(role="solution", replies=["It is \\boxed{391}"])]
    await scripted_run(
        ScriptedModel(SimScript(rules=solutions), scripted_settings(method__name="cot")), run_dir, PROBLEMS[:1]
    )
    with RunStore(run_dir, create=False) as store:
        await grade_run(store, GradeConfig(mode="rules"))
        assert last_grading(store) == GradingRecord(mode="rules", runs=1)
        store.set_meta(GRADING_META, None)  # as a run graded by an earlier version holds
        assert last_grading(store) is None
    overview = _overview(run_dir)
    assert overview.grades is not None and not overview.grades.recorded
    assert overview.grades.grades.mode == "rules" and [p.correct for p in overview.problems] == [True]


async def test_a_grade_of_an_answer_since_replaced_is_not_shown_for_the_new_one(tmp_path: Path) -> None:
    # Majority vote with k = 1 answers 390 and is graded (wrong). Resumed with k = 3, the problem is solved again: its
    # first sample replays (390), two new ones answer 391, and the vote returns 391. The stored grade of the selected
    # answer is 390's: the viewer showed 391 marked wrong, where tmas report grades it anew, right.
    run_dir = tmp_path / "majority"
    first = scripted_settings(method__name="majority", method__params={"k": 1})
    await scripted_run(
        ScriptedModel(SimScript(rules=[Rule(role="solution", replies=["So \\boxed{390}"])]), first),
        run_dir,
        PROBLEMS[:1],
    )
    with RunStore(run_dir, create=False) as store:
        await grade_run(store, GradeConfig(mode="rules"))
    again = scripted_settings(method__name="majority", method__params={"k": 3})
    script = SimScript(rules=[Rule(role="solution", replies=["So \\boxed{391}"])])
    await scripted_run(ScriptedModel(script, again), run_dir, settings=again)
    selected = ("p1", 0, -1)
    with RunStore(run_dir, create=False) as store:
        assert [(g.answer, g.verdict) for g in store.grades() if g.candidate == -1] == [("390", False)]
        # Read without grading (tmas report --no-grade): no verdict for 391 is stored.
        loaded = load_grades(store, GradeConfig(mode="rules"))
        assert loaded is not None and loaded.verdicts[selected] == [None] and loaded.verdicts[("p1", 0, 0)] == [False]
    overview = _overview(run_dir)
    assert [(p.answer, p.correct, p.grade_source) for p in overview.problems] == [("391", True, "live")]
    grades, metrics = await _report(run_dir, GradeConfig(mode="rules"))
    assert grades.verdicts[selected] == [True]
    overview = _overview(run_dir)
    assert overview.grades is not None and overview.grades.grades.verdicts == grades.verdicts
    assert overview.metrics == metrics


async def test_pages_tell_why_a_run_is_not_graded_without_reading_all_its_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three runs: labeled, with no reference answer at all, and in proof mode. Each run page says why it is not
    # graded (or grades it); the problem and iteration pages then decide the same without reading the run's whole
    # problem list (a run of many problems read in full on every page): every read of it fails meanwhile.
    unlabeled = [Problem(problem_id=p.problem_id, question=p.question) for p in PROBLEMS]
    proof = {"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 1, "mode": "proof"}}
    tmas = {"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 1}}
    cases = [("labeled", PROBLEMS, tmas, ""), ("unlabeled", unlabeled, tmas, UNLABELED_NOT_GRADED)]
    cases.append(("proof", PROBLEMS, proof, PROOF_NOT_GRADED))
    rules = [
        Rule(role="solution", replies=["So the value is $\\boxed{391}$."]),
        Rule(role="verifier", replies=[_verdict(1)]),
    ]
    for name, problems, method, _ in cases:
        settings = scripted_settings(method=method)
        await scripted_run(ScriptedModel(SimScript(rules=rules), settings), tmp_path / name, problems)
    read_result = RunStore.result
    results_read: list[str] = []

    def counted(store: RunStore, problem_id: str) -> Any:
        results_read.append(problem_id)
        return read_result(store, problem_id)

    with AppThread(view_app([tmp_path / name for name, *_ in cases], warm_up=False)) as viewer:
        for name, _, _, reason in cases:
            ref = run_ref_for([tmp_path], tmp_path / name)
            assert ref is not None
            base = f"{viewer.url}/run/{ref.key}"
            status, body = get(base)
            assert status == 200
            assert (f'<p class="muted" id="not-graded">{reason}.</p>' in body.decode()) == bool(reason), name

            def unread(*args: object, **kwargs: object) -> None:
                raise AssertionError("the run's whole problem list was read")

            # Each page also reads the problem's result once (a thinking model's is megabytes), not once per use.
            results_read.clear()
            with monkeypatch.context() as patch:
                patch.setattr(RunStore, "problems", unread)
                patch.setattr(RunStore, "iter_problems", unread)
                patch.setattr(RunStore, "result", counted)
                pages = [get(f"{base}/problem?id=p1")]
                assert results_read == ["p1"], name
                pages.append(get(f"{base}/iteration?id=p1&t=0"))
                assert results_read == ["p1", "p1"], name
                missing = get(f"{base}/problem?id=p9")
            assert [status for status, _ in pages] == [200, 200], name
            assert missing[0] == 404 and "no problem &#39;p9&#39; in this run" in missing[1].decode()
            for _, page in pages:
                # p1's answer 391 is right: marked so where the run is graded, and nowhere where it is not.
                assert ('class="tag correct"' in page.decode()) == (not reason), name


async def test_majority_votes_count_answers_of_equal_value_as_one_as_the_run_did(tmp_path: Path) -> None:
    # Majority vote over three samples: sqrt(2)/2 written two ways, and 7. The run's vote counts the first two as one
    # answer (Math-Verify finds them equal): two votes of three, right. The viewer counted them by spelling: a
    # three-way tie, MV (1 + 1 + 0) / 3 = 66.7% where tmas report shows 100%. Now the run page groups them as the run
    # did, worked out in the background: the first page says the problem is still being compared, and once it is,
    # the run's marker moves (the open page reloads) and its MV is the report's.
    run_dir = tmp_path / "majority"
    settings = scripted_settings(method__name="majority", method__params={"k": 3})
    replies = ["So \\boxed{\\frac{\\sqrt{2}}{2}}", "So \\boxed{\\frac{1}{\\sqrt{2}}}", "So \\boxed{7}"]
    problem = Problem(problem_id="p1", question="What is sin(pi/4)?", answer="\\frac{\\sqrt{2}}{2}")
    await scripted_run(
        ScriptedModel(SimScript(rules=[Rule(role="solution", replies=replies)]), settings), run_dir, [problem]
    )
    with RunStore(run_dir, create=False) as store:
        await grade_run(store, GradeConfig(mode="rules"))
        result = store.result("p1")
    assert result is not None and result.iterations[0].state["votes"] == {"\\frac{\\sqrt{2}}{2}": 2, "7": 1}
    report = await evaluate_run(run_dir, None, None, grade=False)
    assert [m.mv for m in report.metrics.iterations] == [1.0]

    viewer = Viewer([tmp_path], warm_up=False)
    client = TestClient(viewer.build())
    ref = run_ref_for([tmp_path], run_dir)
    assert ref is not None
    first = client.get(f"/run/{ref.key}").text
    marker = client.get(f"/run/{ref.key}/marker").text
    assert 'id="votes-pending"' in first and "The answers of\n1 problem are still being compared" in first
    viewer.cache.votes.wait()
    assert client.get(f"/run/{ref.key}/marker").text != marker
    page = client.get(f"/run/{ref.key}").text
    assert 'id="votes-pending"' not in page
    # Pass@1: two of the three samples are right; the selected answer and MV: right.
    row = '<td class="num">66.7%</td><td class="num">100.0%</td><td class="num">100.0%</td>'
    assert row in page
    with RunReader(ref, viewer.cache) as reader:
        overview = reader.overview()
    assert overview.metrics == report.metrics and overview.frontier == report.frontier
    # Without the viewer's cache (a comparison of runs outside it) the grouping is worked out at once.
    with RunReader(ref) as reader:
        overview = reader.overview()
    assert overview.votes_pending == 0 and overview.metrics == report.metrics and overview.frontier == report.frontier


async def test_a_problem_page_reads_the_stored_grades_of_its_problem_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A graded run of two problems. The problem page of p1 read every grade row of the run (and its whole problem
    # list) to show p1's verdicts: a big graded run's 100,000 rows on every problem page. Now it reads p1's rows, and
    # its verdicts are the run page's.
    run_dir = tmp_path / "majority"
    settings = scripted_settings(method__name="majority", method__params={"k": 2})
    script = SimScript(rules=[Rule(role="solution", replies=["So \\boxed{391}"])])
    await scripted_run(ScriptedModel(script, settings), run_dir, PROBLEMS)
    with RunStore(run_dir, create=False) as store:
        await grade_run(store, GradeConfig(mode="rules"))
        assert {g.problem_id for g in store.grades()} == {"p1", "p2"}
    overview = _overview(run_dir)
    assert overview.grades is not None and not overview.grades.live
    run_verdicts = {k: v for k, v in overview.grades.grades.verdicts.items() if k[0] == "p1"}
    read_rows: list[str] = []
    problem_lists: list[int] = []
    grades, problems = RunStore.grades, RunStore.problems

    def counted_grades(store: RunStore, *args: Any, **kwargs: Any) -> Any:
        rows = grades(store, *args, **kwargs)
        read_rows.extend(g.problem_id for g in rows)
        return rows

    def counted_problems(store: RunStore) -> Any:
        problem_lists.append(1)
        return problems(store)

    monkeypatch.setattr(RunStore, "grades", counted_grades)
    monkeypatch.setattr(RunStore, "problems", counted_problems)
    ref = run_ref_for([tmp_path], run_dir)
    assert ref is not None
    client = TestClient(Viewer([tmp_path], warm_up=False).build())
    page = client.get(f"/run/{ref.key}/problem", params={"id": "p1"}).text
    assert page.count('class="tag correct"') == 3  # the two samples and the answer returned
    assert read_rows == ["p1"] * len(run_verdicts) and not problem_lists
    with RunReader(ref) as reader:
        problem = reader.store.problem("p1")
        assert problem is not None
        result, records = reader.solved("p1")
        live = reader.problem_grades(problem, result, records)
    assert live is not None and live.grades.verdicts == run_verdicts and live.stored_mode == "rules"


async def test_the_judges_calls_show_on_the_problem_page_as_the_graders_not_as_an_unfinished_iteration(
    tmp_path: Path,
) -> None:
    # A chain-of-thought run of one problem, graded by the judge (tmas report --grade judge): the judge's calls are
    # stored in the run under the problem, of no iteration. The problem page listed them as "calls of no recorded
    # iteration", made "for an iteration the problem never finished".
    run_dir = tmp_path / "cot"
    solutions = [Rule(role="solution", replies=["Two and three make \\boxed{5}"])]
    problem = Problem(problem_id="five", question="What is 2+3, in words?", answer="\\text{five}")
    await scripted_run(
        ScriptedModel(SimScript(rules=solutions), scripted_settings(method__name="cot")), run_dir, [problem]
    )
    judge = ScriptedModel(SimScript(rules=[_judged("5", True)]), scripted_settings())
    await _report(run_dir, GradeConfig(mode="judge", judge_runs=1), judge)
    with RunStore(run_dir, create=False) as store:
        calls = [(c.call_id, c.key.role, c.key.iteration) for c in store.calls("five")]
    judged = [call_id for call_id, role, _ in calls if role == "judge"]
    assert judged and [(role, t) for _, role, t in calls if role != "judge"] == [("solution", 0)]
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, body = get(f"{viewer.url}/run/{ref.key}/problem?id=five")
    page = body.decode()
    assert status == 200 and 'id="unrecorded-calls"' not in page and "never finished" not in page
    table = page.split('id="judge-calls"')[1].split("</table>")[0]
    rows = table.split("<tr>")[2:]
    assert [int(row.split('">#')[1].split("<")[0]) for row in rows] == judged
    assert all("<td>judge</td>" in row for row in rows)
    # The problem's own cost counts the method's one call, the judge's apart, as the run's cost table counts them.
    assert page.split('id="spent">')[1].startswith("1 calls")


async def test_the_accuracy_table_says_on_how_many_problems_each_iteration_stands_as_the_reports(
    tmp_path: Path,
) -> None:
    # Majority vote, k=1, two iterations, on p1 (17*23, labeled: 391) and u (12*12, no reference answer); the simulator
    # answers both right. The run is stopped with p1 through It0 alone and u through both: It0 stands on p1 (right:
    # 100%), It1 on no labeled problem (u is not graded), where an accuracy of 0% would read as every answer wrong.
    import sqlite3

    settings = scripted_settings(method={"name": "majority", "params": {"k": 1, "iterations": 2}})
    problems = [PROBLEMS[0], Problem(problem_id="u", question="What is 12*12?")]
    run_dir = tmp_path / "mv"
    await scripted_run(ScriptedModel(SimScript(), settings), run_dir, problems)
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results")
        db.execute("DELETE FROM iterations WHERE problem_id = 'p1' AND iteration = 1")
    report = await evaluate_run(run_dir, GradeConfig(mode="rules"), None)
    assert [(m.iteration, m.problems, m.pass1) for m in report.metrics.iterations] == [(0, 1, 1.0), (1, 0, 0.0)]
    ref = run_ref_for([run_dir], run_dir)
    assert ref is not None
    page = TestClient(Viewer([run_dir], warm_up=False).build()).get(f"/run/{ref.key}").text
    rows = [row.split("</tr>")[0] for row in page.split('<tr class="metrics-row">')[1:]]
    cells = [[cell.split(">", 1)[1] for cell in row.split("</td>")[:5]] for row in rows]
    # Iteration, problems (of the run's 1 labeled), Pass@1, selected answer, MV: as the report's table reads them.
    assert cells == [["0", "1", "100.0%", "100.0%", "100.0%"], ["1", "0 of 1", "-", "-", "-"]]
    assert 'id="metrics-short"' in page
