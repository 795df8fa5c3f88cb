"""The client keeps one cap on calls in flight per URL, taken from whichever role calls it first: settings that give
one URL two ``max_in_flight`` values are refused, naming both, rather than one of them silently not applying."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import isolate
from tmas.api import asolve
from tmas.cli.main import app
from tmas.config import Settings, load_settings
from tmas.errors import ConfigError
from tmas.llm.routes import Routes
from tmas.testing import SimServer

URL = "http://gpu1:8000/v1"


def written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(f'[endpoint]\nbase_url = "{URL}"\nmax_in_flight = 64\n{text}')
    return path


def test_a_roles_own_cap_at_the_endpoints_url_is_refused(tmp_path: Path) -> None:
    path = written(tmp_path, "[roles.verifier]\nmax_in_flight = 2\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    assert str(caught.value) == (
        f"{path}: endpoint.max_in_flight = 64 and roles.verifier.max_in_flight = 2 both cap the calls in flight at"
        f" {URL}, which has one cap: give them one value, or the role its own base_url"
    )


def test_what_the_cap_was_before_the_check() -> None:
    # Such settings built in Python still load (stored runs read back so); the client then caps the URL once, at the
    # first role's value: the verifier's 2 never applied, which is why a configuration saying so is refused.
    settings = Settings.model_validate(
        {"endpoint": {"base_url": URL, "max_in_flight": 64}, "roles": {"verifier": {"max_in_flight": 2}}}
    )
    routes = Routes(settings)
    solution, verifier = routes.route("solution"), routes.route("verifier")
    assert verifier.endpoint.max_in_flight == 2 and verifier.replicas[0].cap is solution.replicas[0].cap


def test_a_flag_that_brings_two_caps_to_one_url_is_refused(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    other = "http://gpu2:8000/v1"
    path = written(tmp_path, f'[roles.verifier]\nbase_url = "{other}"\nmax_in_flight = 2\n')
    assert load_settings(path, environ={}).roles["verifier"].max_in_flight == 2
    out = CliRunner().invoke(app, ["solve", "What is 2+2?", "-m", "cot", "-c", str(path), "--base-url", other])
    assert isinstance(out.exception, ConfigError)
    assert str(out.exception).startswith(
        f"environment and command line: endpoint.max_in_flight = 64 and roles.verifier.max_in_flight = 2 both cap"
        f" the calls in flight at {other}"
    )
    assert [entry for entry in sim.requests if entry.endpoint == "chat"] == []


async def test_caps_that_agree_or_urls_apart_still_run(sim: SimServer) -> None:
    given = {
        "endpoint": {"base_url": sim.base_url, "max_in_flight": 4},
        "method": {"name": "cot"},
        "roles": {"solution": {"max_in_flight": 4}, "judge": {"base_url": "http://judge:1/v1", "max_in_flight": 1}},
    }
    await asolve("What is 17*23?", given)
    assert [entry.role for entry in sim.requests if entry.endpoint == "chat"] == ["solution"]
    with pytest.raises(ConfigError, match=r"^settings: endpoint\.max_in_flight = 4 and roles\.solution\.max"):
        await asolve("What is 17*23?", {**given, "roles": {"solution": {"max_in_flight": 8}}})
