"""A ``TMAS_`` variable tmas does not read (a typo of one it does) is named in one warning line, with the closest one
tmas reads; the settings load as they would without it, since other tools may share the prefix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tmas.config import ENV_KEYS, OTHER_ENV, load_settings


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tmas.config" and r.levelno == logging.WARNING]


def test_a_misspelt_variable_is_named_with_the_one_meant(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[endpoint]\nbase_url = "http://gpu1:8000/v1"\napi_key_env = "TMAS_GATEWAY_KEY"\n')
    env = {
        "TMAS_TEMPRATURE": "0.1",  # the typo
        "TMAS_MAX_TOKENS": "300",  # a setting
        "TMAS_CACHE_DIR": str(tmp_path),  # read by tmas, no setting
        "TMAS_GATEWAY_KEY": "sk-x",  # named by api_key_env
        "HOME": str(tmp_path),
    }
    with caplog.at_level(logging.WARNING, logger="tmas.config"):
        settings = load_settings(path, environ=env)
    assert settings.sampling.temperature == 0.7 and settings.sampling.max_tokens == 300  # the default temperature
    assert warnings_of(caplog) == [
        "tmas: environment variable TMAS_TEMPRATURE is not one tmas reads: ignored (did you mean TMAS_TEMPERATURE?)"
    ]


def test_a_variable_like_none_is_named_alone(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tmas.config"):
        load_settings(environ={"TMAS_XYZZY_QUUX": "1"})
    assert warnings_of(caplog) == ["tmas: environment variable TMAS_XYZZY_QUUX is not one tmas reads: ignored"]


def test_every_variable_tmas_reads_goes_unwarned(caplog: pytest.LogCaptureFixture) -> None:
    # Values that parse for every setting are not needed: the known names are checked alone.
    env = {var: "" for var in [*ENV_KEYS, *OTHER_ENV]}
    with caplog.at_level(logging.WARNING, logger="tmas.config"):
        load_settings(environ=env)
    assert warnings_of(caplog) == []
