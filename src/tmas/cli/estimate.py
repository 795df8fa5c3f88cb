"""The cost estimate of ``tmas run``, ``tmas eval`` and ``tmas sweep``: ``--dry-run`` prints it and stops; ``eval``
and ``sweep`` print it before starting and ask for a confirmation above a threshold (``--yes`` skips; with no
terminal to ask on, they stop with a one-line error instead of waiting)."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from tmas.cli.options import option_group
from tmas.config import Settings
from tmas.errors import InputError
from tmas.llm.provision import on_embedded_model
from tmas.methods import create_method
from tmas.planning.estimate import Estimate, TokenRates, estimate_point, format_estimate
from tmas.problems import Problem

# Confirmation thresholds: above either, eval and sweep ask before starting.
DEFAULT_CONFIRM_CALLS = 20_000
DEFAULT_CONFIRM_TOKENS = 50_000_000

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
    int, typer.Option("--confirm-calls", help="Ask before starting when the estimate exceeds this many calls.")
]
ConfirmTokensOpt = Annotated[
    float,
    typer.Option("--confirm-tokens", help="Ask before starting above this many completion tokens (when known)."),
]


@dataclass
class EstimateFlags:
    """The estimate's flags as given; a command takes them with :data:`estimate_options`."""

    dry_run: DryRunOpt = False
    pilot: PilotOpt = None
    tokens_per_call: TokensPerCallOpt = None
    throughput: ThroughputOpt = None
    yes: YesOpt = False
    confirm_calls: ConfirmCallsOpt = DEFAULT_CONFIRM_CALLS
    confirm_tokens: ConfirmTokensOpt = DEFAULT_CONFIRM_TOKENS

    def check(self) -> None:
        if self.pilot is not None and self.pilot < 1:
            raise InputError("--pilot must be at least 1 problem")
        if self.tokens_per_call is not None and self.tokens_per_call <= 0:
            raise InputError("--tokens-per-call must be positive")
        if self.throughput is not None and self.throughput <= 0:
            raise InputError("--throughput must be positive")


# The estimate's flags: a command decorated with it receives them as ``estimate: EstimateFlags``.
estimate_options = option_group(EstimateFlags, "estimate")


def build_estimate(
    configs: list[tuple[str, Settings]],
    problems: list[Problem],
    flags: EstimateFlags,
    pilot_dir: Path,
) -> Estimate:
    """The estimate of running each (name, settings) over ``problems``; with ``--pilot`` the configurations first
    run on that many problems (into ``pilot_dir``) to measure tokens per call and throughput."""
    flags.check()
    rates: TokenRates | None = None
    if flags.pilot:
        from tmas.planning.pilot import run_pilot

        typer.echo(
            f"tmas: pilot: {len(configs)} configuration(s) on {flags.pilot} problem(s) into {pilot_dir}", err=True
        )
        rates = asyncio.run(run_pilot(configs, problems[: flags.pilot], pilot_dir))
    elif flags.tokens_per_call is not None:
        rates = TokenRates(default_completion=flags.tokens_per_call, source="given")
    points = []
    for name, settings in configs:
        method = create_method(settings.method.name, settings.method.params, embedded=on_embedded_model(settings))
        points.append(estimate_point(name, method, settings, len(problems), rates))
    throughput = flags.throughput or (rates.throughput if rates else None)
    return Estimate(points, rates, throughput)


def gate(estimate: Estimate, flags: EstimateFlags, *, ask: bool) -> None:
    """Print the estimate (standard error); stop after it on ``--dry-run``; when ``ask`` and it is over a threshold,
    ask for confirmation, or fail in one line when there is no terminal and no ``--yes``."""
    typer.echo(format_estimate(estimate), err=True)
    if flags.dry_run:
        raise typer.Exit(0)
    if not ask or flags.yes:
        return
    why = estimate.over(flags.confirm_calls, flags.confirm_tokens)
    if why is None:
        return
    if not sys.stdin.isatty():
        raise InputError(f"the estimate is {why}: pass --yes to start it without a terminal to confirm on")
    if not typer.confirm(f"tmas: the estimate is {why}. Start?", default=False, err=True):
        raise typer.Exit(1)
