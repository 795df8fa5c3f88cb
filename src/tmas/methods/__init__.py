"""Test-time scaling methods, one module each, on the interface in :mod:`tmas.methods.base`, and their registry.

Beside the methods: the steps the baselines share (``baseline_steps``), the candidate selection rules
(``selection``), stopping and confidence rules (``stopping``, ``confidence``, ``online_stop``), parameters several
methods take (``style_params``, ``confidence_params``), TMAS's parameters (``tmas_params``) and the calls per
problem a method states for the cost estimate (``call_count``). A method registered here (:func:`register_method`)
is known to every command, the proxy and the viewer."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tmas.errors import ConfigError
from tmas.methods.base import Method
from tmas.methods.cot import CoT
from tmas.methods.majority import MajorityVote
from tmas.methods.mattrl import MATTRL
from tmas.methods.pacore import PaCoRe
from tmas.methods.rse import RSE
from tmas.methods.self_refine import SelfRefine
from tmas.methods.tmas import TMAS
from tmas.methods.verify_refine import VerifyRefine

# The registry: name -> method class. Every command, the proxy and the viewer find methods here alone.
METHODS: dict[str, type[Method[Any]]] = {}


def register_method(cls: type[Method[Any]]) -> type[Method[Any]]:
    """Add ``cls`` to the registry under its ``name`` (a class decorator too); a name taken by another class is an
    error."""
    known = METHODS.get(cls.name)
    if known is not None and known is not cls:
        raise ConfigError(f"method name {cls.name!r} is taken by {known.__qualname__}")
    METHODS[cls.name] = cls
    return cls


for _cls in (TMAS, CoT, MajorityVote, SelfRefine, VerifyRefine, PaCoRe, RSE, MATTRL):
    register_method(_cls)


def method_names() -> str:
    """The registered methods' names, for help texts and errors."""
    return ", ".join(METHODS)


def create_method(name: str, params: dict[str, Any] | None = None, *, embedded: bool = False) -> Method[Any]:
    """The method ``name`` with validated ``params``; unknown names and bad params are one-line ConfigErrors.

    ``embedded``: the run uses the embedded local model, so the method's ``embedded_defaults`` go under ``params``.
    """
    cls = METHODS.get(name)
    if cls is None:
        raise ConfigError(f"unknown method {name!r} (known: {', '.join(sorted(METHODS))})")
    if embedded:
        params = {**cls.embedded_defaults, **(params or {})}
    try:
        return cls(cls.Params.model_validate(params or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        what = "unknown parameter" if err["type"] == "extra_forbidden" else f"bad value ({err['msg']}) for"
        raise ConfigError(f"method {name!r}: {what} {loc!r}") from None
