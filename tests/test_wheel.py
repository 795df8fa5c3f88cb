"""The wheel as users install it: built from this tree, installed with the core dependencies only into a fresh venv,
and run against the simulated upstream (served by this test's interpreter, which has the dev install).

Every command that needs an extra must end, without it, with one line naming the extra to install.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import clean_env
from tmas.testing import SimScript, SimServer

# Every test here installs the built wheel in a fresh virtual environment first.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = [
    {"problem_id": "p1", "question": "What is 17*23?", "answer": "391"},
    {"problem_id": "p2", "question": "What is 6*7?", "answer": "42"},
]
# Modules of the extras: none may come with the core install (torch above all: a multi-GB download).
EXTRA_MODULES = ["uvicorn", "starlette", "numpy", "faiss", "torch", "transformers", "math_verify", "matplotlib"]


class Installed:
    """The wheel's fresh venv."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmas = root / "bin" / "tmas"
        self.python = root / "bin" / "python"

    def run(self, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        # No TMAS_* variable of the developer's may reach it: the commands read only their flags.
        env = clean_env()
        env["NO_COLOR"] = "1"
        return subprocess.run(
            [str(self.tmas), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )


def _pip(python: Path | str, *args: str) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "--quiet", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    # pip builds the wheel (hatchling in an isolated build environment, from pip's cache after the first time).
    _pip(sys.executable, "wheel", "--no-deps", "--wheel-dir", str(dist), str(REPO))
    [wheel] = dist.glob("tmas-*.whl")
    venv.EnvBuilder(with_pip=True, clear=True).create(root / "venv")
    target = Installed(root / "venv")
    _pip(target.python, "install", str(wheel))
    return target


@pytest.fixture(scope="module")
def upstream() -> Iterator[SimServer]:
    with SimServer(SimScript()) as server:
        yield server


@pytest.fixture(scope="module")
def problems_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("problems") / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def test_the_core_install_holds_no_extra(installed: Installed) -> None:
    probe = (
        "import importlib.util, json, sys; print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m)]))"
    )
    done = subprocess.run(
        [str(installed.python), "-c", probe, *EXTRA_MODULES], capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == []


def test_help_lists_the_commands(installed: Installed, tmp_path: Path) -> None:
    done = installed.run("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for command in ("solve", "run", "eval", "serve", "view", "pool", "rl"):
        assert command in done.stdout


def test_solve_answers_through_the_upstream(installed: Installed, upstream: SimServer, tmp_path: Path) -> None:
    upstream.reset()
    done = installed.run(
        "solve", "--base-url", upstream.base_url, "--model", "sim-model", "--method", "cot", "What is 17*23?",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "391"
    [body] = upstream.chat_bodies()
    assert body["model"] == "sim-model"
    assert "What is 17*23?" in json.dumps(body["messages"])


def test_run_solves_a_problem_file_into_a_run_directory(
    installed: Installed, upstream: SimServer, problems_file: Path, tmp_path: Path
) -> None:
    upstream.reset()
    out = tmp_path / "run"
    done = installed.run(
        "run", str(problems_file), "--out", str(out), "--base-url", upstream.base_url, "--model", "sim-model",
        "--method", "tmas", "--param", "n=2", "--param", "m=1", "--iterations", "1", "--temperature", "0.3", "--yes",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (out / "run.sqlite").is_file()
    bodies = upstream.chat_bodies()
    # Each problem: two candidates and one verification of each, at the flag's temperature.
    assert len(upstream.chat_bodies("solution")) == 4 and len(upstream.chat_bodies("verifier")) == 4
    assert all(b["model"] == "sim-model" and b["temperature"] == 0.3 for b in bodies)
    asked = " ".join(json.dumps(b["messages"]) for b in upstream.chat_bodies("solution"))
    assert "What is 17*23?" in asked and "What is 6*7?" in asked
    exported = installed.run("export", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    answers = {r["problem_id"]: r["answer"] for r in map(json.loads, exported.stdout.splitlines())}
    assert answers == {"p1": "391", "p2": "42"}


@pytest.fixture(scope="module")
def run_dir(
    installed: Installed, upstream: SimServer, problems_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("made") / "run"
    done = installed.run(
        "run", str(problems_file), "--out", str(out), "--base-url", upstream.base_url, "--model", "sim-model",
        "--method", "tmas", "--param", "n=2", "--param", "m=1", "--iterations", "1", "--yes", cwd=out.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


# Each command that needs an extra, run without it: (arguments, the extra named). RUN stands for a finished TMAS run.
NEEDS_EXTRA: list[tuple[list[str], str]] = [
    (["serve", "--base-url", "UPSTREAM", "--model", "sim-model"], "serve"),
    (["view", "RUN"], "serve"),
    (["eval", "PROBLEMS", "--out", "ev", "--base-url", "UPSTREAM", "--model", "sim-model", "-m", "cot", "-y"], "eval"),
    (["report", "RUN", "--out", "report"], "eval"),
    (
        [
            "sweep",
            "--problems",
            "PROBLEMS",
            "-m",
            "cot",
            "-o",
            "sw",
            "--base-url",
            "UPSTREAM",
            "--model",
            "sim-model",
            "-y",
        ],
        "eval",
    ),
    (["data", "filter", "PROBLEMS", "--out", "f.jsonl", "--base-url", "UPSTREAM", "--model", "sim-model"], "eval"),
    (["pool", "build", "RUN", "--out", "pool"], "pool"),
    (["pool", "show", "pool"], "pool"),
    (["pool", "prune", "pool"], "pool"),
    (["experience", "search", "pool", "a question"], "pool"),
    (["pool", "router", "train", "--single", "RUN", "--mattrl", "RUN", "--out", "router.json"], "eval"),
    (["rl", "build-data", "RUN", "--out", "rl"], "rl"),
    (["data", "import", "hle", "data.parquet", "--out", "imported.jsonl"], "rl"),
    (["rl", "train", "data.parquet", "--out", "trained"], "rl"),
    (["rl", "export-gguf", "checkpoint", "--out", "model.gguf"], "rl"),
    # No endpoint: the embedded model, whose server and weights are the local extra.
    (["solve", "What is 1+1?"], "local"),
]


@pytest.mark.parametrize(("args", "extra"), NEEDS_EXTRA, ids=[" ".join(a[:2]) for a, _ in NEEDS_EXTRA])
def test_a_missing_extra_is_one_line_naming_it(
    installed: Installed,
    upstream: SimServer,
    problems_file: Path,
    run_dir: Path,
    tmp_path: Path,
    args: list[str],
    extra: str,
) -> None:
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    where = {"UPSTREAM": upstream.base_url, "RUN": str(run_dir), "PROBLEMS": str(problems_file)}
    upstream.reset()
    done = installed.run(*[where.get(a, a) for a in args], cwd=tmp_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    # The cost gate's one line of estimate may come first (solve says it before anything starts).
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("tmas: estimate: ")]
    assert len(lines) == 1 or (args[0] == "solve" and len(lines) == 2), done.stderr
    assert lines[-1].startswith("tmas: error: ") and f"pip install 'tmas[{extra}]'" in lines[-1], done.stderr
    # Found before any model call: nothing was spent upstream.
    assert upstream.chat_bodies() == []
