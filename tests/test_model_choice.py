"""Which model answers a run: ``--base-url``, ``--local-model`` and ``--hf-model`` each choose one. Two of them on one
command line are a one-line error before anything is made or sent; one of them over a config file, the environment or
a stored run replaces the choice made there, and the run's settings name what it runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import isolate, run_tmas
from tmas.cli import main as cli_main
from tmas.cli.options import ModelFlags
from tmas.config import Settings, load_settings, with_overrides
from tmas.errors import InputError
from tmas.runner import resume_settings
from tmas.testing import SimServer

PROBLEM = '{"problem_id": "a", "question": "What is 17*23?", "answer": "391"}\n'
MISSING_GGUF = "/no/such/model.gguf"


def _problems(tmp_path: Path) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text(PROBLEM, encoding="utf-8")
    return str(path)


def _chat_requests(sim: SimServer) -> int:
    return sum(1 for entry in sim.requests if entry.endpoint == "chat")


@pytest.mark.parametrize(
    ("first", "second", "shown"),
    [
        ("--base-url", "--hf-model", "--base-url and --hf-model"),
        ("--local-model", "--hf-model", "--local-model and --hf-model"),
        ("--base-url", "--local-model", "--base-url and --local-model"),
        ("--local-model", "--base-url", "--base-url and --local-model"),
    ],
)
def test_two_model_flags_on_one_command_line_are_one_line_and_nothing_runs(
    sim: SimServer, tmp_path: Path, first: str, second: str, shown: str
) -> None:
    values = {"--base-url": sim.base_url, "--local-model": "qwen2.5-coder-0.5b", "--hf-model": "qwen2.5-coder-0.5b"}
    out = tmp_path / "out"
    result = run_tmas(
        "run", _problems(tmp_path), "-o", str(out), "-m", "cot", first, values[first], second, values[second], text=True
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"tmas: error: {shown} each name the model to run: give one of them"]
    assert not out.exists()
    assert _chat_requests(sim) == 0


def test_a_local_model_flag_replaces_the_config_files_endpoint(sim: SimServer, tmp_path: Path) -> None:
    # Before, the config's endpoint answered and --local-model was dropped without a word: the run went to the server.
    config = tmp_path / "cfg.toml"
    config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "served"\n', encoding="utf-8")
    out = tmp_path / "out"
    args = ("run", _problems(tmp_path), "-o", str(out), "-m", "cot", "--config", str(config))
    result = run_tmas(*args, "--local-model", MISSING_GGUF, text=True)
    # The local model named is the one checked (and would be started): a missing file is said before anything is made.
    assert result.returncode == 2, result.stderr
    assert f"local.model (--local-model) '{MISSING_GGUF}' is neither a GGUF file" in result.stderr
    assert not out.exists()
    assert _chat_requests(sim) == 0
    # In process too.
    result = run_tmas(*args, "--hf-model", MISSING_GGUF, text=True)
    assert result.returncode == 2, result.stderr
    assert f"hf.model (--hf-model) '{MISSING_GGUF}' is neither a checkpoint folder" in result.stderr
    assert _chat_requests(sim) == 0


@pytest.mark.parametrize(("model_flag", "setting"), [("--local-model", "local.model"), ("--hf-model", "hf.model")])
def test_a_missing_model_is_said_before_the_estimate(
    sim: SimServer, tmp_path: Path, model_flag: str, setting: str
) -> None:
    # Before, a run on a model that is no file and no known name printed its cost estimate first: a --dry-run passed
    # with exit code 0, and a run above the gate's threshold asked (or refused without --yes) about a run that could
    # not start. Now the one line naming the model comes first, for a new run and a resume alike.
    out = tmp_path / "out"
    result = run_tmas(
        "run", _problems(tmp_path), "-o", str(out), "-m", "cot", model_flag, MISSING_GGUF, "--dry-run", text=True
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tmas: error: {setting} ({model_flag}) '{MISSING_GGUF}' is neither"), line
    assert not out.exists()
    made = run_tmas("run", _problems(tmp_path), "-o", str(out), "-m", "cot", "--base-url", sim.base_url, text=True)
    assert made.returncode == 0, made.stderr
    sent = _chat_requests(sim)
    again = run_tmas("run", "--resume", str(out), model_flag, MISSING_GGUF, "--dry-run", text=True)
    assert again.returncode == 2, again.stderr
    [line] = again.stderr.strip().splitlines()
    assert line.startswith(f"tmas: error: {setting} ({model_flag}) '{MISSING_GGUF}' is neither"), line
    assert _chat_requests(sim) == sent


@pytest.mark.parametrize(("model_flag", "setting"), [("--local-model", "local.model"), ("--hf-model", "hf.model")])
@pytest.mark.parametrize("command", ["sweep", "data filter"])
def test_a_missing_model_is_said_before_the_estimate_of_a_sweep_and_a_filter(
    tmp_path: Path, command: str, model_flag: str, setting: str
) -> None:
    # Before, a sweep and a difficulty filter printed their cost estimate first and a --dry-run passed with exit code
    # 0, as a run did; now each says the model in one line, as a run does, and makes nothing.
    out = tmp_path / "out"
    where = ["--problems", _problems(tmp_path), "-m", "cot"] if command == "sweep" else [_problems(tmp_path)]
    result = run_tmas(*command.split(), *where, "-o", str(out), model_flag, MISSING_GGUF, "--dry-run", text=True)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tmas: error: {setting} ({model_flag}) '{MISSING_GGUF}' is neither"), line
    assert line.endswith(": 'tmas models' lists them"), line
    assert not out.exists()


def test_serve_says_a_missing_local_model_as_a_run_does(tmp_path: Path) -> None:
    # Before, the embedded server's launch said "model '...' is neither ...", without the setting or flag it came from.
    result = run_tmas(
        "serve", "--local-model", MISSING_GGUF, "--port", "0", "--dir", str(tmp_path / "serve"), text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tmas: error: local.model (--local-model) '{MISSING_GGUF}' is neither"), line


def test_solve_says_which_model_it_starts_over_a_configured_endpoint(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "cfg.toml"
    config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\n', encoding="utf-8")
    asked = ["solve", "What is 17*23?", "-m", "cot", "--config", str(config), "--local-model"]
    # A model that is no file and no known name is said in one line, before the estimate, as a run says it.
    result = run_tmas(*asked, MISSING_GGUF, text=True)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"tmas: error: local.model (--local-model) '{MISSING_GGUF}' is neither"), line

    async def solving(*args: object) -> None:  # the embedded model is not started here
        raise InputError("not solved here")

    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(cli_main, "_solving", solving)
    monkeypatch.setattr(sys, "argv", ["tmas", *asked, "smollm2-135m", "--yes"])
    with pytest.raises(SystemExit):
        cli_main.main()
    lines = capsys.readouterr().err.strip().splitlines()
    # Not "no endpoint configured": the config file configures one, which the flag replaced.
    assert lines[-2:] == ["tmas: starting the embedded model smollm2-135m", "tmas: error: not solved here"]
    assert _chat_requests(sim) == 0


def test_the_settings_a_run_records_name_the_model_the_flag_chose(tmp_path: Path) -> None:
    endpoint = tmp_path / "endpoint.toml"
    endpoint.write_text('[endpoint]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "served"\n', encoding="utf-8")
    in_process = tmp_path / "hf.toml"
    in_process.write_text('[hf]\nmodel = "qwen2.5-coder-0.5b"\n', encoding="utf-8")

    local = ModelFlags(config=endpoint, local_model="smollm2-135m").settings()
    assert local.uses_local_model and local.local.model == "smollm2-135m"
    assert local.endpoint.base_url == [] and local.endpoint.model == "served"
    hf = ModelFlags(config=endpoint, hf_model="smollm2-135m").settings()
    assert hf.uses_in_process_model and hf.hf.model == "smollm2-135m" and hf.endpoint.base_url == []
    # A local model over a configured in-process one.
    over_hf = ModelFlags(config=in_process, local_model="smollm2-135m").settings()
    assert over_hf.uses_local_model and over_hf.hf.model is None
    # An endpoint over either: it won already.
    assert ModelFlags(config=in_process, base_url="http://a/v1").settings().endpoint.base_url == ["http://a/v1"]
    # The environment is a layer below the flags, as the config file is.
    environ = {"TMAS_BASE_URL": "http://127.0.0.1:9/v1"}
    chosen = load_settings(None, overrides={"local.model": "smollm2-135m"}, environ=environ)
    assert chosen.uses_local_model
    # So is the environment over the config file; within one layer the endpoint still comes first.
    in_env = load_settings(endpoint, environ={"TMAS_LOCAL_MODEL": "smollm2-135m"})
    assert in_env.uses_local_model and in_env.endpoint.model == "served"
    assert load_settings(in_process, environ={"TMAS_LOCAL_MODEL": "smollm2-135m"}).uses_local_model
    both_env = {"TMAS_BASE_URL": "http://127.0.0.1:9/v1", "TMAS_HF_MODEL": "smollm2-135m"}
    assert load_settings(None, environ=both_env).endpoint.base_url == ["http://127.0.0.1:9/v1"]
    # A config file naming both keeps its own order: the endpoint answers, local.model waits for a run without one.
    both = tmp_path / "both.toml"
    both.write_text(
        '[endpoint]\nbase_url = "http://127.0.0.1:9/v1"\n[local]\nmodel = "smollm2-135m"\n', encoding="utf-8"
    )
    assert not ModelFlags(config=both).settings().uses_local_model
    # And what is recorded is what runs.
    stored = Settings.model_validate(json.loads(local.model_dump_json()))
    assert stored.uses_local_model and stored.local.model == "smollm2-135m"


def test_a_stored_runs_model_is_replaced_by_the_flag_given_on_resume() -> None:
    on_endpoint = Settings.model_validate(
        {"endpoint": {"base_url": "http://127.0.0.1:9/v1"}, "method": {"name": "cot"}}
    )
    resumed = resume_settings(on_endpoint, {"local.model": "smollm2-135m"}, stored_at=Path("run"))
    assert resumed.uses_local_model and resumed.local.model == "smollm2-135m"
    in_process = with_overrides(Settings(hf={"model": "smollm2-135m"}), {"local.model": "qwen2.5-coder-0.5b"})
    assert in_process.uses_local_model and in_process.local.model == "qwen2.5-coder-0.5b"


@pytest.mark.slow
def test_a_model_flag_given_on_resume_is_the_model_the_run_continues_on(sim: SimServer, tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    made = run_tmas("run", _problems(tmp_path), "-o", run_dir, "-m", "cot", "--base-url", sim.base_url, text=True)
    assert made.returncode == 0, made.stderr
    sent = _chat_requests(sim)
    # Before, --local-model was dropped and the run went on at its stored endpoint without a word.
    again = run_tmas("run", "--resume", run_dir, "--local-model", MISSING_GGUF, "-y", text=True)
    assert again.returncode == 2, again.stderr
    assert f"local.model (--local-model) '{MISSING_GGUF}' is neither a GGUF file" in again.stderr
    assert _chat_requests(sim) == sent


@pytest.mark.parametrize("model_flag", ["--local-model", "--hf-model"])
def test_model_beside_a_model_tmas_runs_itself_is_one_line(sim: SimServer, tmp_path: Path, model_flag: str) -> None:
    # Before, --model was dropped without a word: the embedded server is called by its own alias (a role's own
    # endpoint too, which takes the default endpoint's model), the in-process model answers under its own name.
    out = tmp_path / "out"
    args = ("run", _problems(tmp_path), "-o", str(out), "-m", "cot", model_flag, MISSING_GGUF)
    result = run_tmas(*args, "--model", "VALUE", text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"tmas: error: --model names an endpoint's model, and {model_flag} calls none: leave out one of them"
    ]
    assert not out.exists()
    # Beside --base-url it is the endpoint's, as before; --api-key-env may serve a role's own endpoint.
    assert ModelFlags(base_url=sim.base_url, model="m").settings().endpoint.model == "m"
    assert ModelFlags(local_model="smollm2-135m", api_key_env="K").settings().endpoint.api_key_env == "K"
