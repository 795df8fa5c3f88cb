"""Test-time scaling methods, one module each, on the interface in :mod:`tmas.methods.base`, and their registry.

Beside the methods: the toolkit every method's steps come from (``steps``), the candidate selection rules
(``selection``), stopping and confidence rules (``stopping``, ``confidence``, ``online_stop``), parameters several
methods take (``style_params``, ``confidence_params``), TMAS's parameters (``tmas_params``) and the calls per
problem a method states for the cost estimate (``call_count``). A method registered here (:func:`register_method`)
is known to every command, the proxy and the viewer."""

from __future__ import annotations

import importlib.metadata
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
from tmas.methods.traits import DEFAULT_TRAITS, Traits
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

# Methods from other installed packages: each entry point of this group names a Method subclass
# (``[project.entry-points."tmas.methods"] NAME = "package.module:Class"`` in the package's pyproject.toml).
PLUGIN_GROUP = "tmas.methods"
# Entry-point name -> why its method could not be registered; said when a command asks for it.
PLUGIN_ERRORS: dict[str, str] = {}


def load_plugins() -> None:
    """Register every method that installed packages declare under :data:`PLUGIN_GROUP`. One that fails to load
    is left out with its reason (naming its package), so the other methods and commands still work."""
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        package = entry.dist.name if entry.dist is not None else "an unknown package"
        try:
            cls = entry.load()
            if not (isinstance(cls, type) and issubclass(cls, Method)):
                raise TypeError(f"{entry.value} is not a tmas.methods.base.Method subclass")
            register_method(cls)
        except Exception as exc:  # any failure of foreign code: recorded, never fatal to the registry
            reason = next(iter(str(exc).splitlines()), "")
            PLUGIN_ERRORS[entry.name] = (
                f"method plugin {entry.name!r} from package {package!r} failed to load: {type(exc).__name__}: {reason}"
            )


load_plugins()


def method_traits(name: str) -> Traits:
    """What the method ``name`` declares of itself; a method not registered here (a stored run of a plugin that is
    not installed) has the default traits."""
    cls = METHODS.get(name)
    return cls.traits if cls is not None else DEFAULT_TRAITS


def method_names() -> str:
    """The registered methods' names, for help texts and errors."""
    return ", ".join(METHODS)


def create_method(name: str, params: dict[str, Any] | None = None, *, embedded: bool = False) -> Method[Any]:
    """The method ``name`` with validated ``params``; unknown names and bad params are one-line ConfigErrors.

    ``embedded``: the run uses the embedded local model, so the method's ``embedded_defaults`` go under ``params``.
    """
    cls = METHODS.get(name)
    if cls is None and name in PLUGIN_ERRORS:
        raise ConfigError(PLUGIN_ERRORS[name])
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
