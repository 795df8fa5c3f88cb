"""``tmas experience build|prune|fewshot|router`` as a user runs them, against the simulated server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mattrl_runs import hand_worked_transcript, write_run
from test_cli import tmas
from test_pool_build import scripted_rules
from tmas.problems import Problem
from tmas.testing import SimScript, SimServer


@pytest.mark.slow
def test_build_then_prune_from_the_command_line(tmp_path: Path) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])
    pool = tmp_path / "pool"
    with SimServer(SimScript(rules=scripted_rules())) as sim:
        args = ["--base-url", sim.base_url, "--model", "sim-model"]
        out = tmas(
            "experience",
            "build",
            str(run),
            "-o",
            str(pool),
            "--scheme",
            "difference",
            "--lambda",
            "0.5",
            "--gamma",
            "0.5",
            "--beta",
            "10.397",
            "--grade",
            "rules",
            *args,
        )
        assert out.returncode == 0, out.stderr.decode()
        summary = json.loads(out.stdout)
        assert (summary["cases"], summary["turns"], summary["kept"], summary["added"]) == (1, 5, 2, 2)
        judge = [r for r in sim.requests if r.role == "judge"]
        assert len(judge) == 12 and all(r.body["model"] == "sim-model" for r in judge)

        shown = tmas("experience", "show", str(pool), "--json")
        assert shown.returncode == 0 and len(shown.stdout.decode().splitlines()) == 3  # meta + 2 entries

        pruned = tmas("experience", "prune", str(pool), "--dry-run")
        assert pruned.returncode == 0, pruned.stderr.decode()
        assert json.loads(pruned.stdout)["after"] == 2

        # A bad option is named by its flag (--lambda sets the field lam, --grade grade_mode) and the value given.
        for option, value, said in (
            ("--scheme", "vote", "Input should be 'naive', 'difference' or 'shapley'"),
            ("--decay", "sideways", "Input should be 'auto', 'later' or 'earlier'"),
            ("--match", "sound", "Input should be 'judge' or 'spelling'"),
            ("--lambda", "1.5", "Input should be less than or equal to 1"),
            ("--grade", "vote", "unknown grader 'vote' (known: "),
        ):
            bad = tmas("experience", "build", str(run), "-o", str(pool), option, value, *args)
            assert bad.returncode == 2
            [line] = bad.stderr.decode().strip().splitlines()
            assert line.startswith(f"tmas: error: {option} {value}: {said}"), line


@pytest.mark.slow
def test_fewshot_and_router_route(tmp_path: Path) -> None:
    lines = [json.dumps({"problem_id": f"e{i}", "question": f"What is {i}+1?", "answer": str(i + 1)}) for i in range(4)]
    (tmp_path / "build.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"problem_id": "t1", "question": "What is 9+1?"}) + "\n")
    out = tmas(
        "experience",
        "fewshot",
        str(tmp_path / "test.jsonl"),
        "--exemplars",
        str(tmp_path / "build.jsonl"),
        "-o",
        str(tmp_path / "shots.jsonl"),
    )
    assert out.returncode == 0, out.stderr.decode()
    [shot] = [json.loads(x) for x in (tmp_path / "shots.jsonl").read_text().splitlines()]
    assert shot["question"].count("Final answer:") == 3

    router = tmp_path / "router.json"
    router.write_text(
        json.dumps({"features": [], "mean": [], "scale": [], "weights": [], "intercept": 0.0, "constant": "mattrl"})
    )
    routed = tmas(
        "experience", "router", "route", str(router), str(tmp_path / "test.jsonl"), "--split", str(tmp_path / "split")
    )
    assert routed.returncode == 0, routed.stderr.decode()
    assert json.loads(routed.stdout) == {"problem_id": "t1", "route": "mattrl"}
    assert (tmp_path / "split" / "mattrl.jsonl").read_text().count("t1") == 1
    assert (tmp_path / "split" / "single.jsonl").read_text() == ""
    missing = tmas("experience", "router", "route", str(tmp_path / "nope.json"), str(tmp_path / "test.jsonl"))
    assert missing.returncode == 2 and "no such router file" in missing.stderr.decode()
