"""EleutherAI's lm-evaluation-harness through `tmas serve`: its `local-chat-completions` model, 8 requests at once,
against the proxy on the simulated upstream, with the task `tmas data lm-eval-task` writes (the recipe of
docs/serve.md, run as a user runs it: lm-eval's own command line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import settings_for
from tmas.data.lm_eval_task import write_task
from tmas.problems import Problem
from tmas.serve.launch import ServeOptions
from tmas.testing import SimServer
from web_helpers import ProxyThread, get

PROBLEMS = [
    Problem(problem_id=f"q{i}", question=f"What is {a}*{b}?", answer=str(a * b))
    for i, (a, b) in enumerate((3 + i, 7 + 2 * i) for i in range(20))
]
TMAS_PARAMS = {"n": 2, "m": 1, "iterations": 1}
TOKEN = "lm-eval-test-token"


def lm_eval(model: str, proxy: ProxyThread, task_dir: Path, out: Path, *extra: str) -> dict[str, Any]:
    """``lm_eval run`` with ``local-chat-completions`` on ``model``; its results JSON."""
    args = [
        "--model", "local-chat-completions",
        "--model_args", f"model={model},base_url={proxy.url}/v1/chat/completions,num_concurrent=8,max_retries=1",
        "--tasks", "tmas_arith", "--include_path", str(task_dir), "--apply_chat_template",
        "--output_path", str(out), "--log_samples", *extra,
    ]  # fmt: skip
    # No hub, no network: the task's documents are a local JSON file; the datasets cache stays in the test's folder.
    env = {**os.environ, "HF_HOME": str(out / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    # local-chat-completions sends OPENAI_API_KEY as its bearer token: the proxy's, here.
    env["OPENAI_API_KEY"] = TOKEN
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    [results] = out.rglob("results_*.json")
    data: dict[str, Any] = json.loads(results.read_text())
    return data


def metric_value(proxy: ProxyThread, method: str, status: str) -> float:
    status_code, page = get(f"{proxy.url}/metrics")
    assert status_code == 200
    line = f'tmas_requests_total{{method="{method}",status="{status}"}} '
    found = [float(row.split()[-1]) for row in page.decode().splitlines() if row.startswith(line)]
    return found[0] if found else 0.0


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    write_task(PROBLEMS, tmp_path / "task", "tmas_arith", max_gen_toks=700, temperature=0.5)
    return tmp_path / "task"


@pytest.mark.slow
def test_lm_eval_scores_cot_and_tmas_through_the_proxy(
    sim: SimServer, task_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The proxy wants a bearer token, as it does beyond loopback.
    monkeypatch.setenv("TMAS_LM_EVAL_TOKEN", TOKEN)
    options = ServeOptions(serve_dir=tmp_path / "served", max_problems=4, token_env="TMAS_LM_EVAL_TOKEN")
    with ProxyThread(settings_for(sim), options) as proxy:
        cot = lm_eval("cot/sim-model", proxy, task_dir, tmp_path / "cot")
        cot_bodies = sim.chat_bodies()
        sim.reset()
        # Method parameters ride in the body's `tmas` object: lm-eval sends what --gen_kwargs holds.
        tmas = lm_eval(
            "tmas/sim-model", proxy, task_dir, tmp_path / "tmas", "--gen_kwargs", json.dumps({"tmas": TMAS_PARAMS})
        )
        tmas_bodies = sim.chat_bodies()
        served = {"cot": metric_value(proxy, "cot", "200"), "tmas": metric_value(proxy, "tmas", "200")}

    for results in (cot, tmas):
        scores = results["results"]["tmas_arith"]
        assert scores["exact_match,boxed"] == 1.0
        assert results["n-samples"]["tmas_arith"]["effective"] == 20
    # Every question answered through the proxy, each one run.
    assert served == {"cot": 20, "tmas": 20}
    assert len(list((tmp_path / "served").glob("chatcmpl-*"))) == 40

    # What reached the upstream: one CoT call a question; two TMAS candidates and a verification of each.
    assert len(cot_bodies) == 20
    asked = [json.dumps(b["messages"]) for b in cot_bodies]
    assert all(sum(json.dumps(p.question)[1:-1] in text for text in asked) == 1 for p in PROBLEMS)
    assert len([b for b in tmas_bodies if b["max_tokens"] == 700]) >= 40
    assert len(sim.chat_bodies("solution")) == 40 and len(sim.chat_bodies("verifier")) == 40
    for body in cot_bodies + tmas_bodies:
        # The task's sampling: max_gen_toks and temperature became every call's defaults ...
        assert body["model"] == "sim-model" and body["temperature"] == 0.5
        # ... lm-eval's seed (1234) is the run's seed, from which each call's own is derived ...
        assert isinstance(body.get("seed"), int)
        # ... and a stop sequence never reaches a method's call.
        assert "stop" not in body
    assert all(b["max_tokens"] == 700 for b in cot_bodies)
    solution_seeds = [b["seed"] for b in sim.chat_bodies("solution")]
    assert len(set(solution_seeds)) > 1  # the two candidates of a question were not asked for the same sample
