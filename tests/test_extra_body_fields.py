"""``extra_body`` goes on a request last, so a key of it that names a field tmas sends from its settings would replace
what tmas sends while budgets, estimates, batching and the run's records read the setting: such keys are refused where
settings are given (config file, Python API, a grid file, TMAS's per-role method sampling), naming the key, where it
was set and the setting to use; every other key still reaches the server as written."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import config_file, isolate
from tmas.api import asolve
from tmas.cli.main import app
from tmas.config import Settings, load_settings
from tmas.errors import ConfigError
from tmas.sweep import load_spec
from tmas.testing import SimServer

Q = "What is 17*23?"


def test_a_config_files_extra_body_max_tokens_is_refused_on_the_command_line(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    path = config_file(sim, tmp_path, "[sampling]\nmax_tokens = 300\nextra_body = { max_tokens = 5 }\n")
    out = CliRunner().invoke(app, ["solve", Q, "-m", "cot", "--config", str(path)])
    assert isinstance(out.exception, ConfigError)
    line = f"{path}: sampling.extra_body.max_tokens would replace the max_tokens tmas sends from its settings:"
    assert str(out.exception) == f"{line} set sampling.max_tokens instead"
    # Before, the call went out with max_tokens 5 where the run recorded (and budgeted) 300.
    assert sim.chat_bodies() == []


@pytest.mark.parametrize(
    ("key", "instead"),
    [
        ("max_completion_tokens", "set sampling.max_tokens instead"),
        ("temperature", "set sampling.temperature instead"),
        ("seed", "set sampling.seed instead"),
        ("top_k", "set sampling.top_k instead"),
        ("repeat_penalty", "set sampling.repetition_penalty instead"),
        ("model", "set endpoint.model instead"),
        ("stream", "set endpoint.stream instead"),
        ("n", "set endpoint.batch_samples instead"),
        ("messages", "no setting sets it: leave it out"),
    ],
)
def test_each_field_tmas_sends_is_refused_in_the_files_extra_body(
    sim: SimServer, tmp_path: Path, key: str, instead: str
) -> None:
    path = config_file(sim, tmp_path, f"[sampling]\nextra_body = {{ {key} = 1 }}\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    assert str(caught.value).startswith(f"{path}: sampling.extra_body.{key} would replace the {key} tmas sends")
    assert str(caught.value).endswith(instead)


def test_a_roles_extra_body_names_the_roles_own_settings(sim: SimServer, tmp_path: Path) -> None:
    for key, instead in [("model", "roles.verifier.model"), ("max_tokens", "roles.verifier.sampling.max_tokens")]:
        path = config_file(sim, tmp_path, f'[roles.verifier.sampling]\nextra_body = {{ {key} = "x" }}\n')
        with pytest.raises(ConfigError, match=rf"^{path}: roles\.verifier\.sampling\.extra_body\.{key} would"):
            load_settings(path, environ={})
        with pytest.raises(ConfigError, match=rf"set {instead} instead$"):
            load_settings(path, environ={})


def test_tmas_per_role_method_sampling_refuses_them_on_the_command_line(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    param = "sampling=" + json.dumps({"solution": {"extra_body": {"n": 3}}})
    out = CliRunner().invoke(app, ["solve", Q, "-m", "tmas", "-p", param, "--base-url", sim.base_url])
    assert isinstance(out.exception, ConfigError)
    assert "sampling.solution.extra_body.n would replace the n tmas sends" in str(out.exception)
    assert str(out.exception).endswith("set roles.solution.batch_samples instead")
    assert sim.chat_bodies() == []


async def test_the_python_apis_settings_and_a_grid_file_refuse_them(sim: SimServer, tmp_path: Path) -> None:
    given = {"endpoint": {"base_url": sim.base_url}, "sampling": {"extra_body": {"stream": False}}}
    with pytest.raises(ConfigError, match=r"^settings: sampling\.extra_body\.stream would .* endpoint\.stream instead"):
        await asolve(Q, given)
    grid = tmp_path / "grid.toml"
    grid.write_text('[sampling]\nextra_body = { stop = ["x"] }\n')
    with pytest.raises(ConfigError, match=rf"^{grid}: sampling\.extra_body\.stop would .* sampling\.stop instead$"):
        load_spec(grid)
    assert sim.chat_bodies() == []


# Fields tmas has no setting for: sent as written.
ALLOWED = {
    "min_tokens": 3,
    "frequency_penalty": 0.25,
    "repeat_last_n": 32,
    "chat_template_kwargs": {"enable_thinking": False},
}


def test_other_extra_body_keys_still_reach_the_server_from_the_command_line(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    body = (
        "[sampling]\nmax_tokens = 300\ntop_k = 7\n"
        "extra_body = { min_tokens = 3, frequency_penalty = 0.25, repeat_last_n = 16,"
        " chat_template_kwargs = { enable_thinking = false } }\n"
        "[roles.refiner.sampling]\nextra_body = { repeat_last_n = 32 }\n"
    )
    path = config_file(sim, tmp_path, body)
    out = CliRunner().invoke(app, ["solve", Q, "-m", "self_refine", "-p", "n=1", "-p", "iterations=2", "-c", str(path)])
    assert out.exit_code == 0, out.output
    by_role: dict[str, list[dict[str, object]]] = {}
    for entry in sim.requests:
        if entry.endpoint == "chat":
            by_role.setdefault(entry.role, []).append(entry.body)
    assert set(by_role) == {"solution", "refiner"}
    for role, bodies in by_role.items():
        for sent in bodies:
            assert (sent["max_tokens"], sent["top_k"]) == (300, 7)
            wanted = {**ALLOWED, "repeat_last_n": 32 if role == "refiner" else 16}
            assert {key: sent.get(key) for key in wanted} == wanted, role


def test_a_run_stored_with_such_a_key_still_resumes(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # top_k went in extra_body before it was a setting: a run stored so resumes (and reports) as it ran.
    isolate(monkeypatch, tmp_path)
    old = {"endpoint": {"base_url": sim.base_url}, "method": {"name": "cot"}, "sampling": {"extra_body": {"top_k": 20}}}
    run_dir = tmp_path / "run"
    asyncio.run(asolve(Q, Settings.model_validate(old), run_dir=run_dir))
    out = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    assert out.exit_code == 0, out.output
    assert [body.get("top_k") for body in sim.chat_bodies()] == [20]


def test_the_embedding_roles_extra_body_input_is_refused(sim: SimServer, tmp_path: Path) -> None:
    # An embeddings request's body is that role's extra_body under tmas's model and input: before, this input was
    # overwritten by the texts to embed without a word.
    path = config_file(sim, tmp_path, "[roles.embedding.sampling]\nextra_body = { input = ['x'], dimensions = 64 }\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(path, environ={})
    line = f"{path}: roles.embedding.sampling.extra_body.input would replace the input tmas sends"
    assert str(refused.value) == f"{line}, and no setting sets it: leave it out"
    # A chat role's request has no input field of tmas's: its extra_body input goes as written.
    path = config_file(sim, tmp_path, "[roles.judge.sampling]\nextra_body = { input = 'x' }\n")
    assert load_settings(path, environ={}).roles["judge"].sampling.extra_body == {"input": "x"}
