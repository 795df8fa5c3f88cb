"""``tmas sweep``: grid expansion, one run per point, resume after an interruption without repeating finished work,
and the combined report."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import run_tmas, scripted_settings
from scripted_runs import GoneModel
from tmas.cli.main import app
from tmas.config import Budget
from tmas.errors import ConfigError, InputError
from tmas.methods.base import ProblemResult
from tmas.problems import Problem
from tmas.runner import Unreachable, holds_run
from tmas.store.run_store import RunStore
from tmas.sweep import (
    GridAbout,
    PointOutcome,
    Study,
    SweepSpec,
    expand,
    load_spec,
    not_applied,
    report_sweep,
    run_sweep,
)
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer

PROBLEMS = [("p1", "What is 12*11?", "132"), ("p2", "What is 7*8?", "56"), ("p3", "What is 9*9?", "81")]


def write_problems(path: Path) -> str:
    path.write_text("".join(json.dumps({"problem_id": i, "question": q, "answer": a}) + "\n" for i, q, a in PROBLEMS))
    return str(path)


def spec_for(problems: str) -> SweepSpec:
    return SweepSpec(
        problems=problems,
        study=[
            Study(name="baselines", methods=["cot", "majority"], params={}, grid={}),
            Study(name="refine", method="self_refine", params={"iterations": 2}, grid={"n": [1, 2]}),
        ],
    )


def test_expand_dedups_points_shared_by_studies() -> None:
    spec = SweepSpec(
        problems="x",
        study=[
            Study(name="ablation", method="tmas", params={"n": 2, "m": 1}, variants=[{}, {"no_guideline": True}]),
            Study(name="epsilon", method="tmas", params={"n": 2, "m": 1}, grid={"epsilon": [0.2, 1.0]}),
        ],
    )
    points = expand(spec)
    # epsilon = 0.2 is the default: the same run as the ablation study's plain point.
    assert len(points) == 3
    assert points[0].studies == ["ablation", "epsilon"]
    assert {p.name for p in points} == {
        "tmas__m=1__n=2",
        "tmas__m=1__n=2__no_guideline=true",
        "tmas__epsilon=1.0__m=1__n=2",
    }


def test_bad_points_fail_before_any_call() -> None:
    spec = SweepSpec(problems="x", study=[Study(method="tmas", grid={"m": [0, 4]})])
    with pytest.raises(ConfigError, match="'m'"):
        expand(spec)


def test_a_bad_parameter_names_the_study_that_gives_it() -> None:
    spec = SweepSpec(
        problems="x",
        study=[
            Study(name="baselines", method="cot"),
            Study(name="domains", method="mattrl", grid={"domain": ["math", "law"]}),
        ],
    )
    with pytest.raises(ConfigError) as info:
        expand(spec)
    assert str(info.value) == (
        "study 'domains': method 'mattrl': bad value (unknown MATTRL domain 'law' (known: math, medicine,"
        " education)) for 'domain'"
    )


def test_grid_file(tmp_path: Path) -> None:
    write_problems(tmp_path / "problems.jsonl")
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'problems = "problems.jsonl"\nbudget = { calls = 4 }\n\n'
        '[[study]]\nname = "eps"\nmethod = "tmas"\nparams = { n = 2, m = 1 }\ngrid = { epsilon = [0.0, 1.0] }\n'
    )
    spec = load_spec(grid)
    assert spec.problems == str(tmp_path / "problems.jsonl")
    assert [p.name for p in expand(spec)] == [
        "tmas__epsilon=0.0__m=1__n=2__budget_calls=4",
        "tmas__epsilon=1.0__m=1__n=2__budget_calls=4",
    ]


async def test_sweep_resumes_after_interruption_without_repeating_finished_runs(tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "problems.jsonl")
    spec = spec_for(problems)
    names = [p.name for p in expand(spec)]
    assert names == ["cot", "majority", "self_refine__iterations=2__n=1", "self_refine__iterations=2__n=2"]
    settings = scripted_settings(concurrency=1)

    # The uninterrupted sweep, for reference.
    ref = ScriptedModel(SimScript(), settings)
    await run_sweep(spec, settings, tmp_path / "ref", model=ref)
    total = len(ref.calls)

    # The same sweep, cut off by the model going away in the middle of the third point (after its first problem).
    model = GoneModel(SimScript(), settings)
    finished: list[str] = []
    solved_in_third: list[str] = []

    def on_point(outcome: PointOutcome) -> None:
        finished.append(outcome.point.name)

    def on_result(result: ProblemResult) -> None:
        if len(finished) == 2:
            solved_in_third.append(result.problem_id)
            model.gone = True

    with pytest.raises(Unreachable):
        await run_sweep(spec, settings, tmp_path / "sweep", on_point=on_point, on_result=on_result, model=model)
    first = len(model.calls)
    assert finished == names[:2] and solved_in_third == ["p1"]

    again = ScriptedModel(SimScript(), settings)
    summary = await run_sweep(spec, settings, tmp_path / "sweep", model=again)
    assert [o.status for o in summary.outcomes] == ["skipped", "skipped", "resumed", "new"]
    # Nothing finished was asked again: the two runs together made exactly the uninterrupted sweep's calls, and
    # the resumed point asked only about the problems it had not finished.
    assert first + len(again.calls) == total
    # p1 was finished in the third point before the cut: it is asked about only in the fourth (n=2, 2 iterations).
    assert sum(c.key.problem_id == "p1" for c in again.calls) == 2 * 2
    # Each point's summary counts its own calls: the resumed one replays what it had sent before the cut.
    points = {p["name"]: p for p in summary.to_dict()["points"]}
    assert sum(p["calls"] for p in points.values()) == len(again.calls)
    # Each point says where its run is.
    assert all(holds_run(Path(p["run_dir"])) and Path(p["run_dir"]).name == name for name, p in points.items())
    assert points["cot"]["calls"] == points["majority"]["calls"] == 0

    # A third run does nothing at all.
    idle = ScriptedModel(SimScript(), settings)
    summary = await run_sweep(spec, settings, tmp_path / "sweep", model=idle)
    assert idle.calls == []
    assert [o.status for o in summary.outcomes] == ["skipped"] * 4
    manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert all(p["finished"] for p in manifest["points"].values())


async def test_each_point_runs_under_its_studys_budget(tmp_path: Path) -> None:
    # A study's own budget overrides the sweep's, and each point's run holds the one it ran under.
    spec = SweepSpec(
        problems=write_problems(tmp_path / "problems.jsonl"),
        budget=Budget(calls=3),
        study=[
            Study(name="wide", method="majority", params={"k": 4}),
            Study(name="narrow", method="majority", params={"k": 4}, budget=Budget(calls=2)),
        ],
    )
    model = ScriptedModel(SimScript(), scripted_settings())
    summary = await run_sweep(spec, model.settings, tmp_path / "sweep", model=model)
    assert [o.point.name for o in summary.outcomes] == [
        "majority__k=4__budget_calls=3",
        "majority__k=4__budget_calls=2",
    ]
    for outcome, calls in zip(summary.outcomes, (3, 2), strict=True):
        with RunStore(tmp_path / "sweep" / "runs" / outcome.point.name, create=False) as store:
            assert store.get_meta("settings")["budget"]["calls"] == calls
            results = store.results()
        assert outcome.summary is not None and outcome.summary.calls == calls * len(PROBLEMS)
        assert all(len(r.iterations[0].candidates) == calls for r in results)
    assert len(model.calls) == (3 + 2) * len(PROBLEMS)


@pytest.mark.slow
async def test_sweep_report_has_every_curve(tmp_path: Path) -> None:
    from tmas.grading.grades import GradeConfig

    spec = spec_for(write_problems(tmp_path / "problems.jsonl"))
    model = ScriptedModel(SimScript(), scripted_settings())
    await run_sweep(spec, model.settings, tmp_path / "sweep", model=model)
    written = await report_sweep(spec, tmp_path / "sweep", GradeConfig(mode="rules"), None)
    report = written["markdown"].read_text()
    for label in ("cot", "majority", "self_refine [sim-model] (n=1)", "self_refine [sim-model] (n=2)"):
        assert f"| {label if '[' in label else label + ' [sim-model]'} |" in report
    assert any(k.startswith("frontier_") and k.endswith(".png") for k in written)
    assert "Accuracy (%) at equal completion-token budgets" in report
    assert (tmp_path / "sweep" / "report" / "refine" / "report.md").exists()


async def test_each_new_point_records_its_place_in_the_sweep_and_the_papers_benchmark(tmp_path: Path) -> None:
    spec = spec_for(write_problems(tmp_path / "problems.jsonl"))
    spec.about = GridAbout(paper="TMAS", benchmark="AIME 2025")
    spec.limit = 1
    model = ScriptedModel(SimScript(), scripted_settings())
    summary = await run_sweep(spec, model.settings, tmp_path / "sweep", model=model)
    assert [o.status for o in summary.outcomes] == ["new"] * 4
    for outcome in summary.outcomes:
        with RunStore(tmp_path / "sweep" / "runs" / outcome.point.name, create=False) as store:
            assert store.get_meta("sweep") == {"point": outcome.point.name, "studies": outcome.point.studies}
            assert store.get_meta("paper_benchmark") == "AIME 2025"
            assert [p.problem_id for p in store.iter_problems()] == ["p1"]
    # The manifest holds the grid and the settings a resume reads back.
    manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert manifest["spec"]["about"]["benchmark"] == "AIME 2025" and manifest["spec"]["limit"] == 1
    assert manifest["points"]["cot"] == {"method": "cot", "params": {}, "studies": ["baselines"], "finished": True}


async def test_a_sweep_on_a_model_without_an_endpoint_skips_its_finished_points(tmp_path: Path) -> None:
    # Settings that name no endpoint would mean the embedded model, whose defaults change a method's parameters:
    # on a model of one's own the points keep theirs, so a second sweep finds every point finished.
    spec = SweepSpec(problems=write_problems(tmp_path / "problems.jsonl"), study=[Study(methods=["tmas"])])
    spec.study[0].params = {"n": 1, "m": 1, "iterations": 1}
    model = ScriptedModel(SimScript())
    assert model.settings.uses_local_model
    first = await run_sweep(spec, model.settings, tmp_path / "sweep", model=model)
    assert [o.status for o in first.outcomes] == ["new"] and first.outcomes[0].summary is not None
    assert first.outcomes[0].summary.done == len(PROBLEMS)
    again = ScriptedModel(SimScript())
    second = await run_sweep(spec, again.settings, tmp_path / "sweep", model=again)
    assert [o.status for o in second.outcomes] == ["skipped"] and again.calls == []


async def test_a_finished_point_with_a_failed_call_is_resumed_and_asks_only_that_call(tmp_path: Path) -> None:
    spec = SweepSpec(problems=write_problems(tmp_path / "problems.jsonl"), study=[Study(methods=["majority"])])
    spec.study[0].params = {"k": 3}
    # p1's first sample fails after its retries: the point finishes, p1 voting over two samples.
    failing = ScriptedModel(SimScript(rules=[Rule(role="solution", pattern=r"12\*11", fault="http_500", times=1)]))
    first = await run_sweep(spec, failing.settings, tmp_path / "sweep", model=failing)
    assert [o.status for o in first.outcomes] == ["new"] and first.outcomes[0].summary is not None
    failed = next(call for call in failing.calls if call.key.problem_id == "p1")
    # Run again, the model healthy: the point is resumed, not skipped, and only p1's failed sample is asked.
    healthy = ScriptedModel(SimScript())
    second = await run_sweep(spec, healthy.settings, tmp_path / "sweep", model=healthy)
    assert [o.status for o in second.outcomes] == ["resumed"]
    assert [(c.key.problem_id, c.key.sample, c.messages) for c in healthy.calls] == [
        ("p1", failed.key.sample, failed.messages)
    ]
    with RunStore(tmp_path / "sweep" / "runs" / second.outcomes[0].point.name, create=False) as store:
        assert [(r.problem_id, r.failed_calls) for r in store.results()] == [("p1", 0), ("p2", 0), ("p3", 0)]
    idle = ScriptedModel(SimScript())
    third = await run_sweep(spec, idle.settings, tmp_path / "sweep", model=idle)
    assert [o.status for o in third.outcomes] == ["skipped"] and idle.calls == []


async def test_a_point_whose_calls_fail_is_recorded_unfinished_and_the_others_go_on(tmp_path: Path) -> None:
    spec = SweepSpec(
        problems=write_problems(tmp_path / "problems.jsonl"),
        study=[Study(methods=["self_refine", "cot"], params={"iterations": 2, "n": 2})],
    )
    # Every refinement of self_refine fails after its retries: its problems are solved without them.
    failing = ScriptedModel(SimScript(rules=[Rule(role="refiner", fault="http_500")]))
    summary = await run_sweep(spec, failing.settings, tmp_path / "sweep", model=failing)
    # The next point ran all the same.
    assert [(o.point.name, o.status) for o in summary.outcomes] == [
        ("self_refine__iterations=2__n=2", "new"),
        ("cot", "new"),
    ]
    points = {p["name"]: p for p in summary.to_dict()["points"]}
    # self_refine's n = 2 refinements of each of the 3 problems failed: the summary says so, and the manifest does
    # not count the point finished (run again, it is resumed, not skipped).
    assert points["self_refine__iterations=2__n=2"]["failed_calls"] == 2 * len(PROBLEMS)
    assert points["cot"]["failed_calls"] == 0
    manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["points"]
    assert {name: p["finished"] for name, p in manifest.items()} == {
        "self_refine__iterations=2__n=2": False,
        "cot": True,
    }
    healthy = ScriptedModel(SimScript())
    again = await run_sweep(spec, healthy.settings, tmp_path / "sweep", model=healthy)
    assert [o.status for o in again.outcomes] == ["resumed", "skipped"]
    assert {c.key.role for c in healthy.calls} == {"refiner"}
    manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["points"]
    assert all(p["finished"] for p in manifest.values())


@pytest.mark.parametrize("problems_stored", [False, True])
async def test_a_point_killed_while_storing_its_problems_is_run_anew(tmp_path: Path, problems_stored: bool) -> None:
    problems = write_problems(tmp_path / "problems.jsonl")
    spec = SweepSpec(problems=problems, study=[Study(name="s", methods=["cot"], params={}, grid={})])
    settings = scripted_settings()
    # What a kill leaves in the point's directory before its setup was recorded (and so before any call).
    with RunStore(tmp_path / "sweep" / "runs" / "cot") as left:
        if problems_stored:
            left.add_problems(Problem(problem_id=i, question=q, answer=a) for i, q, a in PROBLEMS)
    model = ScriptedModel(SimScript(), settings)
    summary = await run_sweep(spec, settings, tmp_path / "sweep", model=model)
    assert [o.status for o in summary.outcomes] == ["new"]
    assert len(model.calls) == len(PROBLEMS)
    with RunStore(tmp_path / "sweep" / "runs" / "cot", create=False) as store:
        assert len(store.results()) == len(PROBLEMS)


@pytest.mark.parametrize(
    "given", [["--limit", "3"], ["--problems", "other.jsonl"], ["--param", "k=3"]], ids=["limit", "problems", "param"]
)
def test_a_resume_refuses_the_options_it_would_not_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: list[str]
) -> None:
    from typer.testing import CliRunner

    from conftest import isolate
    from tmas.cli.main import app
    from tmas.errors import InputError

    isolate(monkeypatch, tmp_path)
    spec = SweepSpec(problems=write_problems(tmp_path / "problems.jsonl"), limit=1, study=[Study(methods=["cot"])])
    model = ScriptedModel(SimScript(), scripted_settings())
    asyncio.run(run_sweep(spec, model.settings, tmp_path / "sweep", model=model))
    # Resumed, the sweep keeps its own grid and problems: an option that would change them is refused, not ignored
    # (with --limit 3 it would otherwise say that every point is finished, having solved 1 problem of 3).
    result = CliRunner().invoke(app, ["sweep", "--resume", str(tmp_path / "sweep"), "--no-report", *given])
    assert isinstance(result.exception, InputError), result.output
    assert str(result.exception).startswith("--resume takes the sweep directory alone")
    assert given[0] in str(result.exception)
    with RunStore(tmp_path / "sweep" / "runs" / "cot", create=False) as store:
        assert [p.problem_id for p in store.iter_problems()] == ["p1"]


async def test_a_sweep_refused_for_changed_requests_makes_no_call_and_keeps_its_manifest(tmp_path: Path) -> None:
    from tmas.errors import InputError
    from tmas.sweep import resumed_sweep

    problems = write_problems(tmp_path / "problems.jsonl")
    out = tmp_path / "sweep"
    first = ScriptedModel(SimScript(), scripted_settings(concurrency=1))
    await run_sweep(SweepSpec(problems=problems, study=[Study(methods=["majority"])]), first.settings, out, model=first)
    manifest = (out / "sweep.json").read_text()
    # The same directory, a point added before the finished one, and another temperature: the finished point's
    # problems were solved at 0.7, so the sweep is refused before its new first point sends anything.
    hotter = ScriptedModel(SimScript(), scripted_settings(concurrency=1, sampling__temperature=0.9))
    spec = SweepSpec(problems=problems, study=[Study(methods=["cot", "majority"])])
    with pytest.raises(InputError, match=r"temperature 0\.7 \(now 0\.9\)"):
        await run_sweep(spec, hotter.settings, out, model=hotter)
    assert hotter.calls == [] and not (out / "runs" / "cot").exists()
    # The manifest still holds the settings the points ran with: resumed without the change, the sweep goes on.
    assert (out / "sweep.json").read_text() == manifest
    kept_spec, kept = resumed_sweep(out, {})
    assert kept.sampling.temperature == 0.7
    again = ScriptedModel(SimScript(), kept)
    summary = await run_sweep(kept_spec, kept, out, model=again)
    assert [o.status for o in summary.outcomes] == ["skipped"] and again.calls == []


async def test_a_sweep_goes_on_where_its_endpoint_moved_to_another_address(tmp_path: Path) -> None:
    import sqlite3

    from conftest import settings_for
    from tmas.testing import SimServer

    spec = SweepSpec(problems=write_problems(tmp_path / "problems.jsonl"), study=[Study(methods=["cot", "majority"])])
    out = tmp_path / "sweep"
    with SimServer(SimScript()) as first:
        await run_sweep(spec, settings_for(first), out)
    # Stopped while the second point had finished p1 and p2 only.
    with sqlite3.connect(out / "runs" / "majority" / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'p3'")
        db.execute("DELETE FROM calls WHERE problem_id = 'p3'")
    # The same server, started again on another port: the sweep's settings are unchanged but for the address, and
    # its replies are read as the first server's were learnt once it answers.
    with SimServer(SimScript()) as moved:
        summary = await run_sweep(spec, settings_for(moved), out)
        chats = [r for r in moved.requests if r.endpoint == "chat"]
    assert [o.status for o in summary.outcomes] == ["skipped", "resumed"]
    assert {r.body["messages"][-1]["content"].count("9*9") > 0 for r in chats} == {True}
    with RunStore(out / "runs" / "majority", create=False) as store:
        assert sorted(r.problem_id for r in store.results()) == ["p1", "p2", "p3"]


def test_a_bad_point_of_a_grid_file_is_one_line_naming_the_file_and_the_study(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from conftest import isolate
    from tmas.cli.main import app

    isolate(monkeypatch, tmp_path)
    write_problems(tmp_path / "problems.jsonl")
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'problems = "problems.jsonl"\n[[study]]\nname = "plain"\nmethod = "cot"\n'
        '[[study]]\nname = "eps"\nmethod = "tmas"\ngrid = { epsilon = [0.1, "high"] }\n'
    )
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, ["sweep", str(grid), "-o", str(out), "--no-report"])
    assert isinstance(result.exception, ConfigError), result.output
    message = str(result.exception)
    assert message.startswith(f"{grid}: study 'eps': method 'tmas': bad value (") and "'epsilon'" in message
    assert "\n" not in message and not out.exists()


async def test_points_whose_names_meet_run_in_directories_of_their_own(tmp_path: Path) -> None:
    # 'x y' and 'x_y' read alike as directory names: each point keeps its own run, with its own value.
    problems = write_problems(tmp_path / "p.jsonl")
    spec = SweepSpec(problems=problems, study=[Study(method="mattrl", grid={"pool": ["pools/x y", "pools/x_y"]})])
    points = expand(spec)
    assert [p.params for p in points] == [{"pool": "pools/x y"}, {"pool": "pools/x_y"}]
    assert len({p.name for p in points}) == 2
    assert all(p.name.startswith("mattrl__pool=pools_x_y__") for p in points)
    assert expand(spec)[0].name == points[0].name  # stable: a resumed sweep finds its runs


def test_points_whose_names_differ_only_in_case_run_in_directories_of_their_own(tmp_path: Path) -> None:
    # 'A' and 'a' are one directory on a file system that ignores case (macOS, Windows).
    problems = write_problems(tmp_path / "p.jsonl")
    spec = SweepSpec(problems=problems, study=[Study(method="mattrl", grid={"pool": ["pools/A", "pools/a"]})])
    points = expand(spec)
    assert [p.params for p in points] == [{"pool": "pools/A"}, {"pool": "pools/a"}]
    assert len({p.name.casefold() for p in points}) == 2
    assert points[0].name.startswith("mattrl__pool=pools_A__") and points[1].name.startswith("mattrl__pool=pools_a__")


def swept_k_1_2(sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The arguments of a sweep of majority vote into sw under tmp_path (all but --grid), after it ran over
    k = 1, 2 on the simulated server (1 + 2 samples a problem) and said nothing of another grid."""
    monkeypatch.chdir(tmp_path)
    problems = write_problems(tmp_path / "p.jsonl")
    args = ["sweep", "--out", "sw", "--problems", problems, "-m", "majority", "-p", "iterations=1"]
    args += ["--base-url", sim.base_url, "--no-report"]
    first = CliRunner().invoke(app, [*args, "--grid", "k=1,2"])
    assert first.exit_code == 0, first.output
    assert "another grid" not in first.output and len(sim.chat_bodies()) == 3 * len(PROBLEMS)
    return args


def test_a_sweep_run_again_with_a_grid_that_leaves_points_out_says_which(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = swept_k_1_2(sim, tmp_path, monkeypatch)
    sent = len(sim.chat_bodies())
    again = CliRunner().invoke(app, [*args, "--grid", "k=1,3"])
    assert again.exit_code == 0, again.output
    assert (
        "tmas sweep: sw was made with another grid: 1 of its points left out of this one and of its report (their"
        " runs stay under sw/runs): majority__k=2; 1 added: majority__k=3"
    ) in again.output
    # k=1 is finished and skipped: only k=3's calls are sent, 3 samples a problem.
    assert len(sim.chat_bodies()) - sent == 3 * len(PROBLEMS)


def test_a_sweep_run_again_with_a_grid_that_adds_points_says_which(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = swept_k_1_2(sim, tmp_path, monkeypatch)
    sent = len(sim.chat_bodies())
    again = CliRunner().invoke(app, [*args, "--grid", "k=1,2,3"])
    assert again.exit_code == 0, again.output
    assert "tmas sweep: sw was made with another grid: 1 point added to its 2: majority__k=3" in again.output
    assert len(sim.chat_bodies()) - sent == 3 * len(PROBLEMS)
    # The same grid once more: nothing changed, nothing said.
    same = CliRunner().invoke(app, [*args, "--grid", "k=1,2,3"])
    assert same.exit_code == 0 and "another grid" not in same.output


async def test_studies_whose_names_meet_as_folder_names_each_keep_their_report(tmp_path: Path) -> None:
    from tmas.grading.grades import GradeConfig

    spec = SweepSpec(
        problems=write_problems(tmp_path / "problems.jsonl"),
        limit=1,
        study=[
            Study(name="Table 1 (IMO)", methods=["cot", "majority"]),
            Study(name="Table 1 IMO", method="self_refine", params={"iterations": 1}, grid={"n": [1, 2]}),
        ],
    )
    model = ScriptedModel(SimScript(), scripted_settings())
    await run_sweep(spec, model.settings, tmp_path / "sweep", model=model)
    written = await report_sweep(spec, tmp_path / "sweep", GradeConfig(mode="rules"), None)
    first, second = written["Table 1 (IMO)/markdown"], written["Table 1 IMO/markdown"]
    assert first != second and first.parent.name.startswith("Table_1_IMO__")
    assert "| majority [sim-model] |" in first.read_text()
    assert "| self_refine [sim-model] (n=2) |" not in first.read_text()
    assert "| self_refine [sim-model] (n=2) |" in second.read_text()
    assert "| majority [sim-model] |" not in second.read_text()


async def test_a_study_report_labels_each_point_as_the_combined_report_does(tmp_path: Path) -> None:
    from tmas.grading.grades import GradeConfig

    # 'votes' holds one majority point of the two the sweep has: its report still says which one it is.
    spec = SweepSpec(
        problems=write_problems(tmp_path / "problems.jsonl"),
        limit=1,
        study=[
            Study(name="votes", methods=["cot", "majority"], params={"k": 3}),
            Study(name="wide", method="majority", grid={"k": [2, 4]}),
        ],
    )
    model = ScriptedModel(SimScript(), scripted_settings())
    await run_sweep(spec, model.settings, tmp_path / "sweep", model=model)
    written = await report_sweep(spec, tmp_path / "sweep", GradeConfig(mode="rules"), None)
    combined, votes, wide = (written[k].read_text() for k in ("markdown", "votes/markdown", "wide/markdown"))
    for k in (2, 3, 4):
        assert f"| majority [sim-model] (k={k}) |" in combined
    assert "| majority [sim-model] (k=3) |" in votes and "| majority [sim-model] |" not in votes
    assert "| cot [sim-model] |" in votes
    assert "| majority [sim-model] (k=2) |" in wide and "| majority [sim-model] (k=4) |" in wide


def test_a_point_is_named_by_what_it_is_whatever_the_spelling_or_the_order_of_the_studies() -> None:
    grid = Study(name="iterations", method="self_refine", params={"n": 1}, grid={"iterations": [1, 20]})
    plain = Study(name="plain", method="self_refine", params={"n": 1})
    # iterations=20 is self_refine's default: the grid's second point is the plain study's only one.
    for studies in ([grid, plain], [plain, grid]):
        points = {p.name: p.studies for p in expand(SweepSpec(problems="x", study=studies))}
        assert points.keys() == {"self_refine__iterations=1__n=1", "self_refine__n=1"}
        assert sorted(points["self_refine__n=1"]) == ["iterations", "plain"]
    # A value as validated (1 is 1.0), and what a preset sets is the preset's, not shown again.
    spelled = [
        Study(name="a", method="tmas", params={"preset": "paper", "n": 8, "epsilon": 1}),
        Study(name="b", method="tmas", params={"preset": "paper", "epsilon": 1.0}),
    ]
    for studies in (spelled, spelled[::-1]):
        [point] = expand(SweepSpec(problems="x", study=studies))
        assert point.name == "tmas__epsilon=1.0__preset=paper"
    # A table shows what is set in it, not every field validation fills in.
    roles = Study(method="tmas", params={"sampling": {"solution": {"temperature": 0.3}}})
    [point] = expand(SweepSpec(problems="x", study=[roles]))
    assert point.name == "tmas__sampling=_solution_temperature_0.3_"


def shared_point_studies(problems: str) -> tuple[SweepSpec, SweepSpec]:
    grid = Study(name="iterations", method="self_refine", params={"n": 1}, grid={"iterations": [1, 20]})
    plain = Study(name="plain", method="self_refine", params={"n": 1})
    return SweepSpec(problems=problems, study=[grid, plain]), SweepSpec(problems=problems, study=[plain, grid])


async def test_a_grid_whose_studies_are_reordered_keeps_its_finished_points(tmp_path: Path) -> None:
    first, reordered = shared_point_studies(write_problems(tmp_path / "problems.jsonl"))
    settings = scripted_settings(concurrency=1)
    model = ScriptedModel(SimScript(), settings)
    await run_sweep(first, settings, tmp_path / "sw", model=model)
    assert model.calls
    again = ScriptedModel(SimScript(), settings)
    summary = await run_sweep(reordered, settings, tmp_path / "sw", model=again)
    assert again.calls == []
    assert [o.status for o in summary.outcomes] == ["skipped", "skipped"]
    assert sorted(p.name for p in (tmp_path / "sw" / "runs").iterdir()) == [
        "self_refine__iterations=1__n=1",
        "self_refine__n=1",
    ]


async def test_a_sweep_whose_points_were_named_by_a_studys_spelling_goes_on_in_their_directories(
    tmp_path: Path,
) -> None:
    first, reordered = shared_point_studies(write_problems(tmp_path / "problems.jsonl"))
    settings = scripted_settings(concurrency=1)
    await run_sweep(first, settings, tmp_path / "sw", model=ScriptedModel(SimScript(), settings))
    # As an older tmas left it: the shared point named by the first study's spelling (iterations=20 written out).
    runs = tmp_path / "sw" / "runs"
    older = "self_refine__iterations=20__n=1"
    (runs / "self_refine__n=1").rename(runs / older)
    manifest = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    manifest["points"][older] = manifest["points"].pop("self_refine__n=1")
    (tmp_path / "sw" / "sweep.json").write_text(json.dumps(manifest))

    again = ScriptedModel(SimScript(), settings)
    summary = await run_sweep(first, settings, tmp_path / "sw", model=again)
    assert again.calls == []
    assert [(o.point.name, o.status) for o in summary.outcomes] == [
        ("self_refine__iterations=1__n=1", "skipped"),
        (older, "skipped"),
    ]
    assert sorted(p.name for p in runs.iterdir()) == ["self_refine__iterations=1__n=1", older]
    assert set(json.loads((tmp_path / "sw" / "sweep.json").read_text())["points"]) == {
        "self_refine__iterations=1__n=1",
        older,
    }
    # The grid reordered, or its report: the same directory.
    assert [p.name for p in expand(reordered, tmp_path / "sw")] == [older, "self_refine__iterations=1__n=1"]


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        ('name = "wide"\nmethod = "cot"\nbudget = { count = "all" }\n', "study 'wide': budget.count: Input should be"),
        (
            'name = "wide"\nmethod = "cot"\nparms = { k = 2 }\n',
            "study 'wide': parms: unknown field (known: budget, grid, method, methods, name, params, variants)",
        ),
        ('name = "wide"\nmethods = []\n', "study 'wide': names no method ('method' or 'methods')"),
        ('method = "tmas"\ngrid = { n = [] }\n', "study 2 (of 2): grid key 'n' has no values"),
    ],
    ids=["bad-value", "unknown-field", "no-method", "unnamed"],
)
def test_a_bad_field_of_a_grid_file_is_one_line_naming_the_study_and_the_field(
    tmp_path: Path, second: str, expected: str
) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text(f'problems = "p.jsonl"\n[[study]]\nname = "plain"\nmethod = "cot"\n[[study]]\n{second}')
    with pytest.raises(ConfigError) as info:
        load_spec(grid)
    assert str(info.value).startswith(f"{grid}: {expected}")
    assert "\n" not in str(info.value)


def test_a_sweep_over_other_problems_is_refused_before_its_pilot(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tmas.errors import InputError

    monkeypatch.chdir(tmp_path)
    problems = write_problems(tmp_path / "p.jsonl")
    args = ["--problems", problems, "-m", "cot", "--base-url", sim.base_url, "--no-report", "--limit", "2"]
    first = CliRunner().invoke(app, ["sweep", "--out", "sw", *args])
    assert first.exit_code == 0, first.output
    sim.reset()
    # The same command over 3 problems: the directory holds a sweep over 2. It is refused before the pilot sends the
    # calls of a sweep that is then refused.
    args.remove("--limit")
    args.remove("2")
    again = CliRunner().invoke(app, ["sweep", "--out", "sw", *args, "--pilot", "1", "-y"])
    assert isinstance(again.exception, InputError), again.output
    assert str(again.exception) == "sw: holds a sweep over other problems; choose another directory"
    assert sim.requests == [] and not (tmp_path / "sw" / "pilot").exists()


def test_a_param_a_method_of_the_study_does_not_take_or_use_is_not_applied_to_it() -> None:
    # Before, cot (one round) made a point for each value of iterations: the same run, its calls sent again.
    spec = SweepSpec(problems="x", study=[Study(methods=["cot", "tmas"], grid={"iterations": [1, 2, 4]})])
    points = expand(spec)
    assert [(p.name, p.params) for p in points] == [
        ("cot", {"iterations": 1}),
        ("tmas__iterations=1", {"iterations": 1}),
        ("tmas__iterations=2", {"iterations": 2}),
        ("tmas__iterations=4", {"iterations": 4}),
    ]
    assert (
        not_applied(points) == "iterations not applied to method 'cot', which does not take or use it: one point for it"
    )
    # A param cot does not take at all (majority's k), fixed or on the grid: cot runs once, without it.
    spec = SweepSpec(
        problems="x", study=[Study(methods=["cot", "majority"], params={"iterations": 3}, grid={"k": [4, 8]})]
    )
    points = expand(spec)
    assert [(p.name, p.params) for p in points] == [
        ("cot", {}),
        ("majority__iterations=3__k=4", {"iterations": 3, "k": 4}),
        ("majority__iterations=3__k=8", {"iterations": 3, "k": 8}),
    ]
    assert not_applied(points) == (
        "iterations, k not applied to method 'cot', which does not take or use them: one point for it"
    )
    # A param no method of the study takes is still refused (a misspelling is no param of another method).
    with pytest.raises(ConfigError, match="unknown parameter 'iteratoins'"):
        expand(SweepSpec(problems="x", study=[Study(methods=["cot", "tmas"], params={"iteratoins": 3})]))


@pytest.mark.parametrize("given", [{"params": {"iterations": 3}}, {"grid": {"iterations": [1, 2]}}])
def test_iterations_for_a_method_of_one_round_alone_is_refused_as_the_run_refuses_it(given: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as caught:
        expand(SweepSpec(problems="x", study=[Study(method="cot", **given)]))
    assert str(caught.value) == "iterations does not apply to method 'cot': it runs one round; leave it out"


async def test_a_method_of_one_round_in_a_grid_over_iterations_runs_once(tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "problems.jsonl")
    spec = SweepSpec(problems=problems, study=[Study(methods=["cot", "self_refine"], grid={"iterations": [1, 2]})])
    settings = scripted_settings(concurrency=1)
    model = ScriptedModel(SimScript(), settings)
    summary = await run_sweep(spec, settings, tmp_path / "sw", model=model)
    assert [o.point.name for o in summary.outcomes] == [
        "cot",
        "self_refine__iterations=1",
        "self_refine__iterations=2",
    ]
    # cot's one call per problem, once.
    assert sorted(p.name for p in (tmp_path / "sw" / "runs").iterdir()) == [o.point.name for o in summary.outcomes]
    with RunStore(tmp_path / "sw" / "runs" / "cot", create=False) as store:
        assert sum(row.calls for row in store.results()) == len(PROBLEMS)


async def test_a_sweep_made_when_cot_took_every_iterations_keeps_its_finished_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    problems = write_problems(tmp_path / "problems.jsonl")
    spec = SweepSpec(problems=problems, study=[Study(methods=["cot", "self_refine"], params={"iterations": 2})])
    settings = scripted_settings(concurrency=1)
    with monkeypatch.context() as older:
        # As an older tmas expanded it: every param applied to every method (cot's point named with iterations=2).
        older.setattr("tmas.sweep._applies", lambda method, key, value: True)
        older.setattr("tmas.sweep.check_given_params", lambda method, params, named: None)
        made = await run_sweep(spec, settings, tmp_path / "sw", model=ScriptedModel(SimScript(), settings))
    assert [o.point.name for o in made.outcomes] == ["cot__iterations=2", "self_refine__iterations=2"]
    again = ScriptedModel(SimScript(), settings)
    summary = await run_sweep(spec, settings, tmp_path / "sw", model=again)
    assert again.calls == []
    assert [(o.point.name, o.status) for o in summary.outcomes] == [
        ("cot__iterations=2", "skipped"),
        ("self_refine__iterations=2", "skipped"),
    ]


def test_the_sweep_plan_says_in_one_line_which_params_a_method_is_not_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    problems = write_problems(tmp_path / "problems.jsonl")
    args = ["sweep", "-o", "sw", "--problems", problems, "-m", "cot", "-m", "tmas", "-g", "iterations=1,2"]
    out = CliRunner().invoke(app, [*args, "--base-url", "http://127.0.0.1:9/v1", "--dry-run"])
    assert out.exit_code == 0, out.output
    said = [line for line in out.output.splitlines() if "not applied" in line]
    assert said == [
        "tmas sweep: iterations not applied to method 'cot', which does not take or use it: one point for it"
    ]
    assert [
        line.split()[0] for line in out.output.splitlines() if line.startswith("  cot") or line.startswith("  tmas")
    ] == [
        "cot",
        "tmas__iterations=1",
        "tmas__iterations=2",
    ]


@pytest.mark.parametrize(
    ("method", "grid", "refused"),
    [
        ("cot", {"iterations": [1, 3]}, "iterations does not apply to method 'cot': it runs one round; leave it out"),
        ("majority", {"mode": ["numeric", "proof"]}, "method 'majority': bad value ("),
    ],
)
async def test_a_sweep_stored_with_a_grid_refused_since_is_refused_on_resume_in_one_line(
    tmp_path: Path, method: str, grid: dict[str, list[Any]], refused: str
) -> None:
    # A grid an older tmas took (cot alone over iterations, majority vote in proof mode): before, its resume ended on
    # the check's bare line, naming neither the sweep nor that the grid is its stored one.
    problems = write_problems(tmp_path / "problems.jsonl")
    settings = scripted_settings(concurrency=1)
    sweep_dir = tmp_path / "sw"
    spec = SweepSpec(problems=problems, study=[Study(method=method, params={"k": 2} if method == "majority" else {})])
    await run_sweep(spec, settings, sweep_dir, model=ScriptedModel(SimScript(), settings))
    manifest = json.loads((sweep_dir / "sweep.json").read_text(encoding="utf-8"))
    manifest["spec"]["study"][0]["grid"] = grid
    (sweep_dir / "sweep.json").write_text(json.dumps(manifest), encoding="utf-8")
    out = CliRunner().invoke(app, ["sweep", "--resume", str(sweep_dir), "-y"])
    assert isinstance(out.exception, InputError), out.output
    line = str(out.exception)
    head = f"{sweep_dir}: cannot resume: this version of tmas refuses the grid stored in its sweep.json ({refused}"
    assert line.startswith(head), line
    assert line.endswith(
        f"); its finished points are kept and read as they ran (tmas report {sweep_dir / 'runs'}/* -o DIR, tmas view"
        f" {sweep_dir}): start a new sweep for the rest"
    )
    assert "\n" not in line
    # The point it ran is kept as it was.
    [point] = (sweep_dir / "runs").iterdir()
    with RunStore(point, read_only=True) as store:
        assert sorted(r.problem_id for r in store.results()) == [p for p, _, _ in PROBLEMS]


def test_iterations_for_cot_alone_in_one_of_several_studies_names_the_study() -> None:
    spec = SweepSpec(
        problems="x", study=[Study(name="a", method="tmas"), Study(name="b", method="cot", params={"iterations": 2})]
    )
    with pytest.raises(ConfigError) as caught:
        expand(spec)
    assert str(caught.value) == "study 'b': iterations does not apply to method 'cot': it runs one round; leave it out"


def test_a_budget_flag_a_studys_own_budget_would_not_reach_is_refused_before_any_call(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import isolate

    isolate(monkeypatch, tmp_path)
    write_problems(tmp_path / "problems.jsonl")
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'problems = "problems.jsonl"\n[[study]]\nname = "wide"\nmethod = "majority"\nparams = { k = 4 }\n'
        '[[study]]\nname = "narrow"\nmethod = "majority"\nparams = { k = 4 }\nbudget = { calls = 2 }\n'
    )
    args = ["sweep", str(grid), "-o", "sw", "--base-url", sim.base_url, "--no-report", "--budget-calls", "3"]
    result = CliRunner().invoke(app, args)
    # Taken, the flag would cap 'wide' at 3 calls a problem and leave 'narrow' at its own 2, without a word.
    assert isinstance(result.exception, InputError), result.output
    assert str(result.exception) == (
        f"{grid}: study 'narrow' sets its own budget, which --budget-calls would not reach (a study's budget replaces"
        " the sweep's): set the limit in the grid file, or leave --budget-calls out"
    )
    assert sim.requests == [] and not Path("sw").exists()
    # Without the flag the grid runs as the file says.
    ran = CliRunner().invoke(app, args[:-2])
    assert ran.exit_code == 0, ran.output
    assert sorted(p.name for p in Path("sw", "runs").iterdir()) == ["majority__k=4", "majority__k=4__budget_calls=2"]


class _HeldModel(ScriptedModel):
    """A scripted model whose calls wait for ``go``; ``reached`` is set at its first call."""

    async def chat(self, role: str, messages: Any, **kwargs: Any) -> Any:
        self.reached.set()
        await self.go.wait()
        return await super().chat(role, messages, **kwargs)


async def test_a_second_sweep_in_a_directory_a_sweep_is_running_in_is_refused_and_its_record_kept(
    tmp_path: Path,
) -> None:
    # Both rewrote sweep.json with their own grid, the last to write dropping the other's record (the first, writing
    # as each of its points ended, dropped the second's, whose points had run all the same).
    problems = write_problems(tmp_path / "p.jsonl")
    settings = scripted_settings(concurrency=1)
    first = SweepSpec(problems=problems, study=[Study(name="a", method="majority", params={"k": 1}, grid={})])
    second = SweepSpec(problems=problems, study=[Study(name="b", method="majority", params={"k": 3}, grid={})])
    out = tmp_path / "sw"
    held = _HeldModel(SimScript(), settings)
    held.reached, held.go = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(run_sweep(first, settings, out, model=held))
    await held.reached.wait()
    other = ScriptedModel(SimScript(), settings)
    with pytest.raises(InputError) as refused:
        await run_sweep(second, settings, out, model=other)
    message = str(refused.value)
    assert message.startswith(f"{out}: tmas sweep (pid ") and "is running a sweep in this directory" in message
    assert "\n" not in message and other.calls == []
    held.go.set()
    await running
    assert list(json.loads((out / "sweep.json").read_text())["points"]) == ["majority__k=1"]
    # Once it has ended, the second runs (its grid replaces the first's, as for a grid edited between two runs).
    await run_sweep(second, settings, out, model=other)
    assert list(json.loads((out / "sweep.json").read_text())["points"]) == ["majority__k=3"]


def test_tmas_sweep_in_a_directory_a_sweep_is_running_in_is_refused_before_any_call(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tmas.store.run_lock import RunLock

    monkeypatch.chdir(tmp_path)
    problems = write_problems(tmp_path / "p.jsonl")
    args = ["sweep", "--out", "sw", "--problems", problems, "-m", "majority", "-p", "iterations=1", "--grid", "k=1,2"]
    args += ["--base-url", sim.base_url, "--no-report"]
    Path("sw").mkdir()
    with RunLock(Path("sw"), doing="tmas sweep"):  # as a sweep running there holds it
        result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, InputError), result.output
    assert str(result.exception).startswith("sw: tmas sweep (pid ") and "\n" not in str(result.exception)
    assert sim.requests == [] and not Path("sw", "sweep.json").exists()
    # Let go, the same sweep runs.
    ran = CliRunner().invoke(app, args)
    assert ran.exit_code == 0, ran.output


async def test_export_and_report_given_a_sweep_directory_say_where_its_runs_are(tmp_path: Path) -> None:
    spec = SweepSpec(problems=write_problems(tmp_path / "problems.jsonl"), study=[Study(methods=["cot"])])
    model = ScriptedModel(SimScript())
    sweep = tmp_path / "sweep"
    await run_sweep(spec, model.settings, sweep, model=model)
    said = f"{sweep}: a sweep, not a run directory: each point's run is a directory of {sweep / 'runs'}"
    for args in (["export", str(sweep)], ["report", str(sweep), "-o", str(tmp_path / "r"), "--no-grade"]):
        out = run_tmas(*args, text=True)
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [f"tmas: error: {said}"]
