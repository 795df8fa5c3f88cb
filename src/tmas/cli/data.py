"""The ``tmas data`` group: ``generate`` (problems whose answers code computes), ``filter`` (the TMAS paper's
difficulty filter, appendix A.2) and ``import`` (official benchmark files into tmas JSONL)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from tmas.errors import InputError

data_app = typer.Typer(
    help="Problem data: generate verifiable problems, filter by difficulty, import official files.",
    no_args_is_help=True,
)


@data_app.command("generate")
def data_generate(
    family: Annotated[str, typer.Option("--family", help="Problem family, or 'all' (N of each).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="JSONL file to write.")],
    n: Annotated[int, typer.Option("--n", help="Problems per family.")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="Seed: the same seed gives the same problems.")] = 0,
    level: Annotated[int, typer.Option("--level", help="Difficulty, 1 (easy) to 5.")] = 1,
) -> None:
    """Write problems whose answers are computed by code (tilings, recurrences, modular arithmetic, ...)."""
    from tmas.data.generators import FAMILIES, generate, write_jsonl

    if family != "all" and family not in FAMILIES:
        raise InputError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}, all")
    count = write_jsonl(generate(family, n, seed=seed, level=level), out)
    typer.echo(f"wrote {count} problems to {out}")


@data_app.command("filter")
def data_filter(
    problems: Annotated[Path, typer.Argument(help="Problems JSONL or a benchmark name (imo-answerbench, ...).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Subset JSONL to write (its card goes beside it).")],
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="Where the k samples are kept (default: OUT's name + '.filter-run'); resumes."),
    ] = None,
    k: Annotated[int, typer.Option("-k", help="Chain-of-thought samples per problem (paper: 8).")] = 8,
    below: Annotated[
        int, typer.Option("--below", help="Keep problems solved fewer than this many times (paper: 2).")
    ] = 2,
    n: Annotated[int, typer.Option("-n", help="Problems to select from those kept (paper: 50).")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the selection (and of the run).")] = 0,
    limit: Annotated[int | None, typer.Option("--limit", help="Only the first N problems of the file.")] = None,
    grade: Annotated[str, typer.Option("--grade", help="Grading: rules, judge or combined.")] = "combined",
    judge_runs: Annotated[int, typer.Option("--judge-runs", help="Judge runs per sample (majority decides).")] = 1,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file.")] = None,
    base_url: Annotated[str | None, typer.Option("--base-url", help="OpenAI-compatible base URL(s).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="The filter model (paper: Qwen3-4B-Thinking).")] = None,
    api_key_env: Annotated[str | None, typer.Option("--api-key-env", help="Variable holding the API key.")] = None,
    concurrency: Annotated[int | None, typer.Option("--concurrency", help="Most LLM calls in flight.")] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", help="Default: the paper's 1.0.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Default: the paper's 0.95.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Max tokens per sample.")] = None,
) -> None:
    """Keep the problems a model solves fewer than --below times in k, then select n (TMAS appendix A.2)."""
    from tmas.cli.grade_flags import read_grade_flags
    from tmas.cli.options import ModelFlags
    from tmas.data.difficulty_filter import filter_settings, run_filter
    from tmas.problems import resolve_dataset

    grading = read_grade_flags(grade, judge_runs)
    flags = {"temperature": temperature, "top_p": top_p}
    settings = ModelFlags(
        config=config,
        base_url=base_url,
        model=model,
        api_key_env=api_key_env,
        concurrency=concurrency,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
    ).settings()
    settings = filter_settings(settings, k, {key for key, value in flags.items() if value is not None})
    source = resolve_dataset(problems)
    where = run_dir or out.with_name(out.stem + ".filter-run")
    card = asyncio.run(run_filter(source, where, out, settings, grading, k=k, below=below, n=n, seed=seed, limit=limit))
    counts = ", ".join(f"{c}: {card.solved_counts.get(c, 0)}" for c in range(k + 1))
    typer.echo(f"solved-of-{k} counts {{{counts}}}; kept {card.kept}; selected {len(card.selected)}")
    typer.echo(f"wrote {out} and its card ({out.stem}.card.json, .md); samples in {where}")


@data_app.command("import")
def data_import(
    source: Annotated[str, typer.Argument(help="hle, imo-answerbench or matharena.")],
    file: Annotated[Path, typer.Argument(help="The downloaded file (.csv, .jsonl, .json or .parquet).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="tmas JSONL to write.")],
    keep_all: Annotated[
        bool, typer.Option("--all", help="HLE: keep every question (default: text-only Math, as HLE-Math).")
    ] = False,
) -> None:
    """Convert an official benchmark file into tmas problems (problem_id, question, answer, its other fields)."""
    from tmas.data.importers import LAYOUTS, import_problems, write_problems

    if source not in LAYOUTS:
        raise InputError(f"unknown source {source!r}; known: {', '.join(LAYOUTS)}")
    records = import_problems(file, source, keep_all=keep_all)
    write_problems(records, out)
    typer.echo(f"wrote {len(records)} problems to {out}")
