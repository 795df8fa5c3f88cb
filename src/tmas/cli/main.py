"""The ``tmas`` command."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Annotated, Any

import typer

from tmas import __version__
from tmas.cli.cases import cases_app
from tmas.cli.data import add_data_commands
from tmas.cli.estimate import (
    DEFAULT_CONFIRM_CALLS,
    DEFAULT_CONFIRM_TOKENS,
    ConfirmCallsOpt,
    ConfirmTokensOpt,
    DryRunOpt,
    EstimateFlags,
    PilotOpt,
    ThroughputOpt,
    TokensPerCallOpt,
    YesOpt,
)
from tmas.cli.experience import experience_app
from tmas.cli.prompts import prompts_app
from tmas.cli.rl import rl_app
from tmas.cli.serve import serve_app
from tmas.cli.view import view_app
from tmas.config import Settings, load_settings, with_overrides
from tmas.errors import InputError, TmasError

app = typer.Typer(
    name="tmas",
    help="Multi-agent test-time scaling of LLM reasoning on any OpenAI-compatible endpoint.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# Options every command that talks to a model shares. Each maps to a dotted settings key.
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file (default: ./tmas.toml).")]
BaseUrlOpt = Annotated[
    str | None, typer.Option("--base-url", help="OpenAI-compatible base URL(s), comma-separated replicas.")
]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Model name sent to the endpoint.")]
KeyEnvOpt = Annotated[str | None, typer.Option("--api-key-env", help="Environment variable that holds the API key.")]
ConcurrencyOpt = Annotated[int | None, typer.Option("--concurrency", help="Most LLM calls in flight.")]
ProblemsInFlightOpt = Annotated[
    int | None,
    typer.Option(
        "--problems-in-flight",
        help="Most problems solved at once (default: the endpoint's slots, else --concurrency; never above it).",
    ),
]
LocalModelOpt = Annotated[
    str | None, typer.Option("--local-model", help="Embedded model name or GGUF path (when no endpoint).")
]
MethodOpt = Annotated[
    str | None,
    typer.Option(
        "--method", "-m", help="Method: tmas, cot, majority, self_refine, verify_refine, pacore, rse, mattrl."
    ),
]
ParamOpt = Annotated[
    list[str] | None,
    typer.Option("--param", "-p", help="Method parameter KEY=VALUE (repeatable; VALUE as JSON)."),
]
IterationsOpt = Annotated[
    int | None, typer.Option("--iterations", "-T", help="Iterations (on --resume: the total target).")
]
NoExperienceOpt = Annotated[
    bool, typer.Option("--no-experience", help="TMAS ablation: no experience bank (param no_experience=true).")
]
NoGuidelineOpt = Annotated[
    bool, typer.Option("--no-guideline", help="TMAS ablation: no guideline bank (param no_guideline=true).")
]
DomainOpt = Annotated[
    str | None, typer.Option("--domain", help="MATTRL's domain: math, medicine or education (param domain=...).")
]
TemperatureOpt = Annotated[float | None, typer.Option("--temperature", help="Default sampling temperature.")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help="Default nucleus sampling top_p.")]
MaxTokensOpt = Annotated[int | None, typer.Option("--max-tokens", help="Default max tokens per call.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Run seed.")]
BudgetTokensOpt = Annotated[
    int | None,
    typer.Option("--budget-tokens", help="Per problem: stop at the first call once this many tokens are spent."),
]
BudgetCallsOpt = Annotated[
    int | None, typer.Option("--budget-calls", help="Per problem: stop at the first call past this many calls.")
]
BudgetCountOpt = Annotated[
    str | None,
    typer.Option("--budget-count", help="Tokens a token budget counts: completion (default) or total (+ prompt)."),
]

# Each flag of a command that talks to a model -> the dotted settings key it sets.
FLAG_KEYS: dict[str, str] = {
    "base_url": "endpoint.base_url",
    "model": "endpoint.model",
    "api_key_env": "endpoint.api_key_env",
    "concurrency": "concurrency",
    "problems_in_flight": "problems_in_flight",
    "local_model": "local.model",
    "method": "method.name",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "max_tokens": "sampling.max_tokens",
    "seed": "seed",
    "budget_tokens": "budget.tokens",
    "budget_calls": "budget.calls",
    "budget_count": "budget.count",
}


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


def _params(items: list[str] | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--param {item!r}: expected KEY=VALUE")
        try:
            params[key.strip()] = json.loads(raw)
        except ValueError:
            params[key.strip()] = raw
    return params


def _settings(
    config: Path | None, *, params: list[str] | None = None, iterations: int | None = None, **flags: Any
) -> Settings:
    """Settings from the config file, ``TMAS_*`` variables and ``flags`` (names of :data:`FLAG_KEYS`)."""
    settings = load_settings(config, overrides={FLAG_KEYS[name]: value for name, value in flags.items()})
    return _with_params(settings, params, iterations)


def _with_params(settings: Settings, params: list[str] | None, iterations: int | None) -> Settings:
    extra = _params(params)
    if iterations is not None:
        extra["iterations"] = iterations
    if extra:
        settings.method.params = {**settings.method.params, **extra}
    return settings


def _with_ablations(
    param: list[str] | None, no_experience: bool, no_guideline: bool, domain: str | None = None
) -> list[str] | None:
    """The ablation flags (and MATTRL's --domain) as the method parameters they stand for."""
    extra = [*(["no_experience=true"] if no_experience else []), *(["no_guideline=true"] if no_guideline else [])]
    extra += [f"domain={domain}"] if domain else []
    return [*(param or []), *extra] or None


def _read_question(question: str | None, file: Path | None) -> str:
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
        return question
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: question is not valid UTF-8 (byte {exc.start})") from None


@app.command()
def solve(
    question: Annotated[str | None, typer.Argument(help="The question; '-' or none reads standard input.")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read the question from a file.")] = None,
    method: MethodOpt = None,
    param: ParamOpt = None,
    iterations: IterationsOpt = None,
    no_experience: NoExperienceOpt = False,
    no_guideline: NoGuidelineOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full result record as JSON.")] = False,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", "-o", help="Keep the run (store) here.")] = None,
    config: ConfigOpt = None,
    base_url: BaseUrlOpt = None,
    model: ModelOpt = None,
    api_key_env: KeyEnvOpt = None,
    concurrency: ConcurrencyOpt = None,
    local_model: LocalModelOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    max_tokens: MaxTokensOpt = None,
    seed: SeedOpt = None,
    budget_tokens: BudgetTokensOpt = None,
    budget_calls: BudgetCallsOpt = None,
    budget_count: BudgetCountOpt = None,
) -> None:
    """Solve one question and print the answer."""
    from tmas.api import asolve
    from tmas.llm.types import cached_share_text

    text = _read_question(question, file)
    settings = _settings(
        config,
        base_url=base_url,
        model=model,
        api_key_env=api_key_env,
        concurrency=concurrency,
        local_model=local_model,
        method=method,
        params=_with_ablations(param, no_experience, no_guideline),
        iterations=iterations,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        budget_tokens=budget_tokens,
        budget_calls=budget_calls,
        budget_count=budget_count,
    )
    if settings.uses_local_model:
        typer.echo(f"tmas: no endpoint configured; starting the embedded model {settings.local.model}", err=True)
    result = asyncio.run(asolve(text, settings, run_dir=run_dir))
    if as_json:
        data = result.model_dump(mode="json")
        data["usage"]["cached_prompt_share"] = result.usage.cached_prompt_share
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        typer.echo(result.answer if result.answer is not None else (result.text or "(no answer)"))
        u = result.usage
        typer.echo(
            f"tmas: {result.calls} calls; tokens: prompt {u.prompt_tokens}{cached_share_text(u)}, completion"
            f" {u.completion_tokens} (reasoning {u.reasoning_tokens}){' (estimated)' if u.estimated else ''}",
            err=True,
        )
    if result.status != "done":
        typer.echo(f"tmas: the method failed: {result.error}", err=True)
        raise typer.Exit(1)


@app.command()
def run(
    problems: Annotated[
        Path | None,
        typer.Argument(help="Problems as JSONL (problem_id, question, answer), or a benchmark name (hmmt25, ...)."),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Run directory to create.")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="Continue the run in this directory.")] = None,
    method: MethodOpt = None,
    param: ParamOpt = None,
    iterations: IterationsOpt = None,
    no_experience: NoExperienceOpt = False,
    no_guideline: NoGuidelineOpt = False,
    limit: Annotated[int | None, typer.Option("--limit", help="Only the first N problems.")] = None,
    domain: DomainOpt = None,
    config: ConfigOpt = None,
    base_url: BaseUrlOpt = None,
    model: ModelOpt = None,
    api_key_env: KeyEnvOpt = None,
    concurrency: ConcurrencyOpt = None,
    problems_in_flight: ProblemsInFlightOpt = None,
    local_model: LocalModelOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    max_tokens: MaxTokensOpt = None,
    seed: SeedOpt = None,
    budget_tokens: BudgetTokensOpt = None,
    budget_calls: BudgetCallsOpt = None,
    budget_count: BudgetCountOpt = None,
    dry_run: DryRunOpt = False,
    pilot: PilotOpt = None,
    tokens_per_call: TokensPerCallOpt = None,
    throughput: ThroughputOpt = None,
    yes: YesOpt = False,
    confirm_calls: ConfirmCallsOpt = DEFAULT_CONFIRM_CALLS,
    confirm_tokens: ConfirmTokensOpt = DEFAULT_CONFIRM_TOKENS,
    ask: Annotated[bool, typer.Option("--ask", hidden=True, help="Ask above the thresholds (as eval does).")] = False,
) -> None:
    """Solve a file of problems into a run directory (resumable with --resume)."""
    from tmas.cli.estimate import build_estimate, gate
    from tmas.cli.progress import RunProgress
    from tmas.problems import dataset_name, iter_problems, resolve_dataset
    from tmas.runner import RunState, prepare_run, run_problems
    from tmas.store.run_store import RunStore

    overrides: dict[str, Any] = {
        "base_url": base_url,
        "model": model,
        "api_key_env": api_key_env,
        "concurrency": concurrency,
        "problems_in_flight": problems_in_flight,
        "local_model": local_model,
        "method": method,
        "params": _with_ablations(param, no_experience, no_guideline, domain),
        "iterations": iterations,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "seed": seed,
        "budget_tokens": budget_tokens,
        "budget_calls": budget_calls,
        "budget_count": budget_count,
    }
    estimate = EstimateFlags(dry_run, pilot, tokens_per_call, throughput, yes, confirm_calls, confirm_tokens)
    # The estimate is worked out when asked for (--dry-run, --pilot) and before eval's runs, which confirm it.
    wants_estimate = dry_run or pilot is not None or ask
    if resume is not None:
        if problems is not None or out is not None:
            raise InputError("--resume takes the run directory alone: give no problem file and no --out")
        with RunStore(resume, create=False) as peek:
            stored = Settings.model_validate(peek.get_meta("settings"))
            listed = peek.problems() if wants_estimate else []
        # The stored settings are the base; flags given now (e.g. a larger --iterations) go on top.
        settings = _apply_flags(stored, config, overrides)
        if wants_estimate:
            gate(build_estimate([(resume.name, settings)], listed, estimate, resume / "pilot"), estimate, ask=ask)
        store, settings, todo = prepare_run(resume, settings, None, resume=True)
    else:
        if problems is None or out is None:
            raise InputError("give a problem file and --out RUN_DIR (or --resume RUN_DIR)")
        settings = _settings(config, **overrides)
        source = resolve_dataset(problems)
        if wants_estimate:
            listed = list(islice(iter_problems(source), limit) if limit else iter_problems(source))
            gate(build_estimate([(out.name, settings)], listed, estimate, out / "pilot"), estimate, ask=ask)
        # Streamed into the store (a bad line anywhere stops before any call and leaves no run behind).
        reader = iter_problems(source)
        store, settings, todo = prepare_run(out, settings, islice(reader, limit) if limit else reader, resume=False)
        # Reports group runs by benchmark name.
        store.set_meta("dataset", dataset_name(problems))
    state = RunState()
    reporter = RunProgress(state)

    async def go() -> Any:
        async with reporter.running():
            return await run_problems(settings, todo, store, state=state, on_result=reporter.on_result)

    with store:
        summary = asyncio.run(go())
    typer.echo(json.dumps(summary.to_dict(), indent=2))
    for line in summary.warnings:
        typer.echo(f"warning: {line}", err=True)


def _apply_flags(stored: Settings, config: Path | None, overrides: dict[str, Any]) -> Settings:
    """A resumed run's settings: the stored ones with every flag given now on top (a ``--config`` file replaces
    them). The environment is not read again: a run continues as it was set up unless a flag says otherwise."""
    flags = {name: value for name, value in overrides.items() if name not in ("params", "iterations")}
    if config is not None:
        return _settings(config, params=overrides.get("params"), iterations=overrides.get("iterations"), **flags)
    settings = with_overrides(stored, {FLAG_KEYS[name]: value for name, value in flags.items()})
    return _with_params(settings, overrides.get("params"), overrides.get("iterations"))


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write here instead of standard output.")] = None,
    calls: Annotated[bool, typer.Option("--calls", help="Export every LLM call instead of the results.")] = False,
) -> None:
    """Write a run's results (or calls) as JSONL."""
    from tmas.store.run_store import RunStore

    with RunStore(run_dir, create=False) as store:
        rows: Iterator[dict[str, Any]] = (
            (c.model_dump(mode="json") for c in store.calls()) if calls else iter(store.results())
        )
        handle = out.open("w", encoding="utf-8") if out else sys.stdout
        try:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        finally:
            if out:
                handle.close()


@app.command()
def models(config: ConfigOpt = None, base_url: BaseUrlOpt = None, api_key_env: KeyEnvOpt = None) -> None:
    """List each configured endpoint (default and per role) and whether it answers."""
    import os

    from tmas.llm.client import list_models

    settings = _settings(config, base_url=base_url, api_key_env=api_key_env)
    targets: list[tuple[str, str, str | None]] = []
    if settings.uses_local_model:
        from tmas.llm.local_server import describe

        typer.echo(f"default: embedded model {describe(settings.local)}, started on demand")
    for role, override in [("default", None), *settings.roles.items()]:
        urls = (override.base_url if override else None) or settings.endpoint.base_url
        key_env = (override.api_key_env if override else None) or settings.endpoint.api_key_env
        if role != "default" and not (override and override.base_url):
            continue  # a role on the default endpoint is probed with it
        targets.extend((role, url, os.environ.get(key_env) if key_env else None) for url in urls)

    async def probe() -> bool:
        healthy = True
        for role, url, key in targets:
            try:
                ids = await list_models(url, key)
                typer.echo(f"{role}: {url} ok, models: {', '.join(ids) or '(none listed)'}")
            except TmasError as exc:
                typer.echo(f"{role}: {url} NOT ANSWERING: {exc}")
                healthy = False
        return healthy

    if not asyncio.run(probe()):
        raise typer.Exit(1)


GradeModeOpt = Annotated[
    str, typer.Option("--grade", help="Grading: combined (rules, then the judge), rules, or judge.")
]
JudgeRunsOpt = Annotated[int, typer.Option("--judge-runs", help="Independent LLM-judge runs (paper: 4).")]
JudgeUrlOpt = Annotated[
    str | None, typer.Option("--judge-base-url", help="Endpoint of the judge role (default: the run's endpoint).")
]
JudgeModelOpt = Annotated[str | None, typer.Option("--judge-model", help="Model name of the judge role.")]


def _grade_config(grade: str, judge_runs: int) -> Any:
    from tmas.eval.grading import GradeConfig

    if grade not in ("combined", "rules", "judge"):
        raise InputError(f"--grade {grade!r}: choose combined, rules or judge")
    if judge_runs < 1:
        raise InputError("--judge-runs must be at least 1")
    return GradeConfig(mode=grade, judge_runs=judge_runs)  # type: ignore[arg-type]


def _judge_settings(
    config: Path | None, base_url: str | None, judge_base_url: str | None, judge_model: str | None
) -> Settings:
    settings = _settings(config, base_url=base_url)
    role: dict[str, Any] = {}
    if judge_base_url:
        role["base_url"] = judge_base_url
    if judge_model:
        role["model"] = judge_model
    if role:
        data = settings.model_dump(mode="json", exclude_unset=True)
        data.setdefault("roles", {}).setdefault("judge", {}).update(role)
        if not settings.endpoint.base_url and judge_base_url:
            data.setdefault("endpoint", {})["base_url"] = [judge_base_url]
        settings = Settings.model_validate(data)
    return settings


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (runs on the same problems share tables).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for report.md, report.html and plots.")],
    grade: GradeModeOpt = "combined",
    judge_runs: JudgeRunsOpt = 4,
    no_grade: Annotated[bool, typer.Option("--no-grade", help="Use stored grades only; grade nothing new.")] = False,
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
    from tmas.eval.report import build_report

    settings = _judge_settings(config, base_url, judge_base_url, judge_model)
    grade_config = _grade_config(grade, judge_runs)
    written = asyncio.run(
        build_report(run_dirs, out, grade_config, settings, grade=not no_grade, paper_model=paper_model)
    )
    typer.echo(json.dumps({k: str(v) for k, v in written.items()}, indent=2))


@app.command("eval")
def evaluate(
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
    param: ParamOpt = None,
    iterations: IterationsOpt = None,
    no_experience: NoExperienceOpt = False,
    no_guideline: NoGuidelineOpt = False,
    limit: Annotated[int | None, typer.Option("--limit", help="Only the first N problems.")] = None,
    config: ConfigOpt = None,
    base_url: BaseUrlOpt = None,
    model: ModelOpt = None,
    api_key_env: KeyEnvOpt = None,
    concurrency: ConcurrencyOpt = None,
    problems_in_flight: ProblemsInFlightOpt = None,
    local_model: LocalModelOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    max_tokens: MaxTokensOpt = None,
    seed: SeedOpt = None,
    budget_tokens: BudgetTokensOpt = None,
    budget_calls: BudgetCallsOpt = None,
    budget_count: BudgetCountOpt = None,
    dry_run: DryRunOpt = False,
    pilot: PilotOpt = None,
    tokens_per_call: TokensPerCallOpt = None,
    throughput: ThroughputOpt = None,
    yes: YesOpt = False,
    confirm_calls: ConfirmCallsOpt = DEFAULT_CONFIRM_CALLS,
    confirm_tokens: ConfirmTokensOpt = DEFAULT_CONFIRM_TOKENS,
) -> None:
    """Run a method on problems, grade the run and write its report (run + report in one step)."""
    from tmas.eval.report import build_report

    grade_config = _grade_config(grade, judge_runs)  # bad flags fail before any model call
    run(
        problems=problems,
        out=out,
        resume=None,
        method=method,
        param=param,
        iterations=iterations,
        no_experience=no_experience,
        no_guideline=no_guideline,
        limit=limit,
        config=config,
        base_url=base_url,
        model=model,
        api_key_env=api_key_env,
        concurrency=concurrency,
        problems_in_flight=problems_in_flight,
        local_model=local_model,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        budget_tokens=budget_tokens,
        budget_calls=budget_calls,
        budget_count=budget_count,
        dry_run=dry_run,
        pilot=pilot,
        tokens_per_call=tokens_per_call,
        throughput=throughput,
        yes=yes,
        confirm_calls=confirm_calls,
        confirm_tokens=confirm_tokens,
        ask=True,
    )
    settings = _judge_settings(config, base_url, judge_base_url, judge_model)
    written = asyncio.run(build_report([out], report_dir or out / "report", grade_config, settings))
    typer.echo(json.dumps({k: str(v) for k, v in written.items()}, indent=2))


@app.command()
def sweep(
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
    limit: Annotated[int | None, typer.Option("--limit", help="Only the first N problems.")] = None,
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
    config: ConfigOpt = None,
    base_url: BaseUrlOpt = None,
    model: ModelOpt = None,
    api_key_env: KeyEnvOpt = None,
    concurrency: ConcurrencyOpt = None,
    problems_in_flight: ProblemsInFlightOpt = None,
    local_model: LocalModelOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    max_tokens: MaxTokensOpt = None,
    seed: SeedOpt = None,
    budget_tokens: BudgetTokensOpt = None,
    budget_calls: BudgetCallsOpt = None,
    budget_count: BudgetCountOpt = None,
    dry_run: DryRunOpt = False,
    pilot: PilotOpt = None,
    tokens_per_call: TokensPerCallOpt = None,
    throughput: ThroughputOpt = None,
    yes: YesOpt = False,
    confirm_calls: ConfirmCallsOpt = DEFAULT_CONFIRM_CALLS,
    confirm_tokens: ConfirmTokensOpt = DEFAULT_CONFIRM_TOKENS,
) -> None:
    """Run a grid of methods x parameters over one problem set (one run per point, resumable) and report it."""
    from tmas.cli.estimate import build_estimate, gate
    from tmas.config import Budget
    from tmas.sweep import (
        SweepSpec,
        expand,
        load_spec,
        parse_grid_flag,
        read_manifest,
        report_sweep,
        run_sweep,
        spec_from_flags,
        sweep_problems,
        with_grid_sampling,
    )

    grade_config = _grade_config(grade, judge_runs)
    flags: dict[str, Any] = {
        "base_url": base_url,
        "model": model,
        "api_key_env": api_key_env,
        "concurrency": concurrency,
        "problems_in_flight": problems_in_flight,
        "local_model": local_model,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "seed": seed,
    }
    budget_flags: dict[str, Any] = {"tokens": budget_tokens, "calls": budget_calls, "count": budget_count}
    given_budget = {key: value for key, value in budget_flags.items() if value is not None}
    if resume is not None:
        if grid_file is not None or out is not None or method or grid:
            raise InputError("--resume takes the sweep directory alone: give no grid, --out, --method or --grid")
        if given_budget:
            raise InputError("--resume keeps the sweep's budget (it names the points): give no --budget-* flag")
        manifest = read_manifest(resume)
        spec = SweepSpec.model_validate(manifest["spec"])
        stored = Settings.model_validate(manifest["settings"])
        settings = _apply_flags(stored, config, {**flags, "params": None, "iterations": None})
        out = resume
    else:
        if out is None:
            raise InputError("give --out SWEEP_DIR (or --resume SWEEP_DIR)")
        # The budget from the config file and TMAS_BUDGET_* under the flags; a grid file's own budget sits between.
        settings = _settings(config, **flags, **{f"budget_{key}": value for key, value in budget_flags.items()})
        if grid_file is not None:
            if method or grid or param:
                raise InputError("give either a grid file or --method/--param/--grid, not both")
            spec = load_spec(grid_file)
            if not spec.budget.limited:
                spec.budget = settings.budget
            elif given_budget:
                spec.budget = Budget.model_validate({**spec.budget.model_dump(), **given_budget})
        else:
            if not method:
                raise InputError("give a grid file or at least one --method")
            axes = dict(parse_grid_flag(item) for item in grid or [])
            spec = spec_from_flags(problems, method, _params(param), axes, limit=limit, budget=settings.budget)
        if problems is not None:
            spec.problems = problems
            if spec.about is not None:
                spec.about.benchmark = None  # other problems than the grid's: the report matches on their name
        if limit is not None:
            spec.limit = limit
        settings = with_grid_sampling(
            settings, spec, {k for k in ("temperature", "top_p", "max_tokens", "seed") if flags[k] is not None}
        )

    def progress(outcome: Any) -> None:
        typer.echo(f"tmas sweep: {outcome.point.name}: {outcome.status}", err=True)

    assert out is not None
    estimate = EstimateFlags(dry_run, pilot, tokens_per_call, throughput, yes, confirm_calls, confirm_tokens)
    configs = [(point.name, point.settings(settings)) for point in expand(spec)]
    gate(build_estimate(configs, sweep_problems(spec), estimate, out / "pilot"), estimate, ask=True)
    summary = asyncio.run(run_sweep(spec, settings, out, on_point=progress))
    if not no_report:
        summary.report = asyncio.run(report_sweep(spec, out, grade_config, settings))
    typer.echo(json.dumps(summary.to_dict(), indent=2))


data_app = typer.Typer(
    help="Problem data: generate verifiable problems, filter by difficulty, import official files.",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")
add_data_commands(data_app)
app.add_typer(experience_app, name="experience")
app.add_typer(cases_app, name="cases")
app.add_typer(serve_app, name="serve")
app.add_typer(view_app, name="view")
app.add_typer(rl_app, name="rl")
app.add_typer(prompts_app, name="prompts")


@data_app.command("generate")
def data_generate(
    family: Annotated[str, typer.Option("--family", help="Problem family, or 'all' (N of each).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="JSONL file to write.")],
    n: Annotated[int, typer.Option("--n", help="Problems per family.")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="Seed: the same seed gives the same problems.")] = 0,
    level: Annotated[int, typer.Option("--level", help="Difficulty, 1 (easy) to 5.")] = 1,
) -> None:
    """Write problems whose answers are computed by code (tilings, recurrences, modular arithmetic, ...)."""
    from tmas.eval.generators import FAMILIES, generate, write_jsonl

    if family != "all" and family not in FAMILIES:
        raise InputError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}, all")
    count = write_jsonl(generate(family, n, seed=seed, level=level), out)
    typer.echo(f"wrote {count} problems to {out}")


def main() -> None:
    try:
        app()
    except TmasError as exc:
        typer.echo(f"tmas: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("tmas: interrupted; finished work is kept (continue a run with --resume)", err=True)
        sys.exit(130)
