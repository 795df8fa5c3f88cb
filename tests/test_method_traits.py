"""Methods declare what they are (``Method.traits``): every reader asks the registry, never a method's name, and
methods from other packages are found by their entry points."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest

from conftest import run_tmas, settings_for
from name_comparisons import name_comparisons
from tmas.methods import METHODS, known_roles, method_traits, register_method
from tmas.methods.base import Method
from tmas.methods.traits import DEFAULT_TRAITS, Traits
from tmas.serve.client_sampling import greedy_notice
from tmas.serve.launch import ServeOptions
from tmas.serve.protocol import ChatBody
from tmas.testing import SimServer
from web_helpers import ProxyThread, post

SRC = Path(__file__).resolve().parents[1] / "src" / "tmas"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_role_a_method_declares_can_be_configured(name: str) -> None:
    roles = METHODS[name].traits.roles
    assert roles and all(name in known_roles()[role] for role in roles), f"{name}: roles {roles} not all known"


def method_name_comparisons(path: Path) -> list[str]:
    """Comparisons of a value with a registered method's name (``== "tmas"``, ``in ("cot", ...)``) in one file."""
    return name_comparisons(path, set(METHODS))


def test_no_code_outside_the_methods_compares_a_method_name() -> None:
    outside = [p for p in sorted(SRC.rglob("*.py")) if "methods" not in p.relative_to(SRC).parts]
    assert [hit for p in outside for hit in method_name_comparisons(p)] == []


def test_the_comparison_finder_finds_one(tmp_path: Path) -> None:
    """The check above can fail: a planted comparison is found."""
    planted = tmp_path / "planted.py"
    planted.write_text('def f(method):\n    return method == "majority" or method in ("cot", "x")\n')
    assert len(method_name_comparisons(planted)) == 2


def test_readers_get_the_declared_traits_and_defaults_for_unknown_methods() -> None:
    assert method_traits("majority").frontier == "votes" and method_traits("cot").one_chain
    assert method_traits("tmas").selects and method_traits("verify_refine").selects
    assert method_traits("a-plugin-not-installed") == DEFAULT_TRAITS


def test_the_proxy_warns_of_temperature_zero_by_the_methods_traits() -> None:
    body = ChatBody.model_validate({"model": "x/m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert greedy_notice("cot", body, "defaults") is None  # one chain: nothing to lose
    # Parallel samples (majority's k, Self-Refine's n trajectories) are alike at temperature 0.
    for name in ("majority", "self_refine", "tmas"):
        notice = greedy_notice(name, body, "defaults")
        assert notice is not None and name in notice

    class OneChain(METHODS["cot"]):  # type: ignore[misc,valid-type]
        name: ClassVar[str] = "one_chain_toy"
        traits: ClassVar[Traits] = Traits(one_chain=True)

    register_method(OneChain)
    try:
        assert greedy_notice("one_chain_toy", body, "defaults") is None
    finally:
        del METHODS["one_chain_toy"]


def test_the_proxy_notes_temperature_zero_for_parallel_samples(sim: SimServer, tmp_path: Path) -> None:
    with ProxyThread(settings_for(sim), ServeOptions(serve_dir=tmp_path / "served")) as proxy:
        replies = {}
        for method, params in (("cot", {}), ("self_refine", {"n": 2, "iterations": 1})):
            body = {
                "model": f"{method}/sim-model",
                "messages": [{"role": "user", "content": "What is 17*23?"}],
                "temperature": 0,
                "tmas": params,
            }
            status, replies[method] = post(f"{proxy.url}/v1/chat/completions", json.dumps(body).encode())
            assert status == 200, replies[method]
    # What the server received: temperature 0 on every call of both methods.
    assert {r.body["temperature"] for r in sim.requests if r.endpoint == "chat"} == {0}
    assert "notices" not in replies["cot"]["tmas"]
    [notice] = replies["self_refine"]["tmas"]["notices"]
    assert notice.startswith("temperature 0 was applied to every upstream call of self_refine")


# ------------------------------------------------------------------------------------------ entry points
PLUGIN = '''
from typing import ClassVar

from tmas.agents.solution import generation_prompt
from tmas.methods.base import Iterations, Method, MethodParams, ProblemResult, ProblemSession
from tmas.methods.steps import finish, solve_call
from tmas.methods.traits import Traits


class TwiceParams(MethodParams):
    iterations: Iterations = 2


class Twice(Method[TwiceParams]):
    """A fresh sample per iteration; the last one answers."""

    name: ClassVar[str] = "twice"
    Params: ClassVar[type[MethodParams]] = TwiceParams
    traits: ClassVar[Traits] = Traits()

    async def solve(self, session: ProblemSession) -> ProblemResult:
        last = None
        for t in range(self.params.iterations):
            session.begin_iteration(t)
            messages = generation_prompt(session.problem.question, self.params.mode)
            last = await solve_call(session, "solution", messages, index=0, mode=self.params.mode)
            if last is None:
                return finish(session, self.name, None, stopped=True)
            session.end_iteration([last], selected=last.answer)
        return finish(session, self.name, last, stopped=False)
'''


def plugin_site(root: Path) -> dict[str, str]:
    """An installed package as pip leaves one: its module and a dist-info whose entry points name two methods,
    one that loads and one whose module is missing. The environment that puts it on the path."""
    site = root / "site"
    (site / "toy_methods").mkdir(parents=True)
    (site / "toy_methods" / "__init__.py").write_text(PLUGIN)
    info = site / "toy_methods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-methods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[tmas.methods]\ntwice = toy_methods:Twice\nbroken = toy_methods_gone:Broken\n"
    )
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


@pytest.mark.slow
def test_a_method_from_another_package_is_found_by_its_entry_point(sim: SimServer, tmp_path: Path) -> None:
    env = plugin_site(tmp_path)
    done = run_tmas("solve", "What is 17*23?", "--base-url", sim.base_url, "-m", "twice", env=env, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "391" and sim.stats().by_role == {"solution": 2}
    # The methods' help lists it beside the packaged ones.
    listed = run_tmas("solve", "--help", env=env, text=True)
    assert "twice" in listed.stdout


@pytest.mark.slow
def test_a_plugin_that_fails_to_load_is_named_with_its_package(sim: SimServer, tmp_path: Path) -> None:
    env = plugin_site(tmp_path)
    broken = run_tmas("solve", "What is 17*23?", "--base-url", sim.base_url, "-m", "broken", env=env, text=True)
    assert broken.returncode != 0 and "Traceback" not in broken.stderr
    expected = (
        "method plugin 'broken' from package 'toy-methods' failed to load:"
        " ModuleNotFoundError: No module named 'toy_methods_gone'"
    )
    assert expected in broken.stderr
    # The packaged methods still work beside it.
    done = run_tmas("solve", "What is 17*23?", "--base-url", sim.base_url, "-m", "cot", env=env, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "391"


def test_register_rejects_what_is_not_a_method_of_its_own_name() -> None:
    class Other(Method[Any]):
        name: ClassVar[str] = "cot"

        async def solve(self, session: Any) -> Any:
            raise NotImplementedError

    with pytest.raises(Exception, match="method name 'cot' is taken"):
        register_method(Other)
