"""How `tmas view` grades, against how `tmas report` grades the same run: scripted runs read by both, the figures
compared."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.problems import Problem
from tmas.testing import Rule, ScriptedModel, SimScript
from tmas.view.app import view_app
from tmas.view.cache import RunCache
from tmas.view.runs import RunOverview, RunReader
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
