"""``tmas models`` against a web server that is no OpenAI-compatible endpoint (a proxy's login page, a static file
server): it says in one line what answered, not JSON's own words about the first character."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import isolate
from tmas.cli import main as cli

PAGE = b"<!DOCTYPE html><html><head><title>Sign in</title></head><body>Sign in to continue</body></html>"


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def web_page() -> Iterator[str]:
    """The base URL of a server that answers every GET with an HTML page, status 200."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_models_says_an_html_page_answered(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, web_page: str
) -> None:
    # Before: "default: URL NOT ANSWERING: JSONDecodeError: Expecting value: line 1 column 1 (char 0)".
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(sys, "argv", ["tmas", "models", "--base-url", web_page])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 1
    assert capsys.readouterr().out.strip() == (
        f"default: {web_page} NOT ANSWERING: HTTP 200, but not a JSON list of models: Sign in (an HTML page, not an"
        " API error: a proxy or web server answered)"
    )
