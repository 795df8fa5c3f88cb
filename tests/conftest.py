"""Shared fixtures: simulated OpenAI-compatible servers on loopback, settings pointing at them, and the command line
run as a user runs it."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tmas.config import Settings
from tmas.testing import SimScript, SimServer


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimScript()) as server:
        yield server


@pytest.fixture
def sim2() -> Iterator[SimServer]:
    with SimServer(SimScript(model="sim-two")) as server:
        yield server


def settings_for(*servers: SimServer, **overrides: Any) -> Settings:
    """Settings whose default endpoint is the given server(s), with fast retries so fault tests stay quick."""
    return _settings([s.base_url for s in servers], overrides)


def config_file(sim: SimServer, tmp_path: Path, body: str = "") -> Path:
    """A config file (``run.toml`` in ``tmp_path``) whose default endpoint is ``sim``, with ``body`` (TOML) after it."""
    path = tmp_path / "run.toml"
    path.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\n{body}', encoding="utf-8")
    return path


def scripted_settings(**overrides: Any) -> Settings:
    """The same settings for an in-process :class:`tmas.testing.ScriptedModel` (its endpoint is never called; it is
    named so that the settings are an endpoint's, not the embedded model's)."""
    return _settings([SCRIPTED_URL], overrides)


SCRIPTED_URL = "http://scripted.invalid/v1"


def _settings(base_urls: list[str], overrides: dict[str, Any]) -> Settings:
    data: dict[str, Any] = {
        "endpoint": {"base_url": base_urls, "model": "sim-model", "timeout_s": 5},
        "retry": {"max_attempts": 4, "backoff_base_s": 0.01, "backoff_max_s": 0.05},
        "sampling": {"temperature": 0.7, "max_tokens": 256},
    }
    for key, value in overrides.items():
        node = data
        *parents, last = key.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return Settings.model_validate(data)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # A new connection per request: the llama-server persona closes its side after a stream, as llama-server does.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


@contextmanager
def dead_url() -> Iterator[str]:
    """An endpoint URL on loopback where every connection is refused, for the block: its port is held bound but not
    listening, so no other process can start listening there meanwhile (a port merely found free and let go can be
    taken by another test's server before it is used)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}/v1"


async def eventually(condition: Callable[[], bool], tries: int = 400) -> None:
    """Poll ``condition`` (for state another thread changes); fail after ``tries`` polls."""
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.025)
    raise AssertionError("condition never became true")


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` (for state another thread or process changes) from a synchronous test; fail naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any ``TMAS_*`` variable, so that a child's settings come from its
    arguments (and ``extra``) alone, whatever the machine running the tests has set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMAS_")}
    return {**env, **(extra or {})}


def run_tmas(
    *args: str,
    text: bool = False,
    stdin: bytes | str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[Any]:
    """``python -m tmas ARGS`` in a child process (:func:`clean_env`, plus ``env``), its output captured. Its stdin
    is a pipe, never a terminal, so a confirmation gate fails rather than waits."""
    given = stdin if stdin is not None else ("" if text else b"")
    return subprocess.run(
        [sys.executable, "-m", "tmas", *args],
        input=given,
        capture_output=True,
        text=text,
        env=clean_env(env),
        cwd=cwd,
        timeout=timeout,
    )


def isolate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No ``./tmas.toml`` and no ``TMAS_*`` variable reaches settings read in this process (an in-process CLI
    call): the working directory is an empty folder of ``tmp_path``."""
    workdir = tmp_path / "cwd"
    workdir.mkdir(exist_ok=True)
    monkeypatch.chdir(workdir)
    for var in [v for v in os.environ if v.startswith("TMAS_")]:
        monkeypatch.delenv(var)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint cache (``TMAS_CACHE_DIR``) the session's tests share: the embedded GGUF, dequantised into it by
    the first test that loads it (a minute or two), is read from it by every later one."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """:func:`isolate` as a fixture."""
    isolate(monkeypatch, tmp_path)
