"""docs/serve.md's statements about the proxy's routes are the app's: which answer without the bearer token, and the
defaults of its limits table."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from starlette.routing import Route
from starlette.testclient import TestClient

from conftest import scripted_settings
from tmas.cli.main import app as cli
from tmas.methods import METHODS
from tmas.serve.app import ServeApp
from tmas.serve.jobs import ServedRuns
from tmas.serve.metrics import ServeMetrics
from tmas.testing import ScriptedModel

SERVE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "serve.md"


def limits_rows() -> dict[str, tuple[str, str]]:
    """``option -> (default, past it)`` of the page's ``| option | default | past it |`` table."""
    rows, in_table = {}, False
    for line in SERVE_PAGE.read_text().splitlines():
        if line.startswith("| option | default |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and (option := re.match(r"\| `(--[\w-]+)[^|]*\| ([^|]+) \|(.*)\|$", line)):
            rows[option.group(1)] = (option.group(2).strip(), option.group(3))
    return rows


def test_the_routes_the_page_names_open_are_the_ones_that_answer_without_the_token(tmp_path: Path) -> None:
    _, row = limits_rows()["--token-env"]
    named_open = set(re.findall(r"`(/[\w/]+)`", row.split("every route but")[1].split("needs")[0]))
    settings = scripted_settings()
    runs = ServedRuns(
        tmp_path, settings, embedded=False, model=ScriptedModel(settings=settings), max_problems=1, max_queue=1
    )
    metrics = ServeMetrics(queued=lambda: 0, in_flight=lambda: 0)
    served = ServeApp(
        runs, methods=sorted(METHODS), upstreams=["sim-model"], token="s3cret", max_body_bytes=1 << 20, metrics=metrics
    ).build()
    routes = [route for route in served.routes if isinstance(route, Route)]
    with TestClient(served) as client:
        answered_open = {
            route.path
            for route in routes
            if client.request(next(iter(route.methods or {"GET"})), route.path).status_code != 401
        }
    assert {route.path for route in routes} > answered_open  # the token guards something
    assert answered_open == named_open


def test_the_limits_table_states_the_commands_defaults() -> None:
    serve = typer.main.get_command(cli).commands["serve"]  # type: ignore[attr-defined]
    defaults = {opt: param.default for param in serve.params for opt in param.opts}
    rows = limits_rows()
    assert len(rows) >= 5
    for option, (stated, _) in rows.items():
        value = None if stated == "none" else int(stated.replace(",", ""))
        assert defaults[option] == value, (
            f"serve.md: {option} is documented as {stated}, its default is {defaults[option]}"
        )
