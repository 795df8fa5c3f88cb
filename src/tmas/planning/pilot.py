"""A pilot before a big run: each configuration on a few problems for at most two iterations (every role of every
method speaks by then), to measure tokens per call by role and the throughput the endpoint gives.

Pilot runs are ordinary run directories under ``<out>/pilot/<name>``: a second ``--pilot`` resumes them instead of
paying again, and ``tmas report`` or the viewer open them like any run. ``run_pilot(..., model=mine)`` runs them on
a :class:`tmas.llm.model.ChatModel` of the caller's own, as ``run_problems(..., model=mine)`` does one run; a model
run in process is loaded once for them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tmas.config import Settings
from tmas.llm.model import ChatModel
from tmas.methods.base import Method
from tmas.planning.estimate import PilotSpend, TokenRates, calls_per_problem, rates_from_role_costs
from tmas.problems import Problem
from tmas.runner import RunState, SeriesModel, holds_run, prepare_run, run_method
from tmas.store.run_store import RunStore

# Iterations a pilot runs at most: iteration 1 is where refiners, correctors and distillers first speak.
PILOT_ITERATIONS = 2


def pilot_settings(settings: Settings, *, own_model: bool = False) -> Settings:
    """``settings`` with the method's iterations cut to :data:`PILOT_ITERATIONS` (``own_model``: the pilot is on a
    model of the caller's own, as :func:`tmas.runner.run_method` tells it)."""
    data = settings.model_dump(mode="json")
    params = dict(data["method"]["params"])
    full = run_method(settings, own_model=own_model)
    params["iterations"] = min(full.params.iterations, PILOT_ITERATIONS)
    data["method"]["params"] = params
    return Settings.model_validate(data)


async def run_pilot(
    configs: list[tuple[str, Settings]], problems: list[Problem], pilot_dir: Path, *, model: ChatModel | None = None
) -> TokenRates:
    """Run every configuration on ``problems`` into ``pilot_dir/<name>`` (on the endpoint of its settings, or on
    ``model``, the caller's own) and return the tokens they spent per call."""
    costs = []
    resumed = False
    # The runs' own wall times: a model run in process is loaded before its first run starts, so its load is no
    # part of the throughput.
    wall = 0.0
    async with SeriesModel(model) as series:
        for name, settings in configs:
            run_dir = pilot_dir / name
            pilot = pilot_settings(settings, own_model=series.own)
            resume = holds_run(run_dir)
            resumed = resumed or resume
            store, pilot, todo = prepare_run(
                run_dir, pilot, None if resume else problems, resume=resume, own_model=series.own
            )
            with store:
                wall += (await series.run(pilot, todo, store, state=RunState())).wall_s
    spends = {}
    for name, settings in configs:
        with RunStore(pilot_dir / name, create=False) as store:
            costs.append(store.role_costs())
            spends[name] = pilot_spend(store, run_method(pilot_settings(settings, own_model=series.own)))
    # A resumed pilot replays stored calls at no cost: its wall time says nothing about the endpoint's speed.
    rates = rates_from_role_costs(costs, None if resumed else wall)
    rates.pilots = spends
    return rates


def pilot_spend(store: RunStore, method: Method[Any]) -> PilotSpend:
    """What the pilot in ``store``, run under ``method`` (its iterations cut), spent per problem: every stored call,
    as a run's spend counts them, and which of its problems ran to its last iteration."""
    spent = store.spent_by_iteration()
    last = method.params.iterations - 1
    return PilotSpend(
        problems=store.problem_count(),
        completion_tokens=sum(s.usage.completion_tokens for by in spent.values() for s in by.values()),
        prompt_tokens=sum(s.usage.prompt_tokens for by in spent.values() for s in by.values()),
        calls=calls_per_problem(method).expected,
        at_cap=sum(1 for by in spent.values() if max((i for i in by if i is not None), default=-1) >= last),
    )
