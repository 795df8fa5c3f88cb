"""An ``https://`` base URL whose TLS handshake fails, against a real local HTTPS server with a self-signed
certificate: one line naming the URL, OpenSSL's words and the fix, after one connection, never retried as a server
that is not there; and the same server accepted once ``SSL_CERT_FILE`` names its certificate."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from conftest import clean_env, settings_for
from tmas.config import Settings
from tmas.errors import ConfigError
from tmas.llm.client import LLMClient
from tmas.llm.model import EndpointUnreachable
from tmas.llm.preflight import check_endpoints
from tmas.llm.types import user
from tmas.testing import SimServer

OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="the openssl command, which makes the test's certificate")

# OpenSSL 3 writes "self-signed", 1.1 "self signed".
SELF_SIGNED = "self-signed certificate" if ssl.OPENSSL_VERSION_INFO[0] >= 3 else "self signed certificate"
UNTRUSTED = (
    f"TLS handshake failed: certificate verify failed: {SELF_SIGNED}; trust the server's certificate by pointing the"
    " SSL_CERT_FILE environment variable at the PEM file of its CA (of the certificate itself where it is self-signed)"
)


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its subjectAltName) and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [OPENSSL or "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.asynccontextmanager
async def https_server(certificate: tuple[Path, Path]) -> AsyncIterator[tuple[str, list[int]]]:
    """(its base URL, one entry per connection it accepted, handshake failed or not): a server listing model ``m``."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    connections: list[int] = []

    def accepted() -> web.RequestHandler:  # type: ignore[type-arg]
        connections.append(1)
        return runner.server()  # type: ignore[misc]

    server = await asyncio.get_running_loop().create_server(accepted, "127.0.0.1", 0, ssl=context)
    try:
        yield f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", connections
    finally:
        server.close()
        await runner.cleanup()


async def tmas_models(url: str, **env: str) -> tuple[int, str]:
    """``tmas models --base-url url`` in a child process (so that the server, in this loop, answers meanwhile)."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tmas", "models", "--base-url", url,
        env=clean_env(env), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await child.communicate()
    assert child.returncode is not None
    return child.returncode, out.decode().strip()


async def test_the_check_before_a_run_names_an_untrusted_certificate_after_one_connection(
    certificate: tuple[Path, Path],
) -> None:
    # Before, it was taken for nobody listening: three connections, then "cannot connect to URL: Cannot connect to
    # host ... ssl:True [...]; start the server there or correct --base-url".
    async with https_server(certificate) as (url, connections):
        with pytest.raises(ConfigError) as caught:
            await check_endpoints(Settings.model_validate({"endpoint": {"base_url": url}}), ["solution"])
    assert str(caught.value) == f"{url}: {UNTRUSTED}"
    assert len(connections) == 1


async def test_a_plain_http_server_given_as_https_is_named_so(sim: SimServer) -> None:
    url = f"https://127.0.0.1:{sim.port}/v1"
    with pytest.raises(ConfigError) as caught:
        await check_endpoints(Settings.model_validate({"endpoint": {"base_url": url}}), ["solution"])
    assert str(caught.value) == (
        f"{url}: TLS handshake failed: wrong version number; give the URL with http:// if the server speaks plain HTTP"
    )


async def test_a_call_is_not_sent_again_after_its_handshake_failed(certificate: tuple[Path, Path]) -> None:
    # Before, it was cause "connect", sent again until its attempts were spent (5 connections with the tests'
    # retries), each failing alike.
    async with https_server(certificate) as (url, connections):
        settings = settings_for()
        settings.endpoint.base_url = [url]
        async with LLMClient(settings) as llm:
            with pytest.raises(EndpointUnreachable) as caught:
                await llm.chat("solution", [user("What is 17*23?")])
            retries = llm.stats.retries
    assert str(caught.value) == f"endpoint {url} unreachable for role 'solution': {url}/chat/completions: {UNTRUSTED}"
    assert retries == 0
    assert len(connections) == 2  # the model card asked once, the call sent once


async def test_models_says_it_in_one_line_and_trusts_the_certificate_ssl_cert_file_names(
    certificate: tuple[Path, Path],
) -> None:
    async with https_server(certificate) as (url, _):
        refused = await tmas_models(url, SSL_CERT_FILE="")
        trusted = await tmas_models(url, SSL_CERT_FILE=str(certificate[0]))
    assert refused == (1, f"default: {url} NOT ANSWERING: {UNTRUSTED}")
    assert trusted == (0, f"default: {url} ok, models: m")
