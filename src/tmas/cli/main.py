"""The ``tmas`` command."""

from __future__ import annotations

import functools
import json
import signal
import sqlite3
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError

from tmas import __version__
from tmas.cli import interrupt
from tmas.cli.cases import cases_app
from tmas.cli.data import data_app
from tmas.cli.estimate import (
    JUDGE_GRADERS,
    EstimateFlags,
    GateFlags,
    estimate_options,
    gate_options,
    judge_calls,
)
from tmas.cli.extras import MISSING_EXTRA_EXIT, missing_extra
from tmas.cli.grade_flags import (
    GradeModeOpt,
    JudgeRunsOpt,
    ReportGradeOpt,
    ReportJudgeRunsOpt,
    check_grading_installed,
    grade_words,
    read_grade_flags,
    read_report_grade_flags,
)
from tmas.cli.help_format import command_of
from tmas.cli.method_help import method_parameters_help
from tmas.cli.options import (
    BaseUrlOpt,
    ConfigOpt,
    HFModelOpt,
    KeyEnvOpt,
    MethodFlags,
    MethodOpt,
    ModelFlags,
    ModelOpt,
    ParamOpt,
    flag_error,
    method_options,
    model_options,
    parse_params,
)
from tmas.cli.outcome import EXIT_ALL_FAILED, EXIT_INTERRUPTED, exit_code, failed_calls_line, failed_line
from tmas.cli.pool import pool_app
from tmas.cli.prompts import prompts_app
from tmas.cli.rl import rl_app
from tmas.cli.serve import SERVE_HELP, serve
from tmas.cli.steps import Steps
from tmas.cli.usage import ParserError, error_line
from tmas.cli.view import VIEW_HELP, view
from tmas.config import OverrideError, Settings, with_method_params
from tmas.errors import InputError, TmasError
from tmas.files import check_out_dir, replacing

if TYPE_CHECKING:
    from tmas.grading.grades import GradeConfig
    from tmas.runner import StoredProblems
    from tmas.store.run_store import RunStore
    from tmas.sweep import SweepSpec, SweepSummary

app = typer.Typer(
    name="tmas",
    help="Multi-agent test-time scaling of LLM reasoning on any OpenAI-compatible endpoint.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# The option group every command that talks to a model shares is declared once, in tmas.cli.options.
LimitOpt = Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N problems.")]
# Every method's parameters and the stopping and confidence rules, at the end of --help of the commands with --param.
METHOD_PARAMETERS = method_parameters_help()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tmas {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """tmas: TMAS, MATTRL and baselines on any OpenAI-compatible endpoint."""


async def _solving(text: str, settings: Settings, run_dir: Path | None) -> Any:
    """The question solved; on a terminal with the live display ``tmas run`` shows (the question's iteration, the
    calls in flight and sent, the tokens), since a question can take minutes (the embedded model on a CPU) or hours
    (``preset=paper``). Without a terminal, standard error holds the estimate and the summary alone, as before."""
    from tmas.api import solve_question
    from tmas.cli.progress import RunProgress
    from tmas.runner import RunState

    state = RunState() if sys.stderr.isatty() else None
    asking = solve_question(
        text, settings, run_dir=run_dir, max_calls=None, max_completion_tokens=None, for_api=False, state=state
    )
    if state is None:
        return await asking
    async with RunProgress(state, live=True).running():
        return await asking


def _read_question(question: str | None, file: Path | None) -> str:
    """The question, from the argument, ``--file`` or standard input: non-empty UTF-8 text, or a one-line error
    naming where it was read from."""
    if file is not None and question is not None:
        raise InputError("give the question as an argument or with --file, not both")
    if file is not None:
        try:
            raw = file.read_bytes()
        except OSError as exc:
            raise InputError(f"{file}: cannot read: {exc.strerror}") from None
        where = str(file)
    elif question is None or question == "-":
        if sys.stdin.isatty():
            raise InputError("no question: give it as an argument, with --file, or on standard input")
        raw = sys.stdin.buffer.read()
        where = "standard input"
    else:
        # Bytes that are not UTF-8 reach argv as lone surrogates (Python's surrogateescape), which no text can hold.
        raw, where = question.encode("utf-8", "surrogateescape"), "the argument"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: question is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise InputError(f"{where}: the question is empty")
    return text


@app.command(epilog=METHOD_PARAMETERS)
@method_options
@model_options
@gate_options
def solve(
    flags: ModelFlags,
    given: MethodFlags,
    gate: GateFlags,
    question: Annotated[str | None, typer.Argument(help="The question; '-' or none reads standard input.")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read the question from a file.")] = None,
    method: MethodOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full result record as JSON.")] = False,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", "-o", help="Keep the run (store) here.")] = None,
) -> None:
    """Solve one question and print the answer (on your endpoint, given no parameters, TMAS runs its quick preset:
    at most 48 calls)."""
    from tmas.api import question_settings
    from tmas.cli.estimate import QUESTION_CONFIRM_CALLS, question_estimate
    from tmas.cli.estimate import gate as cost_gate
    from tmas.llm.types import cached_share_text
    from tmas.runner import check_before_estimate, check_new_run_dir

    text = _read_question(question, file)
    settings = question_settings(flags.settings(method, given))
    flags.check_token_flags(settings.budget)
    check_before_estimate(settings, flags.key_origin)
    if run_dir is not None:
        check_new_run_dir(run_dir)  # as tmas run's, before the gate asks about a question it then refuses
    cost_gate(question_estimate(settings), gate, calls=QUESTION_CONFIRM_CALLS)
    # Said whether no endpoint is configured or --local-model / --hf-model replaced the one configured.
    if settings.uses_local_model:
        typer.echo(f"tmas: starting the embedded model {settings.local.model}", err=True)
    elif settings.uses_in_process_model:
        typer.echo(f"tmas: loading {settings.hf.model} in process", err=True)
    check_endpoint(settings)  # nothing listening, or no /v1: said before a run directory is made
    try:
        # The gate above has asked (or been told --yes): no second limit.
        result = interrupt.run(_solving(text, settings, run_dir))
    except interrupt.Stopped as stop:
        kept = "nothing was kept (tmas solve --run-dir DIR keeps a question's calls)"
        if run_dir is not None:
            kept = f"its finished calls are kept: continue with 'tmas run --resume {run_dir}'"
        raise stop.saying(kept) from None
    if as_json:
        data = result.model_dump(mode="json")
        # The usage with its cached share of the prompt, which the record keeps as its parts.
        data["usage"] = {
            **result.usage.model_dump(mode="json"),
            "cached_prompt_share": result.usage.cached_prompt_share,
        }
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        if result.status == "done":  # a failed question prints no answer: its last line says why
            typer.echo(result.answer if result.answer is not None else (result.text or "(no answer)"))
        u = result.usage
        calls = f"{result.calls} call{'' if result.calls == 1 else 's'}"
        typer.echo(
            f"tmas: {calls}; tokens: prompt {u.prompt_tokens}{cached_share_text(u)}, completion"
            f" {u.completion_tokens} (reasoning {u.reasoning_tokens}){' (estimated)' if u.estimated else ''}",
            err=True,
        )
    for line in result.notices:
        typer.echo(f"tmas: notice: {line}", err=True)
    if result.status != "done":
        typer.echo(f"tmas: the question failed: {result.error or 'no answer'}", err=True)
        raise typer.Exit(EXIT_ALL_FAILED)


@app.command(epilog=METHOD_PARAMETERS)
@method_options
@model_options
@estimate_options
def run(
    flags: ModelFlags,
    given: MethodFlags,
    estimate: EstimateFlags,
    problems: Annotated[
        Path | None,
        typer.Argument(help="Problems as JSONL (problem_id, question, answer), or a benchmark name (hmmt25, ...)."),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Run directory to create.")] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue the run in this directory (failed calls asked again).")
    ] = None,
    method: MethodOpt = None,
    limit: LimitOpt = None,
) -> None:
    """Solve a file of problems into a run directory (resumable with --resume)."""
    if resume is not None:
        if problems is not None or out is not None or limit is not None:
            raise InputError(
                "--resume takes the run directory alone: give no problem file, no --out and no --limit (a run"
                " continues over the problems it was made with)"
            )
        code = _resume_run(resume, flags, method, given, estimate)
    else:
        if problems is None or out is None:
            raise InputError("give a problem file and --out RUN_DIR (or --resume RUN_DIR)")
        settings = flags.settings(method, given)
        flags.check_token_flags(settings.budget)
        code = _new_run(problems, out, settings, limit, estimate, flags.key_origin)
    if code:
        raise typer.Exit(code)


def _new_run(
    problems: Path,
    out: Path,
    settings: Settings,
    limit: int | None,
    estimate: EstimateFlags,
    origin: Callable[[str], str],
    left_out: str | None = None,
) -> int:
    """``tmas run`` (and the run of ``tmas eval``): the cost gate, then a new run directory; the exit code.
    ``left_out``: what the command sends beside the run, said with its estimate (``tmas eval``'s judge)."""
    from tmas.cli.estimate import build_estimate, gate
    from tmas.problems import iter_problems, resolve_dataset
    from tmas.runner import check_before_estimate, check_new_run_dir, open_new_run

    check_new_run_dir(out)  # before the estimate, whose pilot would run into the directory
    # A model tmas would run itself that names no file or known model, or a bad --prompts-dir: said before an
    # estimate (or a dry run's success, or the gate's question) for a run that could not start.
    check_before_estimate(settings, origin)
    source = resolve_dataset(problems)
    reader = islice(iter_problems(source), limit) if limit else iter_problems(source)
    # A pipe (/dev/stdin, a shell's <(...)) is read once: its problems are held for the run. A file is read again
    # to store them, so a big one is not held.
    held = None if source.is_file() else list(reader)
    reader = iter(held) if held is not None else reader
    # A pilot runs on the first problems; otherwise only their count matters.
    listed = list(reader) if estimate.pilot is not None else sum(1 for _ in reader)
    if not listed:
        # Said of the file, before an estimate of nothing (which a dry run would end on) or a check of the endpoint.
        raise InputError(f"{source}: no problems in the file (it is empty or blank)")
    planned = build_estimate([(out.name, settings)], listed, estimate, out / "pilot")
    planned.left_out += [left_out] if left_out else []
    gate(planned, estimate)
    check_endpoint(settings)  # nothing listening, or no /v1: said before the run directory is made
    # Streamed into the store (a bad line anywhere stops before any call and leaves no run behind).
    store, settings, todo = open_new_run(out, settings, problems, limit=limit, read=held)
    return _execute(store, settings, todo)


def _resume_run(
    run_dir: Path, flags: ModelFlags, method: str | None, given: MethodFlags, estimate: EstimateFlags
) -> int:
    from tmas.cli.estimate import build_estimate, gate
    from tmas.llm.model import EndpointUnreachable
    from tmas.llm.preflight import check_endpoints
    from tmas.planning.estimate import replay_credit, stored_ceiling
    from tmas.runner import (
        RunSetup,
        Unreachable,
        check_before_estimate,
        prepare_run,
        resume_settings,
        served_now,
        stored_settings,
    )
    from tmas.store.run_lock import running
    from tmas.store.run_store import RunStore

    # The stored settings are the base; flags given now (e.g. a larger --iterations) go on top.
    with flags.pool_refused():
        settings = resume_settings(
            stored_settings(run_dir), flags.overrides(method), stored_at=run_dir, config=flags.config
        )
    flags.check_token_flags(settings.budget)
    # Refused at once where another process runs it, before the estimate (whose pilot would send calls); the lock is
    # taken for good by prepare_run.
    with running(run_dir):
        pass
    settings = with_method_params(settings, given.params(settings.method.name))
    # Stored parameters this version refuses are said as the run's, before the checks a new run makes.
    setup = RunSetup.check(settings, resuming=run_dir)
    origin = functools.partial(flags.key_origin, stored=run_dir)
    check_before_estimate(settings, origin, setup.method.traits.roles)  # as a new run's
    with RunStore(run_dir, create=False) as peek:
        # A resume that would keep finished results under other settings is refused here, before the estimate: its
        # pilot would send calls, and its gate ask about a run that is then refused (prepare_run checks it again).
        # Where no model is named, its servers are asked what they serve now: one restarted with another model
        # would mix its replies with the stored ones.
        # A server that does not answer is said as a run says it, with how to continue, not as one that may serve
        # another model.
        # Both from one GET /models of each URL.
        try:
            asked = interrupt.run(check_endpoints(settings, setup.unnamed_roles(peek)))
        except EndpointUnreachable as exc:
            raise Unreachable(str(exc), run_dir) from None
        setup.check_resume(peek, interrupt.run(served_now(setup, peek, asked)))
        count = peek.problem_count()
        listed = peek.problems() if estimate.pilot is not None else count
        # The problems finished as this resume asks are skipped: they send nothing and replay nothing, and the
        # estimate counts the others alone.
        settled = setup.settled(peek)
        # Answered calls are replayed, not sent: the gate asks about what is still to send (those a failed call asked
        # again may change count as to send; under other requests the stored calls answer none).
        replays = setup.replays(peek, settled)
        roles = setup.replayed_roles(peek)
        spent = setup.replayed_tokens(peek, settled)
        # A pooled token budget's bank starts with what the settled problems left: the others may spend it.
        banked = setup.pooled_left(peek, settled)
        # Other method parameters solve the problems finished under the old ones again: said, not done silently.
        params = setup.changed_params(peek)
        again = len(peek.finished_problem_ids() - settled) if params else 0
    solving = count - len(settled)
    if again:
        typer.echo(
            f"tmas: resumed with other method parameters ({'; '.join(params)}): the run's {again} finished"
            f" problem{' is' if again == 1 else 's are'} solved again under them, their stored calls replayed where"
            " asked alike",
            err=True,
        )
    if not solving:
        typer.echo(
            f"tmas: nothing to run: every problem of the run is finished ({count}); its summary follows", err=True
        )
    pilot_dir = run_dir / "pilot"
    planned = build_estimate([(run_dir.name, settings)], listed, estimate, pilot_dir, solving=solving, banked=[banked])
    planned.stored_calls = replay_credit(planned.points[0], replays)
    # At their roles' max_tokens where the tokens are a ceiling: a run stopped after its cheap calls has its dear
    # ones left.
    planned.stored_tokens = stored_ceiling(planned.points[0], planned.stored_calls, roles, spent)
    gate(planned, estimate)
    store, settings, todo = prepare_run(run_dir, settings, None, resume=True)
    return _execute(store, settings, todo)


def check_endpoint(settings: Settings) -> None:
    """Whether anything answers at the endpoints the method's roles call (:mod:`tmas.llm.preflight`); a model
    tmas starts itself (embedded or in process) has none to check."""
    from tmas.llm.preflight import check_endpoints
    from tmas.runner import run_method

    if settings.uses_local_model:
        return
    interrupt.run(check_endpoints(settings, run_method(settings).traits.roles), keeps=False)


def _execute(store: RunStore, settings: Settings, todo: StoredProblems) -> int:
    """Solve a prepared run's problems with a progress line, then print its summary and, last, how many problems
    failed and why; the exit code that says so (:mod:`tmas.cli.outcome`)."""
    from tmas.cli.progress import RunProgress
    from tmas.runner import RunState, run_problems

    state = RunState()
    reporter = RunProgress(state)

    async def go() -> Any:
        async with reporter.running():
            return await run_problems(settings, todo, store, state=state, on_result=reporter.on_result)

    with store:
        try:
            summary = interrupt.run(go())
        except interrupt.Stopped as stop:
            finished = state.done + state.failed + state.skipped
            kept = f"finished work is kept ({finished} of {state.total} problems finished, and every finished call)"
            raise stop.saying(f"{kept}: continue with 'tmas run --resume {store.run_dir}'") from None
    typer.echo(json.dumps(summary.to_dict(), indent=2))
    for line in summary.warnings:
        typer.echo(f"warning: {line}", err=True)
    for line in summary.notices:
        typer.echo(f"notice: {line}", err=True)
    if summary.problems_with_failed_calls:
        again = f"tmas run --resume {summary.run_dir}"
        typer.echo(f"notice: {failed_calls_line(summary.problems_with_failed_calls, again)}", err=True)
    done = summary.done
    where = f" (every problem's error: tmas export {summary.run_dir})" if summary.failed else ""
    typer.echo(failed_line(done, summary.failed, summary.failures, where), err=True)
    return exit_code(done, summary.failed)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write here instead of standard output.")] = None,
    calls: Annotated[bool, typer.Option("--calls", help="Export every LLM call instead of the results.")] = False,
) -> None:
    """Write a run's results (or calls) as JSONL."""
    from tmas.store.run_store import DB_NAME, RunStore, check_began

    if out is not None and out.resolve().parent == run_dir.resolve() and out.name.startswith(DB_NAME):
        raise InputError(f"--out {out} is the run's own store: export to another file")
    if out is not None and out.is_dir():
        raise InputError(f"--out {out} is a directory: give the file to write")
    # Read-only: an export never writes into the run it reads (an empty store file stays empty).
    check_began(run_dir, "export")
    with RunStore(run_dir, read_only=True) as store:
        rows: Iterator[dict[str, Any]] = (
            (c.model_dump(mode="json") for c in store.calls())
            if calls
            else (r.model_dump(mode="json") for r in store.results())
        )
        if out is None:
            for row in rows:
                sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
            return
        # Written beside it, then put in its place: an export cut short leaves an earlier file as it was.
        try:
            with replacing(out) as handle:
                for row in rows:
                    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        except OSError as exc:  # no such folder, a full disk: named as --out, with nothing left beside it
            raise InputError(f"--out {out}: cannot write it: {exc.strerror or exc}") from None


@app.command()
def models(
    config: ConfigOpt = None,
    base_url: BaseUrlOpt = None,
    model: ModelOpt = None,
    api_key_env: KeyEnvOpt = None,
    hf_model: HFModelOpt = None,
) -> None:
    """List each configured endpoint (default and per role), whether it answers, and whether it serves the
    configured model (--model); or the model run in process (--hf-model)."""
    import os

    from tmas.llm.preflight import base_url_fix, unreachable_fix
    from tmas.llm.replica import NoConnection, list_models
    from tmas.llm.routes import key_problem

    chosen = ModelFlags(config=config, base_url=base_url, model=model, api_key_env=api_key_env, hf_model=hf_model)
    settings = chosen.settings()
    # One probe and one line per (URL, key), naming the roles it serves: another key may see other models there.
    targets: dict[tuple[str, str | None], tuple[list[str], list[str | None]]] = {}
    unkeyed = False
    if settings.uses_local_model:
        from tmas.llm.local_command import describe

        typer.echo(f"default: embedded model {describe(settings.local)}, started on demand")
        typer.echo(_embedded_models(settings.local.model))
    elif settings.uses_in_process_model:
        hf = settings.hf
        typer.echo(
            f"default: {hf.model} run in process by transformers (device {hf.device}, dtype {hf.dtype}),"
            " loaded by each command that runs it"
        )
        typer.echo(_embedded_models(str(hf.model)))
    for role, override in [("default", None), *settings.roles.items()]:
        urls = (override.base_url if override else None) or settings.endpoint.base_url
        key_env = (override.api_key_env if override else None) or settings.endpoint.api_key_env
        wanted = (override.model if override else None) or settings.endpoint.model
        if role != "default" and not (override and override.base_url):
            continue  # a role on the default endpoint is probed with it
        problem = key_problem(settings, role, chosen.key_origin)
        if problem is not None:
            # Asked without its key, a hosted API would answer 401, which says nothing of the variable.
            typer.echo(f"{role}: NOT CHECKED: {problem}")
            unkeyed = True
            continue
        key = os.environ.get(key_env) if key_env else None
        for url in urls:
            roles, wants = targets.setdefault((url, key), ([], []))
            roles.append(role)
            wants.append(wanted)

    async def probe() -> bool:
        healthy = True
        for (url, key), (roles, wants) in targets.items():
            label = ", ".join(roles)
            own = None if roles[0] == "default" else roles[0]  # a role listed has its own base_url
            try:
                ids = await list_models(url, key)
            except NoConnection as exc:
                # Said as the check before a run says it (tmas.llm.preflight).
                typer.echo(f"{label}: {url} NOT ANSWERING: cannot connect: {exc}; {unreachable_fix(own)}")
                healthy = False
                continue
            except TmasError as exc:
                # A 404 from a server that answers under another path: which base URL to give.
                fix = await base_url_fix(url, key, own) if str(exc).startswith("HTTP 404") else None
                typer.echo(f"{label}: {url} NOT ANSWERING: {exc}" + (f"; {fix}" if fix else ""))
                healthy = False
                continue
            listed = ", ".join(ids) or "(none listed)"
            missing = [repr(w) for w in dict.fromkeys(wants) if w is not None and ids and w not in ids]
            if missing:
                typer.echo(f"{label}: {url} answers but DOES NOT SERVE {', '.join(missing)}; models: {listed}")
                healthy = False
            else:
                typer.echo(f"{label}: {url} ok, models: {listed}")
        return healthy

    if not interrupt.run(probe(), keeps=False) or unkeyed:
        raise typer.Exit(1)


def _embedded_models(chosen: str) -> str:
    """The known embedded models, one line each: name, size, what it is for, whether its weights are installed."""
    from tmas.llm.weights import INSTALL_HINT, KNOWN_MODELS, installed

    lines = ["embedded models (--local-model NAME or --hf-model NAME, or a GGUF path):"]
    for name, known in KNOWN_MODELS.items():
        mark = "*" if name == chosen else " "
        state = "installed" if installed(known) else f"not installed: {INSTALL_HINT}"
        lines.append(f" {mark} {name}: {known.description} [{state}]")
    return "\n".join(lines)


JudgeUrlOpt = Annotated[
    str | None, typer.Option("--judge-base-url", help="Endpoint of the judge role (default: the run's endpoint).")
]
JudgeModelOpt = Annotated[str | None, typer.Option("--judge-model", help="Model name of the judge role.")]


def _judged(config: GradeConfig, settings: Settings) -> tuple[str, ...]:
    """The judge's role where grading under ``config`` asks a judge of ``settings`` (none: the rules alone, or the
    embedded model alone, which is no judge)."""
    from tmas.grading.judge import JUDGE_ROLE, judge_route

    return (JUDGE_ROLE,) if config.mode in JUDGE_GRADERS and judge_route(settings) is not None else ()


def _judge_settings(settings: Settings, judge_base_url: str | None, judge_model: str | None) -> Settings:
    """The judge's settings: the runs' ``settings`` (their endpoint, model name, key and sampling, or the model tmas
    runs), with the judge's own endpoint and model on top."""
    role: dict[str, Any] = {}
    for flag, key, value in [("--judge-base-url", "base_url", judge_base_url), ("--judge-model", "model", judge_model)]:
        if value is not None and not value.strip():  # read as not given, the run's own would be asked
            raise InputError(f"{flag} is empty: give a value, or leave the flag out")
        if value is not None:
            role[key] = value
    if role:
        data = settings.model_dump(mode="json", exclude_unset=True)
        data.setdefault("roles", {}).setdefault("judge", {}).update(role)
        try:
            settings = Settings.model_validate(data)
        except ValidationError as exc:
            raise OverrideError(exc, [f"roles.judge.{key}" for key in role]) from None
    return settings


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (runs on the same problems share tables).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for report.md, report.html and plots.")],
    grade: ReportGradeOpt = None,
    judge_runs: ReportJudgeRunsOpt = None,
    no_grade: Annotated[
        bool,
        typer.Option(
            "--no-grade", help="Use stored grades only, read as each run's last grading unless --grade names one."
        ),
    ] = False,
    config: ConfigOpt = None,
    base_url: BaseUrlOpt = None,
    judge_base_url: JudgeUrlOpt = None,
    judge_model: JudgeModelOpt = None,
    paper_model: Annotated[
        str | None,
        typer.Option("--paper-model", help="The paper's model the runs stand for (default: from their model name)."),
    ] = None,
) -> None:
    """Grade runs and write a Markdown + HTML report with per-iteration tables and plots."""
    from tmas.reports.report import build_report, check_report_out

    check_out_dir(out, "a report is written into a directory", "--out")  # said before any run is graded
    check_report_out(run_dirs, out, "--out")
    judging = {
        "--config": config,
        "--base-url": base_url,
        "--judge-base-url": judge_base_url,
        "--judge-model": judge_model,
    }
    if no_grade and (unread := [flag for flag, value in judging.items() if value is not None]):
        # They name the judge, which stored grades do not ask: read by nothing, they would be dropped without a word.
        raise InputError(f"{', '.join(unread)}: --no-grade reads stored grades and asks no judge; leave them out")
    settings = _judge_settings(ModelFlags(config=config, base_url=base_url).settings(), judge_base_url, judge_model)
    if settings is not None and settings.prompts_dir and not no_grade:
        # The config's or TMAS_PROMPTS_DIR's folder: the judge's templates there would be read by nothing.
        from tmas.agents.overrides import check_not_grading, check_overrides

        check_not_grading(check_overrides(settings.prompts_dir))
    grade_config = read_report_grade_flags(grade, judge_runs, no_grade=no_grade)
    if grade_config is not None and not no_grade:
        check_grading_installed(grade_config)  # a missing extra said before any step starts
    steps = Steps("report")
    written = interrupt.run(
        steps.during(
            build_report(
                run_dirs, out, grade_config, settings, grade=not no_grade, paper_model=paper_model, on_step=steps.step
            )
        )
    )
    typer.echo(json.dumps({k: str(v) for k, v in written.items()}, indent=2))


@app.command("eval", epilog=METHOD_PARAMETERS)
@method_options
@model_options
@estimate_options
def evaluate(
    flags: ModelFlags,
    given: MethodFlags,
    estimate: EstimateFlags,
    problems: Annotated[Path, typer.Argument(help="Problems as JSONL, or a benchmark name (hmmt25, ...).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory to create.")],
    report_dir: Annotated[
        Path | None, typer.Option("--report-dir", help="Where the report goes (default: RUN_DIR/report).")
    ] = None,
    grade: GradeModeOpt = "combined",
    judge_runs: JudgeRunsOpt = 4,
    judge_base_url: JudgeUrlOpt = None,
    judge_model: JudgeModelOpt = None,
    method: MethodOpt = None,
    limit: LimitOpt = None,
) -> None:
    """Run a method on problems, grade the run and write its report (run + report in one step)."""
    from tmas.reports.report import build_report, check_report_out

    grade_config = read_grade_flags(grade, judge_runs)  # bad flags fail before any model call
    check_grading_installed(grade_config)
    if report_dir is not None:
        # Said before the run, not after it.
        check_out_dir(report_dir, "the report is written into a directory", "--report-dir")
        check_report_out([out], report_dir, "--report-dir")
    from tmas.llm.routes import check_api_keys
    from tmas.runner import RunExists, StoreFailed, Unreachable

    report_dir = report_dir or out / "report"
    report = f"tmas report {out} -o {report_dir}{grade_words(grade_config)}"
    # The judge defaults to the run's own model, as the run's flags set it up (a sweep's report does the same); a bad
    # judge flag is said before the run, not after it.
    judge = _judge_settings(flags.settings(), judge_base_url, judge_model)
    check_api_keys(judge, _judged(grade_config, judge), flags.key_origin)  # before the run's estimate
    try:
        settings = flags.settings(method, given)
        flags.check_token_flags(settings.budget)
        code = _new_run(problems, out, settings, limit, estimate, flags.key_origin, judge_calls(grade_config))
    except RunExists as exc:  # continued as tmas run, then reported
        raise RunExists(exc.run_dir, f"'tmas run --resume {out}', then '{report}',") from None
    except interrupt.Stopped as stop:
        if stop.next_step is None:  # stopped before its run began
            raise
        raise stop.saying(f"{stop.next_step}, then '{report}'") from None
    except Unreachable as exc:
        # The run's own line says how to finish the run; the report it leaves unwritten is the step after.
        if exc.run_dir is None:
            raise
        raise Unreachable(exc.reason, exc.run_dir, then=report) from None
    except StoreFailed as exc:
        raise StoreFailed(exc.reason, exc.run_dir, then=report) from None
    steps = Steps("eval")
    try:
        written = interrupt.run(steps.during(build_report([out], report_dir, grade_config, judge, on_step=steps.step)))
    except interrupt.Stopped as stop:
        raise stop.saying(f"the run is kept: write its report with '{report}'") from None
    typer.echo(json.dumps({k: str(v) for k, v in written.items()}, indent=2))
    if code:
        raise typer.Exit(code)


def _sweep_plan(
    flags: ModelFlags,
    grid_file: Path | None,
    out: Path | None,
    resume: Path | None,
    *,
    problems: str | None,
    limit: int | None,
    method: list[str] | None,
    param: list[str] | None,
    grid: list[str] | None,
) -> tuple[SweepSpec, Settings, Path]:
    """The sweep's grid, settings and directory: a resumed sweep's own, a grid file's, or the flags'."""
    from tmas.sweep import (
        check_limit_flags,
        check_studies,
        given_sampling,
        load_spec,
        parse_grid_flag,
        resumed_sweep,
        spec_from_flags,
        sweep_budget,
        with_grid_sampling,
        with_token_flags,
    )

    if resume is not None:
        if method or grid or param or any(v is not None for v in (grid_file, out, problems, limit)):
            raise InputError(
                "--resume takes the sweep directory alone: give no grid, --out, --method, --param, --grid, --problems"
                " or --limit (a sweep continues over the grid and problems it was made with)"
            )
        spec, settings = resumed_sweep(resume, flags.overrides(), config=flags.config)
        return spec, settings, resume
    if out is None:
        raise InputError("give --out SWEEP_DIR (or --resume SWEEP_DIR)")
    # The budget from the config file, TMAS_BUDGET_* and the flags; sweep_budget puts a grid file's in between.
    # A grid file may give the token budget that --budget-pool pools: the flag goes on the points' budgets below.
    settings = (flags if grid_file is None else replace(flags, budget_pool=None)).settings()
    if grid_file is not None:
        if method or grid or param:
            raise InputError("give either a grid file or --method/--param/--grid, not both")
        spec = load_spec(grid_file)
        check_studies(spec, grid_file)
        given = {key: getattr(flags, f"budget_{key}") for key in ("tokens", "calls", "count")}
        check_limit_flags(spec, grid_file, [key for key in ("tokens", "calls") if given[key] is not None])
        spec.budget = sweep_budget(
            spec.budget, settings.budget, {key: value for key, value in given.items() if value is not None}
        )
        with_token_flags(spec, {key: getattr(flags, f"budget_{key}") for key in ("count", "pool")})
    else:
        if not method:
            raise InputError("give a grid file or at least one --method")
        axes: dict[str, list[Any]] = {}
        for key, values in map(parse_grid_flag, grid or []):
            if key in axes:
                raise InputError(f"--grid {key} is given twice: list its values in one flag ({key}=V1,V2,...)")
            axes[key] = values
        spec = spec_from_flags(problems, method, parse_params(param), axes, limit=limit, budget=settings.budget)
    flags.check_token_flags(*(study.budget or spec.budget for study in spec.study))
    if problems is not None:
        spec.problems = problems
        if spec.about is not None:
            spec.about.benchmark = None  # other problems than the grid's: the report matches on their name
    if limit is not None:
        spec.limit = limit
    settings = with_grid_sampling(settings, spec, given_sampling(flags.overrides()))
    return spec, settings, out


def _sweep_exit(summary: SweepSummary, again: str) -> None:
    """A notice for each point whose finished problems hold failed calls (``again`` asks them), then the last line over
    every point's problems, and the exit code it implies."""
    runs = [o.summary for o in summary.outcomes if o.summary is not None]
    if not runs:
        typer.echo(f"tmas: nothing to run: every point of the sweep is finished ({len(summary.outcomes)})", err=True)
        return
    for outcome in summary.outcomes:
        if outcome.summary is not None and (held := outcome.summary.problems_with_failed_calls):
            typer.echo(f"notice: point {outcome.point.name}: {failed_calls_line(held, again)}", err=True)
    done, failed = sum(r.done for r in runs), sum(r.failed for r in runs)
    reasons: Counter[str] = Counter()
    for run_summary in runs:
        reasons.update(run_summary.failures)
    typer.echo(failed_line(done, failed, reasons, " (over the sweep's points)" if failed else ""), err=True)
    if code := exit_code(done, failed):
        raise typer.Exit(code)


@app.command(epilog=METHOD_PARAMETERS)
@model_options
@estimate_options
def sweep(
    flags: ModelFlags,
    estimate: EstimateFlags,
    grid_file: Annotated[
        Path | None, typer.Argument(help="Grid file (TOML, [[study]] tables); or use the flags.")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Sweep directory (created, or continued).")] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue the sweep in this directory with its own grid.")
    ] = None,
    problems: Annotated[
        str | None, typer.Option("--problems", help="Problems JSONL or benchmark name (overrides the grid file's).")
    ] = None,
    limit: LimitOpt = None,
    method: Annotated[
        list[str] | None, typer.Option("--method", "-m", help="Method of the flag-built study (repeatable).")
    ] = None,
    param: ParamOpt = None,
    grid: Annotated[
        list[str] | None,
        typer.Option("--grid", "-g", help="Grid axis KEY=V1,V2,... (repeatable; every combination runs)."),
    ] = None,
    no_report: Annotated[bool, typer.Option("--no-report", help="Run the points, write no report.")] = False,
    grade: GradeModeOpt = "combined",
    judge_runs: JudgeRunsOpt = 4,
) -> None:
    """Run a grid of methods x parameters over one problem set (one run per point, resumable) and report it."""
    from tmas.cli.estimate import build_estimate, gate
    from tmas.cli.progress import plain_status
    from tmas.planning.estimate import replay_credit, stored_over_points
    from tmas.runner import RunState, StoreFailed, Unreachable, check_before_estimate, run_method
    from tmas.sweep import (
        check_not_running,
        check_sweep_dir,
        expand,
        grid_changes,
        not_applied,
        point_resume,
        report_sweep,
        run_sweep,
        sweep_problems,
    )

    grade_config = read_grade_flags(grade, judge_runs)
    if not no_report:
        check_grading_installed(grade_config)
    spec, settings, out = _sweep_plan(
        flags, grid_file, out, resume, problems=problems, limit=limit, method=method, param=param, grid=grid
    )

    points = expand(spec, out)
    # As a run's, for the roles its points' methods call (and the report's judge): before the estimate.
    roles = {role for point in points for role in run_method(point.settings(settings)).traits.roles}
    # A resumed sweep's settings are those it stored, where no config file is given now.
    origin = flags.key_origin if resume is None else functools.partial(flags.key_origin, stored=resume)
    check_before_estimate(settings, origin, roles | set(() if no_report else _judged(grade_config, settings)))
    unapplied = not_applied(points)
    if unapplied is not None:
        typer.echo(f"tmas sweep: {unapplied}", err=True)
    # Before it says how its grid differs from the one in the directory: another sweep may be running that grid.
    check_not_running(out)
    added, left = grid_changes(out, points)
    if left:
        # Said before any call: the runs of the points left out stay on disk, and out of the report.
        typer.echo(
            f"tmas sweep: {out} was made with another grid: {len(left)} of its points left out of this one and of"
            f" its report (their runs stay under {out / 'runs'}): {', '.join(left)}"
            + (f"; {len(added)} added: {', '.join(added)}" if added else ""),
            err=True,
        )
    elif added:
        # A grid grown since: its new points run, and join the report, beside those it had.
        typer.echo(
            f"tmas sweep: {out} was made with another grid: {len(added)} point{'s' if len(added) > 1 else ''} added"
            f" to its {len(points) - len(added)}: {', '.join(added)}",
            err=True,
        )
    # Read once: the points run these (a pipe, /dev/stdin or a shell's <(...), has nothing left to read again).
    listed = sweep_problems(spec)
    # A point that would keep finished results under other settings is refused here, before the estimate: its pilot
    # would send calls, and its gate ask about a sweep that is then refused (run_sweep checks it again).
    check_sweep_dir(points, listed, settings, out)
    steps = Steps("sweep")
    started = iter(range(1, len(points) + 1))

    def begins(point: Any, state: RunState) -> None:
        steps.step(f"point {next(started)} of {len(points)}: {point.name}", status=lambda: plain_status(state))

    def ends(outcome: Any) -> None:
        if outcome.status == "skipped":
            next(started)
        typer.echo(f"tmas sweep: {outcome.point.name}: {outcome.status}", err=True)

    configs = [(point.name, point.settings(settings)) for point in points]
    # A sweep run again counts each point as a resume of its run does: the problems it has still to solve (none for a
    # finished point, which is skipped), less the answered calls of those it replays rather than sends.
    resumed = [point_resume(point, settings, out, len(listed)) for point in points]
    solving, banked = [r.solves for r in resumed], [r.banked for r in resumed]
    planned = build_estimate(configs, listed, estimate, out / "pilot", solving=solving, banked=banked)
    held = [(p, replay_credit(p, r.replays), r.roles, r.spent) for p, r in zip(planned.points, resumed, strict=True)]
    planned.stored_calls = sum(calls for _, calls, _, _ in held)
    # Each point's stored calls come off its own tokens, at their roles' max_tokens where those are a ceiling.
    planned.stored_tokens = stored_over_points(held)
    judged = None if no_report else judge_calls(grade_config)
    planned.left_out += [judged] if judged else []
    gate(planned, estimate)
    again = f"tmas sweep --resume {out}{' --no-report' if no_report else grade_words(grade_config)}"
    try:
        summary = interrupt.run(
            steps.during(run_sweep(spec, settings, out, on_point=ends, on_start=begins, read=listed))
        )
    except interrupt.Stopped as stop:
        raise stop.saying(f"finished points and calls are kept: continue with '{again}'") from None
    except Unreachable as exc:
        # A point's run alone would say 'tmas run --resume POINT', which leaves the later points and the report.
        raise Unreachable(exc.reason, exc.run_dir, again=again) from None
    except StoreFailed as exc:
        raise StoreFailed(exc.reason, exc.run_dir, again=again) from None
    if not no_report:
        report = report_sweep(spec, out, grade_config, settings, on_step=steps.step)
        try:
            summary.report = interrupt.run(steps.during(report))
        except interrupt.Stopped as stop:
            again = f"tmas sweep --resume {out}{grade_words(grade_config)}"
            raise stop.saying(f"every point is kept: write the report with '{again}'") from None
    typer.echo(json.dumps(summary.to_dict(), indent=2))
    _sweep_exit(summary, again)


app.add_typer(data_app, name="data")
app.add_typer(pool_app, name="pool")
# The name users know, kept as an alias of `tmas pool` (listed, so old scripts and docs keep working).
app.add_typer(pool_app, name="experience", help="MATTRL's experience pool: the same commands as 'tmas pool'.")
app.add_typer(cases_app, name="cases")
# Commands, not groups (a group's usage line would offer COMMAND [ARGS], and a stray word would be 'No such
# command'); the docstring is the --help text, the short line is the one `tmas --help` lists.
app.command("serve", short_help=SERVE_HELP)(serve)
app.command("view", short_help=VIEW_HELP)(view)
app.add_typer(rl_app, name="rl")
app.add_typer(prompts_app, name="prompts")


def main() -> None:
    interrupt.install()
    try:
        # Not standalone: Click's own errors come here, to be said in one line, not drawn in Typer's box.
        code = command_of(app).main(prog_name="tmas", standalone_mode=False)
    except ParserError as exc:
        line = error_line(exc)
        if line is not None:
            typer.echo(line, err=True)
        sys.exit(exc.exit_code)  # type: ignore[attr-defined]
    except typer.Abort:
        # A prompt of Click's answered with end of input (the cost gate asks on its own: tmas.cli.estimate).
        typer.echo("tmas: aborted; nothing was started", err=True)
        sys.exit(1)
    except interrupt.Stopped as stop:
        typer.echo(stop.line(), err=True)
        sys.exit(stop.exit_code)
    except OverrideError as exc:
        typer.echo(f"tmas: error: {flag_error(exc)}", err=True)
        sys.exit(exc.exit_code)
    except TmasError as exc:
        typer.echo(f"tmas: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except sqlite3.DatabaseError as exc:
        # A run store damaged past what its opening checks: named where the error says which it was.
        from tmas.store.run_store import DamagedStore, damaged_store

        store = damaged_store(exc)
        if store is not None:
            typer.echo(f"tmas: error: {store}: not a readable run store ({exc})", err=True)
            sys.exit(DamagedStore.exit_code)
        typer.echo(f"tmas: error: a run store could not be read: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        # A path the command cannot read or write (a directory where a file goes, a missing parent, a full disk):
        # the system's own words, with the path.
        where = f"{exc.filename}: " if exc.filename else ""
        typer.echo(f"tmas: error: {where}{exc.strerror or exc}", err=True)
        sys.exit(1)
    except ModuleNotFoundError as exc:
        # A module of an extra that is not installed: say which extra, in one line (anything else is a bug).
        message = missing_extra(exc.name, sys.argv[1:])
        if message is None:
            raise
        typer.echo(f"tmas: error: {message}", err=True)
        sys.exit(MISSING_EXTRA_EXIT)
    except KeyboardInterrupt:
        # A KeyboardInterrupt rather than install's Stopped: said as a stop is, by what the command had begun.
        typer.echo(interrupt.Stopped(signal.SIGINT).line(), err=True)
        sys.exit(EXIT_INTERRUPTED)
    # A command's return value, or the code of the typer.Exit it raised (help and --version exit 0).
    sys.exit(code if isinstance(code, int) else 0)
