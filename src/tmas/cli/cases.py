"""``tmas cases``: MATTRL's medicine and education domains: import public case formats, grade a run by the
domain's own metrics (medicine: Hit@1/3/5/10 and MRR; education: Acc_pre, Acc_post and their delta)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer

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
    from tmas.errors import InputError
    from tmas.eval.case_formats import READERS

    if fmt not in READERS:
        raise InputError(f"unknown case format {fmt!r} (known: {', '.join(READERS)})")
    problems = list(READERS[fmt](source))  # a bad line stops before anything is written
    with out.open("w", encoding="utf-8") as handle:
        for p in problems:
            record = {"problem_id": p.problem_id, "question": p.question, "answer": p.answer, **p.metadata}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    typer.echo(f"wrote {len(problems)} cases to {out}")


@cases_app.command("grade")
def grade(
    run_dir: Annotated[Path, typer.Argument(help="A run of `--method mattrl --domain medicine|education`.")],
    judge: Annotated[
        bool, typer.Option("--judge", help="Medicine: match names with the `judge` role (A.5 rules), not by spelling.")
    ] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file.")] = None,
    base_url: Annotated[str | None, typer.Option("--base-url", help="The judge's endpoint.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="The judge's model.")] = None,
) -> None:
    """One JSON line per case, then the metrics."""
    from tmas.config import load_settings
    from tmas.eval.diagnosis import judge_rank, name_rank, ranking_metrics
    from tmas.eval.teaching import teaching_metrics
    from tmas.llm.client import LLMClient
    from tmas.store.run_store import RunStore

    with RunStore(run_dir, create=False) as store:
        answers = {p.problem_id: p.answer for p in store.iter_problems()}
        results = [r for r in store.results() if answers.get(r["problem_id"])]
        states = [_last_state(r) for r in results]
        if any("pre" in s for s in states):
            rows = [
                {
                    "problem_id": r["problem_id"],
                    "pre": s.get("pre"),
                    "post": s.get("post"),
                    "pre_correct": bool(s.get("pre_correct")),
                    "post_correct": bool(s.get("post_correct")),
                }
                for r, s in zip(results, states, strict=True)
            ]
            for row in rows:
                typer.echo(json.dumps(row))
            typer.echo(json.dumps({"cases": len(rows), **teaching_metrics(rows)}))
            return
        cases = [
            (r["problem_id"], _top10(s), answers[r["problem_id"]] or "") for r, s in zip(results, states, strict=True)
        ]

        async def ranks() -> list[tuple[int | None, str | None]]:
            if not judge:
                return [(name_rank(top, gold), None) for _, top, gold in cases]
            settings = load_settings(config, {"endpoint.base_url": base_url, "endpoint.model": model})
            async with LLMClient(settings, store) as llm:
                return [await judge_rank(llm, pid, top, gold) for pid, top, gold in cases]

        ranked = asyncio.run(ranks())
    for (pid, _, _), (rank, why) in zip(cases, ranked, strict=True):
        typer.echo(json.dumps({"problem_id": pid, "rank": rank, **({"error": why} if why else {})}))
    typer.echo(json.dumps({"cases": len(cases), **ranking_metrics([rank for rank, _ in ranked])}))


def _last_state(result: dict[str, Any]) -> dict[str, Any]:
    iterations = result.get("iterations") or []
    state = iterations[-1].get("state", {}) if iterations else {}
    return state if isinstance(state, dict) else {}


def _top10(state: dict[str, Any]) -> list[str]:
    """The final differential of a result (its last record's decision)."""
    decision = state.get("decision") or {}
    return [str(name) for name in decision.get("top10", [])]
