"""The ``tmas data`` group: ``generate`` (problems whose answers code computes), ``filter`` (the TMAS paper's
difficulty filter, appendix A.2), ``import`` (official benchmark files into tmas JSONL) and ``lm-eval-task`` (an
lm-evaluation-harness task over a problem file, to score ``tmas serve`` with it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tmas.cli import interrupt
from tmas.cli.estimate import GateFlags, gate_options
from tmas.cli.options import ModelFlags, model_options
from tmas.errors import InputError
from tmas.files import check_creatable

if TYPE_CHECKING:
    from tmas.config import Settings
    from tmas.data.difficulty_filter import FilterCard
    from tmas.grading.grades import GradeConfig
    from tmas.planning.estimate import Estimate

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
    from tmas.data.generators import FAMILIES, generate
    from tmas.jsonl import write_jsonl

    if family != "all" and family not in FAMILIES:
        raise InputError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}, all")
    check_creatable(out, "--out")
    count = write_jsonl(generate(family, n, seed=seed, level=level), out)
    typer.echo(f"wrote {count} problems to {out}")


@data_app.command("filter")
@model_options
@gate_options
def data_filter(
    flags: ModelFlags,
    gate: GateFlags,
    problems: Annotated[Path, typer.Argument(help="Problems JSONL or a benchmark name (imo-answerbench, ...).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Subset JSONL to write (its card goes beside it).")],
    run_dir: Annotated[
        Path | None,
        typer.Option(
            "--run-dir",
            help="Where the k samples are kept (default: OUT's name + '.filter-run'); the same command again resumes"
            " it: replied samples are reused, failed ones asked again, problems a wider --limit asks for added.",
        ),
    ] = None,
    k: Annotated[int, typer.Option("-k", help="Chain-of-thought samples per problem (paper: 8).")] = 8,
    below: Annotated[
        int, typer.Option("--below", help="Keep problems solved fewer than this many times (paper: 2).")
    ] = 2,
    n: Annotated[int, typer.Option("-n", help="Problems to select from those kept (paper: 50).")] = 50,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N problems of the file.")] = None,
    grade: Annotated[str, typer.Option("--grade", help="Grading: rules, judge or combined.")] = "combined",
    judge_runs: Annotated[
        int, typer.Option("--judge-runs", help="Judge runs per sample (solved when at least half say so).")
    ] = 1,
) -> None:
    """Keep the problems a model solves fewer than --below times in k, then select n (TMAS appendix A.2).

    Only samples that replied count (a failed call says nothing of difficulty), and only those graded (a sample whose
    judge's calls failed is asked again next time, not counted wrong); a problem with replies to fewer than half of
    its k samples is undecided and left out, and named on the card. Running the same command again asks
    only the samples whose call failed (the replied ones are reused from --run-dir), so a problem left undecided by a
    failing server is decided once it answers. Run again with another model, server (where no --model is named),
    sampling or --seed, it is refused before any call: one filter's samples are of one model; give another --run-dir.

    The samples are drawn at the paper's temperature 1.0, top_p 0.95 and 128K tokens (the paper's filter model:
    Qwen3-4B-Thinking) where no one set their own: a value of the config file, a TMAS_* variable or a flag is sent as
    set and said beside the paper's. The paper's sampling is the samples' alone: the grading judge is asked at the
    settings' own, as tmas eval's judge is. The 128K tokens are fitted down to the context window the server states; run
    again on its --run-dir, the filter samples at the max_tokens its samples were drawn with (2048 for a run begun
    before the paper's length was the default). Problems without an answer are skipped, never sampled. The run seed
    (--seed) seeds the selection too.

    Before any call it prints what it will send, and above --confirm-calls (20,000) or --confirm-tokens asks
    (without a terminal, refuses unless --yes); --dry-run prints the whole estimate and stops."""
    from tmas.cli.estimate import gate as cost_gate
    from tmas.cli.grade_flags import check_grading_installed, read_grade_flags
    from tmas.cli.progress import RunProgress
    from tmas.data.difficulty_filter import (
        default_max_tokens,
        filter_settings,
        run_filter,
        sampling_notes,
        user_sampling,
    )
    from tmas.problems import resolve_dataset
    from tmas.runner import RunState, check_before_estimate

    grading = read_grade_flags(grade, judge_runs)
    check_grading_installed(grading)  # before the model's calls are spent
    given = flags.settings()
    user = user_sampling(given)
    where = run_dir or out.with_name(out.stem + ".filter-run")
    # As a run's: a wrong model name, an unset API key variable or --prompts-dir before the estimate (and before the
    # server is asked its context window).
    check_before_estimate(filter_settings(given, k), flags.key_origin)
    cap, why = interrupt.run(default_max_tokens(given, where), keeps=False)
    settings = filter_settings(given, k, max_tokens=cap)
    source = resolve_dataset(problems)
    notes = sampling_notes(user, settings)
    said = [f"max_tokens {cap}: {why} (--max-tokens sets another)"] if cap is not None else []
    said += [f"note: {note}" for note in notes]
    # The estimate first: it refuses a run directory of other samples, and a refusal is the one line said.
    planned = _filter_estimate(source, where, settings, grading, k, limit)
    if gate.dry_run and said:  # said with the estimate it stops at; else once the gate passes
        typer.echo("\n".join(f"tmas: {line}" for line in said), err=True)
    cost_gate(planned, gate)
    for line in said:
        typer.echo(f"tmas: {line}", err=True)
    seed = settings.seed
    state = RunState()
    reporter = RunProgress(state)

    async def sample() -> FilterCard:
        async with reporter.running():
            return await run_filter(
                source, where, out, settings, grading, k=k, below=below, n=n, seed=seed, limit=limit,
                state=state, on_result=reporter.on_result, notes=notes,
            )  # fmt: skip

    try:
        card = interrupt.run(sample())
    except interrupt.Stopped as stop:
        sampled = f"{state.done + state.failed + state.skipped} of {state.total} problems sampled"
        raise stop.saying(
            f"the samples drawn are kept in {where} ({sampled}): run the same command again to resume"
        ) from None
    counts = ", ".join(f"{c}: {card.solved_counts.get(c, 0)}" for c in range(k + 1))
    undecided = f"; undecided {len(card.undecided)} (too few replies)" if card.undecided else ""
    skipped = f"; skipped {len(card.unlabeled)} problems without an answer" if card.unlabeled else ""
    typer.echo(
        f"solved-of-{k} counts {{{counts}}}; kept {card.kept}; selected {len(card.selected)}{undecided}{skipped}"
    )
    typer.echo(f"wrote {out} and its card ({out.stem}.card.json, .md); samples in {where}")


def _filter_estimate(
    source: Path, run_dir: Path, settings: Settings, grading: GradeConfig, k: int, limit: int | None
) -> Estimate:
    """The samples the filter sends: k per problem asked, less the problems an earlier filter into ``run_dir``
    settled (skipped) and the answered samples it replays; its judge's calls said beside them."""
    from tmas.cli.estimate import judge_calls
    from tmas.data.difficulty_filter import holds_filter_run, labeled_problems, served_by_filter_run
    from tmas.planning.estimate import Estimate, estimate_point, replay_credit
    from tmas.runner import RunSetup, run_method
    from tmas.store.run_store import RunStore

    # Only problems with a reference answer are sampled (the others cannot be judged).
    asked, _ = labeled_problems(source, limit)
    settled: set[str] = set()
    replays: dict[str, int] = {}
    # Another run there, or samples drawn otherwise (another model, server or sampling), are refused before the
    # estimate (which would count their calls as this filter's, and print before the refusal).
    served = interrupt.run(served_by_filter_run(run_dir, settings, own_model=False))
    if holds_filter_run(run_dir, source, k, settings, served=served):
        with RunStore(run_dir, read_only=True) as peek:
            setup = RunSetup.check(settings)
            settled = setup.settled(peek) & {p.problem_id for p in asked}
            replays = setup.replays(peek, settled)
    point = estimate_point(run_dir.name, run_method(settings), settings, len(asked) - len(settled), None)
    planned = Estimate([point], measurable=False)
    planned.stored_calls = replay_credit(point, replays)
    judged = judge_calls(grading)
    planned.left_out += [judged.replace("the report's", "the grading's")] if judged else []
    return planned


@data_app.command("import")
def data_import(
    source: Annotated[str, typer.Argument(help="hle, imo-answerbench or matharena.")],
    file: Annotated[Path, typer.Argument(help="The downloaded file (.csv, .jsonl, .json or .parquet).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="tmas JSONL to write.")],
    keep_all: Annotated[
        bool, typer.Option("--all", help="HLE: text-only questions of every category (default: of Math, as HLE-Math).")
    ] = False,
) -> None:
    """Convert an official benchmark file into tmas problems (problem_id, question, answer, its other fields)."""
    from tmas.data.importers import LAYOUTS, import_problems
    from tmas.jsonl import write_jsonl

    if source not in LAYOUTS:
        raise InputError(f"unknown source {source!r}; known: {', '.join(LAYOUTS)}")
    if out.is_dir():
        raise InputError(f"--out {out} is a directory: give the file to write")
    check_creatable(out, "--out")
    if out.exists() and out.resolve() == file.resolve():
        # The download would be replaced by its conversion, the fields this import leaves out lost with it.
        raise InputError(f"--out {out} is the file being imported: write the problems to another file")
    records = import_problems(file, source, keep_all=keep_all)
    write_jsonl(records, out)
    typer.echo(f"wrote {len(records)} problems to {out}")


@data_app.command("lm-eval-task")
def data_lm_eval_task(
    problems: Annotated[Path, typer.Argument(help="Problems JSONL or a benchmark name (with answers).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write NAME.yaml and NAME.jsonl into.")],
    name: Annotated[str, typer.Option("--name", help="The task's name (lm_eval --tasks NAME).")] = "tmas_problems",
    max_gen_toks: Annotated[
        int, typer.Option("--max-gen-toks", help="max_tokens of every upstream call (lm-eval's default: 256).")
    ] = 2048,
    temperature: Annotated[
        float, typer.Option("--temperature", help="Temperature of every upstream call (lm-eval's default: 0).")
    ] = 0.7,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N problems.")] = None,
) -> None:
    """Write an lm-evaluation-harness task over the problems, to score `tmas serve` with lm-eval (docs/serve.md)."""
    from itertools import islice

    from tmas.data.lm_eval_task import write_task
    from tmas.problems import located_problems, resolve_dataset

    located = list(islice(located_problems(resolve_dataset(problems)), limit))
    chosen = [problem for _, problem in located]
    # A problem with no answer, or a blank one (it matches no reply: lm-eval would score every reply to it wrong), is
    # refused naming its file and line.
    places = {problem.problem_id: where for where, problem in located}
    yaml_file, data_file = write_task(
        chosen, out, name, max_gen_toks=max_gen_toks, temperature=temperature, places=places
    )
    typer.echo(f"wrote {yaml_file} and {data_file} ({len(chosen)} problems)")
    typer.echo(
        f"lm_eval run --model local-chat-completions --apply_chat_template --include_path {out} --tasks {name}"
        " --model_args model=tmas/MODEL,base_url=http://127.0.0.1:8080/v1/chat/completions,num_concurrent=8"
    )
