"""Ctrl-C and SIGTERM stop a run cleanly: its calls in flight are closed, every finished call is kept, the last line
says how to go on, the exit code is 130 or 143; and the resumed run sends no call it had finished. As a user runs it,
against the simulated server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env, isolate, run_tmas, wait_for
from tmas.cli import entry, estimate, interrupt
from tmas.cli import main as cli_main
from tmas.llm import preflight
from tmas.testing import SimScript, SimServer

PROBLEMS, K, T = 3, 2, 6


def write_problems(path: Path) -> None:
    lines = [json.dumps({"problem_id": f"p{i}", "question": f"What is {i + 2}*7?"}) for i in range(PROBLEMS)]
    path.write_text("\n".join(lines) + "\n")


def stored_calls(run_dir: Path) -> int:
    """Answered calls in the run's store (0 while it is being made)."""
    try:
        db = sqlite3.connect(run_dir / "run.sqlite")
        try:
            return int(db.execute("SELECT COUNT(*) FROM calls WHERE error IS NULL").fetchone()[0])
        finally:
            db.close()
    except sqlite3.OperationalError:
        return 0


def default_sigint() -> None:
    # A child started from a non-interactive shell's background job inherits SIGINT ignored: give it Ctrl-C back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("signum", "code", "name"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_a_signal_stops_the_run_cleanly_and_the_resume_repeats_no_call(
    tmp_path: Path, signum: int, code: int, name: str
) -> None:
    write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "run"
    # The server answers 4 calls and holds the next: the signal comes while the run waits on them, 4 calls stored.
    with SimServer(SimScript(hold_after=4)) as sim:
        args = ["run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "-m", "majority", "-p", f"k={K}", "-T", str(T)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "tmas", *args, "--base-url", sim.base_url],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=default_sigint,
        )

        def held_with_answers_stored() -> bool:
            assert proc.poll() is None, "the run ended before it was stopped"
            return sim.stats().held > 0 and stored_calls(run_dir) == 4

        wait_for(held_with_answers_stored, "the run to store 4 calls and wait on the next")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        lines = err.decode().strip().splitlines()
        assert proc.returncode == code, err.decode()
        assert lines[-1].startswith(f"tmas: stopped by {name}; finished work is kept")
        assert lines[-1].endswith(f"continue with 'tmas run --resume {run_dir}'")
        # The calls in flight were closed, not left running on the server (a request written just before the
        # stop can still reach it after the process is gone: its handler ends when it finds the client gone).
        wait_for(lambda: sim.stats().in_flight == 0, "the held calls to end on the server")
    kept = stored_calls(run_dir)
    assert kept == 4

    # The resume talks to a server of its own, so that the count below holds its requests alone.
    with SimServer(SimScript(latency_s=0.15)) as sim:
        out = run_tmas("run", "--resume", str(run_dir), "--base-url", sim.base_url, timeout=120)
        assert out.returncode == 0, out.stderr.decode()
        assert ": iteration " not in out.stderr.decode()  # replayed iterations are not said as new ones
        summary = json.loads(out.stdout)
        sent_after = sim.stats().total_requests
    # Every finished call came from the store; what was sent is exactly what was missing.
    assert summary["done"] == PROBLEMS and summary["replayed_calls"] == kept
    assert summary["calls"] == sent_after == PROBLEMS * K * T - kept
    assert stored_calls(run_dir) == PROBLEMS * K * T


def test_a_second_ctrl_c_cuts_the_wind_down_short_and_still_says_what_was_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wound_down: list[str] = []

    async def work() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(3600)
        finally:
            # A wind-down that would take long (a local server's grace period): the second Ctrl-C comes meanwhile.
            os.kill(os.getpid(), signal.SIGINT)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                wound_down.append("cut short")
                raise

    before = signal.getsignal(signal.SIGINT)
    # Started as a background job (a CI runner's), the process inherits SIGINT ignored, which run() keeps ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(interrupt.Stopped) as stopped:
            interrupt.run(work())
    finally:
        signal.signal(signal.SIGINT, before)
    assert wound_down == ["cut short"]
    # A Stopped as after one Ctrl-C: the command adds what was kept and how to go on, and exits 130.
    assert stopped.value.exit_code == 130
    assert stopped.value.saying("continue").line() == "tmas: stopped by Ctrl-C; continue"
    # No "unhandled exception during asyncio.run() shutdown" with a traceback.
    assert not caplog.records


@pytest.mark.parametrize("command", ["eval", "sweep"])
def test_a_signal_while_the_report_is_graded_says_how_to_write_it(tmp_path: Path, command: str) -> None:
    # The problems are solved (3 calls, one each); the judge's first call is held, and the signal comes then.
    lines = [json.dumps({"problem_id": f"p{i}", "question": f"What is {i + 2}*7?", "answer": str((i + 2) * 7)})
             for i in range(PROBLEMS)]  # fmt: skip
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    grading = ["--grade", "judge", "--judge-runs", "1"]
    if command == "eval":
        args = ["eval", str(tmp_path / "p.jsonl"), "-o", str(out), "-m", "cot", *grading]
        then = f"the run is kept: write its report with 'tmas report {out} -o {out / 'report'} {' '.join(grading)}'"
    else:
        grid = tmp_path / "grid.toml"
        grid.write_text(f'problems = "{tmp_path / "p.jsonl"}"\n[[study]]\nname = "cot"\nmethod = "cot"\n')
        args = ["sweep", str(grid), "--out", str(out), *grading]
        then = f"every point is kept: write the report with 'tmas sweep --resume {out} {' '.join(grading)}'"
    with SimServer(SimScript(hold_after=PROBLEMS)) as sim:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tmas", *args, "--base-url", sim.base_url],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

        def judge_held() -> bool:
            assert proc.poll() is None, "the command ended before it was stopped"
            return sim.stats().held > 0

        wait_for(judge_held, "the report's first judge call to be held")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()
    assert err.decode().strip().splitlines()[-1] == f"tmas: stopped by SIGTERM; {then}"
    # The command said writes the report, sending none of the problems' calls again.
    with SimServer(SimScript()) as sim:
        again = run_tmas(*then.split("'")[1].split()[1:], "--base-url", sim.base_url, timeout=120)
        assert again.returncode == 0, again.stderr.decode()
        assert sim.stats().total_requests == PROBLEMS  # the judge's, one a problem
    assert (out / "report" / "report.md").exists()


@pytest.fixture
def own_signals() -> Iterator[None]:
    """The test process's own SIGINT and SIGTERM handlers back after an in-process command installed its own."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _ctrl_c(*args: Any, **kwargs: Any) -> None:
    raise interrupt.Stopped(signal.SIGINT)


async def _ctrl_c_while_probing(*args: Any, **kwargs: Any) -> None:
    raise interrupt.Stopped(signal.SIGINT)


@pytest.mark.parametrize("stopped_in", ["the cost gate", "the endpoint check"])
@pytest.mark.usefixtures("own_signals")
def test_ctrl_c_before_a_run_began_says_nothing_was_started(
    sim: SimServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    stopped_in: str,
) -> None:
    # Before, a Ctrl-C at the gate's question (or while the endpoint was probed) said "finished work is kept" of a
    # run that had not begun.
    write_problems(tmp_path / "p.jsonl")
    out = tmp_path / "run"
    isolate(monkeypatch, tmp_path)
    if stopped_in == "the cost gate":
        monkeypatch.setattr(estimate, "gate", _ctrl_c)
    else:
        monkeypatch.setattr(preflight, "check_endpoints", _ctrl_c_while_probing)
    args = ["run", str(tmp_path / "p.jsonl"), "-o", str(out), "-m", "cot", "--base-url", sim.base_url, "--yes"]
    monkeypatch.setattr(sys, "argv", ["tmas", *args])
    with pytest.raises(SystemExit) as ended:
        cli_main.main()
    assert ended.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "tmas: stopped by Ctrl-C; nothing was started"
    assert sim.requests == []
    assert not out.exists()


class _CtrlCOnImport:
    """A finder that meets ``tmas.cli.main`` with a Ctrl-C, as one pressed while the command's modules load."""

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "tmas.cli.main":
            raise KeyboardInterrupt
        return None


def test_ctrl_c_while_the_command_is_imported_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, the entry point imported the command outside any handler: a traceback of the import ending in
    # KeyboardInterrupt, and exit code 1.
    monkeypatch.delitem(sys.modules, "tmas.cli.main")
    monkeypatch.setattr(sys, "meta_path", [_CtrlCOnImport(), *sys.meta_path])
    with pytest.raises(SystemExit) as ended:
        entry.main()
    assert ended.value.code == 130
    assert capsys.readouterr().err.splitlines() == ["tmas: stopped by Ctrl-C; nothing was started"]
