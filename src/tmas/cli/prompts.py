"""``tmas prompts``: the packaged prompt templates, and a folder of overrides checked against them (``prompts_dir``).

Start an override from ours: ``tmas prompts show tmas_verify.j2 > my-prompts/tmas_verify.j2``, edit it, check it with
``tmas prompts diff my-prompts``, and run with ``prompts_dir = "my-prompts"`` (or ``TMAS_PROMPTS_DIR``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

prompts_app = typer.Typer(
    help="Prompt templates: list and show the packaged ones, check and diff a folder of overrides.",
    no_args_is_help=True,
)


@prompts_app.command("list")
def list_templates(
    prompts_dir: Annotated[
        Path | None, typer.Option("--prompts-dir", help="Also mark which templates this folder overrides.")
    ] = None,
) -> None:
    """Every packaged template with the variables it is rendered with (partials, included by others, start
    with '_'); those grading renders are always the packaged ones."""
    from tmas.agents.overrides import (
        GRADING_TEMPLATES,
        check_not_grading,
        check_overrides,
        given_variables,
        packaged_names,
    )

    overridden = {o.name for o in check_not_grading(check_overrides(prompts_dir))} if prompts_dir else set()
    for name in packaged_names():
        mark = "  (overridden)" if name in overridden else ""
        mark = "  (grading: always the packaged one)" if name in GRADING_TEMPLATES else mark
        typer.echo(f"{name}{mark}\n    variables: {', '.join(sorted(given_variables(name))) or '-'}")


@prompts_app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="A template name, e.g. tmas_verify.j2 ('.j2' may be left out).")],
) -> None:
    """Print a packaged template, to start an override from (not one grading renders: always the packaged one)."""
    from tmas.agents.overrides import GRADING_TEMPLATES, SUFFIX, packaged_source

    name = name if name.endswith(SUFFIX) else name + SUFFIX
    typer.echo(packaged_source(name), nl=False)
    if name in GRADING_TEMPLATES:
        said = "every grading renders the packaged one, and refuses an override"
        typer.echo(f"tmas: {name} is a grading template: {said}", err=True)


@prompts_app.command("diff")
def diff(prompts_dir: Annotated[Path, typer.Argument(help="A folder of override templates (NAME.j2).")]) -> None:
    """Check every override in PROMPTS_DIR (as a run does at start) and show how each differs from ours."""
    from tmas.agents.overrides import check_not_grading, check_overrides, override_diff

    overrides = check_not_grading(check_overrides(prompts_dir))
    if not overrides:
        typer.echo(f"{prompts_dir}: no override templates (*.j2)")
    for override in overrides:
        typer.echo(f"# {override.name}  sha256 {override.sha256}")
        typer.echo(override_diff(override) or "(same as the packaged template)\n", nl=False)
