"""``tmas pool`` (also ``tmas experience``, the name users know): MATTRL's cross-problem experience pool: show and
search it; build, prune, the few-shot control and the adaptive router (docs/experience.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import BaseModel

from tmas.cli import interrupt
from tmas.cli.estimate import GateFlags, gate_options
from tmas.cli.options import ModelFlags, PromptsDirOpt, model_options
from tmas.errors import InputError

if TYPE_CHECKING:  # numpy and faiss: imported where a command needs them
    from tmas.pool.build import BuildConfig

Model = TypeVar("Model", bound=BaseModel)

pool_app = typer.Typer(
    help="MATTRL's experience pool: build, show, search and prune it; the few-shot control; the router."
    " Also 'tmas experience'.",
    no_args_is_help=True,
)

PoolArg = Annotated[Path, typer.Argument(help="An experience pool folder.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object a line instead of text.")]


@pool_app.command("show")
def show(
    pool: PoolArg,
    limit: Annotated[int | None, typer.Option("--limit", "-n", min=1, help="Only the first N entries.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the pool's metadata and its entries."""
    from tmas.memory.pool import Pool, pool_summary

    opened = Pool.open(pool)
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


@pool_app.command("search")
@model_options
def search(
    flags: ModelFlags,
    pool: PoolArg,
    query: Annotated[str, typer.Argument(help="What to look for (a problem, a round's context).")],
    k: Annotated[int, typer.Option("-k", min=1, help="How many entries (paper: K = 8).")] = 8,
    as_json: JsonOpt = False,
) -> None:
    """The K entries nearest to QUERY, with the pool's own embedder (a local model, or the `embedding` role's
    endpoint, which must serve the model the pool was built with)."""
    from tmas.llm.factory import open_model
    from tmas.memory.embedders import LOCAL_NAME, LocalEmbedder, embedder_for
    from tmas.memory.pool import Pool
    from tmas.memory.pool_entry import PoolEntry

    opened = Pool.open(pool)
    if opened.meta.embedder == LOCAL_NAME:
        flags.unused(f"for a pool of the {LOCAL_NAME} embedder, which runs in process")
    else:
        _unread(flags, _CHAT_FLAGS + _RUN_FLAGS, "tmas pool search sends only embedding requests, which take none")

    async def go() -> list[tuple[PoolEntry, float]]:
        if opened.meta.embedder == LOCAL_NAME:
            return await opened.search(query, k, LocalEmbedder())
        async with open_model(flags.settings()) as llm:
            embed = embedder_for("endpoint", llm)
            opened.check_embedder(embed.name)
            return await opened.search(query, k, embed)

    for entry, score in interrupt.run(go()):
        if as_json:
            typer.echo(json.dumps({"score": round(score, 6), "entry": entry.model_dump(mode="json")}))
        else:
            typer.echo(f"{score:.4f} [{entry.id}] ACTION: {entry.action}\n       EXPERIENCE: {entry.experience}")


# ---- construction and lifecycle (paper 003, sections 3.2, 5.1, 5.2) --------------------------------------------

RunsArg = Annotated[list[Path], typer.Argument(help="Run directories of MATTRL runs on labelled problems.")]
GradeOpt = Annotated[
    str | None,
    typer.Option(
        "--grade",
        help="How final answers are graded: rules, judge or combined (default; as `tmas eval`; a medicine run's"
        " diagnoses by the diagnosis grader).",
    ),
]


# The options whose flag is not their field's name with dashes.
_FLAGS = {"lam": "--lambda", "grade_mode": "--grade"}


def _checked(model: type[Model], command: str, values: dict[str, Any]) -> Model:
    """The options given (not None) validated as ``model``, its defaults elsewhere; a bad option is a one-line
    error naming its flag and the value given."""
    from pydantic import ValidationError

    from tmas.errors import ConfigError

    given = {k: v for k, v in values.items() if v is not None}
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        field = str(err["loc"][0]) if err["loc"] else None
        if field not in given:
            raise ConfigError(f"pool {command}: {msg}") from None
        flag = _FLAGS.get(field, "--" + field.replace("_", "-"))
        raise ConfigError(f"{flag} {given[field]}: {msg}") from None


# The flags of the model group that bound a run's problems (its budget, how many at once): no pool command solves a
# problem, so they would be read by nothing (a build's calls are bounded by the cost gate's --confirm-calls).
_RUN_FLAGS = ("problems_in_flight", "budget_tokens", "budget_calls", "budget_count", "budget_pool")
_BOUND = "a budget and problems in flight bound a run's problems"
# What a chat call takes beyond its endpoint and model: an embedding request takes none of it.
_CHAT_FLAGS = (
    "prompts_dir",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "max_tokens",
    "seed",
)


def _unread(flags: ModelFlags, names: tuple[str, ...], why: str) -> None:
    """Refuse the flags of ``names`` given, which the command reads nothing of (``why``, in words)."""
    given = flags.given(*names)
    typed = [f"--{name.replace('_', '-')}" for name in names if name in given]
    if typed:
        raise InputError(f"{', '.join(typed)}: {why}; leave {'it' if len(typed) == 1 else 'them'} out")


def _grading_only(flags: ModelFlags, command: str) -> None:
    """Refuse what a command whose only calls grade the runs reads nothing of: ``--prompts-dir`` (a grading renders
    the packaged judge templates: its verdicts are stored in the run and read by its reports) and the flags that
    bound a run's problems."""
    graded = "whose judge prompts are the packaged ones (as tmas report's)"
    _unread(flags, ("prompts_dir",), f"tmas pool {command} sends only the runs' grading, {graded}")
    _unread(flags, _RUN_FLAGS, f"{_BOUND}, and tmas pool {command} solves none")


def _check_selection(config: BuildConfig, given: dict[str, Any]) -> None:
    """Refuse the build options the chosen scheme or selection reads nothing of: each would change nothing."""
    unread = [
        (
            "quantile",
            config.tau is not None,
            "with --tau the turns kept are those with reward >= tau (Eq. 13), not a top share",
        ),
        (
            "permutations",
            config.scheme != "shapley",
            f"only the shapley scheme draws orders (--scheme {config.scheme})",
        ),
        (
            "beta",
            config.scheme == "naive",
            "Eq. 16 normalises the difference and shapley schemes' credit scores; the"
            " naive scheme's shares are Eq. 11's",
        ),
    ]
    for name, unused, why in unread:
        if unused and given[name] is not None:
            raise InputError(f"--{name} {given[name]}: {why}; leave it out")


@pool_app.command("build")
@model_options
@gate_options
def build(
    flags: ModelFlags,
    gate: GateFlags,
    runs: RunsArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="The pool folder to create or extend.")],
    scheme: Annotated[
        str | None, typer.Option("--scheme", help="Credit: naive (Eq. 11, default), difference (17), shapley (18).")
    ] = None,
    lam: Annotated[float | None, typer.Option("--lambda", help="Eq. 12's weight of the judge's score (0.4).")] = None,
    gamma: Annotated[float | None, typer.Option("--gamma", help="Eq. 10's decay per earlier turn (0.85).")] = None,
    beta: Annotated[float | None, typer.Option("--beta", help="Eq. 16's softmax sharpness (5).")] = None,
    decay: Annotated[
        str | None,
        typer.Option("--decay", help="Eq. 10's direction: auto (education earlier, else later), later, earlier."),
    ] = None,
    tau: Annotated[float | None, typer.Option("--tau", help="Keep turns with reward >= tau (Eq. 13).")] = None,
    quantile: Annotated[float | None, typer.Option("--quantile", help="Without --tau: the top share (0.25).")] = None,
    permutations: Annotated[int | None, typer.Option("--permutations", help="Shapley: orders per turn (8).")] = None,
    retries: Annotated[int | None, typer.Option("--retries", help="Retries of unusable judge replies (2).")] = None,
    grade: GradeOpt = None,
    match: Annotated[
        str | None,
        typer.Option(
            "--match", help="Medicine: gold names by 'judge' (spelling, then the judge; default) or 'spelling'."
        ),
    ] = None,
    embedder: Annotated[str | None, typer.Option("--embedder", help="endpoint (default) or local.")] = None,
) -> None:
    """Score, credit and distil the runs' transcripts into pool entries (calls stored in OUT.build/: run it again
    to resume). The endpoint serves the judge, summarizer and embedder; --seed also seeds the Shapley orders (0);
    --prompts-dir replaces the turn judge's and the summarizer's templates (the runs' grading keeps the packaged ones).
    Before any call it prints what it will send, and above --confirm-calls (20,000) asks (without a terminal, refuses
    unless --yes); --dry-run prints the whole estimate and stops."""
    from tmas.cli.estimate import gate as cost_gate
    from tmas.memory.embedders import EMBEDDING_ROLE, ENDPOINT
    from tmas.planning.pool_build import estimate_build
    from tmas.pool.build import SUMMARIZER_ROLE, BuildConfig, build_pool
    from tmas.pool.scoring import JUDGE_ROLE
    from tmas.runner import check_before_estimate

    options = {
        "scheme": scheme,
        "lam": lam,
        "gamma": gamma,
        "beta": beta,
        "decay": decay,
        "tau": tau,
        "quantile": quantile,
        "permutations": permutations,
        "retries": retries,
        "grade_mode": grade,
        "match": match,
        "embedder": embedder,
        "seed": flags.seed,
    }
    build_config = _checked(BuildConfig, "build", options)
    _check_selection(build_config, options)
    _unread(flags, _RUN_FLAGS, f"{_BOUND}, and tmas pool build solves none (--confirm-calls bounds its calls)")
    settings = flags.settings()
    # As a run's: a wrong model name, an unset API key variable or --prompts-dir before the estimate.
    roles = (JUDGE_ROLE, SUMMARIZER_ROLE, *((EMBEDDING_ROLE,) if build_config.embedder == ENDPOINT else ()))
    check_before_estimate(settings, flags.key_origin, roles)
    cost_gate(estimate_build(runs, out, settings, build_config), gate)
    with _StageProgress() as progress:
        summary = interrupt.run(build_pool(runs, out, settings, build_config, progress=progress.update))
    typer.echo(json.dumps(summary.to_dict(), indent=2))


@pool_app.command("prune")
@model_options
def prune(
    flags: ModelFlags,
    pool: PoolArg,
    runs: Annotated[
        list[Path] | None, typer.Option("--runs", help="MATTRL runs that retrieved from the pool (repeatable).")
    ] = None,
    duplicate_cosine: Annotated[
        float | None, typer.Option("--duplicate-cosine", help="Merge at this similarity (0.92).")
    ] = None,
    recency_decay: Annotated[
        float | None, typer.Option("--recency-decay", help="Weight kept per pool version (0.8).")
    ] = None,
    min_recency_weight: Annotated[
        float | None, typer.Option("--min-recency-weight", help="Drop below this weight (0.1).")
    ] = None,
    min_uses: Annotated[int | None, typer.Option("--min-uses", help="Uses needed to judge an entry (3).")] = None,
    wrong_margin: Annotated[
        float | None, typer.Option("--wrong-margin", help="Wrong rate above the base that drops (0.3).")
    ] = None,
    grade: GradeOpt = None,
    match: Annotated[
        str | None,
        typer.Option(
            "--match", help="Medicine: gold names by 'judge' (spelling, then the judge; default) or 'spelling'."
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would go; change nothing.")] = False,
) -> None:
    """Merge near-duplicates, drop entries that aged out and entries whose use correlates with wrong answers."""
    from tmas.pool.lifecycle import PruneConfig, prune_pool

    options = {
        "duplicate_cosine": duplicate_cosine,
        "recency_decay": recency_decay,
        "min_recency_weight": min_recency_weight,
        "min_uses": min_uses,
        "wrong_margin": wrong_margin,
        "grade_mode": grade,
        "match": match,
        "dry_run": dry_run,
    }
    prune_config = _checked(PruneConfig, "prune", options)
    if not runs:
        flags.unused("without --runs (only the runs' answers are graded)")
        # Rule 1's options: it judges entries by the graded problems of the runs that retrieved them.
        for name in ("min_uses", "wrong_margin", "grade_mode", "match"):
            if options[name] is not None:
                flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
                raise InputError(
                    f"{flag} {options[name]}: only the wrong-correlated rule reads it, from the graded problems of"
                    " --runs; give --runs, or leave it out"
                )
    _grading_only(flags, "prune")
    settings = flags.settings() if runs else None
    summary = interrupt.run(prune_pool(pool, runs or [], settings, prune_config))
    typer.echo(json.dumps(summary.to_dict(), indent=2))


router_app = typer.Typer(help="The adaptive router (paper 003, Table 5): single agent or MATTRL per case.")
pool_app.add_typer(router_app, name="router")


@router_app.command("train")
@model_options
def router_train(
    flags: ModelFlags,
    single: Annotated[Path, typer.Option("--single", help="Run directory of the single agent (e.g. cot).")],
    mattrl: Annotated[Path, typer.Option("--mattrl", help="Run directory of MATTRL on the same problems.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Router file (JSON) to write.")],
    grade: GradeOpt = None,
) -> None:
    """Train the router from two graded runs; print its accuracy and token savings (--seed seeds the
    cross-validation folds, 0 by default)."""
    from tmas.pool.router import RouterTraining, paired_cases, save_router, train_router

    checked = _checked(RouterTraining, "router train", {"grade_mode": grade})
    _grading_only(flags, "router train")
    cases = interrupt.run(paired_cases(single, mattrl, flags.settings(), checked.grade_mode))
    router = train_router(cases, seed=flags.seed or 0)
    save_router(router, out)
    typer.echo(json.dumps(router.report, indent=2))


@router_app.command("route")
def router_route(
    router: Annotated[Path, typer.Argument(help="A router file from `router train`.")],
    problems: Annotated[Path, typer.Argument(help="Problems JSONL.")],
    split: Annotated[
        Path | None, typer.Option("--split", help="Also write DIR/single.jsonl and DIR/mattrl.jsonl to run apart.")
    ] = None,
) -> None:
    """Print each problem's route (one JSON object a line)."""
    from tmas.pool.router import SINGLE, TEAM, RouterModel
    from tmas.problems import load_problems

    if split is not None and split.exists() and not split.is_dir():
        raise InputError(f"--split {split}: a file, not a directory for single.jsonl and mattrl.jsonl")
    model_ = RouterModel.load(router)
    loaded = load_problems(problems)
    routes = {p.problem_id: model_.route(p.question, p.metadata) for p in loaded}
    for p in loaded:
        typer.echo(json.dumps({"problem_id": p.problem_id, "route": routes[p.problem_id]}))
    if split is not None:
        split.mkdir(parents=True, exist_ok=True)
        for name in (SINGLE, TEAM):
            with (split / f"{name}.jsonl").open("w", encoding="utf-8") as handle:
                for p in loaded:
                    if routes[p.problem_id] == name:
                        handle.write(p.model_dump_json(exclude_none=True) + "\n")


class _StageProgress:
    """A Rich progress bar per build stage on a terminal; nothing otherwise (the summary is printed at the end)."""

    def __init__(self) -> None:
        import sys

        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not sys.stderr.isatty(),
        )
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> _StageProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, stage: str, done: int, total: int) -> None:
        if stage not in self._tasks:
            self._tasks[stage] = self._progress.add_task(stage, total=total)
        self._progress.update(self._tasks[stage], completed=done, total=total)


@pool_app.command("fewshot")
def fewshot(
    problems: Annotated[Path, typer.Argument(help="Problems JSONL to prepend exemplars to.")],
    exemplars: Annotated[Path, typer.Option("--exemplars", help="Labelled problems JSONL (a disjoint split).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="JSONL file to write.")],
    k: Annotated[int, typer.Option("-k", min=1, help="Exemplars per problem (paper, Table 6: 3).")] = 3,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the draw.")] = 0,
    prompts_dir: PromptsDirOpt = None,
) -> None:
    """The few-shot control of Table 6: each problem with K random solved exemplars prepended (fewshot_question.j2,
    which --prompts-dir, prompts_dir or TMAS_PROMPTS_DIR may replace)."""
    from tmas.agents.overrides import check_overrides
    from tmas.agents.templates import prompts_from
    from tmas.jsonl import write_jsonl
    from tmas.pool.fewshot import with_exemplars
    from tmas.problems import load_problems

    folder = ModelFlags(prompts_dir=prompts_dir).settings().prompts_dir
    if folder:
        check_overrides(folder)
    with prompts_from(folder):
        shots = with_exemplars(load_problems(problems), load_problems(exemplars), k, seed)
    count = write_jsonl((p.model_dump(mode="json", exclude_none=True) for p in shots), out)
    typer.echo(f"wrote {count} problems with {k} exemplars each to {out}")
