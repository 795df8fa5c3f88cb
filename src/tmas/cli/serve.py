"""``tmas serve``: the OpenAI-compatible proxy in front of the configured upstream."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

from tmas.cli.options import ModelFlags, model_options
from tmas.errors import ConfigError
from tmas.planning.estimate import QUESTION_CALLS

# The line `tmas --help` lists it with (main.py registers the command; the docstring is its --help).
SERVE_HELP = "Serve every method as an OpenAI-compatible endpoint."


@model_options
def serve(
    flags: ModelFlags,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (beyond loopback: --token-env needed).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on.")] = 8080,
    serve_dir: Annotated[
        Path, typer.Option("--dir", "-o", help="Where each request's run is kept (viewable with tmas view).")
    ] = Path("serve-runs"),
    token_env: Annotated[
        str | None, typer.Option("--token-env", help="Environment variable holding the bearer token clients send.")
    ] = None,
    max_problems: Annotated[
        int,
        typer.Option(
            "--max-problems", envvar="TMAS_SERVE_MAX_PROBLEMS", help="Most requests solved at once (queued past)."
        ),
    ] = 4,
    max_queue: Annotated[
        int,
        typer.Option(
            "--max-queue",
            envvar="TMAS_SERVE_MAX_QUEUE",
            help="Most requests waiting for a slot, in arrival order (429 with Retry-After past; 0: no queue).",
        ),
    ] = 1024,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="Largest request body (413 past).")] = (
        1_000_000
    ),
    resume: Annotated[
        bool, typer.Option("--resume/--no-resume", help="Resume unfinished requests found in --dir at start.")
    ] = True,
    max_request_calls: Annotated[
        int,
        typer.Option(
            "--max-request-calls",
            envvar="TMAS_SERVE_MAX_REQUEST_CALLS",
            help="Most upstream calls one request's run may make, as estimated before it starts (400 past).",
        ),
    ] = QUESTION_CALLS,
    client_sampling: Annotated[
        str,
        typer.Option(
            "--client-sampling",
            help="A request's temperature, top_p, max_tokens (and top_k, min_p, repetition_penalty,"
            " presence_penalty): 'defaults' of every upstream call of its run, or"
            " 'ignore' them (this server's settings decide; for harnesses that always send their own).",
        ),
    ] = "defaults",
) -> None:
    """Answer /v1/chat/completions with a method: the model name is <method>/<upstream model>."""
    from tmas.cli import interrupt
    from tmas.runner import check_before_estimate
    from tmas.serve.client_sampling import CLIENT_SAMPLING
    from tmas.serve.launch import ServeOptions, serve

    if max_problems < 1 or max_body_bytes < 1 or max_request_calls < 1:
        raise ConfigError("--max-problems, --max-body-bytes and --max-request-calls must be at least 1")
    if max_queue < 0:
        raise ConfigError(f"--max-queue must be 0 or more (got {max_queue})")
    if client_sampling not in CLIENT_SAMPLING:
        raise ConfigError(f"--client-sampling {client_sampling!r}: choose {' or '.join(CLIENT_SAMPLING)}")
    # The group's flags configure the upstream and the defaults of every request (sampling, budget, prompts).
    settings = flags.settings()
    # As a run's: a wrong model name, an unset API key variable or --prompts-dir before the server starts.
    check_before_estimate(settings, flags.key_origin)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options = ServeOptions(
        host=host,
        port=port,
        serve_dir=serve_dir,
        token_env=token_env,
        max_problems=max_problems,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        resume=resume,
        client_sampling=client_sampling,
        max_request_calls=max_request_calls,
    )
    try:
        asyncio.run(serve(settings, options))
    except interrupt.Stopped as stop:
        # uvicorn stops on the signal and raises it again; the runs in progress are cancelled then, kept resumable.
        raise stop.saying(stopped_serving(serve_dir, resume=resume)) from None


def stopped_serving(serve_dir: Path, *, resume: bool) -> str:
    """What a stopped proxy leaves: every request's run, those cut short resumable (their finished calls replayed)."""
    kept = f"finished work is kept: each request's run is in {serve_dir}; "
    if resume:
        return kept + f"started again with --dir {serve_dir}, tmas serve resumes those cut short"
    return kept + "one cut short resumes when its request is sent again"
