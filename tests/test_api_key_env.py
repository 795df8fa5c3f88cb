"""An ``api_key_env`` that names an unset or empty variable, as a user of a hosted API meets it: refused in one line
naming the variable, the key and where it was given, before any estimate and any call, for the roles the method
calls and no other; ``tmas models`` says it instead of the server's 401."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_tmas
from mattrl_runs import hand_worked_transcript, write_run
from tmas.problems import Problem
from tmas.testing import SimServer

KEY = "TMAS_TEST_KEY"  # a TMAS_* name: the children's environment (conftest.clean_env) never holds it unless given


def write_problems(path: Path) -> str:
    path.write_text(json.dumps({"problem_id": "p0", "question": "What is 2*7?"}) + "\n")
    return str(path)


def config(tmp_path: Path, sim: SimServer, table: str = "endpoint") -> Path:
    path = tmp_path / "tmas.toml"
    keyed = f'\n[{table}]\napi_key_env = "{KEY}"\n' if table != "endpoint" else f'api_key_env = "{KEY}"\n'
    path.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\n{keyed}')
    return path


@pytest.mark.parametrize("command", ["run", "eval", "solve", "sweep", "data filter", "serve"])
def test_an_unset_key_variable_is_refused_before_the_estimate(sim: SimServer, tmp_path: Path, command: str) -> None:
    # Before, the estimate (and the gate's question) came first, and the run then failed on its first call with
    # 'environment variable ... (named by api_key_env for role ...) is not set', naming no file.
    problems, out = write_problems(tmp_path / "p.jsonl"), str(tmp_path / "out")
    given = {
        "run": ["run", problems, "-o", out, "-m", "cot", "--dry-run"],
        "eval": ["eval", problems, "-o", out, "-m", "cot", "--dry-run"],
        "solve": ["solve", "What is 2*7?", "-m", "cot", "--dry-run"],
        "sweep": ["sweep", "--problems", problems, "-m", "cot", "-o", out, "--dry-run"],
        "data filter": ["data", "filter", problems, "-o", str(tmp_path / "out.jsonl"), "--dry-run"],
        "serve": ["serve", "--port", "0", "--dir", out],
    }[command]
    path = config(tmp_path, sim)
    result = run_tmas(*given, "--config", str(path), text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"tmas: error: {path}: endpoint.api_key_env = '{KEY}' names an environment variable that is not set: set it"
        " to the API key"
    ]
    assert result.stdout == ""  # no estimate
    assert sim.requests == []
    assert not (tmp_path / "out").exists()


def test_the_flag_or_an_empty_variable_is_named_as_such(sim: SimServer, tmp_path: Path) -> None:
    problems, out = write_problems(tmp_path / "p.jsonl"), str(tmp_path / "out")
    given = ["run", problems, "-o", out, "-m", "cot", "--dry-run", "--base-url", sim.base_url]
    flagged = run_tmas(*given, "--api-key-env", KEY, text=True)
    assert flagged.stderr.strip().splitlines() == [
        f"tmas: error: --api-key-env: endpoint.api_key_env = '{KEY}' names an environment variable that is not set"
        ": set it to the API key"
    ]
    empty = run_tmas(*given, text=True, env={"TMAS_API_KEY_ENV": KEY, KEY: ""})
    assert empty.stderr.strip().splitlines() == [
        f"tmas: error: TMAS_API_KEY_ENV: endpoint.api_key_env = '{KEY}' names an environment variable that is empty"
        ": set it to the API key"
    ]
    assert flagged.returncode == empty.returncode == 2
    assert sim.requests == []


def test_an_empty_api_key_env_is_refused_not_sent_without_a_key(sim: SimServer, tmp_path: Path) -> None:
    # Before, api_key_env = "" sent every call without a key: a hosted API's 401 on each.
    problems, path = write_problems(tmp_path / "p.jsonl"), tmp_path / "tmas.toml"
    path.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\napi_key_env = ""\n')
    out = run_tmas("run", problems, "-o", str(tmp_path / "out"), "-m", "cot", "--config", str(path), text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"tmas: error: {path}: endpoint.api_key_env is empty: name the environment variable that holds the API key,"
        " or leave it out"
    ]
    assert sim.requests == []


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_only_the_roles_the_method_calls_need_their_key(sim: SimServer, tmp_path: Path, command: str) -> None:
    # [roles.verifier] with its key unset stops a method with a verifier, not one that never calls it.
    problems, out = write_problems(tmp_path / "p.jsonl"), str(tmp_path / "out")
    path = config(tmp_path, sim, "roles.verifier")
    given = {
        "run": ["run", problems, "-o", out, "--dry-run"],
        "sweep": ["sweep", "--problems", problems, "-o", out, "--dry-run"],
    }[command]
    unused = run_tmas(*given, "-m", "cot", "--config", str(path), text=True, timeout=60)
    assert unused.returncode == 0, unused.stderr
    used = run_tmas(*given, "-m", "verify_refine", "--config", str(path), text=True, timeout=60)
    assert used.returncode == 2
    assert used.stderr.strip().splitlines() == [
        f"tmas: error: {path}: roles.verifier.api_key_env = '{KEY}' names an environment variable that is not set"
        ": set it to the API key"
    ]
    assert sim.requests == []


def test_models_says_an_unset_key_instead_of_asking_without_it(sim: SimServer, tmp_path: Path) -> None:
    # Before, it asked GET /models without a key: a hosted API's 401, which names no variable.
    path = config(tmp_path, sim)
    out = run_tmas("models", "--config", str(path), text=True)
    assert out.returncode == 1
    assert out.stdout.strip().splitlines() == [
        f"default: NOT CHECKED: {path}: endpoint.api_key_env = '{KEY}' names an environment variable that is not set"
        ": set it to the API key"
    ]
    assert sim.requests == []


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_resume_names_the_runs_stored_settings(sim: SimServer, tmp_path: Path, command: str) -> None:
    # Resumed without a config file, the key comes from what the run stored (the environment is not read again).
    problems, out = write_problems(tmp_path / "p.jsonl"), tmp_path / "out"
    path = config(tmp_path, sim)
    given = {
        "run": ["run", problems, "-o", str(out)],
        "sweep": ["sweep", "--problems", problems, "-o", str(out), "--no-report"],
    }[command]
    made = run_tmas(*given, "-m", "cot", "--config", str(path), text=True, env={KEY: "sk"})
    assert made.returncode == 0, made.stderr
    sent = len(sim.requests)
    resumed = run_tmas(command, "--resume", str(out), "--dry-run", text=True)
    assert resumed.returncode == 2
    assert resumed.stderr.strip().splitlines() == [
        f"tmas: error: {out} (its stored settings): endpoint.api_key_env = '{KEY}' names an environment variable that"
        " is not set: set it to the API key"
    ]
    assert len(sim.requests) == sent


@pytest.mark.parametrize(("embedder", "refused"), [("local", False), ("endpoint", True)])
def test_pool_build_checks_its_embedding_roles_key_where_the_endpoint_embeds(
    sim: SimServer, tmp_path: Path, embedder: str, refused: bool
) -> None:
    # tmas pool build calls its judge and summarizer, and the embedding role only with --embedder endpoint.
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])
    path = config(tmp_path, sim, "roles.embedding")
    given = ["pool", "build", str(run), "-o", str(tmp_path / "pool"), "--grade", "rules", "--embedder", embedder]
    out = run_tmas(*given, "--config", str(path), "--dry-run", text=True)
    if not refused:
        assert out.returncode == 0, out.stderr
        return
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"tmas: error: {path}: roles.embedding.api_key_env = '{KEY}' names an environment variable that is not set:"
        " set it to the API key"
    ]
    assert sim.requests == []
