"""Ctrl-C and SIGTERM stop `tmas serve` and `tmas view` with a last line that says what a stop leaves: the proxy's
runs cut short are kept and resumable, the viewer wrote nothing. As a user runs them, each in a process of its own."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from conftest import clean_env, wait_for
from tmas.store.run_store import RunStore
from tmas.testing import SimScript, SimServer
from tmas.testing.web_servers import free_port
from web_helpers import get

SIGNALS = [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")]


def default_sigint() -> None:
    # A child started from a non-interactive shell's background job inherits SIGINT ignored: give it Ctrl-C back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def tmas_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """``python -m tmas ARGS`` in a process of its own, and the lines of its standard error as they come."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tmas", *args],
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stderr), daemon=True)
    reader.start()
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        reader.join(timeout=60)


def stopped(proc: subprocess.Popen[str], lines: list[str], signum: int) -> list[str]:
    """Send ``signum`` to the running command and wait for its end; its standard error's lines."""
    assert proc.poll() is None, "\n".join(lines)
    proc.send_signal(signum)
    proc.wait(timeout=120)
    return lines


@pytest.mark.parametrize(("signum", "code", "name"), SIGNALS)
def test_a_stopped_proxy_says_its_runs_are_kept_and_how_they_resume(
    tmp_path: Path, signum: int, code: int, name: str
) -> None:
    # Before, the proxy ended on "tmas: stopped by SIGTERM; nothing was started", a request's run cut short with it.
    serve_dir = tmp_path / "served"
    port = free_port()
    with SimServer(SimScript(hold_after=0)) as sim:
        args = ["serve", "--base-url", sim.base_url, "--model", "sim-model", "--port", str(port)]
        with tmas_process(*args, "--dir", str(serve_dir)) as (proc, lines):
            wait_for(lambda: any("Uvicorn running on" in line for line in lines) or proc.poll() is not None, "listen")
            body = {"model": "cot/sim-model", "messages": [{"role": "user", "content": "What is 17*23?"}]}
            asking = threading.Thread(
                target=lambda: httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
            )
            asking.start()
            wait_for(lambda: sim.stats().held > 0 or proc.poll() is not None, "the request's call to be held")
            stopped(proc, lines, signum)
            asking.join()
    assert proc.returncode == code, "\n".join(lines)
    assert lines[-1] == (
        f"tmas: stopped by {name}; finished work is kept: each request's run is in {serve_dir}; started again with"
        f" --dir {serve_dir}, tmas serve resumes those cut short"
    )
    # What the line says: the request's run is there, unfinished, its question stored for the server to resume.
    [run_dir] = [p for p in serve_dir.iterdir() if (p / "run.sqlite").is_file()]
    with RunStore(run_dir, read_only=True) as store:
        assert store.results() == [] and [p.question for p in store.problems()] == ["What is 17*23?"]


def test_a_proxy_started_without_resume_says_a_run_resumes_as_its_request_comes_again(tmp_path: Path) -> None:
    serve_dir = tmp_path / "served"
    port = free_port()
    with SimServer(SimScript()) as sim:
        args = ["serve", "--base-url", sim.base_url, "--model", "sim-model", "--port", str(port), "--no-resume"]
        with tmas_process(*args, "--dir", str(serve_dir)) as (proc, lines):
            wait_for(lambda: any("Uvicorn running on" in line for line in lines) or proc.poll() is not None, "listen")
            stopped(proc, lines, signal.SIGTERM)
    assert proc.returncode == 143, "\n".join(lines)
    assert lines[-1] == (
        f"tmas: stopped by SIGTERM; finished work is kept: each request's run is in {serve_dir}; one cut short"
        " resumes when its request is sent again"
    )


@pytest.mark.parametrize(("signum", "code", "name"), SIGNALS)
def test_a_stopped_viewer_says_it_wrote_nothing(tmp_path: Path, signum: int, code: int, name: str) -> None:
    # Before, a viewer that had been serving pages ended on "nothing was started".
    (tmp_path / "runs").mkdir()
    port = free_port()
    with tmas_process("view", str(tmp_path / "runs"), "--port", str(port)) as (proc, lines):

        def answers() -> bool:
            assert proc.poll() is None, "\n".join(lines)
            try:
                return get(f"http://127.0.0.1:{port}/")[0] == 200
            except OSError:
                return False

        wait_for(answers, "the viewer to answer")
        stopped(proc, lines, signum)
    assert proc.returncode == code, "\n".join(lines)
    assert lines[-1] == f"tmas: stopped by {name}; the viewer has stopped (it writes nothing to the runs it shows)"
    assert not any("Traceback" in line for line in lines)
