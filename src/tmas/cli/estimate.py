"""The cost gate every command that starts model calls passes: ``solve``, ``run``, ``eval``, ``sweep``, ``pool build``
and ``data filter`` work out what they will send before they send anything (``tmas serve`` does so per request:
tmas.serve.cost_gate). Under the threshold the estimate is one line and the command starts; above it the whole
estimate is shown and the command asks on a terminal (on the controlling terminal where standard error is not
one: :func:`confirmed`), and without one refuses in one line unless ``--yes``.
``--dry-run`` prints it and stops.

The thresholds: ``--confirm-calls`` (default 500 calls for one question, 20,000 for a run, an evaluation or a sweep)
and ``--confirm-tokens`` (50M completion tokens, where the estimate knows them). A resumed run, or a sweep run again,
counts only the problems it has still to solve and the calls it has still to send."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from tmas.cli import interrupt
from tmas.cli.options import option_group
from tmas.cli.outcome import EXIT_NOT_STARTED
from tmas.config import Settings
from tmas.errors import InputError
from tmas.llm.provision import on_embedded_model
from tmas.methods import create_method
from tmas.planning.estimate import (
    CONFIRM_TOKENS,
    QUESTION_CALLS,
    RUN_CALLS,
    Estimate,
    PointEstimate,
    TokenRates,
    brief_estimate,
    estimate_point,
    format_estimate,
    replay_credit,
    stored_over_points,
)
from tmas.problems import Problem

if TYPE_CHECKING:
    from tmas.grading.grades import GradeConfig

# Confirmation thresholds: above either, the command asks before starting.
DEFAULT_CONFIRM_CALLS = RUN_CALLS
# One question (tmas solve; a tmas serve request's cap too).
QUESTION_CONFIRM_CALLS = QUESTION_CALLS
DEFAULT_CONFIRM_TOKENS = CONFIRM_TOKENS

DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the cost estimate (calls, tokens, hours) and stop.")]
PilotOpt = Annotated[
    int | None,
    typer.Option("--pilot", help="Measure tokens per call first: each configuration on N problems, 2 iterations."),
]
TokensPerCallOpt = Annotated[
    float | None, typer.Option("--tokens-per-call", help="Estimate with this mean of completion tokens per call.")
]
ThroughputOpt = Annotated[
    float | None, typer.Option("--throughput", help="Completion tokens per second the endpoint gives (for hours).")
]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Start without asking, whatever the estimate.")]
ConfirmCallsOpt = Annotated[
    int | None,
    typer.Option(
        "--confirm-calls",
        help="Ask before starting when the estimate exceeds this many calls; without a terminal, refuse unless --yes"
        f" (default: {QUESTION_CONFIRM_CALLS} for solve, {DEFAULT_CONFIRM_CALLS:,} otherwise).",
    ),
]
ConfirmTokensOpt = Annotated[
    float,
    typer.Option(
        "--confirm-tokens", help="Ask before starting above this many completion tokens, where the estimate knows them."
    ),
]


@dataclass
class GateFlags:
    """The cost gate's flags as given; ``solve`` takes them with :data:`gate_options`."""

    dry_run: DryRunOpt = False
    yes: YesOpt = False
    confirm_calls: ConfirmCallsOpt = None
    confirm_tokens: ConfirmTokensOpt = DEFAULT_CONFIRM_TOKENS

    def check(self) -> None:
        # NaN compares false with every estimate: the token threshold would never ask.
        if math.isnan(self.confirm_tokens):
            raise InputError("--confirm-tokens must be a number of tokens, not nan")
        # Below 0, every estimate is over it: read as 'never ask', it would ask (or refuse) every time.
        for flag, value in [("--confirm-calls", self.confirm_calls), ("--confirm-tokens", self.confirm_tokens)]:
            if value is not None and value < 0:
                raise InputError(f"{flag} must be 0 or more (got {value:g}); --yes starts without asking")


@dataclass
class EstimateFlags(GateFlags):
    """The gate's flags and the estimate's own; ``run``, ``eval`` and ``sweep`` take them with
    :data:`estimate_options`."""

    pilot: PilotOpt = None
    tokens_per_call: TokensPerCallOpt = None
    throughput: ThroughputOpt = None

    def check(self) -> None:
        super().check()
        if self.pilot is not None and self.pilot < 1:
            raise InputError("--pilot must be at least 1 problem")
        if self.pilot is not None and self.tokens_per_call is not None:
            # The pilot's measure would be taken and the given mean dropped without a word.
            raise InputError("--pilot measures the tokens per call that --tokens-per-call gives: give one of them")
        # Not NaN or infinity either: an estimate of nan tokens is under every threshold, and so never asks.
        if self.tokens_per_call is not None and not (math.isfinite(self.tokens_per_call) and self.tokens_per_call > 0):
            raise InputError("--tokens-per-call must be a positive number")
        if self.throughput is not None and not (math.isfinite(self.throughput) and self.throughput > 0):
            raise InputError("--throughput must be a positive number")


# A command decorated with these receives them as ``estimate: EstimateFlags`` (``gate: GateFlags``).
estimate_options = option_group(EstimateFlags, "estimate")
gate_options = option_group(GateFlags, "gate")


def build_estimate(
    configs: list[tuple[str, Settings]],
    problems: Sequence[Problem] | int,
    flags: EstimateFlags,
    pilot_dir: Path,
    *,
    solving: int | Sequence[int] | None = None,
    banked: Sequence[int] | None = None,
) -> Estimate:
    """The estimate of running each (name, settings) over ``problems`` (or that many: without ``--pilot`` only their
    count matters), or over ``solving`` of them where given, one count for every configuration or one each (a resume
    leaves its settled problems as they are), and ``banked``, one each, what a pooled token budget's bank holds for
    them (:meth:`tmas.runner.RunSetup.pooled_left`); with ``--pilot`` the configurations first run on that many
    problems (into ``pilot_dir``) to measure tokens per call and throughput."""
    flags.check()
    rates: TokenRates | None = None
    count = problems if isinstance(problems, int) else len(problems)
    each = count if solving is None or isinstance(solving, Sequence) else solving
    # One count per configuration (the zip below checks there are as many).
    counts = list(solving) if isinstance(solving, Sequence) else [each] * len(configs)
    # A configuration with no problem left to solve (a finished point of a sweep run again) sends nothing: the pilot
    # would measure it for no call.
    piloted = [config for config, n in zip(configs, counts, strict=True) if n]
    if flags.pilot and not isinstance(problems, int) and piloted:
        from tmas.planning.pilot import run_pilot

        sample = list(problems[: flags.pilot])
        _gate_pilot(piloted, len(sample), flags, pilot_dir)
        typer.echo(
            f"tmas: pilot: {len(piloted)} configuration(s) on {flags.pilot} problem(s) into {pilot_dir}", err=True
        )
        rates = interrupt.run(run_pilot(piloted, sample, pilot_dir))
    elif flags.tokens_per_call is not None:
        rates = TokenRates(default_completion=flags.tokens_per_call, source="given")
    banks = list(banked) if banked is not None else [0] * len(configs)
    points = [
        _point(name, settings, n, rates, banked=bank)
        for (name, settings), n, bank in zip(configs, counts, banks, strict=True)
    ]
    throughput = flags.throughput or (rates.throughput if rates else None)
    return Estimate(points, rates, throughput)


def _gate_pilot(configs: list[tuple[str, Settings]], problems: int, flags: EstimateFlags, pilot_dir: Path) -> None:
    """The pilot sends calls before the estimate it measures: it passes the same thresholds first (less what an
    earlier pilot in ``pilot_dir`` stored, which it replays), and above them asks, or refuses without a terminal
    unless ``--yes``."""
    from tmas.planning.pilot import pilot_settings
    from tmas.runner import RunSetup, holds_run
    from tmas.store.run_store import RunStore

    points, held = [], []
    for name, settings in configs:
        pilot = pilot_settings(settings)
        point = _point(name, pilot, problems, None)
        points.append(point)
        if holds_run(pilot_dir / name):
            with RunStore(pilot_dir / name, create=False) as peek:
                setup = RunSetup.check(pilot)
                held.append((point, replay_credit(point, setup.replays(peek, ())), setup.replayed_roles(peek), None))
    # Each configuration's stored calls come off its own tokens, at their roles' max_tokens.
    planned = Estimate(
        points, stored_calls=sum(calls for _, calls, _, _ in held), stored_tokens=stored_over_points(held)
    )
    threshold = flags.confirm_calls if flags.confirm_calls is not None else DEFAULT_CONFIRM_CALLS
    why = planned.over(threshold, flags.confirm_tokens)
    if why is None or flags.yes:
        return
    # Its table without the hours: the pilot is what measures them.
    table = format_estimate(planned).replace("cost estimate (before any call):", "the pilot's cost estimate:", 1)
    typer.echo("\n".join(line for line in table.splitlines() if not line.startswith("  time:")), err=True)
    refusal = (
        f"the pilot is {why}: pass --yes to start it without a terminal to confirm on (or a smaller --pilot N,"
        " --confirm-calls N)"
    )
    if not confirmed(f"tmas: the pilot is {why}. Start it?", refusal):
        typer.echo("tmas: the pilot was not started; nothing was sent", err=True)
        raise typer.Exit(EXIT_NOT_STARTED)


# The graders that ask a judge model (tmas.grading.registry): a report graded so sends calls beyond the run's.
JUDGE_GRADERS = ("combined", "judge", "diagnosis")


def judge_calls(config: GradeConfig) -> str | None:
    """What grading under ``config`` sends that the run's estimate does not count (None: no judge call)."""
    if config.mode not in JUDGE_GRADERS:
        return None
    undecided = "answer" if config.mode == "judge" else "answer the rules cannot decide"
    return (
        f"the report's judge calls, {config.judge_runs} per distinct {undecided} (each unreadable reply asked"
        f" again up to {config.judge_retries} times; --grade rules sends none)"
    )


def question_estimate(settings: Settings) -> Estimate:
    """The estimate of one question (``tmas solve``) under ``settings``."""
    return Estimate([_point("question", settings, 1, None)])


def _point(name: str, settings: Settings, problems: int, rates: TokenRates | None, *, banked: int = 0) -> PointEstimate:
    method = create_method(settings.method.name, settings.method.params, embedded=on_embedded_model(settings))
    return estimate_point(name, method, settings, problems, rates, banked=banked)


def gate(estimate: Estimate, flags: GateFlags, *, calls: int = DEFAULT_CONFIRM_CALLS) -> None:
    """The cost gate: the estimate in one line (standard error), or whole with ``--dry-run`` (which then stops) and
    when it is over a threshold (``--confirm-calls``, else ``calls``; ``--confirm-tokens``): then it asks on a
    terminal, and without one fails in one line unless ``--yes``."""
    flags.check()
    threshold = flags.confirm_calls if flags.confirm_calls is not None else calls
    why = estimate.over(threshold, flags.confirm_tokens)
    if flags.dry_run:
        typer.echo(format_estimate(estimate), err=True)
        raise typer.Exit(0)
    if why is None or flags.yes:
        typer.echo(f"tmas: estimate: {brief_estimate(estimate)}", err=True)
        return
    typer.echo(format_estimate(estimate), err=True)
    refusal = (
        f"the estimate is {why}: pass --yes to start it without a terminal to confirm on"
        " (or --confirm-calls N, --dry-run to see it whole)"
    )
    if not confirmed(f"tmas: the estimate is {why}. Start?", refusal):
        typer.echo("tmas: not started; nothing was sent", err=True)
        raise typer.Exit(EXIT_NOT_STARTED)  # as when it refuses without a terminal


# The controlling terminal: asked there when standard error is not a terminal (a file, a pipe).
TERMINAL = "/dev/tty"


def confirmed(question: str, refusal: str) -> bool:
    """``question`` answered yes on the terminal: asked on standard error where standard input and standard error
    are both terminals, and on the controlling terminal where standard input is one but standard error is not
    (``2>log``, ``2>&1 | tee log``: there the question could go where nobody reads it); refused with ``refusal`` (an
    :class:`InputError`) where standard input is not a terminal, or no controlling terminal can be opened."""
    if not sys.stdin.isatty():
        raise InputError(refusal)
    if sys.stderr.isatty():
        return _confirmed(question, sys.stdin, sys.stderr)
    try:
        fd = os.open(TERMINAL, os.O_RDWR | os.O_NOCTTY)
    except OSError:
        raise InputError(refusal) from None
    try:
        with (
            open(fd, encoding="utf-8", errors="replace", closefd=False) as answers,
            open(fd, "w", encoding="utf-8", closefd=False) as asked,
        ):
            return _confirmed(question, answers, asked)
    finally:
        os.close(fd)


def _confirmed(question: str, answers: TextIO, asked: TextIO) -> bool:
    """``question`` written to ``asked`` (never standard output, which holds the command's own output alone) and
    read from ``answers``: yes or y starts, no, n, an empty line or the end of input does not; anything else is asked
    again."""
    while True:
        asked.write(f"{question} [y/N]: ")
        asked.flush()
        answer = answers.readline()
        if not answer:  # the end of input (Ctrl-D)
            asked.write("\n")
            asked.flush()
            return False
        word = answer.strip().lower()
        if word in ("y", "yes"):
            return True
        if word in ("", "n", "no"):
            return False
