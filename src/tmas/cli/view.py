"""``tmas view RUN_DIR...``: the web viewer of runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tmas.errors import InputError

# The line `tmas --help` lists it with (main.py registers the command; the docstring is its --help).
VIEW_HELP = "Browse runs in a local web viewer."


def view(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run directories, or directories of runs (tmas serve --dir, sweeps).")
    ],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on.")] = 8090,
) -> None:
    """Show runs, problems, iterations, memory banks and every call, updating live; never writes to a run."""
    import uvicorn

    from tmas.cli import interrupt
    from tmas.serve.launch import check_port, is_loopback
    from tmas.view.app import view_app as build

    missing = [str(p) for p in run_dirs if not p.is_dir()]
    if missing:
        raise InputError(f"not a directory: {', '.join(missing)}")
    check_port(host, port)
    if not is_loopback(host):
        typer.echo(f"tmas view: listening on {host}: anyone who reaches it reads every prompt and reply", err=True)
    typer.echo(f"tmas view: http://{host}:{port}/", err=True)
    try:
        uvicorn.run(build(run_dirs, host=host), host=host, port=port, log_level="warning")
    except interrupt.Stopped as stop:
        # uvicorn stops on the signal, then raises it again: no work was begun that a stop could leave half done.
        raise stop.saying(STOPPED) from None


# The last line's end when a signal stops the viewer (tmas.cli.interrupt).
STOPPED = "the viewer has stopped (it writes nothing to the runs it shows)"
