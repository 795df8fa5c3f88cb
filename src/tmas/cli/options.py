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
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from tmas.config import Settings, load_settings, with_method_params
from tmas.errors import InputError
from tmas.methods import check_roles, method_names

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
    str | None, typer.Option("--local-model", help="Embedded model name or GGUF path (when no endpoint).")
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
    typer.Option("--budget-tokens", help="Per problem: stop at the first call once this many tokens are spent."),
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
NoExperienceOpt = Annotated[
    bool, typer.Option("--no-experience", help="TMAS ablation: no experience bank (param no_experience=true).")
]
NoGuidelineOpt = Annotated[
    bool, typer.Option("--no-guideline", help="TMAS ablation: no guideline bank (param no_guideline=true).")
]
DomainOpt = Annotated[
    str | None, typer.Option("--domain", help="MATTRL's domain: math, medicine or education (param domain=...).")
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
        return {**{key: values[name] for name, key in FLAG_KEYS.items()}, "method.name": method}

    def settings(self, method: str | None = None, params: dict[str, Any] | None = None) -> Settings:
        """Settings from the config file, ``TMAS_*`` variables and these flags (and ``method``), their ``[roles]``
        checked against the registered methods, with method ``params`` on top."""
        settings = load_settings(self.config, overrides=self.overrides(method))
        check_roles(settings)
        return with_method_params(settings, params)

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

GROUP: tuple[str, ...] = tuple(f.name for f in fields(ModelFlags))

F = TypeVar("F", bound=Callable[..., Any])


def option_group(group: type[Any], parameter: str) -> Callable[[F], F]:
    """A decorator giving a command the dataclass ``group``'s fields as flags (each field's annotation is its typer
    option, its default the flag's); the command receives them as one ``parameter`` value of that class."""
    names = [f.name for f in fields(group)]
    defaults = {f.name: f.default for f in fields(group)}
    hints = inspect.get_annotations(group, eval_str=True)

    def decorate(command: F) -> F:
        own = inspect.signature(command, eval_str=True)
        if parameter not in own.parameters:
            raise TypeError(f"{command.__name__}: a command with {group.__name__} takes a {parameter!r} parameter")
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name], annotation=hints[name])
            for name in names
        ]
        kept = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own.parameters.values() if p.name != parameter]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            value = group(**{name: kwargs.pop(name, defaults[name]) for name in names})
            return command(**{parameter: value}, **kwargs)

        wrapper.__signature__ = own.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in (*kept, *added)}
        return wrapper  # type: ignore[return-value]

    return decorate


# The model, sampling and budget flags: the command receives them as ``flags: ModelFlags``.
model_options = option_group(ModelFlags, "flags")


def parse_params(items: list[str] | None) -> dict[str, Any]:
    """``--param KEY=VALUE`` items as method parameters (VALUE read as JSON, else kept as text)."""
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--param {item!r}: expected KEY=VALUE")
        try:
            params[key.strip()] = json.loads(raw)
        except ValueError:
            params[key.strip()] = raw
    return params


def method_params(
    param: list[str] | None,
    *,
    iterations: int | None = None,
    no_experience: bool = False,
    no_guideline: bool = False,
    domain: str | None = None,
) -> dict[str, Any]:
    """``--param`` items and the flags that stand for method parameters (ablations, --domain, --iterations)."""
    params = parse_params(param)
    if no_experience:
        params["no_experience"] = True
    if no_guideline:
        params["no_guideline"] = True
    if domain:
        params["domain"] = domain
    if iterations is not None:
        params["iterations"] = iterations
    return params
