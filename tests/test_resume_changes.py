"""A resume that would ask other requests than the run's finished problems were solved with (another model, sampling,
seed or prompt template) is refused in one line before any call, where those problems would keep their results: the
run would otherwise hold results of two configurations under one record of its settings. A change that re-solves
every finished problem (other method parameters) is a resume as before."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from conftest import run_tmas
from tmas.store.run_store import RunStore
from tmas.testing import SimScript, SimServer

pytestmark = pytest.mark.slow


def tmas(*args: str) -> subprocess.CompletedProcess[str]:
    return run_tmas(*args, text=True, timeout=120)


def write_problems(path: Path) -> None:
    path.write_text(
        "".join(
            json.dumps({"problem_id": f"p{k}", "question": f"What is {k + 2}*7?", "answer": str(7 * (k + 2))}) + "\n"
            for k in range(2)
        ),
        encoding="utf-8",
    )


def stopped_before_p1(run_dir: Path) -> None:
    """The run as a stop leaves it when p0 had finished and p1 had not begun."""
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'p1'")
        db.execute("DELETE FROM calls WHERE problem_id = 'p1'")


def test_a_resume_asking_other_requests_is_refused_while_a_finished_problem_would_keep_its_result(
    sim: SimServer, tmp_path: Path
) -> None:
    write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "run"
    made = tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "--base-url", sim.base_url, "-m", "majority")
    assert made.returncode == 0, made.stderr
    stopped_before_p1(run_dir)
    before = tmas("export", str(run_dir)).stdout
    sim.reset()
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "system_math.j2").write_text("You are a mathematician. Work the problem out step by step.\n")
    changes = {
        "solution temperature 0.7 (now 0.3)": ["--temperature", "0.3"],
        "solution max_tokens 2048 (now 99)": ["--max-tokens", "99"],
        'solution model unset (now "other")': ["--model", "other"],
        "seed 0 (now 5)": ["--seed", "5"],
        "prompt template system_math.j2 unset (now ": ["--prompts-dir", str(prompts)],
    }
    for said, flags in changes.items():
        refused = tmas("run", "--resume", str(run_dir), *flags, "-y")
        assert refused.returncode == 2, refused.stderr
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith(f"tmas: error: {run_dir}: 1 finished problem was solved with {said}"), last
    # Nothing was asked, and the run is as it was: its settings say what its finished result was solved with.
    assert sim.requests == []
    assert tmas("export", str(run_dir)).stdout == before
    with RunStore(run_dir, read_only=True) as store:
        assert store.get_meta("settings")["sampling"]["temperature"] == 0.7
        assert store.get_meta("prompt_overrides") == {}

    # Resumed as it was made (a concurrency is no part of any request): p1 is asked at the run's own sampling.
    resumed = tmas("run", "--resume", str(run_dir), "--concurrency", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert {(r.body["temperature"], r.body["max_tokens"]) for r in sim.requests} == {(0.7, 2048)}
    assert {r.body["messages"][-1]["content"].count("What is 3*7?") for r in sim.requests} == {1}
    assert [json.loads(line)["problem_id"] for line in tmas("export", str(run_dir)).stdout.splitlines()] == [
        "p0",
        "p1",
    ]


def test_a_resume_that_solves_every_finished_problem_again_may_change_the_sampling(
    sim: SimServer, tmp_path: Path
) -> None:
    write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "run"
    args = ("--base-url", sim.base_url, "-m", "majority", "-p", "k=2", "-T", "1")
    assert tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), *args).returncode == 0
    stopped_before_p1(run_dir)
    sim.reset()
    # Another iteration target re-solves p0 too: every result is then of the new temperature.
    resumed = tmas("run", "--resume", str(run_dir), "-T", "2", "--temperature", "0.3")
    assert resumed.returncode == 0, resumed.stderr
    assert len(sim.requests) == 2 * 2 * 2 and {r.body["temperature"] for r in sim.requests} == {0.3}
    assert (
        "tmas: resumed with other method parameters (iterations 1 (now 2)): the run's 1 finished problem is"
        " solved again under them, their stored calls replayed where asked alike"
    ) in resumed.stderr


def test_a_finished_sweep_point_is_not_skipped_under_other_requests(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl")
    out = tmp_path / "sweep"
    args = ("--problems", str(tmp_path / "p.jsonl"), "-m", "cot", "--base-url", sim.base_url, "--no-report")
    assert tmas("sweep", "-o", str(out), *args).returncode == 0
    sim.reset()
    refused = tmas("sweep", "--resume", str(out), "--no-report", "--temperature", "0.3")
    assert refused.returncode == 2, refused.stderr
    assert "2 finished problems were solved with solution temperature 0.7 (now 0.3)" in refused.stderr
    assert sim.requests == []


def test_a_sweep_point_refused_for_changed_requests_runs_no_pilot_and_asks_no_cost_question_first(
    sim: SimServer, tmp_path: Path
) -> None:
    """The refusal comes before the estimate: a pilot would send calls for a sweep that is then refused, and the gate
    would ask about its cost first."""
    write_problems(tmp_path / "p.jsonl")
    out = tmp_path / "sweep"
    args = ("--problems", str(tmp_path / "p.jsonl"), "-m", "majority", "--base-url", sim.base_url, "--no-report")
    assert tmas("sweep", "-o", str(out), *args).returncode == 0
    stopped_before_p1(out / "runs" / "majority")
    sim.reset()
    said = f"tmas: error: {out / 'runs' / 'majority'}: 1 finished problem was solved with solution temperature 0.7"
    for gated in (["--pilot", "1", "-y"], ["--confirm-calls", "1"]):
        refused = tmas("sweep", "--resume", str(out), "--no-report", "--temperature", "0.3", *gated)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.strip().splitlines()[0].startswith(said), refused.stderr
        assert sim.requests == []
        assert not (out / "pilot").exists()


def test_a_resume_sending_or_reading_the_calls_otherwise_is_refused(sim: SimServer, tmp_path: Path) -> None:
    """Whether a verifier's schema goes as response_format, and whether replies are read as thinking inside their
    content, change what the finished problems were solved with, though no request hash holds them; a setting left as
    it was resumes, and the schemas go as before."""
    write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "run"
    args = ("--base-url", sim.base_url, "-m", "verify_refine", "-p", "n=1", "-p", "m=1", "-T", "1")
    made = tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), *args)
    assert made.returncode == 0, made.stderr
    assert any("response_format" in r.body for r in sim.requests)
    stopped_before_p1(run_dir)
    sim.reset()

    def config(**endpoint: str) -> str:
        path = tmp_path / "tmas.toml"
        fields = "".join(f'{key} = "{value}"\n' for key, value in endpoint.items())
        path.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\n{fields}', encoding="utf-8")
        return str(path)

    changes = {
        'verifier structured_output "auto" (now "off")': {"structured_output": "off"},
        'solution reasoning "auto" (now "inline")': {"reasoning": "inline"},
    }
    for said, endpoint in changes.items():
        refused = tmas("run", "--resume", str(run_dir), "--config", config(**endpoint), "-y")
        assert refused.returncode == 2, refused.stderr
        assert said in refused.stderr.strip().splitlines()[-1], refused.stderr
    assert sim.requests == []

    resumed = tmas("run", "--resume", str(run_dir), "--config", config(structured_output="auto", reasoning="auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert any("response_format" in r.body for r in sim.requests)


def test_a_resume_given_a_limit_is_refused_rather_than_solving_every_problem(sim: SimServer, tmp_path: Path) -> None:
    write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "run"
    assert (
        tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "--base-url", sim.base_url, "-m", "cot").returncode
        == 0
    )
    stopped_before_p1(run_dir)
    sim.reset()
    refused = tmas("run", "--resume", str(run_dir), "--limit", "1")
    assert refused.returncode == 2, refused.stderr
    assert "--resume takes the run directory alone: give no problem file, no --out and no --limit" in refused.stderr
    assert sim.requests == []


def test_a_refused_resume_runs_no_pilot_and_asks_no_cost_question_first(sim: SimServer, tmp_path: Path) -> None:
    """The refusal comes before the estimate: a pilot would send calls for a run that is then refused, and the gate
    would ask about its cost first."""
    write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "run"
    made = tmas("run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "--base-url", sim.base_url, "-m", "majority")
    assert made.returncode == 0, made.stderr
    stopped_before_p1(run_dir)
    sim.reset()
    refused = tmas("run", "--resume", str(run_dir), "--temperature", "0.3", "--pilot", "1", "-y")
    assert refused.returncode == 2, refused.stderr
    said = f"tmas: error: {run_dir}: 1 finished problem was solved with solution temperature 0.7 (now 0.3)"
    assert refused.stderr.strip().splitlines()[0].startswith(said), refused.stderr
    assert sim.requests == []
    assert not (run_dir / "pilot").exists()


def test_a_resume_at_another_url_with_no_model_named_is_refused_in_one_line(tmp_path: Path) -> None:
    """The run named no model: the server at another --base-url may serve another one, so the resume is refused
    before any call, naming the model that answered the run and both URLs."""
    write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "run"
    with SimServer(SimScript(model="model-a")) as first, SimServer(SimScript(model="model-b")) as second:
        made = tmas(
            "run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "--base-url", first.base_url, "-m", "majority"
        )
        assert made.returncode == 0, made.stderr
        stopped_before_p1(run_dir)
        first.reset()
        refused = tmas("run", "--resume", str(run_dir), "--base-url", second.base_url, "-y")
        assert second.requests == [] and first.chat_bodies() == []
    assert refused.returncode == 2, refused.stderr
    said = f"model 'model-a' served at the solution endpoint {first.base_url} (now {second.base_url}, which serves"
    said += " 'model-b'), and no model is named"
    assert said in refused.stderr.strip().splitlines()[-1], refused.stderr


def test_a_resume_whose_server_now_serves_another_model_is_refused_before_its_estimate(tmp_path: Path) -> None:
    """The run named no model and its server, at the same URL, was restarted with another: the resume is refused
    before its estimate and any call, naming both models and the URL."""
    write_problems(tmp_path / "p.jsonl")
    run_dir = tmp_path / "run"
    with SimServer(SimScript(model="model-a")) as server:
        made = tmas(
            "run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "--base-url", server.base_url, "-m", "majority"
        )
        assert made.returncode == 0, made.stderr
        stopped_before_p1(run_dir)
        server.set_script(SimScript(model="model-b"))
        server.reset()
        refused = tmas("run", "--resume", str(run_dir), "-y")
        assert server.chat_bodies() == []
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"tmas: error: {run_dir}: the run's replies came from model 'model-a' served at the solution endpoint"
        f" {server.base_url}, which now serves 'model-b', and no model is named: its replies would be mixed with the"
        " stored ones; serve 'model-a' there again to resume, or name the model the run asks for with --model NAME"
    )
