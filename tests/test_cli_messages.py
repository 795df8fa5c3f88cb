"""What a new user meets first, as they meet it: the command line against the simulated server. A run where problems
failed exits non-zero and says how many and why; a base URL without /v1 is named before any call; every command that
starts model calls shows its cost and asks above a threshold (refusing without a terminal unless --yes); a single
solve costs a few dozen calls by default; and the small things: help without ``<bool>``, an unknown parameter's
valid ones, a bad JSON line's column, ``tmas models --model``, a resume's dry run counting its stored calls."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from conftest import clean_env, dead_url, run_tmas, scripted_settings
from scripted_runs import GoneModel
from tmas.api import asolve
from tmas.cli.help_format import command_of
from tmas.cli.main import app
from tmas.config import Settings
from tmas.errors import ConfigError
from tmas.llm.model import EndpointUnreachable
from tmas.llm.preflight import check_endpoints
from tmas.problems import Problem
from tmas.runner import Unreachable
from tmas.store.run_store import RunStore
from tmas.testing import Rule, SimScript, SimServer
from tmas.testing.script import PersonaName

Q = "What is 17*23?"


def write_problems(path: Path, n: int) -> None:
    lines = [json.dumps({"problem_id": f"p{i}", "question": f"What is {i + 2}*7?"}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def last_line(out: object) -> str:
    err = out.stderr  # type: ignore[attr-defined]
    return (err if isinstance(err, str) else err.decode()).strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------ failures said
@pytest.mark.parametrize(("failing", "code", "said"), [(r"What is 2\*7", 3, "1 of 3"), (r"What is", 4, "3 of 3")])
def test_failed_problems_exit_non_zero_and_the_last_line_says_how_many_and_why(
    sim: SimServer, tmp_path: Path, failing: str, code: int, said: str
) -> None:
    sim.set_script(SimScript(rules=[Rule(pattern=failing, fault="http_400")]))
    write_problems(tmp_path / "p.jsonl", 3)
    out = run_tmas(
        "run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url
    )
    assert out.returncode == code, out.stderr.decode()
    line = last_line(out)
    assert line.startswith(f"tmas: {said} problems failed: ")
    assert f"HTTP 400 from {sim.base_url}/chat/completions: " in line
    assert line.endswith(f"(every problem's error: tmas export {tmp_path / 'run'})")


def test_a_failed_solve_exits_4_naming_why(sim: SimServer) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="http_400")]))
    out = run_tmas("solve", Q, "-m", "cot", "--base-url", sim.base_url)
    assert out.returncode == 4 and out.stdout == b""  # no "(no answer)" standing for an answer
    assert last_line(out).startswith("tmas: the question failed: no candidate") and sim.base_url in last_line(out)


def test_a_base_url_without_v1_is_named_before_any_call(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 3)
    out = run_tmas("run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "majority", "-p", "k=4",
                   "--base-url", sim.url)  # fmt: skip
    assert out.returncode == 2
    assert last_line(out) == (
        f"tmas: error: {sim.url}/models answered HTTP 404 and {sim.url}/v1/models answers: the base URL lacks its"
        f" /v1; give --base-url {sim.url}/v1"
    )
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()


async def test_a_roles_own_base_url_without_v1_is_named_with_its_roles_fix(sim: SimServer) -> None:
    # --base-url would move every role's calls to the judge's server: the fix is the role's own key.
    settings = Settings.model_validate(
        {"endpoint": {"base_url": sim.base_url}, "roles": {"judge": {"base_url": sim.url}}}
    )
    with pytest.raises(ConfigError) as caught:
        await check_endpoints(settings, ["solution", "judge"])
    assert str(caught.value) == (
        f"{sim.url}/models answered HTTP 404 and {sim.url}/v1/models answers (the base_url of [roles.judge]): the"
        f' base URL lacks its /v1; set base_url = "{sim.url}/v1" in [roles.judge]'
    )
    chat = f"{sim.base_url}/chat/completions"
    settings = Settings.model_validate({"endpoint": {"base_url": sim.base_url}, "roles": {"judge": {"base_url": chat}}})
    with pytest.raises(ConfigError) as caught:
        await check_endpoints(settings, ["judge"])
    assert str(caught.value) == (
        f"{chat} (the base_url of [roles.judge]): the base URL ends in /chat/completions, which tmas adds to it;"
        f' set base_url = "{sim.base_url}" in [roles.judge]'
    )


async def test_a_roles_own_base_url_nobody_listens_at_is_named_with_its_roles_fix(
    sim: SimServer, tmp_path: Path
) -> None:
    # Before, the fix said (by the check before a run and by 'tmas models') was "correct --base-url", which would
    # move every role's calls and leave the judge's where it was.
    config = tmp_path / "run.toml"
    with dead_url() as dead:
        settings = Settings.model_validate(
            {"endpoint": {"base_url": sim.base_url}, "roles": {"judge": {"base_url": dead}}}
        )
        with pytest.raises(EndpointUnreachable) as caught:
            await check_endpoints(settings, ["solution", "judge"])
        config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\n[roles.judge]\nbase_url = "{dead}"\n')
        listed = run_tmas("models", "--config", str(config), text=True)
    assert str(caught.value) == (
        f"cannot connect to {dead} (the base_url of [roles.judge]): connection refused; start the server there or"
        " correct base_url in [roles.judge] ('tmas models --base-url URL' checks an endpoint)"
    )
    assert listed.returncode == 1
    assert (
        f"judge: {dead} NOT ANSWERING: cannot connect: connection refused; start the server there or correct"
        " base_url in [roles.judge]"
    ) in listed.stdout.splitlines()


async def test_a_roles_own_model_vllm_does_not_serve_is_named_with_its_roles_fix(sim: SimServer) -> None:
    sim.set_script(SimScript(persona="vllm"))
    settings = Settings.model_validate(
        {"endpoint": {"base_url": sim.base_url, "model": "sim-model"}, "roles": {"judge": {"model": "judge-model"}}}
    )
    with pytest.raises(ConfigError) as caught:
        await check_endpoints(settings, ["solution", "judge"])
    assert str(caught.value) == (
        f"{sim.base_url} serves no model 'judge-model' (the model of role 'judge'): it serves sim-model;"
        " set model = \"sim-model\" in [roles.judge] ('tmas models' lists each endpoint's)"
    )


def test_a_404_from_a_url_without_v1_says_so(sim: SimServer, tmp_path: Path) -> None:
    # A URL under which nothing answers at all (not even /v1 below it): every call's error names it, and says why.
    write_problems(tmp_path / "p.jsonl", 2)
    wrong = f"{sim.url}/api"
    out = run_tmas("run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", wrong)
    assert out.returncode == 4
    assert (
        f"HTTP 404 from {wrong}/chat/completions: 404: Not Found (the base URL has no /v1, under which"
        " OpenAI-compatible servers answer)"
    ) in last_line(out)


# ------------------------------------------------------------------------------------------------ cost asked
def test_solve_costs_a_few_dozen_calls_by_default_and_asks_before_the_papers(sim: SimServer) -> None:
    out = run_tmas("solve", Q, "--base-url", sim.base_url)
    assert out.returncode == 0, out.stderr.decode()
    assert "tmas: estimate: 16 to 48 calls" in out.stderr.decode()
    assert 16 <= len(sim.chat_bodies()) <= 48
    sim.reset()
    paper = run_tmas("solve", Q, "--base-url", sim.base_url, "-p", "preset=paper")
    assert paper.returncode == 2 and sim.stats().total_requests == 0
    # 1,640 calls, 2,000 with every reply asked again.
    assert last_line(paper).startswith("tmas: error: the estimate is 2,000 calls (threshold 500): pass --yes")


def test_run_asks_above_its_threshold_and_confirm_calls_sets_it(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 4)
    args = ["run", str(tmp_path / "p.jsonl"), "-m", "majority", "-p", "k=8", "--base-url", sim.base_url]
    refused = run_tmas(*args, "-o", str(tmp_path / "a"), "--confirm-calls", "20")
    # 32 samples, each of which may be asked again once: 64 at most.
    assert refused.returncode == 2 and "the estimate is 64 calls (threshold 20)" in last_line(refused)
    assert "cost estimate (before any call):" in refused.stderr.decode()  # shown whole before it refuses
    assert sim.stats().total_requests == 0 and not (tmp_path / "a").exists()
    assert run_tmas(*args, "-o", str(tmp_path / "b"), "--confirm-calls", "64").returncode == 0
    assert run_tmas(*args, "-o", str(tmp_path / "c"), "--confirm-calls", "20", "--yes").returncode == 0
    assert len(sim.chat_bodies()) == 2 * 32


@dataclass
class OnTerminal:
    """What a command run on a terminal left: its exit code, its standard output and error (the pipes; standard
    error is empty where it was the terminal) and what the terminal showed (what was typed, echoed, included)."""

    returncode: int
    stdout: str
    stderr: str
    terminal: str


def on_terminal(*args: str, typed: str, stderr_on_it: bool = False, controlling: bool = True) -> OnTerminal:
    """``tmas ARGS`` with a terminal for its standard input (and its standard error, ``stderr_on_it``), on which
    ``typed`` is typed; the terminal is its controlling terminal (its /dev/tty) unless ``controlling`` is false,
    when it has none."""
    main, attached = os.openpty()
    shown: list[bytes] = []

    def show() -> None:
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # every end of the terminal closed
                return
            if not chunk:
                return
            shown.append(chunk)

    # In a session of its own, the child takes its standard input for its controlling terminal, then runs tmas.
    take_it = "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    command = "os.execv(sys.executable, [sys.executable, '-m', 'tmas', *sys.argv[1:]])"
    reader = threading.Thread(target=show)
    try:
        with subprocess.Popen(
            [sys.executable, "-c", (take_it if controlling else "import os, sys; ") + command, *args],
            stdin=attached,
            stdout=subprocess.PIPE,
            stderr=attached if stderr_on_it else subprocess.PIPE,
            text=True,
            env=clean_env(),
            start_new_session=True,
        ) as child:
            os.close(attached)
            reader.start()
            os.write(main, typed.encode())
            out, err = child.communicate(timeout=120)
        reader.join(timeout=30)
    finally:
        os.close(main)
    terminal = b"".join(shown).decode(errors="replace").replace("\r\n", "\n")
    return OnTerminal(child.returncode, out, err or "", terminal)


@pytest.mark.parametrize("typed", ["n\n", "no\n", "\n", "\x04"])
def test_a_run_not_confirmed_on_the_terminal_says_it_was_not_started(
    sim: SimServer, tmp_path: Path, typed: str
) -> None:
    # Before, an answer of no ended with exit code 2 and no word after the question (end of input: exit code 1).
    write_problems(tmp_path / "p.jsonl", 2)
    out = on_terminal(
        "run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url,
        "--confirm-calls", "1", typed=typed,
    )  # fmt: skip
    assert out.returncode == 2
    # Standard error is a pipe here (2>&1 | tee log): the question is asked on the terminal, the estimate written to
    # standard error.
    assert "the estimate is 4 calls (threshold 1). Start? [y/N]:" in out.terminal
    assert "Start?" not in out.stderr and "cost estimate (before any call):" in out.stderr
    assert out.stderr.strip().endswith("tmas: not started; nothing was sent") and out.stdout == ""
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()


def test_a_pilot_not_confirmed_on_the_terminal_says_it_was_not_started(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 2)
    out = on_terminal(
        "run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url,
        "--pilot", "1", "--confirm-calls", "0", typed="n\n",
    )  # fmt: skip
    assert out.returncode == 2
    assert "tmas: the pilot is" in out.terminal and "Start it? [y/N]:" in out.terminal
    assert out.stderr.strip().endswith("tmas: the pilot was not started; nothing was sent") and out.stdout == ""
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()


def test_a_solve_confirmed_on_the_terminal_prints_the_answer_alone(sim: SimServer) -> None:
    # The question goes to standard error: before, a space went to standard output ahead of the answer.
    args = ["solve", Q, "-m", "cot", "--base-url", sim.base_url, "--confirm-calls", "0"]
    out = on_terminal(*args, typed="y\n", stderr_on_it=True)
    assert out.returncode == 0, out.terminal
    assert "Start? [y/N]:" in out.terminal and out.stdout == "391\n"


def test_a_solve_on_a_terminal_shows_the_runs_live_display(sim: SimServer) -> None:
    # A question can take minutes (the embedded model on a CPU) or hours (preset=paper). Before, tmas solve showed
    # nothing between its estimate and its answer, even on a terminal; now it shows tmas run's display: the question
    # being solved, the calls sent and the tokens. The answer alone still goes to standard output.
    args = ["solve", Q, "-m", "majority", "-p", "k=3", "--base-url", sim.base_url]
    out = on_terminal(*args, typed="", stderr_on_it=True)
    assert out.returncode == 0, out.terminal
    assert out.stdout == "391\n"
    assert "problems" in out.terminal and "1/1" in out.terminal
    assert "calls: 0 in flight, 3 sent" in out.terminal, out.terminal
    # Without a terminal standard error is as before: the estimate and the summary.
    piped = run_tmas(*args, text=True)
    assert piped.returncode == 0 and piped.stdout == "391\n"
    assert [line.split(":")[1].split()[0] for line in piped.stderr.strip().splitlines()] == ["estimate", "3"]


@pytest.mark.parametrize("typed", ["y\n", "n\n"])
def test_with_standard_error_not_a_terminal_the_question_is_asked_on_the_terminal(
    sim: SimServer, tmp_path: Path, typed: str
) -> None:
    # tmas run ... 2>log: before, the question went into the log and the command waited for an answer to a question
    # nobody saw.
    write_problems(tmp_path / "p.jsonl", 2)
    run_dir = tmp_path / "run"
    args = ["run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "-m", "cot", "--base-url", sim.base_url]
    out = on_terminal(*args, "--confirm-calls", "1", typed=typed)
    assert "tmas: the estimate is 4 calls (threshold 1). Start? [y/N]:" in out.terminal
    assert "Start?" not in out.stderr and "cost estimate (before any call):" in out.stderr  # the log keeps it
    if typed == "y\n":
        assert out.returncode == 0, out.stderr
        assert len(sim.chat_bodies()) == 2
    else:
        assert out.returncode == 2 and out.stderr.strip().endswith("tmas: not started; nothing was sent")
        assert sim.stats().total_requests == 0 and not run_dir.exists()


def test_with_standard_error_not_a_terminal_and_no_terminal_to_open_the_gate_refuses(
    sim: SimServer, tmp_path: Path
) -> None:
    # Standard input a terminal, but no controlling terminal to ask on: refused as without a terminal (before, the
    # question went to standard error and the answer typed on standard input started the run).
    write_problems(tmp_path / "p.jsonl", 2)
    args = ["run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url]
    out = on_terminal(*args, "--confirm-calls", "1", typed="y\n", controlling=False)
    assert out.returncode == 2
    assert last_line(out).startswith("tmas: error: the estimate is 4 calls (threshold 1): pass --yes to start it")
    assert "Start?" not in out.stderr + out.terminal
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()


def test_a_resume_dry_run_counts_the_calls_it_holds(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 2)
    run_dir = tmp_path / "run"
    args = ["-m", "majority", "-p", "k=3", "--base-url", sim.base_url]
    assert run_tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), *args).returncode == 0
    out = run_tmas("run", "--resume", str(run_dir), "--iterations", "2", "--dry-run")
    assert out.returncode == 0
    # 12 calls, 24 with every sample asked again, 6 of them stored.
    assert "stored: 6 answered calls, replayed rather than sent; at most 18 still to send" in out.stderr.decode()
    assert len(sim.chat_bodies()) == 6


def test_a_resume_dry_run_counts_only_the_problems_it_has_still_to_solve(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 2)
    run_dir = tmp_path / "run"
    args = ["-m", "majority", "-p", "k=3", "--base-url", sim.base_url]
    assert run_tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), *args).returncode == 0
    # Stopped after p1's calls, before its result: p0 is skipped, p1 replays its 3 calls (6 at most with every sample
    # asked again). Over both problems less every stored call it would say 12 - 6 = 6.
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'p1'")
    out = run_tmas("run", "--resume", str(run_dir), "--dry-run")
    assert out.returncode == 0, out.stderr.decode()
    assert "stored: 3 answered calls, replayed rather than sent; at most 3 still to send" in out.stderr.decode()
    assert len(sim.chat_bodies()) == 6


def test_a_resume_under_other_sampling_counts_no_stored_call_as_replayed(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 2)
    run_dir = tmp_path / "run"
    args = ["-m", "majority", "-p", "k=3", "--base-url", sim.base_url]
    assert run_tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), *args).returncode == 0
    # Every problem is solved again (iterations 0-1) at the new temperature: none of the 6 stored calls answers, so
    # all 12 (24 with every sample asked again) are to send, over the threshold of 20 (counted as replayed, 18 were
    # left under it).
    resume = ["run", "--resume", str(run_dir), "--iterations", "2", "--temperature", "0.3", "--confirm-calls", "20"]
    gated = run_tmas(*resume)
    assert gated.returncode == 2 and last_line(gated).startswith("tmas: error: the estimate is 24 calls (threshold 20)")
    assert len(sim.chat_bodies()) == 6


# ------------------------------------------------------------------------------------------------ smaller items
def test_help_shows_no_type_beside_a_flag() -> None:
    for command in (["--help"], ["run", "--help"], ["serve", "--help"], ["pool", "build", "--help"]):
        out = run_tmas(*command, env={"COLUMNS": "120"}, text=True)
        assert out.returncode == 0 and "<bool>" not in out.stdout, command
    assert re.search(r"--dry-run +Print the cost estimate", run_tmas("run", "--help", text=True).stdout)


def test_a_command_without_subcommands_offers_none() -> None:
    # serve and view were groups with a callback: their usage offered "COMMAND [ARGS]...", and a stray word was
    # "No such command".
    root = command_of(app)
    commands = [(f"tmas {name}", sub) for name, sub in root.commands.items()]
    for name, group in list(commands):
        commands += [(f"{name} {sub_name}", sub) for sub_name, sub in getattr(group, "commands", {}).items()]
    for name, command in commands:
        usage = command.get_usage(click.Context(command, info_name=name))
        assert ("COMMAND" in usage) == bool(getattr(command, "commands", None)), usage
    out = run_tmas("serve", "extra", text=True)
    assert out.returncode == 2 and "Got unexpected extra argument(s) (extra)" in out.stderr, out.stderr


def test_a_command_list_line_is_one_sentence_not_cut_where_the_source_wraps() -> None:
    # Wide enough for solve's line whole: before, it broke after "quick preset:", where its docstring wraps.
    out = run_tmas("--help", env={"COLUMNS": "200"}, text=True)
    assert out.returncode == 0
    assert re.search(r"solve +Solve one question and print the answer \(on your endpoint, given no parameters, TMAS"
                     r" runs its quick preset: at most 48 calls\)\.", out.stdout), out.stdout  # fmt: skip


def test_an_unknown_parameter_lists_the_valid_ones(sim: SimServer) -> None:
    out = run_tmas("solve", Q, "-m", "majority", "-p", "n=4", "--base-url", sim.base_url)
    assert out.returncode == 2
    assert last_line(out).startswith("tmas: error: method 'majority': unknown parameter 'n' (known: ")
    assert re.search(r"known: .*\bk, .*round_size", last_line(out))


def test_proof_mode_given_to_mattrl_is_refused_naming_what_sets_its_answer(sim: SimServer) -> None:
    # MATTRL's domain sets what its answer is: a proof mode it would never read is refused, not recorded.
    out = run_tmas("solve", Q, "-m", "mattrl", "-p", "mode=proof", "--base-url", sim.base_url)
    assert out.returncode == 2
    assert last_line(out).startswith("tmas: error: method 'mattrl': ")
    assert "mode=proof does not apply to it" in last_line(out), last_line(out)


@pytest.mark.parametrize(
    ("given", "stdin", "said"),
    [
        (["   "], "", "the argument: the question is empty"),
        (["-"], " \n", "standard input: the question is empty"),
        # The argument would be dropped for the file's question.
        ([Q, "-f", "{empty}"], "", "give the question as an argument or with --file, not both"),
    ],
)
def test_an_empty_or_doubly_given_question_is_named_before_the_estimate(
    sim: SimServer, tmp_path: Path, given: list[str], stdin: str, said: str
) -> None:
    empty = tmp_path / "q.txt"
    empty.write_text("\n")
    args = [arg.format(empty=empty) for arg in given]
    out = run_tmas("solve", *args, "-m", "cot", "--base-url", sim.base_url, "--dry-run", stdin=stdin, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"tmas: error: {said.format(empty=empty)}"]
    assert sim.stats().total_requests == 0


def test_a_missing_config_file_named_by_the_environment_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "gone.toml"
    out = run_tmas("solve", Q, "--dry-run", env={"TMAS_CONFIG": str(missing)}, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"tmas: error: {missing}: config file named by TMAS_CONFIG not found"]


def test_a_config_file_that_is_a_directory_is_said_as_a_config_error(tmp_path: Path) -> None:
    # Before: "tmas: error: DIR: Is a directory", exit 1, not said to be the config file.
    out = run_tmas("solve", Q, "--dry-run", "-c", str(tmp_path), text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"tmas: error: {tmp_path}: cannot read the config file: Is a directory"]


@pytest.mark.parametrize(
    ("command", "what"),
    [
        ("run", "a run is kept in a directory (choose another)"),
        ("sweep", "a sweep is kept in a directory (choose another)"),
        ("serve", "requests' runs are kept in a directory (choose another)"),
    ],
)
def test_an_out_that_is_a_file_is_named_as_such(sim: SimServer, tmp_path: Path, command: str, what: str) -> None:
    problems = tmp_path / "p.jsonl"
    write_problems(problems, 1)
    before = problems.read_bytes()
    given = {
        "run": [str(problems), "-m", "cot", "-y"],
        "sweep": ["--problems", str(problems), "--no-report", "-m", "cot", "-y"],
        "serve": ["--port", "0"],
    }[command]
    out = run_tmas(command, *given, "-o", str(problems), "--base-url", sim.base_url)
    assert out.returncode == 2
    assert last_line(out) == f"tmas: error: {problems}: a file, not a directory: {what}"
    assert problems.read_bytes() == before


@pytest.mark.parametrize("command", ["run", "eval", "sweep", "serve"])
def test_an_out_below_a_file_is_named_before_the_estimate(sim: SimServer, tmp_path: Path, command: str) -> None:
    problems = tmp_path / "p.jsonl"
    write_problems(problems, 1)
    given = {
        "run": [str(problems), "-m", "cot", "-y"],
        "eval": [str(problems), "-m", "cot", "-y"],
        "sweep": ["--problems", str(problems), "--no-report", "-m", "cot", "-y"],
        "serve": ["--port", "0"],
    }[command]
    out = run_tmas(command, *given, "-o", str(problems / "run"), "--base-url", sim.base_url, text=True)
    assert out.returncode == 2
    # One line, before any estimate: the file in the way named, not the system's "Not a directory" of the path asked.
    assert out.stderr.strip().splitlines() == [
        f"tmas: error: {problems / 'run'}: {problems} is a file, not a directory (choose another)"
    ]
    assert sim.stats().total_requests == 0


@pytest.mark.parametrize("held", ["file", "run"])
def test_a_solves_run_dir_that_cannot_be_one_is_said_before_the_estimate(
    sim: SimServer, tmp_path: Path, held: str
) -> None:
    run_dir = tmp_path / "kept"
    if held == "file":
        run_dir.write_text("x")
    else:
        assert run_tmas("solve", Q, "-m", "cot", "-o", str(run_dir), "--base-url", sim.base_url).returncode == 0
    sent = sim.stats().total_requests
    out = run_tmas("solve", Q, "-m", "cot", "-o", str(run_dir), "--base-url", sim.base_url, text=True)
    assert out.returncode == 2
    said = {
        "file": "a file, not a directory: a run is kept in a directory (choose another)",
        "run": f"already holds a run; continue it with 'tmas run --resume {run_dir}' or choose another directory",
    }[held]
    assert out.stderr.strip().splitlines() == [f"tmas: error: {run_dir}: {said}"]
    assert sim.stats().total_requests == sent


@pytest.mark.parametrize("left", ["empty", "problems"])
def test_a_report_of_a_run_that_never_began_says_so(tmp_path: Path, left: str) -> None:
    # What a run killed before its first call leaves: an empty store file, or its problems without its setup.
    # Before, the report was written, of a run of method '?' whose problems were "unlabeled".
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.sqlite").write_bytes(b"")
    if left == "problems":
        with RunStore(run_dir) as store:
            store.add_problems([Problem(problem_id="p1", question="What is 1+1?", answer="2")])
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    out = run_tmas("report", str(run_dir), "-o", str(tmp_path / "report"), "--grade", "rules", text=True)
    assert out.returncode == 2
    assert last_line(out) == f"tmas: error: {run_dir}: holds no run to report: it was stopped before its first call"
    if left == "empty":  # left as it was: no schema written into the file
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    assert not (tmp_path / "report").exists()


def test_a_grid_file_of_no_study_is_said_of_the_file_before_the_estimate(sim: SimServer, tmp_path: Path) -> None:
    # Before: an estimate of 0 calls (a dry run ended there, exit 0), then "the sweep has no points", of no file.
    problems = tmp_path / "p.jsonl"
    write_problems(problems, 1)
    grid = tmp_path / "grid.toml"
    grid.write_text(f'problems = "{problems}"\n')
    for given in (["-y"], ["--dry-run"]):
        out = run_tmas("sweep", str(grid), "-o", str(tmp_path / "sweep"), "--base-url", sim.base_url, *given, text=True)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            f"tmas: error: {grid}: no [[study]] table: the sweep has no points (add a [[study]])"
        ]
    assert not (tmp_path / "sweep").exists()


def test_a_bad_json_line_names_its_column(sim: SimServer, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    bad = '{"problem_id": "b", "question": "What is 1+1?", "answer": "2"'  # no closing brace: cut at its end
    path.write_text('{"problem_id": "a", "question": "What is 1+1?"}\n' + bad + "\n")
    out = run_tmas("run", str(path), "-o", str(tmp_path / "run"), "--base-url", sim.base_url)
    assert out.returncode == 2
    assert len(bad) == 61  # the column past its last character, not column 1 of the line after
    assert last_line(out) == f"tmas: error: {path}:2: not valid JSON: Expecting ',' delimiter at column 62"


def test_models_takes_model_and_says_whether_it_is_served(sim: SimServer) -> None:
    served = run_tmas("models", "--base-url", sim.base_url, "--model", "sim-model", text=True)
    assert served.returncode == 0 and f"default: {sim.base_url} ok, models: sim-model" in served.stdout
    missing = run_tmas("models", "--base-url", sim.base_url, "--model", "other", text=True)
    assert missing.returncode == 1
    assert f"default: {sim.base_url} answers but DOES NOT SERVE 'other'; models: sim-model" in missing.stdout


def test_models_lists_an_endpoint_once_for_the_roles_that_share_its_url_and_key(sim: SimServer, tmp_path: Path) -> None:
    # Before, each role with its own base_url was asked and listed on a line of its own, the same URL and key as the
    # default's among them. Another key on the same URL may see other models, so it keeps its own line.
    config = tmp_path / "tmas.toml"
    config.write_text(
        f'[endpoint]\nbase_url = "{sim.base_url}"\n'
        f'[roles.judge]\nbase_url = "{sim.base_url}"\n'
        f'[roles.verifier]\nbase_url = "{sim.base_url}"\napi_key_env = "TMAS_TEST_KEY"\n'
        f'[roles.summarizer]\nbase_url = "{sim.base_url}"\napi_key_env = "TMAS_TEST_SAME_KEY"\n'
    )
    env = {"TMAS_TEST_KEY": "k2", "TMAS_TEST_SAME_KEY": "k2"}
    out = run_tmas("models", "--config", str(config), text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        f"default, judge: {sim.base_url} ok, models: sim-model",
        f"verifier, summarizer: {sim.base_url} ok, models: sim-model",
    ]
    # The models its roles name are each checked against the one list.
    config.write_text(
        f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "sim-model"\n'
        f'[roles.judge]\nbase_url = "{sim.base_url}"\nmodel = "judge-model"\n'
    )
    out = run_tmas("models", "--config", str(config), text=True)
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        f"default, judge: {sim.base_url} answers but DOES NOT SERVE 'judge-model'; models: sim-model"
    ]


def test_models_counts_the_aliases_llama_server_lists_as_served(tmp_path: Path) -> None:
    # llama-server started with --alias lists it in its card's aliases and answers calls naming it: before, 'tmas
    # models --model ALIAS' said it DOES NOT SERVE it, and exited 1.
    script = SimScript(model="/models/qwen.gguf", aliases=["qwen"], persona="llama-server")
    with SimServer(script) as server:
        out = run_tmas("models", "--base-url", server.base_url, "--model", "qwen", text=True)
    assert out.returncode == 0, out.stdout
    assert f"default: {server.base_url} ok, models: /models/qwen.gguf, qwen" in out.stdout


@pytest.mark.parametrize("command", ["run", "eval", "solve", "sweep", "data filter", "serve"])
def test_a_prompts_dir_that_is_no_folder_is_said_before_the_estimate(
    sim: SimServer, tmp_path: Path, command: str
) -> None:
    # Before, it was said when the run was made: after the estimate (a --dry-run passed with exit code 0, the gate
    # asked about calls that could not start), and tmas serve started and refused every request with it.
    write_problems(tmp_path / "p.jsonl", 1)
    problems, out, missing = str(tmp_path / "p.jsonl"), str(tmp_path / "out"), str(tmp_path / "no-prompts")
    given = {
        "run": ["run", problems, "-o", out, "-m", "cot", "--dry-run"],
        "eval": ["eval", problems, "-o", out, "-m", "cot", "--dry-run"],
        "solve": ["solve", Q, "-m", "cot", "--dry-run"],
        "sweep": ["sweep", "--problems", problems, "-m", "cot", "-o", out, "--dry-run"],
        "data filter": ["data", "filter", problems, "-o", str(tmp_path / "out.jsonl"), "--dry-run"],
        "serve": ["serve", "--port", "0", "--dir", out],
    }[command]
    result = run_tmas(*given, "--base-url", sim.base_url, "--prompts-dir", missing, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"tmas: error: {missing}: prompts_dir is not a directory"]
    assert sim.requests == []
    assert not (tmp_path / "out").exists()


def test_models_says_a_server_that_is_down_as_a_run_does() -> None:
    # Before, the line ended in aiohttp's own words: 'ClientConnectorError: Cannot connect to host 127.0.0.1:PORT
    # ssl:default [Connect call failed ...]'.
    with dead_url() as dead:
        out = run_tmas("models", "--base-url", dead, text=True)
    assert out.returncode == 1
    assert out.stdout.strip() == (
        f"default: {dead} NOT ANSWERING: cannot connect: connection refused; start the server there or correct"
        " --base-url"
    )


def test_models_names_the_base_url_to_give_where_the_server_answers_under_another_path(sim: SimServer) -> None:
    # The check every run's unreachable-endpoint line points to said only "HTTP 404" of a URL without its /v1.
    for given in (sim.url, f"{sim.base_url}/chat/completions"):
        out = run_tmas("models", "--base-url", given, text=True)
        assert out.returncode == 1
        assert out.stdout.strip().startswith(f"default: {given} NOT ANSWERING: HTTP 404")
        assert out.stdout.strip().endswith(f"; give --base-url {sim.base_url}"), out.stdout


def test_models_names_a_roles_own_base_url_fix_as_the_check_before_a_run_does(sim: SimServer, tmp_path: Path) -> None:
    # Before, tmas models said 'give --base-url URL/v1' of a role's own URL: a fix that moves every role's calls.
    config = tmp_path / "tmas.toml"
    config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\n[roles.judge]\nbase_url = "{sim.url}"\n')
    out = run_tmas("models", "--config", str(config), text=True)
    assert out.returncode == 1
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("judge: ")]
    assert line.endswith(
        f"; {sim.url}/models answered HTTP 404 and {sim.url}/v1/models answers (the base_url of [roles.judge]): the"
        f' base URL lacks its /v1; set base_url = "{sim.url}/v1" in [roles.judge]'
    ), line


def test_models_names_the_model_run_in_process_and_loads_nothing() -> None:
    out = run_tmas("models", "--hf-model", "smollm2-135m", text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (
        "default: smollm2-135m run in process by transformers (device auto, dtype auto), loaded by each command that"
        " runs it"
    )
    assert lines[1] == "embedded models (--local-model NAME or --hf-model NAME, or a GGUF path):"
    assert [line[:3] for line in lines[2:]] == [" * " if "smollm2-135m:" in line else "   " for line in lines[2:]]
    assert "Loading weights" not in out.stderr


async def test_a_solve_whose_endpoint_goes_away_points_at_nothing_deleted(tmp_path: Path) -> None:
    # Without a run directory the question's scratch directory is deleted on the way out: no resume hint names it.
    model = GoneModel(SimScript(), scripted_settings(method={"name": "cot", "params": {}}), gone=True)
    with pytest.raises(Unreachable) as caught:
        await asolve(Q, model=model)
    said = str(caught.value)
    assert "the model went away" in said and "--resume" not in said and "tmas-solve-" not in said
    assert said.endswith("nothing was kept (a run directory keeps a question's calls: pass run_dir=DIR)")
    # With one, the run is kept and the hint names it, as the API continues it (its model is not the command's).
    with pytest.raises(Unreachable) as caught:
        await asolve(Q, model=GoneModel(SimScript(), model.settings, gone=True), run_dir=tmp_path / "kept")
    assert str(caught.value).endswith(f"continue with 'tmas.api.aresume({str(tmp_path / 'kept')!r})'")


# ------------------------------------------------------------------------------------------- a refused command line
@pytest.mark.parametrize(
    ("args", "said", "command"),
    [
        (["run", "p.jsonl", "-o", "out", "-T", "abc"], "Invalid value for '--iterations' / '-T': ", "tmas run"),
        (["solve", "--bogus", Q], "No such option: --bogus", "tmas solve"),
        (["nosuch"], "No such command 'nosuch'", "tmas"),
        (["pool", "--bogus"], "No such option: --bogus", "tmas pool"),
        (["pool", "show"], "Missing argument 'pool'", "tmas pool show"),
        (["prompts", "show"], "Missing argument 'name'", "tmas prompts show"),
        (["rl", "train", "--bogus"], "No such option: --bogus", "tmas rl train"),
        (["data", "generate", "--n", "many"], "Invalid value for '--n': ", "tmas data generate"),
    ],
)
def test_a_command_line_the_parser_refuses_is_one_error_line_naming_its_help(
    args: list[str], said: str, command: str
) -> None:
    out = run_tmas(*args, text=True)
    assert out.returncode == 2 and out.stdout == ""
    [line] = out.stderr.splitlines()
    assert line.startswith(f"tmas: error: {said}") and line.endswith(f" (see '{command} --help')")
    assert not re.search("[\u2500-\u257f]", out.stderr)  # no box drawn


def test_a_group_given_no_command_still_shows_its_help() -> None:
    out = run_tmas("pool", text=True)
    assert out.returncode == 2 and out.stderr == ""
    assert "Usage: tmas pool [OPTIONS] COMMAND [ARGS]..." in out.stdout


@pytest.mark.parametrize("command", ["run", "solve", "sweep"])
def test_a_missing_experience_pool_is_named_before_any_call(sim: SimServer, tmp_path: Path, command: str) -> None:
    # MATTRL's pool is a folder of the user's: a wrong path is one line and exit 2 before any call, with no run
    # directory left behind, as a missing problem file is; not every problem of the run failed one after another.
    missing = tmp_path / "pools" / "math"
    write_problems(tmp_path / "p.jsonl", 2)
    method = ["-m", "mattrl", "-p", f"pool={missing}"]
    where = {"run": [str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), *method], "solve": [Q, *method]}
    grid = tmp_path / "grid.toml"
    # The point without a pool comes first: a sweep checks every point before it runs one.
    grid.write_text(
        f'problems = "{tmp_path / "p.jsonl"}"\n[[study]]\nname = "teams"\nmethod = "mattrl"\n'
        f'variants = [{{}}, {{ pool = "{missing}" }}]\n'
    )
    where["sweep"] = [str(grid), "--out", str(tmp_path / "run")]
    out = run_tmas(command, *where[command], "--base-url", sim.base_url, text=True)
    assert out.returncode == 2, out.stderr
    assert last_line_text(out.stderr) == f"tmas: error: {missing}: no experience pool here (no meta.json)"
    assert sim.stats().total_requests == 0 and not (tmp_path / "run" / "runs").exists()


def last_line_text(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", ["--local-model", "--hf-model"])
@pytest.mark.parametrize("model", ["qwen-nope", "models/missing.gguf"])
def test_an_embedded_model_that_is_not_there_is_named_before_the_run_directory(
    tmp_path: Path, flag: str, model: str
) -> None:
    # A misspelt name or a wrong path: one line and exit 2 (bad configuration), and no run directory left behind
    # that the corrected command would find "already holds a run".
    write_problems(tmp_path / "p.jsonl", 2)
    out = run_tmas("run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", flag, model, text=True)
    assert out.returncode == 2, out.stderr
    setting = "local.model" if flag == "--local-model" else "hf.model"
    line = last_line_text(out.stderr)
    assert line.startswith(f"tmas: error: {setting} ({flag}) {model!r} is neither ")
    assert line.endswith("smollm2-135m): 'tmas models' lists them")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--local-model", "--hf-model"])
def test_an_embedded_model_file_that_is_not_a_gguf_is_named_before_the_run_directory(tmp_path: Path, flag: str) -> None:
    # A checkpoint's weights (or any other file) given where a GGUF goes: the corrected command must not find a run
    # directory that "already holds a run".
    write_problems(tmp_path / "p.jsonl", 2)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    out = run_tmas("run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", flag, str(weights))
    assert out.returncode == 2, out.stderr.decode()
    setting = "local.model" if flag == "--local-model" else "hf.model"
    assert last_line(out) == (
        f"tmas: error: {setting} ({flag}) {weights} is not a GGUF model file (it does not start with b'GGUF')"
    )
    assert not (tmp_path / "run").exists()


def test_a_base_url_that_is_the_chat_completions_url_is_named_before_any_call(sim: SimServer, tmp_path: Path) -> None:
    # The address a server's docs give for chat completions, copied whole: tmas adds /chat/completions itself.
    write_problems(tmp_path / "p.jsonl", 2)
    given = f"{sim.base_url}/chat/completions"
    out = run_tmas("run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", given)
    assert out.returncode == 2, out.stderr.decode()
    assert last_line(out) == (
        f"tmas: error: {given}: the base URL ends in /chat/completions, which tmas adds to it;"
        f" give --base-url {sim.base_url}"
    )
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()


def test_no_model_named_on_vllm_is_said_before_any_call(sim: SimServer, tmp_path: Path) -> None:
    # With no --model, calls ask for "default", which a vLLM server refuses on every call: said once, up front.
    sim.set_script(SimScript(persona="vllm"))
    write_problems(tmp_path / "p.jsonl", 2)
    out = run_tmas(
        "run", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url
    )
    assert out.returncode == 2, out.stderr.decode()
    assert last_line(out) == (
        f"tmas: error: {sim.base_url} serves no model 'default', which tmas asks for when none is named: it serves"
        " sim-model; give --model sim-model ('tmas models' lists each endpoint's)"
    )
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("persona", "refused"), [("vllm", True), ("llama-server", False)])
def test_a_model_vllm_does_not_serve_is_named_before_any_call(
    sim: SimServer, tmp_path: Path, persona: PersonaName, refused: bool
) -> None:
    # vLLM answers a model name it does not serve with a 404 for every call; llama-server answers any name.
    sim.set_script(SimScript(persona=persona))
    write_problems(tmp_path / "p.jsonl", 2)
    args = ["-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url, "--model", "Qwen/Qwen3-4B"]
    out = run_tmas("run", str(tmp_path / "p.jsonl"), *args)
    if refused:
        assert out.returncode == 2, out.stderr.decode()
        assert last_line(out) == (
            f"tmas: error: {sim.base_url} serves no model 'Qwen/Qwen3-4B': it serves sim-model; give --model"
            " sim-model ('tmas models' lists each endpoint's)"
        )
        assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()
    else:
        assert out.returncode == 0, out.stderr.decode()


def test_an_eval_report_dir_that_is_its_run_directory_is_said_before_the_run(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl", 2)
    run = tmp_path / "run"
    out = run_tmas("eval", str(tmp_path / "p.jsonl"), "-o", str(run), "-m", "cot", "--grade", "rules",
                   "--report-dir", f"{run}/../run", "--base-url", sim.base_url)  # fmt: skip
    assert out.returncode == 2, out.stderr.decode()
    assert last_line(out) == (
        f"tmas: error: --report-dir {run}/../run is the run directory {run}: a report is not written among a"
        f" run's files (choose another, such as {run / 'report'})"
    )
    assert sim.stats().total_requests == 0 and not run.exists()


@pytest.mark.parametrize("below", ["", "/report"])
def test_an_eval_report_dir_that_cannot_be_one_is_said_before_the_run(
    sim: SimServer, tmp_path: Path, below: str
) -> None:
    # A file where the report's folder goes (or above it) failed only once the run and its grading were done.
    write_problems(tmp_path / "p.jsonl", 2)
    where = f"{tmp_path / 'p.jsonl'}{below}"
    out = run_tmas("eval", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot", "--grade", "rules",
                   "--report-dir", where, "--base-url", sim.base_url)  # fmt: skip
    assert out.returncode == 2, out.stderr.decode()
    said = (
        "a file, not a directory: the report is written into a directory"
        if not below
        else (f"{tmp_path / 'p.jsonl'} is a file, not a directory")
    )
    assert last_line(out) == f"tmas: error: --report-dir {where}: {said} (choose another)"
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()


def test_a_report_out_that_is_a_file_is_said_before_any_run_is_read(tmp_path: Path) -> None:
    given = tmp_path / "report.md"
    given.write_text("mine\n")
    out = run_tmas("report", str(tmp_path / "no-run"), "-o", str(given), "--grade", "rules")
    assert out.returncode == 2, out.stderr.decode()
    assert last_line(out) == (
        f"tmas: error: --out {given}: a file, not a directory: a report is written into a directory (choose another)"
    )
    assert given.read_text() == "mine\n"


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--judge-base-url", "judge:8000"], "bad value for --judge-base-url: 'judge:8000' is not an http(s) URL"),
        (["--judge-model", " "], "--judge-model is empty: give a value, or leave the flag out"),
    ],
)
def test_a_bad_judge_flag_is_said_in_one_line_before_the_run(
    sim: SimServer, tmp_path: Path, given: list[str], said: str
) -> None:
    # Before, the run went first and then ended in a traceback (a blank flag was read as not given: the run's model
    # judged).
    write_problems(tmp_path / "p.jsonl", 2)
    out = run_tmas("eval", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "run"), "-m", "cot",
                   "--base-url", sim.base_url, *given)  # fmt: skip
    assert out.returncode == 2, out.stderr.decode()
    assert out.stderr.decode().strip() == f"tmas: error: {said}"
    assert sim.stats().total_requests == 0 and not (tmp_path / "run").exists()
    out = run_tmas("report", str(tmp_path / "run"), "-o", str(tmp_path / "report"), *given)
    assert out.returncode == 2 and out.stderr.decode().strip() == f"tmas: error: {said}"


@pytest.mark.parametrize(("flag", "value"), [("--confirm-calls", "-1"), ("--confirm-tokens", "-5")])
def test_a_negative_confirmation_threshold_is_refused(sim: SimServer, flag: str, value: str) -> None:
    # Before, every estimate was over it: the command asked, or refused without a terminal, naming 'threshold -1'.
    out = run_tmas("solve", Q, "-m", "cot", "--base-url", sim.base_url, flag, value)
    assert out.returncode == 2
    assert last_line(out) == f"tmas: error: {flag} must be 0 or more (got {value}); --yes starts without asking"
    assert sim.stats().total_requests == 0


def test_judge_flags_of_a_report_that_grades_nothing_are_refused(tmp_path: Path) -> None:
    # Before, --no-grade read the stored grades and the judge's flags were dropped without a word.
    given = ["--judge-model", "j", "--base-url", "http://127.0.0.1:9/v1"]
    out = run_tmas("report", str(tmp_path / "run"), "-o", str(tmp_path / "report"), "--no-grade", *given)
    assert out.returncode == 2
    assert last_line(out) == (
        "tmas: error: --base-url, --judge-model: --no-grade reads stored grades and asks no judge; leave them out"
    )


@pytest.mark.parametrize("command", ["run", "solve", "eval"])
def test_a_new_run_into_a_directory_holding_one_names_the_command_that_continues_it(
    tmp_path: Path, command: str
) -> None:
    # tmas solve and tmas eval have no --resume: each names the command that has one, not a flag of its own.
    run_dir = tmp_path / "run"
    with RunStore(run_dir) as store:
        store.set_meta("settings", {})
    (tmp_path / "p.jsonl").write_text(json.dumps({"problem_id": "p1", "question": Q, "answer": "391"}) + "\n")
    given = {"run": [str(tmp_path / "p.jsonl")], "solve": [Q], "eval": [str(tmp_path / "p.jsonl"), "--grade", "rules"]}
    with dead_url() as dead:  # refused before any call
        out = run_tmas(command, *given[command], "-m", "cot", "-o", str(run_dir), "--base-url", dead, text=True)
    assert out.returncode == 2
    then = {"eval": f", then 'tmas report {run_dir} -o {run_dir / 'report'} --grade rules',"}.get(command, "")
    assert out.stderr.strip().splitlines() == [
        f"tmas: error: {run_dir}: already holds a run; continue it with 'tmas run --resume {run_dir}'{then} or choose"
        " another directory"
    ]
