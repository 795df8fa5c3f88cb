"""What a method is, declared by the method itself: reports, the viewer, the proxy and RL data read these traits,
never the method's name, so a method added in its own file (or package) is handled by what it declares."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Traits(BaseModel):
    model_config = ConfigDict(frozen=True)

    # What the accuracy-per-budget frontier runs over: the method's iterations, or votes drawn from one pool of
    # independent samples (majority vote: the frontier at k votes needs no run at k).
    frontier: Literal["iterations", "votes"] = "iterations"
    # The returned answer follows ``select`` / ``select_from`` parameters (the report's selection-rule table marks
    # the run's own rule).
    selects: bool = False
    # One chain of calls, no parallel samples: a request's temperature 0 costs it no diversity (the proxy's notice).
    one_chain: bool = False
    # It runs ``iterations`` rounds. False for a method of one round (CoT): its ``iterations`` parameter changes
    # nothing, and a value other than 1 given for it (a flag, a config file, the Python API) is refused rather than
    # dropped without a word (:func:`tmas.methods.check_given_params`; a sweep whose study gives it to another
    # method too runs this one once, and says so).
    iterates: bool = True
    # The agent roles its calls go out under (``[roles.NAME]`` settings and per-role sampling apply to these).
    roles: tuple[str, ...] = ("solution",)
    # The parameter that sets how many independent samples of the plain solution prompt one iteration draws, for a
    # method that draws nothing else (majority vote's ``k``); the difficulty filter samples with such a method.
    samples: str | None = None


DEFAULT_TRAITS = Traits()
