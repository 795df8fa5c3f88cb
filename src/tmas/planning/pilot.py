"""A pilot before a big run: each configuration on a few problems for at most two iterations (every role of every
method speaks by then), to measure tokens per call by role and the throughput the endpoint gives.

Pilot runs are ordinary run directories under ``<out>/pilot/<name>``: a second ``--pilot`` resumes them instead of
paying again, and ``tmas report`` or the viewer open them like any run. ``run_pilot(..., model=mine)`` runs them on
a :class:`tmas.llm.model.ChatModel` of the caller's own, as ``run_problems(..., model=mine)`` does one run; a model
run in process is loaded once for them all.
"""

from __future__ import annotations

from pathlib import Path

from tmas.config import Settings
from tmas.llm.model import ChatModel
from tmas.planning.estimate import TokenRates, rates_from_role_costs
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
    for name, _ in configs:
        with RunStore(pilot_dir / name, create=False) as store:
            costs.append(store.role_costs())
    # A resumed pilot replays stored calls at no cost: its wall time says nothing about the endpoint's speed.
    return rates_from_role_costs(costs, None if resumed else wall)
