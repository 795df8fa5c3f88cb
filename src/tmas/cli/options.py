"""The option group every command that talks to a model shares, declared once.

``@model_options`` adds the group's flags (config, endpoint, concurrency, sampling, budget, prompts) to a command and
hands the command one :class:`ModelFlags` as its ``flags`` parameter; :meth:`ModelFlags.overrides` is the one place
that maps the flags to dotted settings keys. ``solve``, ``run``, ``eval``, ``sweep``, ``serve``, ``data filter``,
``cases grade`` and ``pool`` ``search``, ``build``, ``prune`` and ``router train`` use it; ``rl train``, whose
``--model`` and ``--seed`` are the policy's and the trainer's, reads its judge's settings through it from ``--config``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_type_hints

import typer
from pydantic import ValidationError

from tmas.config import (
    POOL_NEEDS_TOKENS,
    Budget,
    OverrideError,
    Settings,
    config_source,
    load_settings,
    with_method_params,
)
from tmas.errors import ConfigError, InputError
from tmas.methods import (
    METHODS,
    check_given_params,
    check_roles,
    create_method,
    flag_params,
    method_flags,
    method_names,
    params_error,
)
from tmas.methods.param_flags import ParamFlag

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
    str | None,
    typer.Option(
        "--local-model",
        help="Embedded model name or GGUF path, served by llama-server instead of a configured endpoint.",
    ),
]
HFModelOpt = Annotated[
    str | None,
    typer.Option(
        "--hf-model",
        help="Hugging Face checkpoint folder, GGUF path or embedded model name, run in process instead of a"
        " configured endpoint.",
    ),
]
PromptsDirOpt = Annotated[
    str | None,
    typer.Option("--prompts-dir", help="Folder of NAME.j2 templates that replace the packaged prompts (tmas prompts)."),
]
TemperatureOpt = Annotated[float | None, typer.Option("--temperature", help="Default sampling temperature.")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help="Default nucleus sampling top_p.")]
TopKOpt = Annotated[int | None, typer.Option("--top-k", help="Default top_k (vLLM, SGLang, llama-server).")]
MinPOpt = Annotated[float | None, typer.Option("--min-p", help="Default min_p (vLLM, SGLang, llama-server).")]
RepetitionPenaltyOpt = Annotated[
    float | None, typer.Option("--repetition-penalty", help="Default repetition penalty (1 = none).")
]
PresencePenaltyOpt = Annotated[float | None, typer.Option("--presence-penalty", help="Default presence penalty.")]
MaxTokensOpt = Annotated[int | None, typer.Option("--max-tokens", help="Default max tokens per call.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Run seed.")]
BudgetTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--budget-tokens",
        help="Per problem: send no call once this many tokens are spent (passed by one call at most).",
    ),
]
BudgetCallsOpt = Annotated[
    int | None, typer.Option("--budget-calls", help="Per problem: stop at the first call past this many calls.")
]
BudgetCountOpt = Annotated[
    str | None,
    typer.Option("--budget-count", help="Tokens a token budget counts: completion (default) or total (+ prompt)."),
]
BudgetPoolOpt = Annotated[
    bool | None,
    typer.Option(
        "--budget-pool", help="Pool the token budget over the run: what a settled problem leaves goes to open ones."
    ),
]

# Options of single commands that more than one command declares.
MethodOpt = Annotated[
    str | None,
    typer.Option("--method", "-m", help=f"Method: {method_names()}."),
]
ParamOpt = Annotated[
    list[str] | None,
    typer.Option("--param", "-p", help="Method parameter KEY=VALUE (repeatable; VALUE as JSON)."),
]
IterationsOpt = Annotated[
    int | None, typer.Option("--iterations", "-T", help="Iterations (on --resume: the total target).")
]


@dataclass(frozen=True)
class ModelFlags:
    """The group's values as given (None = not given); ``config`` is the file, the rest map to settings keys."""

    config: ConfigOpt = None
    base_url: BaseUrlOpt = None
    model: ModelOpt = None
    api_key_env: KeyEnvOpt = None
    concurrency: ConcurrencyOpt = None
    problems_in_flight: ProblemsInFlightOpt = None
    local_model: LocalModelOpt = None
    hf_model: HFModelOpt = None
    prompts_dir: PromptsDirOpt = None
    temperature: TemperatureOpt = None
    top_p: TopPOpt = None
    top_k: TopKOpt = None
    min_p: MinPOpt = None
    repetition_penalty: RepetitionPenaltyOpt = None
    presence_penalty: PresencePenaltyOpt = None
    max_tokens: MaxTokensOpt = None
    seed: SeedOpt = None
    budget_tokens: BudgetTokensOpt = None
    budget_calls: BudgetCallsOpt = None
    budget_count: BudgetCountOpt = None
    budget_pool: BudgetPoolOpt = None

    def overrides(self, method: str | None = None) -> dict[str, Any]:
        """The flags (and a command's ``--method``) as dotted settings keys (None = not given), for
        ``load_settings``, ``with_overrides`` or :func:`tmas.runner.resume_settings`."""
        values = asdict(self)
        for name in TEXT_FLAGS:
            if values[name] is not None and not values[name].strip():
                # An empty value would read as no value: --base-url "$URL" with URL unset would run the embedded
                # model, --prompts-dir "" the packaged prompts.
                raise InputError(f"--{name.replace('_', '-')} is empty: give a value, or leave the flag out")
        if values["base_url"] is not None and not values["base_url"].replace(",", "").strip():
            # Commas and no URL ("$A,$B" with both unset) would read as no endpoint too: the embedded model.
            raise InputError(f"--base-url {values['base_url']!r} holds no URL: give one, or several comma-separated")
        chosen = [f"--{name.replace('_', '-')}" for name in MODEL_FLAGS if values[name] is not None]
        if len(chosen) > 1:
            # Each names what answers the run's calls, and only one can: the others would be dropped without a word.
            raise InputError(f"{' and '.join(chosen)} each name the model to run: give one of them")
        if chosen and chosen[0] != "--base-url" and values["model"] is not None:
            # The embedded server is called by its own alias and a model run in process answers under its own name:
            # --model would be dropped without a word.
            raise InputError(f"--model names an endpoint's model, and {chosen[0]} calls none: leave out one of them")
        return {**{key: values[name] for name, key in FLAG_KEYS.items()}, "method.name": method}

    def settings(self, method: str | None = None, given: MethodFlags | None = None) -> Settings:
        """Settings from the config file, ``TMAS_*`` variables and these flags (and ``method``), their ``[roles]``
        checked against the registered methods, with the method parameters ``given`` on the command line on top."""
        with self.pool_refused():
            settings = load_settings(self.config, overrides=self.overrides(method))
        source = config_source(self.config)
        name = settings.method.name
        # What the config file gave ([roles.NAME], method.name, [method] params) is said of the file: it may be a
        # ./tmas.toml the command line does not show.
        with _said_of(source):
            check_roles(settings)
            if method is None and name not in METHODS:
                create_method(name)
        params = given.params(name) if given is not None else {}
        # The config file's own parameters, those the command line does not replace.
        configured = {key: value for key, value in settings.method.params.items() if key not in params}
        check_given_params(name, configured, lambda param: f"{source}: method.params.{param}")
        _check_configured(name, configured, params, source)
        return with_method_params(settings, params)

    def key_origin(self, key: str, stored: Path | None = None) -> str:
        """Where the settings ``key`` (an ``api_key_env``) was given: ``--api-key-env``, ``TMAS_API_KEY_ENV``, else
        the config file. ``stored``: a resumed run's directory, whose stored settings stand where no config file is
        given now (the environment is not read again)."""
        endpoint = key == "endpoint.api_key_env"
        if endpoint and self.api_key_env is not None:
            return "--api-key-env"
        if stored is not None and self.config is None:
            return f"{stored} (its stored settings)"
        if endpoint and os.environ.get("TMAS_API_KEY_ENV"):
            return "TMAS_API_KEY_ENV"
        return config_source(self.config)

    def check_token_flags(self, *budgets: Budget) -> None:
        """Refuse ``--budget-count`` and ``--budget-pool`` where none of ``budgets`` (the run's, or a sweep's points')
        has a token limit: they say how a token budget counts, and would change nothing without a word."""
        if any(budget.tokens is not None for budget in budgets):
            return
        for flag, what in [
            ("budget_count", "says which tokens a token budget counts"),
            ("budget_pool", "moves unused tokens between problems"),
        ]:
            if getattr(self, flag):
                name = "--" + flag.replace("_", "-")
                raise InputError(
                    f"{name} {what}, and there is no token budget: give --budget-tokens (or budget.tokens in the"
                    f" config file), or leave {name} out"
                )

    @contextmanager
    def pool_refused(self) -> Iterator[None]:
        """Settings read with these flags on top, where ``--budget-pool`` meets no token budget: refused in the words
        of :meth:`check_token_flags` (the flag as typed, and what to give) rather than as a bad settings value."""
        try:
            yield
        except OverrideError as exc:
            if self.budget_pool and exc.reason == POOL_NEEDS_TOKENS:
                self.check_token_flags()
            raise

    def unused(self, why: str) -> None:
        """Refuse the flags given where the command sends no call (``why``: when it would, in words): read by nothing,
        they would be dropped without a word."""
        typed = [f"--{f.name.replace('_', '-')}" for f in fields(self) if getattr(self, f.name) is not None]
        if typed:
            raise InputError(f"{', '.join(typed)}: the command asks no model {why}; leave them out")

    def given(self, *names: str) -> set[str]:
        """Which of ``names`` were given."""
        values = asdict(self)
        return {name for name in names if values[name] is not None}


# Each flag of the group but --config -> the dotted settings key it sets (the one mapping).
FLAG_KEYS: dict[str, str] = {
    "base_url": "endpoint.base_url",
    "model": "endpoint.model",
    "api_key_env": "endpoint.api_key_env",
    "concurrency": "concurrency",
    "problems_in_flight": "problems_in_flight",
    "local_model": "local.model",
    "hf_model": "hf.model",
    "prompts_dir": "prompts_dir",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "max_tokens": "sampling.max_tokens",
    "seed": "seed",
    "budget_tokens": "budget.tokens",
    "budget_calls": "budget.calls",
    "budget_count": "budget.count",
    "budget_pool": "budget.pool",
}

# Each settings key the flags set -> the flag as the user types it (--method and the judge's are commands' own).
KEY_FLAGS: dict[str, str] = {
    **{key: "--" + name.replace("_", "-") for name, key in FLAG_KEYS.items()},
    "method.name": "--method",
    "roles.judge.base_url": "--judge-base-url",
    "roles.judge.model": "--judge-model",
}


def flag_error(exc: OverrideError) -> str:
    """A bad value the flags set, said of the flags as the user typed them (``--temperature``), not of the settings
    keys they map to."""
    return f"bad value for {', '.join(KEY_FLAGS.get(key, key) for key in exc.keys)}: {exc.reason}"


# The flags that each choose what answers the calls (an endpoint, the embedded server's model, a model run in process):
# one of them over a config file's or a stored run's choice replaces it, two of them on one command line contradict.
MODEL_FLAGS = ("base_url", "local_model", "hf_model")

# The flags whose value is text: none of them may be empty.
TEXT_FLAGS = ("base_url", "model", "api_key_env", "local_model", "hf_model", "prompts_dir", "budget_count")

GROUP: tuple[str, ...] = tuple(f.name for f in fields(ModelFlags))

F = TypeVar("F", bound=Callable[..., Any])


def with_options(
    parameter: str, added: list[inspect.Parameter], build: Callable[[dict[str, Any]], Any]
) -> Callable[[F], F]:
    """A decorator giving a command the ``added`` keyword parameters (each annotation a typer option); the command
    receives ``build`` of their values as its one ``parameter`` instead."""
    names = [p.name for p in added]

    def decorate(command: F) -> F:
        own = inspect.signature(command, eval_str=True)
        if parameter not in own.parameters:
            raise TypeError(f"{command.__name__}: a command with these options takes a {parameter!r} parameter")
        kept = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own.parameters.values() if p.name != parameter]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            value = build({name: kwargs.pop(name) for name in names if name in kwargs})
            return command(**{parameter: value}, **kwargs)

        wrapper.__signature__ = own.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in (*kept, *added)}
        return wrapper  # type: ignore[return-value]

    return decorate


def option_group(group: type[Any], parameter: str) -> Callable[[F], F]:
    """A decorator giving a command the dataclass ``group``'s fields as flags (each field's annotation is its typer
    option, its default the flag's); the command receives them as one ``parameter`` value of that class."""
    hints = get_type_hints(group, include_extras=True)  # a subclass's fields and its bases' alike
    added = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(group)
    ]
    return with_options(parameter, added, lambda values: group(**values))


# The model, sampling and budget flags: the command receives them as ``flags: ModelFlags``.
model_options = option_group(ModelFlags, "flags")


def _param_value(given: str, raw: str) -> Any:
    """A parameter's value as given on the command line (by ``given``: ``--param KEY``, a flag): JSON, else the text
    itself; one that begins as a JSON object or list does (``{...}``, ``[...]``) must be one, or it is said so."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        if raw.lstrip().startswith(("{", "[")):
            raise InputError(f"{given}: {raw!r} is not valid JSON ({exc.msg} at column {exc.colno})") from None
        return raw


def parse_params(items: list[str] | None) -> dict[str, Any]:
    """``--param KEY=VALUE`` items as method parameters (VALUE read as JSON, else kept as text)."""
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--param {item!r}: expected KEY=VALUE")
        if key.strip() in params:  # the later one would win without a word
            raise InputError(f"--param {key.strip()} is given twice: give it once")
        params[key.strip()] = _param_value(f"--param {key.strip()}", raw)
    return params


@dataclass(frozen=True)
class MethodFlags:
    """The method parameters given on the command line: ``--param`` items, ``--iterations`` (every method's T) and
    the shortcut flags that the methods' parameters declare (:mod:`tmas.methods.param_flags`), each given flag ->
    its value."""

    param: list[str] | None = None
    iterations: int | None = None
    shortcuts: dict[str, Any] = field(default_factory=dict)

    def params(self, method: str) -> dict[str, Any]:
        """The parameters of ``method`` these flags set; a shortcut that is not one of its parameters is a one-line
        error naming the flag and the method."""
        listed = parse_params(self.param)
        flagged: dict[str, tuple[str, Any]] = {}  # parameter -> the flag that sets it, and its value
        for flag, value in self.shortcuts.items():
            ((param, value),) = flag_params(method, {flag: value}).items()
            flagged[param] = (flag, value)
        if self.iterations is not None:
            flagged["iterations"] = ("--iterations", self.iterations)
        for param, (flag, _) in flagged.items():
            if param in listed:  # the flag would win without a word, as a second --param would (refused too)
                raise InputError(f"--param {param} and {flag} both set {param}: give one of them")
        params = {**listed, **{param: value for param, (_, value) in flagged.items()}}
        # A method of one round would run as without iterations, the flag dropped without a word.
        typed = {param: "--iterations (-T)" if flag == "--iterations" else flag for param, (flag, _) in flagged.items()}
        check_given_params(method, params, lambda param: typed.get(param, f"--param {param}"), InputError)
        _check_flagged(method, params, {param: flag for param, (flag, _) in flagged.items()})
        return params


@contextmanager
def _said_of(source: str) -> Iterator[None]:
    """A :class:`ConfigError` of the block said of ``source``, the config file that gave what it refuses."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _check_configured(method: str, configured: dict[str, Any], params: dict[str, Any], source: str) -> None:
    """A bad value or unknown name among the config file's own parameters (``configured``), said of the file, as one
    a flag gives is said of the flag; a check across parameters is left to the method's own check, which sees them
    all (``params``: those the command line gives)."""
    cls = METHODS.get(method)
    if cls is None or not configured:
        return
    try:
        cls.Params.model_validate({**configured, **params})
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        if loc and str(loc[0]) in configured:
            raise ConfigError(f"{source}: {params_error(cls, exc)}") from None


def _check_flagged(method: str, params: dict[str, Any], flagged: dict[str, str]) -> None:
    """A bad value of a parameter that a flag set (``flagged``: parameter -> the flag), said of the flag as typed
    (``--iterations (-T)``), not of the parameter; the method's own check of all its parameters comes later, as for
    parameters of a config file."""
    cls = METHODS.get(method)
    if cls is None or not flagged:
        return
    try:
        cls.Params.model_validate(params)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        if param in flagged:
            flag = "--iterations (-T)" if flagged[param] == "--iterations" else flagged[param]
            raise InputError(f"bad value for {flag}: {str(err['msg']).removeprefix('Value error, ')}") from None


def _declared_flags(command: Callable[..., Any]) -> set[str]:
    """The option strings a command declares already (a method's shortcut never shadows one)."""
    names: set[str] = set()
    for p in inspect.signature(command, eval_str=True).parameters.values():
        for meta in getattr(p.annotation, "__metadata__", ()):
            if isinstance(meta, typer.models.OptionInfo):
                names.update(meta.param_decls or ())
        names.add("--" + p.name.replace("_", "-"))
    return names


def _shortcut_option(flag: str, declared: list[tuple[str, ParamFlag]]) -> inspect.Parameter:
    """The typer option of one method parameter's shortcut, its help from the parameter's declaration."""
    first = declared[0][1]
    methods = ", ".join(name for name, _ in declared)
    setting = f"{first.param}=true" if first.switch else f"{first.param}=VALUE"
    option = typer.Option(flag, help=f"{first.help.rstrip('.')} (--param {setting}; method: {methods}).")
    annotation = Annotated[bool, option] if first.switch else Annotated[str | None, option]
    name = "shortcut_" + flag.removeprefix("--").replace("-", "_")
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=False if first.switch else None, annotation=annotation
    )


def method_options(command: F) -> F:
    """Give a command ``--param``, ``--iterations`` and every registered method's parameter shortcuts (one that a
    command declares already is left out: ``--param`` sets that parameter); the command receives them as one
    ``given: MethodFlags``. Put it right under ``@app.command`` so that it sees the command's other options."""
    taken = _declared_flags(command)
    declared_flags = {flag: declared for flag, declared in method_flags().items() if flag not in taken}
    shortcuts = {flag: _shortcut_option(flag, declared) for flag, declared in declared_flags.items()}
    by_name = {p.name: flag for flag, p in shortcuts.items()}
    switches = {flag for flag, declared in declared_flags.items() if declared[0][1].switch}
    added = [
        inspect.Parameter("param", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ParamOpt),
        inspect.Parameter("iterations", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=IterationsOpt),
        *shortcuts.values(),
    ]

    def build(values: dict[str, Any]) -> MethodFlags:
        given = {}
        for name, flag in by_name.items():
            value = values.get(name)
            if flag in switches and value:
                given[flag] = True
            elif flag not in switches and value is not None:
                given[flag] = _param_value(flag, value)
        return MethodFlags(values.get("param"), values.get("iterations"), given)

    return with_options("given", added, build)(command)
