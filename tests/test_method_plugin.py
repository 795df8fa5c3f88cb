"""A new method is one file: found as a module of a methods package (as tmas finds its own) or as an installed
package's entry point, it goes through every command with no other file of the project changed: solve, run, eval (its
cost estimate included), report, view, serve and sweep, and RL data where its state keeps the banks. The method file
here is the smallest whole method: the one to copy for a new one."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import openai
import pytest
from typer.testing import CliRunner

from conftest import settings_for
from tmas.cli.main import app
from tmas.errors import InputError
from tmas.methods import METHODS, load_plugins, methods_in, register_method
from tmas.methods.base import Method, MethodParams, ProblemResult, ProblemSession
from tmas.rl.data import build_dataset
from tmas.serve.launch import ServeOptions
from tmas.store.run_store import RunStore
from tmas.testing import SimServer
from tmas.view.app import view_app
from web_helpers import AppThread, ProxyThread, get, run_ref_for

# The method file: a new method is this one file, in tmas's methods package or in a package of its own. Redraw keeps
# no banks (RL data refuses its runs); TmasLite is TMAS under a name of its own, whose state keeps the banks.
METHOD_FILE = '''
from typing import ClassVar

from tmas.agents.solution import generation_prompt
from tmas.methods.base import Candidate, Iterations, Method, MethodParams, ProblemResult, ProblemSession
from tmas.methods.call_count import CallCount, count_calls
from tmas.methods.steps import finish, solve_call
from tmas.methods.tmas import TMAS


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


class TmasLite(TMAS):
    """TMAS under a name of its own."""

    name: ClassVar[str] = "tmas_lite"
'''
NEW_METHODS = ("redraw", "tmas_lite")


@pytest.fixture(params=["file", "entry_point"])
def redraw(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The method file found as tmas finds its own methods (a module of a methods package, :func:`methods_in`) or as
    an installed package's entry point (:func:`load_plugins`, a dist-info as pip leaves one)."""
    root = tmp_path / "site"
    if request.param == "file":
        package = root / "extra_methods"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "redraw.py").write_text(METHOD_FILE)
        monkeypatch.syspath_prepend(str(root))
        for cls in methods_in("extra_methods", [str(package)]):
            register_method(cls)
        modules = ("extra_methods", "extra_methods.redraw")
    else:
        (root / "redraw_methods").mkdir(parents=True)
        (root / "redraw_methods" / "__init__.py").write_text(METHOD_FILE)
        info = root / "redraw_methods-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: redraw-methods\nVersion: 0.1\n")
        entry_points = "".join(
            f"{name} = redraw_methods:{cls}\n" for name, cls in zip(NEW_METHODS, ("Redraw", "TmasLite"), strict=True)
        )
        (info / "entry_points.txt").write_text("[tmas.methods]\n" + entry_points)
        monkeypatch.syspath_prepend(str(root))
        load_plugins()
        modules = ("redraw_methods",)
    assert set(NEW_METHODS) <= set(METHODS)
    yield request.param
    for name in NEW_METHODS:
        METHODS.pop(name, None)
    for module in modules:
        sys.modules.pop(module, None)


def test_tmas_registers_its_own_methods_the_same_way() -> None:
    import tmas.methods

    found = {cls.name: cls for cls in methods_in("tmas.methods", list(tmas.methods.__path__))}
    assert found == {name: cls for name, cls in METHODS.items() if name in found}
    assert set(found) == {"cot", "majority", "mattrl", "pacore", "rse", "self_refine", "tmas", "verify_refine"}


def invoke(*args: str) -> Any:
    out = CliRunner().invoke(app, list(args))
    assert out.exit_code == 0, out.output
    return out


@pytest.mark.slow
def test_a_new_method_goes_through_every_command(redraw: str, sim: SimServer, tmp_path: Path) -> None:
    url = ("--base-url", sim.base_url, "-m", "redraw")
    assert invoke("solve", "What is 17*23?", *url).stdout.strip() == "391"
    assert sim.stats().by_role == {"solution": 2}

    problems = tmp_path / "p.jsonl"
    rows = [{"problem_id": f"p{i}", "question": f"What is {i}*7?", "answer": str(7 * i)} for i in (2, 3)]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    invoke("run", str(problems), "-o", str(tmp_path / "run"), *url, "-T", "3")
    with RunStore(tmp_path / "run", create=False) as store:
        assert {r.problem_id: len(r.iterations) for r in store.results()} == {"p2": 3, "p3": 3}

    # The estimate is the method's own count: 2 problems x 2 iterations, each call at most max_tokens (2048).
    out = invoke("eval", str(problems), "-o", str(tmp_path / "eval"), *url, "--grade", "rules")
    # It states no replies asked again: the line says they come on top.
    said = (
        "tmas: estimate: 4 calls, <=8.2k completion tokens (an attempt cut part way and retried adds what it had"
        " generated), plus any reply asked again the method does not count"
    )
    assert f"{said} (one call more each)\n" in out.stderr
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


def test_a_new_method_is_served_and_swept(redraw: str, sim: SimServer, tmp_path: Path) -> None:
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
    assert runs == ["redraw", "redraw__iterations=1"]  # iterations=2 is its default: not in the name
    for name, iterations in zip(runs, (2, 1), strict=True):
        with RunStore(tmp_path / "sw" / "runs" / name, create=False) as store:
            [row] = list(store.results())
        assert row.answer == "21" and len(row.iterations) == iterations


def test_rl_data_is_built_from_a_new_method_that_keeps_the_banks(redraw: str, sim: SimServer, tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    rows = [{"problem_id": f"p{i}", "question": f"What is {i}*7?", "answer": str(7 * i)} for i in (2, 3)]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    url = ("--base-url", sim.base_url)
    invoke("run", str(problems), "-o", str(tmp_path / "lite"), *url, "-m", "tmas_lite", "-p", "n=2", "-p", "m=1")
    data = build_dataset([tmp_path / "lite"], mix=None)
    assert data.report.problems == 2 and data.report.groups["normal"] == 2
    assert {row["extra_info"]["problem_id"] for row in data.train} == {"p2", "p3"}
    # A method whose state keeps no banks gives no RL data: said in one line.
    invoke("run", str(problems), "-o", str(tmp_path / "redraw"), *url, "-m", "redraw")
    with pytest.raises(InputError, match="method 'redraw' keeps no experience or guideline banks"):
        build_dataset([tmp_path / "redraw"])


def test_the_estimate_shows_a_method_without_a_count_as_unknown(sim: SimServer, tmp_path: Path) -> None:
    class Uncounted(Method[MethodParams]):
        name: ClassVar[str] = "uncounted"

        async def solve(self, session: ProblemSession) -> ProblemResult:
            raise AssertionError("a dry run solves nothing")

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
