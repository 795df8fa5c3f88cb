"""Test-time scaling methods, one module each, on the interface in :mod:`tmas.methods.base`, and their registry:
every method a module of this package defines is registered (:func:`methods_in`), so adding a method is adding a
file.

Beside the methods: the toolkit every method's steps come from (``steps``), the candidate selection rules
(``selection``), stopping and confidence rules (``stopping``, ``confidence``, ``online_stop``), parameters several
methods take (``style_params``, ``confidence_params``), TMAS's parameters (``tmas_params``), the command-line
shortcuts a parameter declares (``param_flags``) and the calls per problem a method states for the cost estimate
(``call_count``). A method registered here (:func:`register_method`)
is known to every command, the proxy and the viewer."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import pkgutil
import re
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from tmas.config import SERVICE_ROLES, Settings
from tmas.errors import ConfigError, TmasError
from tmas.methods.base import Method, MethodParams
from tmas.methods.param_flags import ParamFlag, param_flags
from tmas.methods.traits import DEFAULT_TRAITS, Traits

# The registry: name -> method class. Every command, the proxy and the viewer find methods here alone.
METHODS: dict[str, type[Method[Any]]] = {}


def method_flags() -> dict[str, list[tuple[str, ParamFlag]]]:
    """Every command-line shortcut the registered methods' parameters declare (:mod:`tmas.methods.param_flags`) ->
    the methods that declare it, each with its declaration. Methods that share a flag share its parameter (checked
    by :func:`register_method`)."""
    flags: dict[str, list[tuple[str, ParamFlag]]] = {}
    for name, cls in METHODS.items():
        for declared in param_flags(cls.Params):
            flags.setdefault(declared.flag, []).append((name, declared))
    return flags


def register_method(cls: type[Method[Any]]) -> type[Method[Any]]:
    """Add ``cls`` to the registry under its ``name`` (a class decorator too); a name taken by another class, or a
    parameter shortcut flag that another method declares for another parameter, is an error."""
    known = METHODS.get(cls.name)
    if known is not None and known is not cls:
        raise ConfigError(f"method name {cls.name!r} is taken by {known.__qualname__}")
    for own in param_flags(cls.Params):
        for other, declared in method_flags().get(own.flag, []):
            if other != cls.name and (declared.param, declared.switch) != (own.param, own.switch):
                raise ConfigError(
                    f"method {cls.name!r}: flag {own.flag} of parameter {own.param!r} is already the flag of"
                    f" method {other!r}'s parameter {declared.param!r}"
                )
    METHODS[cls.name] = cls
    return cls


def methods_in(package: str, path: list[str]) -> list[type[Method[Any]]]:
    """Every method a module of ``package`` (found on ``path``) defines: each concrete ``Method`` subclass with a
    ``name`` of its own, modules in name order. Importing them is what registers tmas's own methods, so a new method
    is one new file in this package."""
    found: list[type[Method[Any]]] = []
    for info in sorted(pkgutil.iter_modules(path), key=lambda module: module.name):
        module = importlib.import_module(f"{package}.{info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, Method)
                and value.__module__ == module.__name__
                and "name" in vars(value)
                and not inspect.isabstract(value)
            ):
                found.append(value)
    return found


for _cls in methods_in(__name__, __path__):
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


def check_given_params(
    method: str, params: Mapping[str, Any], named: Callable[[str], str], error: type[TmasError] = ConfigError
) -> None:
    """Refuse method ``params`` a user gives now (a flag, the Python API's ``params=`` or ``settings``, a config
    file's ``[method] params``, a sweep's grid) that ``method`` would drop without a word: ``iterations`` other than
    1 for a method of one round (:attr:`Traits.iterates`). One line, ``named(param)`` saying where it was given
    (``--param iterations``, ``tmas.solve: params['iterations']``, ``tmas.toml: method.params.iterations``, ``study
    'b': iterations``).

    Checked where parameters are given, not in a method's ``Params``: runs stored before this check (a served
    request's among them) resume as they were asked, and reports read them as they ran."""
    if not method_traits(method).iterates and params.get("iterations", 1) != 1:
        raise error(f"{named('iterations')} does not apply to method {method!r}: it runs one round; leave it out")


def check_settings_params(settings: Settings, source: str) -> None:
    """:func:`check_given_params` of the ``[method] params`` of settings given by a user, read from ``source`` (a
    config file, the API's ``settings``)."""
    check_given_params(settings.method.name, settings.method.params, lambda param: f"{source}: method.params.{param}")


def flag_params(method: str, given: dict[str, Any]) -> dict[str, Any]:
    """The parameters of ``method`` that shortcut flags set: ``given`` maps each flag given to its value. A flag the
    method's parameters do not declare is a one-line ConfigError naming the flag, the method and those that have it."""
    cls = METHODS.get(method)
    own = {f.flag: f for f in param_flags(cls.Params)} if cls is not None else {}
    params: dict[str, Any] = {}
    for flag, value in given.items():
        if flag not in own:
            others = ", ".join(name for name, _ in method_flags().get(flag, [])) or "none"
            raise ConfigError(f"{flag} is not a parameter of method {method!r} (methods that take it: {others})")
        params[own[flag].param] = value
    return params


def known_roles() -> dict[str, list[str]]:
    """Every role a ``[roles.NAME]`` table may configure -> the registered methods whose agents take it (none for the
    roles of no method: :data:`tmas.config.SERVICE_ROLES`)."""
    roles: dict[str, list[str]] = {role: [] for role in SERVICE_ROLES}
    for name, cls in METHODS.items():
        for role in cls.traits.roles:
            roles.setdefault(role, []).append(name)
    return roles


def check_roles(settings: Settings) -> None:
    """A one-line ConfigError for a ``[roles.NAME]`` table that no registered method's agents and no service take.

    The known roles are every method's, not only the run's: one config file serves several methods (a sweep's points,
    a team's shared ``tmas.toml``), and a role the run's method never calls is simply unused. Checked where settings
    meet the methods (every run's setup, every command that reads settings), not in :class:`tmas.config.Settings`,
    which sees no registry and also reads the stored settings of runs whose plugin method is not installed.
    """
    known = known_roles()
    unknown = [role for role in settings.roles if role not in known]
    if unknown:
        name = settings.method.name
        own = ", ".join(method_traits(name).roles) if name in METHODS else "(not a registered method)"
        others = ", ".join(role for role in known if role not in method_traits(name).roles)
        raise ConfigError(
            f"unknown role {unknown[0]!r} in [roles] (method {name!r} takes: {own}; other known roles: {others})"
        )


def stored_params(name: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A stored run's method parameters as its method reads them now, for readers of stored runs (reports, the
    viewer, RL data): each old name under its current one (``Params.renamed``), and each parameter the run did not
    store (one added since) at the value such runs ran with (``Params.before_added``), else at its default, taken from
    the method's parameter model rather than copied by the reader.
    A method not registered here (a plugin that is not installed) gets the defaults every method's parameters share;
    keys of no parameter are kept as stored."""
    cls = METHODS.get(name)
    model: type[MethodParams] = cls.Params if cls is not None else MethodParams
    given = dict(params or {})
    for old, new in model.renamed.items():
        if old in given:
            value = given.pop(old)
            given.setdefault(new, value)
    return {**model.model_construct().model_dump(mode="json"), **model.before_added, **given}


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
        raise ConfigError(params_error(cls, exc)) from None


def params_error(cls: type[Method[Any]], exc: ValidationError) -> str:
    """The first problem of parameters ``cls`` refused, in one line naming the method and the parameter."""
    errors = exc.errors()
    err = errors[0]
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"method {cls.name!r}: unknown parameter {loc!r} ({_known_params(cls, loc)})"
    msg = str(err["msg"]).removeprefix("Value error, ")
    # A value of a union of literals (select: a selection rule or a confidence rule): pydantic says each member's
    # values apart, under a name of the member's own; said as one list, of the parameter.
    members = [e for e in errors if e["loc"][:1] == err["loc"][:1]]
    if len(members) > 1 and all(e["type"] == "literal_error" for e in members):
        values = [v for e in members for v in re.findall(r"'[^']*'", str(e.get("ctx", {}).get("expected", "")))]
        msg = f"Input should be {', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else msg
        loc = str(err["loc"][0])
    if not loc:  # a check of the parameters together: its message names them
        return f"method {cls.name!r}: {msg}"
    return f"method {cls.name!r}: bad value ({msg}) for {loc!r}"


def _known_params(cls: type[Method[Any]], given: str) -> str:
    """The parameters ``cls`` takes, the ones spelt like ``given`` first."""
    known = sorted(cls.Params.model_fields)
    close = difflib.get_close_matches(given, known, n=2)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return f"{hint}known: {', '.join(known)}"


def question_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters one question asked of a user's endpoint runs ``name`` with (``tmas solve``, ``tmas.solve``, a
    ``tmas serve`` request): ``params``, or where none is given at all, the method's ``question_defaults`` (TMAS:
    its ``quick`` preset). Parameters given are a configuration of one's own, run as given."""
    cls = METHODS.get(name)
    return dict(cls.question_defaults) if not params and cls is not None else dict(params)
