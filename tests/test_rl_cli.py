"""The RL pipeline end to end on CPU, as a user runs it: a TMAS run on the simulated server, ``tmas rl build-data``,
``tmas rl train --model tiny`` (a model built from a config, the judge on the simulated server), and the export's
errors."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env, run_tmas, settings_for
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.testing import Rule, SimScript, SimServer


def tmas(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return run_tmas(*args, text=True, timeout=timeout)


def verdict(novelty: int) -> str:
    return f'```json\n{{"identified_strategy": "s", "novelty": {novelty}, "same_as": null}}\n```'


def judge_calls(sim: SimServer) -> int:
    return len([r for r in sim.requests if r.role == "judge"])


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
async def test_run_to_data_to_lora_training_killed_and_resumed(sim: SimServer, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    pytest.importorskip("pyarrow")
    problems = [Problem(problem_id="p1", question="What is 17*23?", answer="391")]
    settings = settings_for(sim, method={"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 3}})
    store, settings, todo = prepare_run(tmp_path / "run", settings, problems, resume=False)
    with store:
        await run_problems(settings, todo, store)
    data = tmp_path / "data.parquet"
    # Exploration prompts only, so that every step asks the judge (which lets the test stop the run mid-step).
    assert tmas("rl", "build-data", str(tmp_path / "run"), "-o", str(data), "--mix", "0:0:1").returncode == 0
    config = tmp_path / "judge.toml"
    config.write_text(f'[roles.judge]\nbase_url = "{sim.base_url}"\n\n[endpoint]\nbase_url = "{sim.base_url}"\n')
    out = tmp_path / "out"
    args = ["rl", "train", str(data), "--model", "tiny", "-o", str(out), "-c", str(config), "--no-vllm"]
    args += ["--max-steps", "4", "--save-steps", "2", "--num-generations", "2", "--max-completion-length", "4"]
    args += ["--lora-rank", "4", "--learning-rate", "0.01"]

    # Two steps (two rollouts each, two judge calls) are answered; the third step's first call never is.
    sim.reset()
    sim.set_script(
        SimScript(
            rules=[
                Rule(role="judge", replies=[verdict(1), verdict(0)], times=4),
                Rule(role="judge", replies=[verdict(0)], latency_s=600),
            ]
        )
    )
    env = clean_env()
    log = tmp_path / "first.err"
    with log.open("w") as err:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tmas", *args, env=env, stderr=err)
        try:
            for _ in range(6000):  # the judge is asked for step 3 only once checkpoint-2 is written
                if judge_calls(sim) >= 5 or proc.returncode is not None:
                    break
                await asyncio.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
    first_err = log.read_text()
    assert judge_calls(sim) in (5, 6), first_err[-2000:]  # step 3 asks about its two rollouts at once
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert [r["step"] for r in rows(out / "steps.jsonl")] == [1, 2]
    assert (out / "rewards.png").is_file()  # drawn at the checkpoint

    sim.set_script(SimScript(rules=[Rule(role="judge", replies=[verdict(1), verdict(0)])]))
    done = tmas(*args)  # OUT holds a stopped run: starting again without --resume is refused
    assert done.returncode == 2 and "holds checkpoint-2 of a stopped run: pass --resume" in done.stderr
    done = tmas(*args, "--resume")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resuming from {out / 'checkpoint-2'}" in done.stdout
    # The resumed run trained steps 3 and 4 only (its progress lines), and every step is logged once.
    assert "step 3/4" in done.stderr and "step 4/4" in done.stderr and "step 1/4" not in done.stderr
    steps = rows(out / "steps.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["guideline/rollouts"] == 2 and r["guideline/novel"] is not None for r in steps)
    assert sorted({r["step"] for r in rows(out / "rewards.jsonl")}) == [0, 1, 2, 3]
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    # A LoRA run's result is the adapter and the base it adapts (the tiny model, saved since it was built).
    final = out / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "config.json").exists()
    assert json.loads((final / "tmas_base.json").read_text()) == {"model": str((out / "base").resolve())}


@pytest.mark.slow
def test_train_and_export_errors(tmp_path: Path) -> None:
    done = tmas("rl", "train", str(tmp_path / "none.parquet"), "-o", str(tmp_path / "o"), "--model", "tiny")
    assert done.returncode == 2 and "no such data file" in done.stderr
    done = tmas("rl", "pilot", str(tmp_path / "none.parquet"), "-o", str(tmp_path / "k.parquet"), "--model", "tiny")
    assert done.returncode == 2 and f"{tmp_path / 'none.parquet'}: no such data file" in done.stderr
    done = tmas("rl", "export-gguf", str(tmp_path), "-o", str(tmp_path / "m.gguf"))
    assert done.returncode == 1 and "not a Hugging Face checkpoint (no config.json) nor a LoRA adapter" in done.stderr
    # A JSONL where the parquet goes, and an odd number of rollouts a group: said before any model loads.
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "q", "answer": "1"}\n', encoding="utf-8")
    done = tmas("rl", "pilot", str(problems), "-o", str(tmp_path / "k.parquet"), "--model", "tiny")
    assert done.returncode == 2 and "not a parquet file of 'tmas rl build-data'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # the one line, no reader's log before it
    done = tmas("rl", "pilot", str(problems), "-o", str(tmp_path / "k.parquet"), "--model", "tiny", "--samples", "3")
    assert done.returncode == 2 and "--samples 3 is odd" in done.stderr
    done = tmas("rl", "export-gguf", str(tmp_path), "-o", str(tmp_path / "m.gguf"), "--outtype", "foo")
    assert done.returncode == 2 and "--outtype 'foo': choose f32" in done.stderr
