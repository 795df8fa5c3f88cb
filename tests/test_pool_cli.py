"""``tmas experience build|prune|fewshot|router`` as a user runs them, against the simulated server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mattrl_runs import hand_worked_transcript, write_run
from test_cli import tmas
from test_pool_build import scripted_rules
from tmas.cli.main import app
from tmas.memory.embedders import LOCAL_NAME
from tmas.memory.pool import Pool
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
def test_build_into_a_run_directory_is_one_line_before_the_estimate_and_any_call(tmp_path: Path) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])
    with SimServer(SimScript(rules=scripted_rules())) as sim:
        args = ["--grade", "rules", "--base-url", sim.base_url, "--model", "sim-model", "--yes"]
        refused = tmas("experience", "build", str(run), "-o", str(run), *args)
        assert sim.requests == []
    assert refused.returncode == 2 and refused.stdout == b""
    assert refused.stderr.decode().splitlines() == [
        f"tmas: error: -o {run}: one of the runs the build reads; give the pool a directory of its own"
    ]
    assert sorted(p.name for p in run.iterdir()) == ["run.sqlite"] and not (tmp_path / "run.build").exists()


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


@pytest.mark.slow
def test_build_shows_its_estimate_and_refuses_over_the_threshold_before_any_call(tmp_path: Path) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])
    pool = tmp_path / "pool"
    with SimServer(SimScript(rules=scripted_rules())) as sim:
        base = ["experience", "build", str(run), "-o", str(pool), "--scheme", "difference", "--grade", "rules"]
        base += ["--base-url", sim.base_url, "--model", "sim-model", "--max-tokens", "1000"]
        # Worked by hand: 5 turns (3 in turn 1, 2 in turn 2); the judge scores each (5) and asks the difference
        # scheme's coalitions: the whole team and each one-out team, 4 in turn 1 and 3 in turn 2 (7). With 2
        # retries each of the 12 may be asked 3 times (36). The top 25 % keeps ceil(1.25) = 2 turns; the most is
        # every turn kept, each asked 3 times (15). 12 + 2 = 14 calls, at most 36 + 15 = 51, each of 1,000 tokens at
        # most.
        refused = tmas(*base, "--confirm-calls", "50")
        assert refused.returncode == 2
        last = refused.stderr.decode().strip().splitlines()[-1]
        assert last.startswith("tmas: error: the estimate is 51 calls (threshold 50): pass --yes"), last
        assert "  total: 14 to 51 calls" in refused.stderr.decode()
        assert sim.requests == [] and not pool.exists() and not (tmp_path / "pool.build").exists()

        dry = tmas(*base, "--dry-run")
        assert dry.returncode == 0 and "  summarizer  " in dry.stderr.decode()
        assert sim.requests == [] and not pool.exists()

        done = tmas(*base, "--confirm-calls", "50", "--yes")
        assert done.returncode == 0, done.stderr.decode()
        said = (
            "tmas: estimate: 14 to 51 calls, <=51k completion tokens (an attempt cut part way and retried adds what"
            " it had generated); not counted: the embedding"
        )
        assert said in done.stderr.decode()
        # As estimated with every reply usable: 12 judge calls and a summary of each of the 2 kept turns.
        roles = [r.role for r in sim.requests if r.endpoint == "chat"]
        assert (roles.count("judge"), roles.count("summarizer"), len(roles)) == (12, 2, 14)

        # Run again, every call is stored: the 14 answered are replayed, and what is left to send is under 50.
        sim.reset()
        again = tmas(*base, "--confirm-calls", "40")
        assert again.returncode == 0, again.stderr.decode()
        assert (
            "tmas: estimate: up to 37 calls to send (14 stored, replayed), <=37k completion tokens"
            in again.stderr.decode()
        )
        assert [r for r in sim.requests if r.endpoint == "chat"] == []
        # Under another scheme the stored calls answer other requests: none is counted as replayed.
        other = tmas(*base[:5], *base[7:], "--confirm-calls", "20")
        assert other.returncode == 2 and "the estimate is 30 calls (threshold 20)" in other.stderr.decode()
        assert [r for r in sim.requests if r.endpoint == "chat"] == []


@pytest.mark.slow
def test_prompts_dir_is_checked_before_a_build_and_refused_where_only_grading_is_sent(tmp_path: Path) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])
    pool = tmp_path / "pool"
    mine = tmp_path / "mine"
    mine.mkdir()
    typo = mine / "mattrl_summarizer.j2"
    typo.write_text("{{ questoin }}\n", encoding="utf-8")
    with SimServer(SimScript(rules=scripted_rules())) as sim:
        args = ["--base-url", sim.base_url, "--model", "sim-model", "--prompts-dir", str(mine)]
        built = tmas("experience", "build", str(run), "-o", str(pool), "--grade", "rules", "--yes", *args)
        pruned = tmas("experience", "prune", str(pool), "--runs", str(run), *args)
        routed = tmas(
            "experience",
            "router",
            "train",
            "--single",
            str(run),
            "--mattrl",
            str(run),
            "-o",
            str(tmp_path / "r.json"),
            *args,
        )
        assert sim.requests == []
    [line] = built.stderr.decode().strip().splitlines()
    assert built.returncode == 2 and line.startswith(f"tmas: error: {typo}: unknown variable 'questoin'"), line
    assert not pool.exists()
    for refused, command in ((pruned, "prune"), (routed, "router train")):
        assert refused.returncode == 2
        assert refused.stderr.decode().strip().splitlines() == [
            f"tmas: error: --prompts-dir: tmas pool {command} sends only the runs' grading, whose judge prompts are"
            " the packaged ones (as tmas report's); leave it out"
        ]


@pytest.mark.slow
def test_flags_a_pool_command_reads_nothing_of_are_refused_before_any_call(tmp_path: Path) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])
    local, endpoint = tmp_path / "local", tmp_path / "endpoint"
    Pool.create(local, LOCAL_NAME)
    Pool.create(endpoint, "endpoint:sim-model")
    bound = "a budget and problems in flight bound a run's problems"
    with SimServer(SimScript(rules=scripted_rules())) as sim:
        args = ["--base-url", sim.base_url, "--model", "sim-model"]
        # Before, each was accepted and read by nothing: a build capped by --budget-calls sent every call it needed.
        said = [
            (
                tmas("experience", "build", str(run), "-o", str(tmp_path / "pool"), "--budget-calls", "3", *args),
                f"--budget-calls: {bound}, and tmas pool build solves none (--confirm-calls bounds its calls);"
                " leave it out",
            ),
            (
                tmas("experience", "prune", str(local), "--runs", str(run), "--problems-in-flight", "2", *args),
                f"--problems-in-flight: {bound}, and tmas pool prune solves none; leave it out",
            ),
            (
                tmas("experience", "search", str(local), "a question", *args),
                f"--base-url, --model: the command asks no model for a pool of the {LOCAL_NAME} embedder, which runs"
                " in process; leave them out",
            ),
            (
                tmas("experience", "search", str(endpoint), "a question", "--temperature", "0", "--seed", "1", *args),
                "--temperature, --seed: tmas pool search sends only embedding requests, which take none; leave them"
                " out",
            ),
        ]
        assert sim.requests == []
    for out, line in said:
        assert out.returncode == 2 and out.stderr.decode().strip().splitlines() == [f"tmas: error: {line}"]
    assert not (tmp_path / "pool").exists()


def test_an_unknown_embedder_is_refused_naming_the_flag_and_the_choices(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    out = CliRunner().invoke(app, ["pool", "build", str(tmp_path / "run"), "-o", str(pool), "--embedder", "foo"])
    assert out.exit_code != 0 and str(out.exception) == "--embedder foo: Input should be 'endpoint' or 'local'"
    assert not pool.exists()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (
            ["--tau", "0.5", "--quantile", "0.1"],
            "--quantile 0.1: with --tau the turns kept are those with reward >= tau (Eq. 13), not a top share",
        ),
        (["--permutations", "16"], "--permutations 16: only the shapley scheme draws orders (--scheme naive)"),
        (
            ["--scheme", "difference", "--permutations", "16"],
            "--permutations 16: only the shapley scheme draws orders (--scheme difference)",
        ),
        (
            ["--beta", "1"],
            "--beta 1.0: Eq. 16 normalises the difference and shapley schemes' credit scores; the naive scheme's"
            " shares are Eq. 11's",
        ),
    ],
)
def test_a_build_option_the_scheme_or_selection_reads_nothing_of_is_refused(
    tmp_path: Path, given: list[str], said: str
) -> None:
    # Before, each was accepted and changed nothing: a naive build under --beta 1 was the build under the default.
    pool = tmp_path / "pool"
    out = CliRunner().invoke(app, ["pool", "build", str(tmp_path / "run"), "-o", str(pool), *given])
    assert out.exit_code != 0 and str(out.exception) == f"{said}; leave it out"
    assert not pool.exists()


@pytest.mark.parametrize(
    ("given", "flag"),
    [
        (["--min-uses", "2"], "--min-uses 2"),
        (["--wrong-margin", "0.1"], "--wrong-margin 0.1"),
        (["--grade", "rules"], "--grade rules"),
    ],
)
def test_a_prune_option_of_the_runs_without_runs_is_refused(tmp_path: Path, given: list[str], flag: str) -> None:
    # Before, each was accepted without --runs and read by nothing: the prune was the one without it.
    Pool.create(tmp_path / "pool", LOCAL_NAME)
    out = CliRunner().invoke(app, ["pool", "prune", str(tmp_path / "pool"), *given])
    assert out.exit_code != 0 and str(out.exception) == (
        f"{flag}: only the wrong-correlated rule reads it, from the graded problems of --runs; give --runs, or leave it"
        " out"
    )
    assert Pool.open(tmp_path / "pool").meta.version == 0 and not (tmp_path / "pool.build").exists()
