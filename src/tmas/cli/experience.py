"""``tmas experience``: MATTRL's experience pool (show, search; construction commands join this group)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

experience_app = typer.Typer(help="MATTRL's experience pool: show and search it.", no_args_is_help=True)

PoolArg = Annotated[Path, typer.Argument(help="An experience pool folder.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object a line instead of text.")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file (default: ./tmas.toml).")]
BaseUrlOpt = Annotated[str | None, typer.Option("--base-url", help="OpenAI-compatible base URL of the embedder.")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Embedding model name sent to the endpoint.")]


@experience_app.command("show")
def show(
    pool: PoolArg,
    limit: Annotated[int | None, typer.Option("--limit", "-n", help="Only the first N entries.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the pool's metadata and its entries."""
    from tmas.memory.experience_pool import ExperiencePool, pool_summary

    opened = ExperiencePool.open(pool)
    entries = opened.entries[:limit] if limit is not None else opened.entries
    if as_json:
        typer.echo(json.dumps(pool_summary(opened)))
        for entry in entries:
            typer.echo(entry.model_dump_json())
        return
    s = pool_summary(opened)
    typer.echo(f"{s['path']}: version {s['version']}, {s['count']} entries, embedder {s['embedder']} (dim {s['dim']})")
    for entry in entries:
        where = f"{entry.source_problem}/r{entry.source_round}/{entry.source_agent}" if entry.source_problem else ""
        typer.echo(f"\n[{entry.id}] {entry.scope} {entry.specialty} reward={entry.reward:.3f} {where}".rstrip())
        typer.echo(entry.text)


@experience_app.command("search")
def search(
    pool: PoolArg,
    query: Annotated[str, typer.Argument(help="What to look for (a problem, a round's context).")],
    k: Annotated[int, typer.Option("-k", help="How many entries (paper: K = 8).")] = 8,
    config: ConfigOpt = None,
    base_url: BaseUrlOpt = None,
    model: ModelOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The K entries nearest to QUERY, with the pool's own embedder (a local model, or the `embedding` role's
    endpoint, which must serve the model the pool was built with)."""
    from tmas.config import load_settings
    from tmas.llm.client import LLMClient
    from tmas.memory.embedders import LOCAL_NAME, LocalEmbedder, embedder_for
    from tmas.memory.experience_pool import ExperiencePool
    from tmas.memory.pool_entry import PoolEntry

    opened = ExperiencePool.open(pool)

    async def go() -> list[tuple[PoolEntry, float]]:
        if opened.meta.embedder == LOCAL_NAME:
            return await opened.search(query, k, LocalEmbedder())
        settings = load_settings(config, {"endpoint.base_url": base_url, "endpoint.model": model})
        async with LLMClient(settings) as llm:
            embed = embedder_for("endpoint", llm)
            opened.check_embedder(embed.name)
            return await opened.search(query, k, embed)

    for entry, score in asyncio.run(go()):
        if as_json:
            typer.echo(json.dumps({"score": round(score, 6), "entry": entry.model_dump(mode="json")}))
        else:
            typer.echo(f"{score:.4f} [{entry.id}] ACTION: {entry.action}\n       EXPERIENCE: {entry.experience}")
