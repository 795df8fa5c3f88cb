"""The run's progress as a user reads it: on an 80-column terminal every line fits, the problems done of the total and
the ETA come first, the problems being solved and the calls are named apart; without a terminal, a plain line with
the same figures (every few seconds) and one per finished problem, none per iteration."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from conftest import run_tmas, scripted_settings
from scripted_runs import scripted_run
from tmas.cli.progress import RunProgress, active_text, eta, headline, plain_line, result_line
from tmas.cli.steps import Steps
from tmas.llm.model import ClientStats
from tmas.llm.types import Usage
from tmas.problems import Problem
from tmas.runner import RunState
from tmas.store.records import IterationRecord, ProblemResult
from tmas.testing import ScriptedModel, SimScript


def busy_state() -> RunState:
    """14 problems, 5 finished (1 failed), 9 solving with long ids under a cap of 64, calls under way."""
    state = RunState(total=14, done=4, failed=1, problem_slots=64, iterations=20)
    state.active = {f"combinatorics-level3-seed{i}-variant-long-name": 3 for i in range(9)}
    state.stats = ClientStats(calls=1234, replayed=20, failed=2, in_flight=17)
    state.stats.usage = Usage(prompt_tokens=1_234_567, completion_tokens=45_678)
    return state


def test_the_live_display_fits_80_columns_with_progress_and_eta_first() -> None:
    state = busy_state()
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None, legacy_windows=False)
    board, _ = RunProgress(state, live=True).board(console, auto_refresh=False)
    console.print(board.get_renderable())
    lines = out.getvalue().rstrip("\n").splitlines()
    assert len(lines) == 3 and all(len(line) <= 80 for line in lines), lines
    # Done of the total, the bar, the ETA first; then the problems being solved; then the calls.
    assert lines[0].startswith("problems  5/14 ") and " 36% eta " in lines[0]
    assert lines[1].startswith("9 solving (up to 64 at once): combinatorics-level3-seed0")
    assert lines[1].endswith("…")  # cut at the edge, not wrapped onto a second line
    assert lines[2].startswith("calls: 17 in flight, 1234 sent, 20 replayed, 2 failed · tokens: 1.2M prompt")


def test_the_headline_counts_problems_and_the_eta_from_iterations_begun() -> None:
    state = busy_state()
    state.started_at -= 100.0
    # Done: 5 problems + 9 x 3/20 iterations = 6.35 of 14, in 100 s: 7.65 left take about 120 s.
    assert eta(state, now=state.started_at + 100.0) == "2m00s"
    assert headline(state).startswith("5/14 problems (1 failed) · eta ")
    assert RunState(total=3).iterations == 1 and eta(RunState(total=3)) == "?"


def test_a_finished_problem_s_line_counts_in_words_that_agree() -> None:
    state = RunState(total=3, done=2)
    first = IterationRecord(problem_id="p1", iteration=0, candidates=[])
    one = ProblemResult(problem_id="p1", method="cot", answer="42", iterations=[first], calls=1)
    one.usage = Usage(completion_tokens=90)
    assert result_line(state, one) == "[2/3] p1: done · answer '42' · 1 iteration · 1 call · 90 completion tokens"
    two = one.model_copy(update={"iterations": [first, first.model_copy(update={"iteration": 1})], "calls": 12})
    assert " · 2 iterations · 12 calls · " in result_line(state, two)


def test_problems_and_the_concurrency_cap_are_named_apart() -> None:
    state = RunState(total=100, problem_slots=64)
    state.active = {"p1": 0, "p2": 2, "p3": 1, "p4": 0}
    assert active_text(state) == "4 solving (up to 64 at once): p1@0 p2@2 p3@1 +1 more"
    line = plain_line(busy_state())
    assert line.startswith("tmas: 5/14 problems (1 failed) · eta ")
    assert " · 9 solving (up to 64 at once) · calls: 17 in flight, 1234 sent" in line


async def test_tmas_report_says_each_step_as_it_begins(tmp_path: Path) -> None:
    # The first report on several runs grades them all: each run's grading, then the writing, has its line.
    problems = [Problem(problem_id=f"q{i}", question=f"What is {i}+{i}?", answer=str(2 * i)) for i in range(2)]
    runs = []
    for method in ("cot", "majority"):
        model = ScriptedModel(SimScript(), scripted_settings(method={"name": method, "params": {}}))
        await scripted_run(model, tmp_path / method, problems)
        runs.append(str(tmp_path / method))
    out = run_tmas("report", *runs, "-o", str(tmp_path / "report"), "--grade", "rules", timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    said = [line for line in out.stderr.decode().splitlines() if line.startswith("tmas report: ")]
    assert said[:3] == [
        f"tmas report: grading run 1 of 2: {runs[0]}",
        f"tmas report: grading run 2 of 2: {runs[1]}",
        f"tmas report: writing the report (tables, plots) into {tmp_path / 'report'}",
    ]


async def test_tmas_report_says_no_grading_of_a_run_it_cannot_grade(tmp_path: Path) -> None:
    # A proof-mode run and one without reference answers are never graded: their lines say they are read, and why,
    # not that they are graded.
    runs = []
    for name, mode, answer in (("proof", "proof", "391"), ("unlabeled", "numeric", None)):
        problems = [Problem(problem_id="q", question="Show that 17*23 = 391.", answer=answer)]
        settings = scripted_settings(method={"name": "cot", "params": {"mode": mode}})
        await scripted_run(ScriptedModel(SimScript(), settings), tmp_path / name, problems)
        runs.append(str(tmp_path / name))
    out = run_tmas("report", *runs, "-o", str(tmp_path / "report"), "--grade", "rules", timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    said = [line for line in out.stderr.decode().splitlines() if line.startswith("tmas report: ")]
    assert said[:2] == [
        f"tmas report: reading run 1 of 2: {runs[0]} (proof mode: answers are proofs, not graded)",
        f"tmas report: reading run 2 of 2: {runs[1]} (no problem has a reference answer (unlabeled): nothing graded)",
    ]
    assert not any("grading" in line for line in said)


def test_a_step_is_said_again_only_once_it_lasts() -> None:
    steps = Steps("report")
    assert steps.still() is None  # no step yet
    steps.step("grading run 1 of 1: r")
    assert steps.still() is None  # its own line has just said it
    steps.began -= 7.0
    assert steps.still() == "tmas report: grading run 1 of 1: r · 7s so far"
