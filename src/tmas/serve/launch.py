"""Start the proxy: refuse an open address without a token, resolve the upstream (or load the model run in process),
run uvicorn until stopped."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from tmas.config import Settings
from tmas.errors import ConfigError, LLMError
from tmas.files import check_out_dir
from tmas.llm.model import ChatModel
from tmas.llm.provision import on_embedded_model, provisioned
from tmas.llm.replica import list_models
from tmas.methods import METHODS
from tmas.planning.estimate import QUESTION_CALLS
from tmas.serve.app import ServeApp
from tmas.serve.client_sampling import ClientSampling
from tmas.serve.jobs import ServedRuns, check_served_methods
from tmas.serve.metrics import ServeMetrics

log = logging.getLogger("tmas.serve")

GRACEFUL_SHUTDOWN_S = 5


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    serve_dir: Path = Path("serve-runs")
    # Name of the environment variable holding the bearer token clients must send (never the token itself).
    token_env: str | None = None
    max_problems: int = 4
    # Requests waiting for one of the max_problems slots, in arrival order; past it, 429 with Retry-After.
    max_queue: int = 1024
    max_body_bytes: int = 1_000_000
    # Resume the unfinished runs found in serve_dir at start-up.
    resume: bool = True
    # What a request's sampling fields mean for its run's calls (tmas.serve.client_sampling).
    client_sampling: ClientSampling = "defaults"
    # The most upstream calls one request's run may make (tmas.serve.cost_gate).
    max_request_calls: int = QUESTION_CALLS


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_port(host: str, port: int) -> None:
    """A one-line :class:`ConfigError` where ``host``:``port`` cannot be listened on (taken, or no address of this
    machine), before anything starts: uvicorn says so only after its own start lines."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def resolve_token(options: ServeOptions) -> str | None:
    """The bearer token, required when listening beyond loopback (a one-line ConfigError otherwise)."""
    token = None
    if options.token_env:
        token = os.environ.get(options.token_env)
        if not token:
            raise ConfigError(f"environment variable {options.token_env} (named by --token-env) is not set")
    if token is None and not is_loopback(options.host):
        raise ConfigError(
            f"refusing to listen on {options.host} without a bearer token: set --token-env NAME"
            " (the variable holding the token), or listen on 127.0.0.1"
        )
    return token


async def upstream_models(settings: Settings) -> list[str]:
    """The configured model first, then whatever else the upstream says it serves."""
    names = [settings.endpoint.model] if settings.endpoint.model else []
    key = os.environ.get(settings.endpoint.api_key_env) if settings.endpoint.api_key_env else None
    try:
        served = await list_models(settings.endpoint.base_url[0], key)
    except LLMError as exc:
        log.warning("upstream %s lists no models (%s)", settings.endpoint.base_url[0], exc)
        served = []
    names += [m for m in served if m not in names]
    if not names:
        raise ConfigError("no upstream model: set endpoint.model (--model) or use an upstream that lists its models")
    return names


@asynccontextmanager
async def in_process(settings: Settings) -> AsyncIterator[ChatModel | None]:
    """The model ``settings`` run in process (``--hf-model``), loaded once for every request's run; else None (the
    runs go to the endpoint)."""
    if not settings.uses_in_process_model:
        yield None
        return
    from tmas.llm.hf_model import open_hf_model  # torch and transformers only where a model runs in process

    async with open_hf_model(settings) as model:
        yield model


async def serve(
    settings: Settings, options: ServeOptions, *, on_start: Callable[[uvicorn.Server], None] | None = None
) -> None:
    """Serve until interrupted; runs cut short stay resumable in ``options.serve_dir``. ``on_start`` gets the
    uvicorn server before it starts (to stop it from elsewhere: ``server.should_exit = True``)."""
    token = resolve_token(options)
    check_port(options.host, options.port)  # before a local model starts
    check_served_methods(settings, embedded=on_embedded_model(settings))
    check_out_dir(options.serve_dir, "requests' runs are kept in a directory")
    options.serve_dir.mkdir(parents=True, exist_ok=True)
    async with provisioned(settings, log_dir=options.serve_dir) as live, in_process(live) as model:
        # The gauges read the runs at each scrape (the names resolve then, once both exist).
        metrics = ServeMetrics(queued=lambda: runs.admission.queued, in_flight=lambda: len(runs.active))
        runs = ServedRuns(
            options.serve_dir,
            live,
            embedded=on_embedded_model(settings),
            model=model,
            max_problems=options.max_problems,
            max_queue=options.max_queue,
            on_call=metrics.call_done,
            client_sampling=options.client_sampling,
            max_request_calls=options.max_request_calls,
        )
        app = ServeApp(
            runs,
            methods=sorted(METHODS),
            upstreams=[model.model_name("solution")] if model is not None else await upstream_models(live),
            token=token,
            max_body_bytes=options.max_body_bytes,
            metrics=metrics,
        )
        # Where the results are: every request is a run directory there, resumable and viewable.
        log.info("each request's run is kept in %s ('tmas view %s' shows them)", options.serve_dir, options.serve_dir)
        if runs.kept_replies:
            # Said at every start while they wait: the same request sent again has its reply, without a call.
            count = len(runs.kept_replies)
            names = ", ".join(run_dir.name for run_dir in runs.kept_replies)
            kept = (
                f"{count} stored run{'s' if count > 1 else ''} keep{'' if count > 1 else 's'} a reply no client has had"
            )
            log.info("%s, for the same request sent again: %s", kept, names)
        if options.resume:
            for job in runs.resume_all():
                log.info("resuming unfinished request %s", job.run_id)
        # On Ctrl-C, requests in flight get a few seconds: a long run is not waited for, it stays resumable.
        config = uvicorn.Config(
            app.build(),
            host=options.host,
            port=options.port,
            log_level="info",
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = uvicorn.Server(config)
        if on_start is not None:
            on_start(server)
        try:
            await server.serve()
        finally:
            await runs.close()
