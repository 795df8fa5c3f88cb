"""What a method declares reaches the commands without their naming it: its agents' roles are the roles a
``[roles.NAME]`` table may configure, its parameters' shortcut flags are CLI flags (with their help), and readers of
stored runs take a missing parameter's default from its parameter model."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import typer
from pydantic import Field
from typer.testing import CliRunner

from conftest import isolate, settings_for
from tmas.agents.solution import generation_prompt
from tmas.cli.main import app
from tmas.cli.options import MethodFlags, method_options
from tmas.config import SERVICE_ROLES, RoleConfig
from tmas.errors import ConfigError
from tmas.methods import METHODS, flag_params, known_roles, method_flags, register_method, stored_params
from tmas.methods.base import Method, MethodParams, ProblemResult, ProblemSession
from tmas.methods.param_flags import cli_flag
from tmas.methods.steps import finish, solve_call
from tmas.methods.tmas_params import TMASParams
from tmas.methods.traits import Traits
from tmas.runner import RunSetup
from tmas.testing import SimServer

Q = "What is 17*23?"


class OracleParams(MethodParams):
    hints: int = Field(default=1, ge=0, json_schema_extra=cli_flag("--oracle-hints", "Oracle calls per problem."))
    bold: bool = Field(default=False, json_schema_extra=cli_flag("--oracle-bold", "Ask the oracle boldly."))


class Oracle(Method[OracleParams]):
    """``hints`` calls of its own ``oracle`` role, then one solution whose answer it returns."""

    name: ClassVar[str] = "oracle_toy"
    Params: ClassVar[type[MethodParams]] = OracleParams
    traits: ClassVar[Traits] = Traits(roles=("solution", "oracle"))

    async def solve(self, session: ProblemSession) -> ProblemResult:
        session.begin_iteration(0)
        messages = generation_prompt(session.problem.question, self.params.mode)
        for i in range(self.params.hints):
            await session.chat("oracle", messages, sample=i)
        last = await solve_call(session, "solution", messages, index=0, mode=self.params.mode)
        if last is None:
            return finish(session, self.name, None, stopped=True)
        session.end_iteration([last], selected=last.answer)
        return finish(session, self.name, last, stopped=False)


@pytest.fixture
def oracle() -> Iterator[None]:
    register_method(Oracle)
    yield
    del METHODS[Oracle.name]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def help_text(runner_out: Any) -> str:
    """A --help page as one line of words, rich's box drawing and line wrapping taken out."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", runner_out.stdout).split())


def one_line_error(*args: str) -> str:
    """The one-line ConfigError a command stops with (``tmas`` prints it and exits 2)."""
    out = invoke(*args)
    assert isinstance(out.exception, ConfigError), out.output
    [line] = str(out.exception).splitlines()
    return line


# ------------------------------------------------------------------------------------------------ roles
def test_the_known_roles_are_the_methods_and_the_services() -> None:
    roles = known_roles()
    assert set(SERVICE_ROLES) <= set(roles) and roles["judge"] == []
    assert "tmas" in roles["verifier"] and "mattrl" in roles["coordinator"]
    assert {role for cls in METHODS.values() for role in cls.traits.roles} <= set(roles)


def test_an_unknown_role_is_one_line_naming_the_role_the_method_and_the_known_roles(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    config = tmp_path / "tmas.toml"
    config.write_text('[roles.wizard]\nmodel = "m"\n')
    line = one_line_error("solve", Q, "-c", str(config), "-m", "cot", "--base-url", sim.base_url)
    assert "unknown role 'wizard' in [roles] (method 'cot' takes: solution; other known roles: judge," in line
    assert "verifier" in line and sim.stats().total_requests == 0
    # A role of another method is known: one config serves several methods, and cot leaves it unused.
    config.write_text('[roles.verifier]\nmodel = "m"\n')
    assert invoke("solve", Q, "-c", str(config), "-m", "cot", "--base-url", sim.base_url).exit_code == 0
    # Settings built in Python are checked when a run is set up.
    settings = settings_for(sim)
    settings.roles = {"wizard": RoleConfig(model="m")}
    with pytest.raises(ConfigError, match=r"^unknown role 'wizard' in \[roles\] \(method 'tmas' takes: solution,"):
        RunSetup.check(settings)


def test_a_method_registered_outside_brings_its_role_and_parameters(
    oracle: None, sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    config = tmp_path / "tmas.toml"
    config.write_text('[roles.oracle]\nmodel = "oracle-model"\n')
    out = invoke("solve", Q, "-c", str(config), "-m", "oracle_toy", "-p", "hints=2", "--base-url", sim.base_url)
    assert out.exit_code == 0, out.output
    assert out.stdout.strip().splitlines()[0] == "391"
    assert sim.stats().by_role == {"oracle": 2, "solution": 1}
    models = [r.body["model"] for r in sim.requests if r.endpoint == "chat"]
    assert models.count("oracle-model") == 2  # its [roles.oracle] table reached its calls
    # Without the method registered, its role is unknown.
    del METHODS[Oracle.name]
    try:
        line = one_line_error("solve", Q, "-c", str(config), "-m", "cot", "--base-url", sim.base_url)
    finally:
        register_method(Oracle)
    assert line.startswith(f"{config}: unknown role 'oracle'")


# ------------------------------------------------------------------------------------------------ flags
def test_a_shortcut_that_is_not_the_methods_parameter_is_one_line(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    for flag in (["--domain", "medicine"], ["--no-experience"]):
        line = one_line_error("solve", Q, "-m", "cot", *flag, "--base-url", sim.base_url)
        assert f"{flag[0]} is not a parameter of method 'cot' (methods that take it: " in line
    assert sim.stats().total_requests == 0


def test_shortcuts_set_the_declared_parameters() -> None:
    assert flag_params("tmas", {"--no-experience": True}) == {"no_experience": True}
    assert flag_params("mattrl", {"--domain": "medicine"}) == {"domain": "medicine"}
    given = MethodFlags(["n=2"], 3, {"--no-guideline": True})
    assert given.params("tmas") == {"n": 2, "no_guideline": True, "iterations": 3}
    with pytest.raises(ConfigError, match=r"^--domain is not a parameter of method 'tmas' \(.*: mattrl\)$"):
        flag_params("tmas", {"--domain": "math"})


def test_help_lists_each_shortcut_with_its_parameters_help() -> None:
    out = invoke("run", "--help")
    assert out.exit_code == 0
    text = help_text(out)
    assert "--no-experience" in text and "TMAS ablation: no experience bank" in text
    assert "--domain" in text and "(--param domain=VALUE; method: mattrl)" in text
    # The methods' parameters follow, read from their parameter models.
    assert "mattrl: iterations=3" in text and "domain=math" in text


def test_a_registered_methods_shortcuts_become_flags_of_a_command(oracle: None) -> None:
    """A command declared once the method is registered (as the CLI is, with plugins loaded at import) takes its
    flags: a switch and a flag with a value, read as JSON like --param."""
    seen: list[MethodFlags] = []
    cli = typer.Typer()

    @cli.command()
    @method_options
    def show(given: MethodFlags, method: str = "oracle_toy") -> None:
        seen.append(given)
        typer.echo(repr(given.params(method)))

    out = CliRunner().invoke(cli, ["--oracle-hints", "3", "--oracle-bold", "-T", "2"])
    assert out.exit_code == 0, out.output
    assert seen[0].params("oracle_toy") == {"hints": 3, "bold": True, "iterations": 2}
    assert "Oracle calls per problem (--param hints=VALUE; method: oracle_toy)." in help_text(
        CliRunner().invoke(cli, ["--help"])
    )


def test_a_flag_taken_by_another_methods_other_parameter_is_refused() -> None:
    class Clash(MethodParams):
        area: str = Field(default="x", json_schema_extra=cli_flag("--domain", "another meaning"))

    class Clashing(Oracle):
        name: ClassVar[str] = "clashing_toy"
        Params: ClassVar[type[MethodParams]] = Clash

    with pytest.raises(ConfigError, match="flag --domain of parameter 'area' is already the flag of method 'mattrl'"):
        register_method(Clashing)
    assert "clashing_toy" not in METHODS


# ------------------------------------------------------------------------------------------------ stored runs
def test_stored_params_fill_defaults_from_the_parameter_model(oracle: None) -> None:
    # A run stored before select_from (then called pool) and confidence_measure were parameters.
    old = stored_params("tmas", {"pool": "all", "n": 4})
    assert old["select_from"] == "all" and "pool" not in old and old["n"] == 4
    assert old["select"] == "best_score" and old["confidence_measure"] == "tail" and old["mode"] == "numeric"
    # It ran before the answer fallback existed (on by default since): replayed without it, as it ran.
    assert old["answer_fallback"] is False and TMASParams().answer_fallback is True
    assert stored_params("tmas", {"answer_fallback": True})["answer_fallback"] is True
    assert stored_params("rse", {"n": 2})["answer_fallback"] is False and stored_params("rse", {})["bank_max"] == 40
    assert stored_params("oracle_toy", {})["hints"] == 1
    # A method not installed: the parameters every method has, and what was stored.
    gone = stored_params("a-plugin-not-installed", {"depth": 2})
    assert gone == {"iterations": 1, "mode": "numeric", "depth": 2}


def test_the_cli_names_no_methods_parameter_shortcut() -> None:
    """The shortcuts' flags and parameters are read from the registry: no string in src/tmas/cli is one of them."""
    declared = {text for flag, methods in method_flags().items() for text in (flag, methods[0][1].param)}
    assert {"--no-experience", "no_experience", "--domain", "domain"} <= declared
    cli = Path(__file__).resolve().parents[1] / "src" / "tmas" / "cli"
    found = [
        f"{path.name}:{node.lineno} {node.value!r}"
        for path in sorted(cli.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value in declared
    ]
    assert found == []
