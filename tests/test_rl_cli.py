"""The RL pipeline end to end on CPU, as a user runs it: a TMAS run on the simulated server, ``tmas rl build-data``,
``tmas rl train --model tiny`` (a model built from a config, the judge on the simulated server), and the export's
errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import settings_for
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.testing import SimServer


def tmas(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMAS_")}
    return subprocess.run(
        [sys.executable, "-m", "tmas", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


async def test_run_to_data_to_trained_checkpoint(sim: SimServer, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("pyarrow")
    problems = [Problem(problem_id="p1", question="What is 17*23?", answer="391")]
    settings = settings_for(sim, method={"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 2}})
    store, settings, todo = prepare_run(tmp_path / "run", settings, problems, resume=False)
    with store:
        await run_problems(settings, todo, store)
    data = tmp_path / "data.parquet"
    assert tmas("rl", "build-data", str(tmp_path / "run"), "-o", str(data)).returncode == 0
    config = tmp_path / "judge.toml"
    config.write_text(f'[roles.judge]\nbase_url = "{sim.base_url}"\n\n[endpoint]\nbase_url = "{sim.base_url}"\n')
    out = tmp_path / "out"
    args = ["--model", "tiny", "-o", str(out), "-c", str(config), "--no-vllm", "--max-steps", "1"]
    done = tmas("rl", "train", str(data), *args, "--num-generations", "2", "--max-completion-length", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()
    logged = [json.loads(line) for line in (out / "rewards.jsonl").read_text().splitlines()]
    # One step, one prompt group of two rollouts, scored by the task's reward.
    assert len(logged) == 2 and len({r["group"] for r in logged}) == 1
    assert all(r["reward"] in {-1.0, 1.0, 0.2, -0.5, 1.6} for r in logged)
    judged = [r for r in sim.requests if r.role == "judge"]
    assert len(judged) == (2 if logged[0]["task"] == "guideline" else 0)


def test_train_and_export_errors(tmp_path: Path) -> None:
    done = tmas("rl", "train", str(tmp_path / "none.parquet"), "-o", str(tmp_path / "o"), "--model", "tiny")
    assert done.returncode == 2 and "no such data file" in done.stderr
    done = tmas("rl", "export-gguf", str(tmp_path), "-o", str(tmp_path / "m.gguf"))
    assert done.returncode == 1 and "not a Hugging Face checkpoint" in done.stderr
