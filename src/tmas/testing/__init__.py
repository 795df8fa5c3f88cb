"""A simulated OpenAI-compatible server for tests and benchmarks (real HTTP on loopback, no mocks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tmas.testing.responders import RESPONDERS, SimRequest, count_tokens, register_responder
from tmas.testing.script import FaultRates, LongReplies, Rule, ScriptedUsage, SimScript
from tmas.testing.sim_stats import LoggedRequest, SimStats

if TYPE_CHECKING:
    from tmas.testing.scripted_model import ScriptedCall, ScriptedModel
    from tmas.testing.sim_server import SimServer

__all__ = [
    "RESPONDERS",
    "FaultRates",
    "LoggedRequest",
    "LongReplies",
    "Rule",
    "ScriptedCall",
    "ScriptedModel",
    "ScriptedUsage",
    "SimRequest",
    "SimScript",
    "SimServer",
    "SimStats",
    "count_tokens",
    "register_responder",
]

_LAZY = frozenset({"SimServer"})


def __getattr__(name: str) -> Any:
    # Imported on first use, not here: `python -m tmas.testing.sim_server` would otherwise find the module
    # already imported by this package and warn.
    if name in _LAZY:
        from tmas.testing import sim_server

        return getattr(sim_server, name)
    if name in ("ScriptedCall", "ScriptedModel"):
        from tmas.testing import scripted_model

        return getattr(scripted_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Default replies, registered on import: the baselines' refiner, corrector, synthesis and distiller roles, and
# TMAS's verifier, summary, experience and guideline roles, MATTRL's coordinator, specialist, reviewer and student,
# and the pool build's judge (its turn scores beside the answer grading) and summarizer.
from tmas.testing import baseline_responders as _baseline_responders  # noqa: E402, F401
from tmas.testing import mattrl_responders as _mattrl_responders  # noqa: E402, F401
from tmas.testing import pool_responders as _pool_responders  # noqa: E402, F401
from tmas.testing import tmas_responders as _tmas_responders  # noqa: E402, F401
