"""``tmas cases``: MATTRL's medicine and education domains: import public case formats, grade a run by the
domain's own metrics (medicine: Hit@1/3/5/10 and MRR; education: Acc_pre, Acc_post and their delta)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tmas.cli import interrupt
from tmas.cli.options import ModelFlags, model_options

cases_app = typer.Typer(help="MATTRL's medicine and education cases: import, grade.", no_args_is_help=True)


@cases_app.command("import")
def import_cases(
    source: Annotated[Path, typer.Argument(help="Cases as JSONL in a public format.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Problems JSONL to write.")],
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="rarebench (medicine) or supergpqa (education multiple choice).")
    ],
) -> None:
    """Convert cases to the problems JSONL that `tmas run` reads."""
    from tmas.data.case_import import READERS, read_cases
    from tmas.errors import InputError

    if fmt not in READERS:
        raise InputError(f"unknown case format {fmt!r} (known: {', '.join(READERS)})")
    problems = read_cases(READERS[fmt], source)  # a bad line stops before anything is written
    with out.open("w", encoding="utf-8") as handle:
        for p in problems:
            record = {"problem_id": p.problem_id, "question": p.question, "answer": p.answer, **p.metadata}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    typer.echo(f"wrote {len(problems)} cases to {out}")


@cases_app.command("grade")
@model_options
def grade(
    flags: ModelFlags,
    run_dir: Annotated[Path, typer.Argument(help="A run of `--method mattrl --domain medicine|education`.")],
    judge: Annotated[
        bool, typer.Option("--judge", help="Medicine: match names with the `judge` role (A.5 rules), not by spelling.")
    ] = False,
) -> None:
    """One JSON line per case, then the metrics (with --judge, the endpoint flags name the judge's)."""
    from tmas.errors import InputError
    from tmas.grading.cases import grade_cases

    if not judge:
        flags.unused("without --judge (names are matched by spelling)")
    settings = flags.settings() if judge else None
    graded = interrupt.run(grade_cases(run_dir, settings))
    if not graded.rows:
        raise InputError(f"{run_dir}: no finished case with a reference answer to grade")
    for row in graded.rows:
        typer.echo(json.dumps(row))
    typer.echo(json.dumps(graded.metrics))
