"""benchmarks/method_comparison.py end to end against the simulated server: problems generated, every study of the
comparison grid run (or left out with its reason where this tmas lacks a parameter), budgets honoured, report
written, and the configured sampling in every request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import BENCHMARKS, load_benchmark
from tmas.config import Budget
from tmas.store.run_store import RunStore
from tmas.sweep import expand, load_spec, read_manifest
from tmas.testing import SimScript, SimServer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = BENCHMARKS / "method_comparison.py"
GRID = ROOT / "examples" / "method_comparison.toml"


def _script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("method_comparison", monkeypatch)


@pytest.mark.slow
def test_every_study_of_the_grid_runs_at_the_budget(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    problems = tmp_path / "problems.jsonl"
    rows = [{"problem_id": "a", "question": "What is 12*7+5?", "answer": "89"}]
    rows.append({"problem_id": "b", "question": "What is 45*3-8?", "answer": "127"})
    problems.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "cmp"
    args = ["--out", str(out), "--base-url", sim.base_url, "--endpoint-model", "sim-model", "--problems", str(problems)]
    args += ["--budget-tokens", "10000", "--temperature", "0.25", "--max-tokens", "300", "--no-report"]
    assert _script(monkeypatch).main([*args, "--skip-unsupported"]) == 0
    record = json.loads((out / "comparison.json").read_text())
    assert record["problems"]["count"] == 2

    # Each grid study either ran or was left out with the parameter this tmas does not know.
    grid_studies = {study.name for study in load_spec(GRID).study}
    skipped = {item["study"]: item["reason"] for item in record["skipped_studies"]}
    assert set(record["studies"]) | set(skipped) == grid_studies
    assert not set(record["studies"]) & set(skipped)
    assert all("unknown parameter" in reason for reason in skipped.values())
    assert {"cot", "majority", "tmas", "baselines"} <= set(record["studies"])

    # Every point of every study that ran is finished, each in its own run, under the one budget.
    spec = load_spec(GRID)
    spec.study = [s for s in spec.study if s.name in record["studies"]]
    spec.budget = Budget(tokens=10000)
    points = expand(spec)
    manifest = read_manifest(out / "sweep")
    assert sorted(manifest["points"]) == sorted(p.name for p in points) == sorted(record["points"])
    assert record["budget"] == {"tokens": 10000, "count": "completion"}
    methods, budget_stops = set(), 0
    for point in points:
        with RunStore(out / "sweep" / "runs" / point.name, create=False) as store:
            results = store.results()
            settings = store.get_meta("settings")
        assert len(results) == 2, point.name
        assert settings["budget"]["tokens"] == 10000
        iterations = point.params.get("iterations", 1)
        if point.method == "pacore" and point.params.get("synthesis", True):
            iterations += 1  # PaCoRe's synthesis round is one more record after its T rounds
        for r in results:
            # Each method stops where the budget says, or at its own last iteration, never before one finished.
            assert 1 <= len(r.iterations) <= iterations, point.name
            assert r.stopped_reason == "budget" or len(r.iterations) == iterations, point.name
            budget_stops += r.stopped_reason == "budget"
        methods.add(point.method)
    assert {"cot", "majority", "tmas", "self_refine", "rse", "verify_refine", "pacore"} <= methods
    assert budget_stops > 0

    assert record["sampling"] == {"temperature": 0.25, "max_tokens": 300}
    assert record["server"] == {"base_url": [sim.base_url], "model": "sim-model"}
    assert record["report"] == {}


def test_the_configured_sampling_reaches_the_server(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "cmp"
    args = ["--out", str(out), "--base-url", sim.base_url, "--studies", "cot,majority", "--per-family", "1"]
    assert _script(monkeypatch).main([*args, "--temperature", "0.25", "--max-tokens", "300", "--no-report"]) == 0
    bodies = [r.body for r in sim.app.requests() if r.role == "solution"]
    assert len(bodies) > 7
    assert all(b.get("temperature") == 0.25 and b.get("max_tokens") == 300 for b in bodies)


def test_an_unsupported_study_stops_the_run_unless_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text('[[study]]\nname = "future"\nmethod = "tmas"\nparams = { no_such_param = 1 }\n')
    script = _script(monkeypatch)
    args = ["--out", str(tmp_path / "cmp"), "--sim", "--grid", str(grid), "--per-family", "1"]
    assert script.main(args) == 1
    assert "study 'future': method 'tmas': unknown parameter 'no_such_param'" in capsys.readouterr().err
    assert not (tmp_path / "cmp" / "sweep").exists()
    assert script.main([*args, "--studies", "nope"]) == 1
    assert "--studies: no study named nope (the grid has: future)" in capsys.readouterr().err
    # Skipped, the study is recorded as left out, and nothing is left to run.
    assert script.main([*args, "--skip-unsupported"]) == 1
    assert "the sweep has no points" in capsys.readouterr().err


@pytest.mark.slow
def test_the_dry_run_is_one_command(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    cmd = [sys.executable, str(SCRIPT), "--sim", "--out", str(out), "--studies", "cot,majority", "--per-family", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "comparison.json").read_text())
    assert record["studies"] == ["cot", "majority"]
    assert record["server"] == "simulated"
    floors = load_spec(GRID)
    floors.study = [s for s in floors.study if s.name in ("cot", "majority")]
    floors.budget = Budget(tokens=record["budget"]["tokens"])
    assert sorted(record["points"]) == sorted(p.name for p in expand(floors))
    assert {p.method for p in expand(floors)} == {"cot", "majority"}
    assert all(status == "new" for status in record["points"].values())
    problems = (out / "problems.jsonl").read_text().splitlines()
    assert len(problems) == record["problems"]["count"] == 7  # one per family
    assert Path(record["report"]["markdown"]).is_file()
    # Run again: every point is finished, so nothing is re-run.
    again = subprocess.run([*cmd, "--no-report"], capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr
    rerun = json.loads((out / "comparison.json").read_text())
    assert all(status == "skipped" for status in rerun["points"].values())


@pytest.mark.slow
def test_a_deadline_stops_the_sweep_and_the_same_command_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _script(monkeypatch)
    out = tmp_path / "cmp"
    # Each call takes 0.5 s, so a 0.2 s deadline falls inside the first point's first calls.
    with SimServer(SimScript(latency_s=0.5)) as slow:
        args = ["--out", str(out), "--base-url", slow.base_url, "--studies", "cot,majority", "--per-family", "1"]
        assert script.main([*args, "--stop-after", "0.2"]) == 0
        first = json.loads((out / "comparison.json").read_text())
        assert first["stopped_early"] is True
        assert first["points"] == {}  # no point finished
        # The report covers the point that had begun; the one that had not is left out, not an error.
        assert Path(first["report"]["markdown"]).is_file()
        assert script.main([*args, "--no-report"]) == 0
    second = json.loads((out / "comparison.json").read_text())
    assert second["stopped_early"] is False
    statuses = sorted(second["points"].items())
    assert [status for _, status in statuses] == ["resumed", "new"]  # cot was under way, majority had not begun
    assert statuses[0][0].startswith("cot") and statuses[1][0].startswith("majority")
    with RunStore(out / "sweep" / "runs" / statuses[0][0], create=False) as store:
        assert len(store.results()) == 7
