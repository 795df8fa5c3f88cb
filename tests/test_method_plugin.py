"""A method registered from outside the package goes through every command: solve, run, eval (its cost estimate
included), report and view, with no other file of the project changed. The toy method here is the smallest whole
method: a file to copy for a new one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import openai
import pytest
from typer.testing import CliRunner

from conftest import settings_for
from tmas.agents.solution import generation_prompt
from tmas.cli.main import app
from tmas.methods import METHODS, register_method
from tmas.methods.base import Candidate, Iterations, Method, MethodParams, ProblemResult, ProblemSession
from tmas.methods.call_count import CallCount, count_calls
from tmas.methods.steps import finish, solve_call
from tmas.serve.launch import ServeOptions
from tmas.store.run_store import RunStore
from tmas.testing import SimServer
from tmas.view.app import view_app
from web_helpers import AppThread, ProxyThread, get, run_ref_for


class RedrawParams(MethodParams):
    iterations: Iterations = 2


class Redraw(Method[RedrawParams]):
    """One fresh sample per iteration; the last one answers."""

    name: ClassVar[str] = "redraw"
    Params: ClassVar[type[MethodParams]] = RedrawParams

    def calls_per_problem(self) -> CallCount:
        return count_calls({"solution": self.params.iterations})

    async def solve(self, session: ProblemSession) -> ProblemResult:
        last: Candidate | None = None
        for t in range(self.params.iterations):
            session.begin_iteration(t)
            messages = generation_prompt(session.problem.question, self.params.mode)
            last = await solve_call(session, "solution", messages, index=0, mode=self.params.mode)
            if last is None:  # the budget refused the call
                return finish(session, self.name, None, stopped=True)
            session.end_iteration([last], selected=last.answer)
        return finish(session, self.name, last, stopped=False)


@pytest.fixture
def redraw() -> Iterator[None]:
    register_method(Redraw)
    yield
    del METHODS[Redraw.name]


def invoke(*args: str) -> Any:
    out = CliRunner().invoke(app, list(args))
    assert out.exit_code == 0, out.output
    return out


@pytest.mark.slow
def test_a_method_registered_outside_goes_through_every_command(redraw: None, sim: SimServer, tmp_path: Path) -> None:
    url = ("--base-url", sim.base_url, "-m", "redraw")
    assert invoke("solve", "What is 17*23?", *url).stdout.strip() == "391"
    assert sim.stats().by_role == {"solution": 2}

    problems = tmp_path / "p.jsonl"
    rows = [{"problem_id": f"p{i}", "question": f"What is {i}*7?", "answer": str(7 * i)} for i in (2, 3)]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    invoke("run", str(problems), "-o", str(tmp_path / "run"), *url, "-T", "3")
    with RunStore(tmp_path / "run", create=False) as store:
        assert {r["problem_id"]: len(r["iterations"]) for r in store.results()} == {"p2": 3, "p3": 3}

    # The estimate is the method's own count: 2 problems x 2 iterations, each call at most max_tokens (2048).
    out = invoke("eval", str(problems), "-o", str(tmp_path / "eval"), *url, "--grade", "rules")
    assert "  eval          2              2          4  <=8.2k (max_tokens)\n  total: 4 calls\n" in out.stderr
    markdown = (tmp_path / "eval" / "report" / "report.md").read_text()
    assert "| redraw |" in markdown and "100.00" in markdown

    invoke("report", str(tmp_path / "run"), "-o", str(tmp_path / "report"), "--grade", "rules")
    assert "| redraw |" in (tmp_path / "report" / "report.md").read_text()

    with AppThread(view_app([tmp_path / "run"])) as viewer:
        ref = run_ref_for([tmp_path / "run"], tmp_path / "run")
        assert ref is not None
        status, page = get(f"{viewer.url}/run/{ref.key}")
        _, problem = get(f"{viewer.url}/run/{ref.key}/problem?id=p3")
    assert status == 200 and b"redraw" in page
    assert b"What is 3*7?" in problem and b"21" in problem


def test_a_method_registered_outside_is_served_and_swept(redraw: None, sim: SimServer, tmp_path: Path) -> None:
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused")
        assert "redraw/sim-model" in {m.id for m in api.models.list()}
        reply = api.chat.completions.create(
            model="redraw/sim-model",
            messages=[{"role": "user", "content": "What is 17*23?"}],
            extra_body={"tmas": {"iterations": 3}},
        )
    assert "\\boxed{391}" in (reply.choices[0].message.content or "")
    assert sim.stats().by_role == {"solution": 3}  # its own parameter reached the method

    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem_id": "a", "question": "What is 3*7?", "answer": "21"}) + "\n")
    args = ["sweep", "--out", str(tmp_path / "sw"), "--problems", str(problems), "-m", "redraw"]
    invoke(*args, "--grid", "iterations=1,2", "--base-url", sim.base_url, "--no-report")
    runs = sorted(p.name for p in (tmp_path / "sw" / "runs").iterdir())
    assert runs == ["redraw__iterations=1", "redraw__iterations=2"]
    for name, iterations in zip(runs, (1, 2), strict=True):
        with RunStore(tmp_path / "sw" / "runs" / name, create=False) as store:
            [row] = list(store.results())
        assert row["answer"] == "21" and len(row["iterations"]) == iterations


def test_the_estimate_shows_a_method_without_a_count_as_unknown(sim: SimServer, tmp_path: Path) -> None:
    class Uncounted(Redraw):
        name: ClassVar[str] = "uncounted"
        calls_per_problem = Method.calls_per_problem

    register_method(Uncounted)
    try:
        problems = tmp_path / "p.jsonl"
        problems.write_text(json.dumps({"problem_id": "a", "question": "What is 2*7?", "answer": "14"}) + "\n")
        args = ("-o", str(tmp_path / "run"), "-m", "uncounted", "--dry-run", "--base-url", sim.base_url)
        out = invoke("run", str(problems), *args)
    finally:
        del METHODS[Uncounted.name]
    assert "method 'uncounted' states no calls per problem" in out.stderr
    assert "and the unknown calls of the points marked ?" in out.stderr and sim.stats().total_requests == 0
