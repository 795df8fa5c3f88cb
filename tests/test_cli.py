"""The ``tmas`` command end to end, as a user runs it, against the simulated server; a finished run's resume in
process."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env, dead_url, run_tmas, scripted_settings, wait_for
from tmas.api import aresume, arun
from tmas.config import load_settings
from tmas.errors import ConfigError
from tmas.problems import load_problems
from tmas.store.run_lock import running
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer


def tmas(*args: str, stdin: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    return run_tmas(*args, stdin=stdin, cwd=cwd, timeout=120)


def write_problems(path: Path, n: int) -> list[tuple[str, int]]:
    problems = [(f"p{i}", (i + 2) * 7) for i in range(n)]
    with path.open("w") as f:
        for pid, _ in problems:
            i = int(pid[1:])
            f.write(
                json.dumps({"problem_id": pid, "question": f"What is {i + 2}*7?", "answer": str((i + 2) * 7)}) + "\n"
            )
    return problems


def test_version() -> None:
    out = tmas("--version")
    assert out.returncode == 0 and out.stdout.decode().startswith("tmas ")


@pytest.mark.slow
def test_solve_prints_the_answer(sim: SimServer) -> None:
    out = tmas("solve", "What is 17*23?", "--base-url", sim.base_url)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "391"


@pytest.mark.slow
def test_solve_reads_stdin_and_files_and_prints_json(sim: SimServer, tmp_path: Path) -> None:
    out = tmas("solve", "--base-url", sim.base_url, "--method", "cot", stdin=b"What is 6*7?")
    assert out.stdout.decode().strip() == "42"
    assert "tmas: 1 call; tokens: prompt" in out.stderr.decode()
    question = tmp_path / "q.txt"
    question.write_text("Compute (12+5)*3.")
    out = tmas("solve", "--file", str(question), "--base-url", sim.base_url, "--method", "cot", "--json")
    record = json.loads(out.stdout)
    assert record["answer"] == "51"
    assert record["method"] == "cot"
    assert record["iterations"][0]["candidates"][0]["answer"] == "51"
    assert record["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(
    ("content", "message"), [(b"   \n", "q.txt: the question is empty"), (b"\xff\xfe bad", "not valid UTF-8")]
)
def test_solve_rejects_bad_questions(sim: SimServer, tmp_path: Path, content: bytes, message: str) -> None:
    question = tmp_path / "q.txt"
    question.write_bytes(content)
    out = tmas("solve", "--file", str(question), "--base-url", sim.base_url)
    assert out.returncode == 2
    assert message in out.stderr.decode()
    assert sim.stats().total_requests == 0


def test_solve_rejects_an_argument_that_is_not_utf8(sim: SimServer) -> None:
    # The byte 0xff in argv (Python hands it over as the lone surrogate U+DCFF).
    out = tmas("solve", "What is \udcff 2?", "--base-url", sim.base_url)
    assert out.returncode == 2
    assert "tmas: error: the argument: question is not valid UTF-8 (byte 8)" in out.stderr.decode()
    assert sim.stats().total_requests == 0


@pytest.mark.slow
def test_run_writes_a_run_directory_and_exports(sim: SimServer, tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "p.jsonl", 6)
    run_dir = tmp_path / "run"
    out = tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "--base-url", sim.base_url, "--method", "cot")
    assert out.returncode == 0, out.stderr.decode()
    summary = json.loads(out.stdout)
    assert (summary["problems"], summary["done"], summary["failed"], summary["calls"]) == (6, 6, 0, 6)
    # Without a terminal, progress is plain log lines, one per problem.
    assert out.stderr.decode().count(": done · answer '") == 6
    exported = tmas("export", str(run_dir))
    rows = [json.loads(line) for line in exported.stdout.decode().splitlines()]
    assert [(r["problem_id"], r["answer"]) for r in rows] == [(pid, str(ans)) for pid, ans in problems]
    calls = tmas("export", str(run_dir), "--calls", "-o", str(tmp_path / "calls.jsonl"))
    assert calls.returncode == 0
    assert len((tmp_path / "calls.jsonl").read_text().splitlines()) == 6
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["calls.jsonl", "p.jsonl"]
    # Exported onto the run's own store: refused, and the run is whole.
    onto = tmas("export", str(run_dir), "-o", str(tmp_path / "." / "run" / "run.sqlite"))
    assert onto.returncode == 2 and "is the run's own store" in onto.stderr.decode()
    assert tmas("export", str(run_dir)).stdout == exported.stdout
    # Onto a folder, or into one that does not exist: one line naming --out, and no partial file left behind.
    (tmp_path / "folder").mkdir()
    missing = tmp_path / "none" / "r.jsonl"
    for target, said in (
        (tmp_path / "folder", f"--out {tmp_path / 'folder'} is a directory: give the file to write"),
        (missing, f"--out {missing}: cannot write it: No such file or directory"),
    ):
        bad = tmas("export", str(run_dir), "-o", str(target))
        assert bad.returncode == 2 and bad.stderr.decode().strip().splitlines() == [f"tmas: error: {said}"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["calls.jsonl", "p.jsonl"]


@pytest.mark.slow
def test_a_resume_keeps_the_runs_method(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 1)
    run_dir = str(tmp_path / "run")
    assert (
        tmas("run", str(tmp_path / "p.jsonl"), "-o", run_dir, "--base-url", sim.base_url, "-m", "cot").returncode == 0
    )
    before = tmas("export", run_dir).stdout
    other = tmas("run", "--resume", run_dir, "-m", "majority", "-y")
    assert other.returncode == 2 and "made with method 'cot': resumed with 'majority'" in other.stderr.decode()
    # A config file naming no method continues the run's own: its finished problem is not solved again.
    config = tmp_path / "cfg.toml"
    config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\n', encoding="utf-8")
    again = tmas("run", "--resume", run_dir, "--config", str(config))
    assert again.returncode == 0, again.stderr.decode()
    assert json.loads(again.stdout)["calls"] == 0 and tmas("export", run_dir).stdout == before


@pytest.mark.slow
def test_a_run_another_process_is_running_is_not_run_twice(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 2)
    run_dir = tmp_path / "run"
    made = tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "--base-url", sim.base_url, "-m", "cot")
    assert made.returncode == 0
    sent = sim.stats().total_requests
    with running(run_dir):  # as the other process holds it
        again = tmas("run", "--resume", str(run_dir))
        # Refused before its estimate too, whose pilot would send calls and make a pilot run in the directory.
        piloted = tmas("run", "--resume", str(run_dir), "--pilot", "1", "-y")
    assert again.returncode == 2 and sim.stats().total_requests == sent
    assert f"another tmas process (pid {os.getpid()}) is running this run" in again.stderr.decode()
    assert piloted.returncode == 2 and sim.stats().total_requests == sent and not (run_dir / "pilot").exists()
    assert piloted.stderr.decode().splitlines() == [
        f"tmas: error: {run_dir}: another tmas process (pid {os.getpid()}) is running this run; wait for it to end or"
        " stop it"
    ]
    # Once it has ended, the run goes on.
    assert tmas("run", "--resume", str(run_dir)).returncode == 0


def test_solve_into_a_run_directory_holding_a_run_names_the_commands_resume(sim: SimServer, tmp_path: Path) -> None:
    args = ("solve", "What is 6*7?", "--base-url", sim.base_url, "-m", "cot", "--run-dir", str(tmp_path / "q"))
    assert tmas(*args).returncode == 0
    again = tmas(*args)
    # The command's own advice, not the Python API's (tmas solve goes through it).
    assert again.returncode == 2 and again.stderr.decode().splitlines()[-1] == (
        f"tmas: error: {tmp_path / 'q'}: already holds a run; continue it with 'tmas run --resume {tmp_path / 'q'}' or"
        " choose another directory"
    )


@pytest.mark.slow
def test_run_refuses_to_overwrite_a_run(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 1)
    args = ("run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "--base-url", sim.base_url, "-m", "cot")
    assert tmas(*args).returncode == 0
    again = tmas(*args)
    assert again.returncode == 2 and f"'tmas run --resume {tmp_path / 'run'}'" in again.stderr.decode()
    # Refused before its estimate too, whose pilot would send calls and make a pilot run in the run's directory.
    sent = sim.stats().total_requests
    piloted = tmas(*args, "--pilot", "1", "-y")
    assert piloted.returncode == 2 and sim.stats().total_requests == sent
    assert piloted.stderr.decode().splitlines() == [
        f"tmas: error: {tmp_path / 'run'}: already holds a run; continue it with 'tmas run --resume {tmp_path / 'run'}'"
        " or choose another directory"
    ]
    assert not (tmp_path / "run" / "pilot").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"problem_id": "a", "question": "x"\n', "p.jsonl:2: not valid JSON"),
        ('{"problem_id": "b"}\n', "p.jsonl:2: missing field 'question'"),
        ('{"problem_id": "a", "question": "again"}\n', "p.jsonl:2: duplicate problem id 'a' (first on line 1)"),
        ('{"question": "no id"}\n', "p.jsonl:2: missing field 'problem_id'"),
        ('{"problem_id": "c", "question": 5}\n', "p.jsonl:2: 'question' must be a string"),
        # A question's picture would never reach the model (questions go as text): refused, not asked without it.
        (
            '{"problem_id": "c", "question": "What does the figure show?", "image": "data:image/png;base64,AA"}\n',
            "p.jsonl:2: field 'image' holds an image, but questions are sent as text only",
        ),
        ('{"problem_id": "c", "question": "Which?", "images": ["", "fig1.png"]}\n', "p.jsonl:2: field 'images' holds"),
        (
            '{"problem_id": "c", "question": "What is 1+2?", "answer": "3", "answer": "4"}\n',
            "p.jsonl:2: field 'answer' is given twice in one object",
        ),
        # A datasets export of another layout: the fields the line has instead are named.
        (
            '{"id": "c", "problem": "What is 2+2?", "solution": "4"}\n',
            "p.jsonl:2: missing field 'question' (the line has: id, problem, solution; 'tmas data import' converts",
        ),
    ],
)
def test_bad_problem_files_fail_with_one_line_naming_the_place(
    sim: SimServer, tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"problem_id": "a", "question": "What is 1+1?"}\n' + line)
    out = tmas("run", str(path), "-o", str(tmp_path / "run"), "--base-url", sim.base_url)
    err = out.stderr.decode().strip()
    assert out.returncode == 2
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()
    assert sim.stats().total_requests == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("head", "message"),
    [
        (gzip.compress(b'{"problem_id": "a", "question": "What is 1+1?"}\n'), "p.jsonl:1: a gzip-compressed file"),
        ('{"problem_id": "a", "question": "What is 1+1?"}\n'.encode("utf-16"), "p.jsonl:1: UTF-16 text"),
        (b"PAR1\x15\x04", "p.jsonl:1: a Parquet file: 'tmas data import' reads it named .parquet"),
    ],
    ids=["gzip", "utf-16", "parquet"],
)
def test_a_problem_file_in_another_format_says_which(sim: SimServer, tmp_path: Path, head: bytes, message: str) -> None:
    # Before, each was only "p.jsonl:1: not valid UTF-8 (byte 1)" (or 0), which says nothing of why.
    path = tmp_path / "p.jsonl"
    path.write_bytes(head)
    out = tmas("run", str(path), "-o", str(tmp_path / "run"), "--base-url", sim.base_url)
    err = out.stderr.decode().strip()
    assert out.returncode == 2
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
    assert sim.stats().total_requests == 0


def test_an_image_field_holding_nothing_is_kept_as_metadata(tmp_path: Path) -> None:
    # HLE's text-only rows carry "image": ""; a datasets export of no image, nulls: these questions lack nothing.
    path = tmp_path / "p.jsonl"
    rows = [
        {"problem_id": "a", "question": "q", "image": ""},
        {"problem_id": "b", "question": "q", "image": None, "images": []},
        {"problem_id": "c", "question": "q", "image": {"bytes": None, "path": None}},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [p.metadata for p in load_problems(path)] == [
        {k: v for k, v in r.items() if k not in ("problem_id", "question")} for r in rows
    ]


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[endpoint]\nbse_url = "http://x"\n', "unknown config key 'endpoint.bse_url'"),
        ("concurrency = 'many'\n", "bad value for 'concurrency'"),
        ('[roles.wizard]\nmodel = "m"\n', "unknown role 'wizard'"),
        ("[endpoint\n", "not valid TOML"),
        # inf is valid TOML, and no timeout (aiohttp cannot wait for it).
        ("[endpoint]\ntimeout_s = inf\n", "bad value for 'endpoint.timeout_s': Input should be a finite number"),
    ],
)
def test_bad_config_is_one_line_exit_2(tmp_path: Path, toml: str, message: str) -> None:
    config = tmp_path / "tmas.toml"
    config.write_text(toml)
    out = tmas("solve", "What is 1+1?", "--config", str(config))
    err = out.stderr.decode().strip()
    assert out.returncode == 2
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[sampling]\ntemprature = 0.5\n", "'sampling.temprature' (did you mean 'sampling.temperature'?)"),
        ('[endpont]\nbase_url = "http://x/v1"\n', "unknown config key 'endpont' (did you mean 'endpoint'?)"),
        ('[roles.verifier]\nmodle = "m"\n', "'roles.verifier.modle' (did you mean 'roles.verifier.model'?)"),
        ("[roles.judge.sampling]\ntop_pp = 1\n", "sampling.top_pp' (did you mean 'roles.judge.sampling.top_p'?)"),
        ("[local]\nparalel = 2\n", "unknown config key 'local.paralel' (did you mean 'local.parallel'?)"),
        ("zzzz = 1\n", "unknown config key 'zzzz'"),
    ],
)  # fmt: skip
def test_a_typo_in_a_config_key_names_the_key_it_is_close_to(tmp_path: Path, toml: str, message: str) -> None:
    config = tmp_path / "tmas.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError) as raised:
        load_settings(config, environ={})
    assert str(raised.value).startswith(f"{config}: unknown config key ") and str(raised.value).endswith(message)


def test_a_path_the_command_cannot_use_is_one_line(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 1)
    (tmp_path / "taken").write_text("", encoding="utf-8")
    for args, path in [
        (("solve", "What is 1+1?", "--config", str(tmp_path)), tmp_path),  # a directory where a file goes
        (("run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "taken"), "-m", "cot", "--base-url", sim.base_url),
         tmp_path / "taken"),  # a file where a directory goes
    ]:  # fmt: skip
        out = tmas(*args)
        errors = [line for line in out.stderr.decode().splitlines() if not line.startswith("tmas: estimate:")]
        assert out.returncode in (1, 2) and len(errors) == 1, errors
        assert errors[0].startswith(f"tmas: error: {path}"), errors


def test_a_damaged_or_foreign_store_is_one_line_and_left_alone(sim: SimServer, tmp_path: Path) -> None:
    garbage, foreign, newer, sweep = (tmp_path / name for name in ("garbage", "foreign", "newer", "sweep"))
    garbage.mkdir()
    (garbage / "run.sqlite").write_bytes(bytes(range(256)) * 20)
    foreign.mkdir()
    with sqlite3.connect(foreign / "run.sqlite") as db:
        db.execute("CREATE TABLE theirs (x)")
    write_problems(tmp_path / "p.jsonl", 1)
    assert (
        tmas("run", str(tmp_path / "p.jsonl"), "-o", str(newer), "--base-url", sim.base_url, "-m", "cot").returncode
        == 0
    )
    # Settings a newer tmas recorded, with a key this one does not know.
    with sqlite3.connect(newer / "run.sqlite") as db:
        [(text,)] = db.execute("SELECT value FROM meta WHERE key = 'settings'")
        db.execute("UPDATE meta SET value = ? WHERE key = 'settings'", (json.dumps({**json.loads(text), "x": 1}),))
    sweep.mkdir()
    (sweep / "sweep.json").write_text('{"spec": {', encoding="utf-8")
    for args, says in [
        (("run", "--resume", str(garbage)), "garbage/run.sqlite: not a readable run store (file is not a database)"),
        (("export", str(garbage)), "not a readable run store"),
        (("export", str(foreign)), "foreign/run.sqlite: a database, but not a tmas run store"),
        (("run", "--resume", str(newer)), "newer: the run's recorded settings: unknown config key 'x'"),
        (("sweep", "--resume", str(sweep)), "sweep/sweep.json: not a sweep manifest (Expecting property name"),
    ]:
        out = tmas(*args)
        err = out.stderr.decode().strip()
        assert out.returncode in (1, 2) and len(err.splitlines()) == 1 and says in err, err
    # Nothing of tmas's was written into the other program's database.
    with sqlite3.connect(foreign / "run.sqlite") as db:
        assert [name for (name,) in db.execute("SELECT name FROM sqlite_master")] == ["theirs"]


def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args in (("view", str(tmp_path)), ("serve", "--base-url", "http://127.0.0.1:9/v1", "--dir", str(tmp_path))):
            out = tmas(*args, "--port", port)
            err = out.stderr.decode().strip()
            assert (
                out.returncode == 2 and err == f"tmas: error: cannot listen on 127.0.0.1:{port}: Address already in use"
            )


@pytest.mark.slow
def test_a_finished_sweep_resumed_says_there_is_nothing_to_run(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 1)
    out = str(tmp_path / "sweep")
    args = ("--problems", str(tmp_path / "p.jsonl"), "-m", "cot", "--base-url", sim.base_url, "--no-report")
    first = tmas("sweep", "-o", out, *args)
    assert first.returncode == 0 and first.stderr.decode().strip().endswith("tmas: 1 of 1 problems done")
    again = tmas("sweep", "--resume", out, "--no-report")
    assert again.returncode == 0
    assert again.stderr.decode().strip().endswith("tmas: nothing to run: every point of the sweep is finished (1)")


@pytest.mark.slow
def test_a_finished_run_resumed_says_there_is_nothing_to_run_and_is_left_as_it_was(
    sim: SimServer, tmp_path: Path
) -> None:
    write_problems(tmp_path / "p.jsonl", 2)
    run_dir = tmp_path / "run"
    assert (
        tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "--base-url", sim.base_url, "-m", "cot").returncode
        == 0
    )
    stored = (run_dir / "run.sqlite").read_bytes()
    sent = sim.stats().total_requests
    # A setting the finished problems do not depend on: before, the resume recorded it as the run's.
    again = tmas("run", "--resume", str(run_dir), "--concurrency", "3")
    assert again.returncode == 0 and json.loads(again.stdout)["calls"] == 0 and sim.stats().total_requests == sent
    assert (
        "tmas: nothing to run: every problem of the run is finished (2); its summary follows" in again.stderr.decode()
    )
    assert (run_dir / "run.sqlite").read_bytes() == stored


def test_a_sweep_point_solved_without_a_failed_calls_reply_says_the_sweep_asks_it_again(tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 1)
    out = tmp_path / "sweep"
    with SimServer(SimScript(rules=[Rule(role="refiner", fault="http_400")])) as sim:
        ran = tmas(
            "sweep", "-o", str(out), "--problems", str(tmp_path / "p.jsonl"), "-m", "self_refine", "-m", "cot",
            "-p", "n=1", "-p", "iterations=2", "--base-url", sim.base_url, "--no-report",
        )  # fmt: skip
    assert ran.returncode == 0, ran.stderr.decode()
    points = {p["name"]: p for p in json.loads(ran.stdout)["points"]}
    assert {name: p["failed_calls"] for name, p in points.items()} == {"self_refine__iterations=2__n=1": 1, "cot": 0}
    notices = [line for line in ran.stderr.decode().splitlines() if line.startswith("notice: ")]
    assert notices == [
        "notice: point self_refine__iterations=2__n=1: 1 finished problem holds calls that failed after their retries"
        f" (solved without their replies): 'tmas sweep --resume {out} --no-report' asks them again"
    ]


def test_environment_variables_configure_the_endpoint(sim: SimServer) -> None:
    env = clean_env()
    env |= {"TMAS_BASE_URL": sim.base_url, "TMAS_MODEL": "from-env"}
    out = subprocess.run(
        [sys.executable, "-m", "tmas", "solve", "What is 2*21?", "-m", "cot"], capture_output=True, env=env, timeout=60
    )
    assert out.stdout.decode().strip() == "42"
    assert sim.requests[0].body["model"] == "from-env"


@pytest.mark.slow
def test_models_reports_each_endpoint(sim: SimServer) -> None:
    out = tmas("models", "--base-url", sim.base_url)
    assert out.returncode == 0 and "ok, models: sim-model" in out.stdout.decode()
    with dead_url() as dead:
        out = tmas("models", "--base-url", dead)
    assert out.returncode == 1 and "NOT ANSWERING" in out.stdout.decode()


def test_unreachable_endpoint_stops_the_run_and_keeps_state(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 2)
    with dead_url() as dead:
        # Nothing listens there: one line naming it, before a run directory is made (nothing to resume).
        out = tmas("run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", dead)
        assert out.returncode == 1
        assert f"cannot connect to {dead}: connection refused" in out.stderr.decode()
        assert not (tmp_path / "run").exists()
        # A run whose endpoint is gone when it goes on: its state is kept and the line says how to continue.
        run = ("run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url)
        assert tmas(*run).returncode == 0
        with sqlite3.connect(tmp_path / "run" / "run.sqlite") as db:
            db.execute("DELETE FROM results WHERE problem_id = 'p1'")  # left to do
        out = tmas("run", "--resume", str(tmp_path / "run"), "--base-url", dead)
    assert out.returncode == 1
    last = out.stderr.decode().strip().splitlines()[-1]
    assert dead in last and f"continue with 'tmas run --resume {tmp_path / 'run'}'" in last
    assert (tmp_path / "run" / "run.sqlite").exists()


def _stored_problem_ids(run_dir: Path) -> set[str]:
    db = sqlite3.connect(run_dir / "run.sqlite")
    try:
        return {r[0] for r in db.execute("SELECT problem_id FROM calls WHERE error IS NULL")}
    except sqlite3.OperationalError:  # the run is still creating its tables
        return set()
    finally:
        db.close()


@pytest.mark.slow
def test_killed_run_resumes_without_repeating_finished_calls(tmp_path: Path) -> None:
    n, answered = 12, 4
    write_problems(tmp_path / "p.jsonl", n)
    run_dir = tmp_path / "run"
    # The server answers the first 4 calls and holds the others: the run is killed while it waits, with exactly 4
    # problems finished, however fast or slow the machine.
    with SimServer(SimScript(hold_after=answered)) as sim:
        env = clean_env()
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tmas", "run", str(tmp_path / "p.jsonl"), "-o", str(run_dir)),
                *("--base-url", sim.base_url, "--concurrency", "2", "--method", "cot"),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def held_with_answers_stored() -> bool:
            assert proc.poll() is None, "the run ended before it was killed"
            return sim.stats().held > 0 and len(_stored_problem_ids(run_dir)) == answered

        wait_for(held_with_answers_stored, "the run to store the answered calls and wait on the others")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        finished_before = _stored_problem_ids(run_dir)
        assert len(finished_before) == answered
        seen_before = len(sim.requests)
        sim.set_script(SimScript())  # the gate opens for the resumed run

        out = tmas("run", "--resume", str(run_dir))
        assert out.returncode == 0, out.stderr.decode()
        summary = json.loads(out.stdout)
        assert summary["done"] == n and summary["failed"] == 0
        asked_after = {r.problem_id for r in sim.requests[seen_before:]}
    assert asked_after.isdisjoint(finished_before)
    assert asked_after | finished_before == {f"p{i}" for i in range(n)}


async def test_resume_of_a_finished_run_asks_nothing_again(tmp_path: Path) -> None:
    # The run itself, as `tmas run` and `tmas run --resume` make it, in process on a scripted model.
    write_problems(tmp_path / "p.jsonl", 3)
    run_dir = tmp_path / "run"
    model = ScriptedModel(SimScript(), scripted_settings(method={"name": "cot", "params": {}}))
    first = await arun(tmp_path / "p.jsonl", run_dir, model=model)
    assert (first.done, first.calls) == (3, 3)
    again = ScriptedModel(SimScript(), model.settings)
    summary = await aresume(run_dir, model=again)
    assert summary.skipped == 3 and summary.calls == 0 and summary.to_dict()["calls"] == 0
    assert again.calls == [] and len(model.calls) == 3


def test_a_sweep_point_whose_endpoint_goes_says_to_continue_the_sweep(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 2)
    out = tmp_path / "sweep"
    args = ("--problems", str(tmp_path / "p.jsonl"), "-m", "cot", "--grade", "rules", "--judge-runs", "2")
    assert tmas("sweep", "-o", str(out), *args, "--base-url", sim.base_url, "--no-report").returncode == 0
    (point,) = (out / "runs").iterdir()
    with sqlite3.connect(point / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'p1'")  # left to do
    with dead_url() as dead:
        resumed = tmas("sweep", "--resume", str(out), "--grade", "rules", "--judge-runs", "2", "--base-url", dead)
    assert resumed.returncode == 1
    last = resumed.stderr.decode().strip().splitlines()[-1]
    # The sweep's own command goes on with every point (the point's run alone would leave the rest and the report).
    assert dead in last and "tmas run --resume" not in last
    assert last.endswith(f"continue with 'tmas sweep --resume {out} --grade rules --judge-runs 2'")


def test_a_problem_file_read_from_a_pipe_is_read_once(tmp_path: Path) -> None:
    # Before, tmas run read the file twice, to count its problems for the estimate and then to store them: a pipe
    # (/dev/stdin, a shell's <(...)) had nothing left the second time, and the run failed with 'no problems given
    # (empty problem file?)' after its estimate had counted them.
    lines = [json.dumps({"problem_id": f"p{i}", "question": f"What is {i + 2}*7?"}) for i in range(3)]
    with SimServer(SimScript()) as sim:
        args = ["run", "/dev/stdin", "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url, "--yes"]
        done = run_tmas(*args, stdin="\n".join(lines) + "\n", text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["done"] == 3


def test_a_sweeps_problem_file_read_from_a_pipe_is_read_once(tmp_path: Path) -> None:
    # Before, tmas sweep read its problem file twice, for the estimate and again to run its points: a pipe had
    # nothing left the second time, and the sweep was refused with '/dev/stdin: no problems in file'.
    lines = [json.dumps({"problem_id": f"p{i}", "question": f"What is {i + 2}*7?"}) for i in range(2)]
    out = tmp_path / "sweep"
    with SimServer(SimScript()) as sim:
        args = ["sweep", "-o", str(out), "--problems", "/dev/stdin", "-m", "cot", "-m", "majority", "-p", "k=2"]
        ran = run_tmas(
            *args,
            "--base-url",
            sim.base_url,
            "--no-report",
            "--yes",
            stdin="\n".join(lines) + "\n",
            text=True,
            timeout=120,
        )
    assert ran.returncode == 0, ran.stderr
    points = json.loads(ran.stdout)["points"]
    assert [(p["status"], p["failed"]) for p in points] == [("new", 0), ("new", 0)]
    assert ran.stderr.strip().endswith("tmas: 4 of 4 problems done")
