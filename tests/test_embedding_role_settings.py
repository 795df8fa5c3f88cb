"""The embedding role sends ``/v1/embeddings`` requests: model, input and its own ``extra_body``. A chat sampling field
of ``[roles.embedding.sampling]``, or a ``[roles.embedding]`` field only chat calls read, is refused where settings
are given (config file, Python API), naming the key; before, each was accepted and never sent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import config_file, isolate
from tmas.api import asolve
from tmas.cli.main import app
from tmas.config import EMBEDDING_UNREAD, Sampling, Settings, load_settings
from tmas.errors import ConfigError
from tmas.testing import SimServer

Q = "What is 17*23?"
RSE = ["-m", "rse", "-p", "n=1", "-p", "iterations=2"]


def test_a_chat_sampling_field_of_the_embedding_role_is_refused_on_the_command_line(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    table = "[roles.embedding.sampling]\nextra_body = { dimensions = 64 }\n"
    path = config_file(sim, tmp_path, f"{table}temperature = 0.1\n")
    out = CliRunner().invoke(app, ["solve", Q, *RSE, "--config", str(path)])
    assert isinstance(out.exception, ConfigError)
    assert str(out.exception) == (
        f"{path}: roles.embedding.sampling.temperature is a chat sampling field, and embeddings requests take none:"
        " only roles.embedding.sampling.extra_body goes in them (dimensions, encoding_format, ...)"
    )
    # Before, the run went on and its embeddings requests carried no temperature.
    assert sim.requests == []
    # What embeddings requests do carry is still taken, and sent.
    out = CliRunner().invoke(app, ["solve", Q, *RSE, "--config", str(config_file(sim, tmp_path, table))])
    assert out.exit_code == 0, out.output
    bodies = sim.embedding_bodies()
    assert bodies and all(set(body) == {"dimensions", "model", "input"} for body in bodies)
    assert {body["dimensions"] for body in bodies} == {64}


async def test_the_python_apis_settings_refuse_them(sim: SimServer) -> None:
    given: dict[str, Any] = {"endpoint": {"base_url": sim.base_url}, "method": {"name": "rse"}}
    refused = [
        ({"sampling": {"max_tokens": 5}}, "roles.embedding.sampling.max_tokens is a chat sampling field"),
        ({"stream": "on"}, "roles.embedding.stream is read by chat calls only, and the embedding role makes none"),
    ]
    for table, line in refused:
        with pytest.raises(ConfigError) as caught:
            await asolve(Q, {**given, "roles": {"embedding": table}})
        assert str(caught.value).startswith(f"settings: {line}")
    assert sim.requests == []


# A value each sampling field takes.
SAMPLED: dict[str, Any] = {
    "temperature": 0.0,
    "top_p": 0.5,
    "max_tokens": 8,
    "seed": 1,
    "stop": ["x"],
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
}
# A value each field only chat calls read takes.
UNREAD: dict[str, Any] = {
    "context_length": 512,
    "tokenizer": "tokenizer.json",
    "stream": "off",
    "queue_timeout_s": 30.0,
    "structured_output": "off",
    "reasoning": "none",
    "pin_slots": False,
    "batch_samples": "off",
    "routing": "load",
    "routing_load_bound": 2.0,
    "session_header": "X-Session-Id",
}


def toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return str(value)


def test_every_field_is_covered() -> None:
    assert set(SAMPLED) == set(Sampling.model_fields) - {"extra_body"}
    assert set(UNREAD) == set(EMBEDDING_UNREAD)


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_each_chat_sampling_field_is_refused_in_the_files_embedding_table(
    sim: SimServer, tmp_path: Path, name: str
) -> None:
    path = config_file(sim, tmp_path, f"[roles.embedding.sampling]\n{name} = {toml(SAMPLED[name])}\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    assert str(caught.value).startswith(f"{path}: roles.embedding.sampling.{name} is a chat sampling field")
    # Another role's table takes it: its calls are chat calls.
    path = config_file(sim, tmp_path, f"[roles.judge.sampling]\n{name} = {toml(SAMPLED[name])}\n")
    assert getattr(load_settings(path, environ={}).roles["judge"].sampling, name) == SAMPLED[name]


@pytest.mark.parametrize("name", sorted(UNREAD))
def test_each_field_only_chat_calls_read_is_refused_in_the_files_embedding_table(
    sim: SimServer, tmp_path: Path, name: str
) -> None:
    path = config_file(sim, tmp_path, f"[roles.embedding]\n{name} = {toml(UNREAD[name])}\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    line = f"{path}: roles.embedding.{name} is read by chat calls only, and the embedding role makes none"
    assert str(caught.value) == f"{line}: leave it out"
    path = config_file(sim, tmp_path, f"[roles.judge]\n{name} = {toml(UNREAD[name])}\n")
    assert getattr(load_settings(path, environ={}).roles["judge"], name) == UNREAD[name]


def test_the_fields_embeddings_requests_read_are_taken(sim: SimServer, tmp_path: Path) -> None:
    body = (
        '[roles.embedding]\nbase_url = "http://emb:8001/v1"\nmodel = "emb"\napi_key_env = "EMB_KEY"\n'
        "max_in_flight = 2\ntimeout_s = 20\ndeadline_s = 60\nprogress_timeout_s = 90\n"
        '[roles.embedding.sampling]\nextra_body = { dimensions = 64, encoding_format = "base64" }\n'
    )
    role = load_settings(config_file(sim, tmp_path, body), environ={}).roles["embedding"]
    assert (role.model, role.max_in_flight, role.timeout_s) == ("emb", 2, 20.0)
    assert role.sampling.extra_body == {"dimensions": 64, "encoding_format": "base64"}


def test_a_chat_field_in_the_embedding_roles_extra_body_names_no_setting_it_refuses(
    sim: SimServer, tmp_path: Path
) -> None:
    # Before, extra_body.max_tokens was refused with "set roles.embedding.sampling.max_tokens instead": a field its
    # requests never carry.
    path = config_file(sim, tmp_path, "[roles.embedding.sampling]\nextra_body = { max_tokens = 8 }\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    line = f"{path}: roles.embedding.sampling.extra_body.max_tokens is a field of chat requests"
    assert str(caught.value) == f"{line}, and tmas sends the embedding role none: leave it out"
    path = config_file(sim, tmp_path, '[roles.embedding.sampling]\nextra_body = { model = "x" }\n')
    with pytest.raises(ConfigError, match=r"set roles\.embedding\.model instead$"):
        load_settings(path, environ={})


def test_a_run_stored_with_such_a_value_still_resumes(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    old = {
        "endpoint": {"base_url": sim.base_url},
        "method": {"name": "rse", "params": {"n": 1, "iterations": 2}},
        "roles": {"embedding": {"stream": "off", "sampling": {"temperature": 0.1, "extra_body": {"dimensions": 64}}}},
    }
    run_dir = tmp_path / "run"
    asyncio.run(asolve(Q, Settings.model_validate(old), run_dir=run_dir))
    out = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    assert out.exit_code == 0, out.output
    assert {body["dimensions"] for body in sim.embedding_bodies()} == {64}
