"""Configured sampling reaches the wire: for every method and every role it calls, each way of setting sampling
(``[sampling]``, ``[roles.R.sampling]``, ``[roles.R]`` endpoint fields, ``TMAS_*`` variables, CLI flags, TMAS's
presets and per-role method params, ``--resume``, sweep points) is asserted on the request bodies the simulated
server received, and so is the precedence among them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import isolate
from tmas.api import asolve
from tmas.cli.main import app
from tmas.config import Sampling, Settings, load_settings
from tmas.grading.diagnosis import judge_rank
from tmas.grading.judge import judge_once
from tmas.llm.factory import open_model
from tmas.llm.types import user
from tmas.methods import METHODS
from tmas.store.run_store import RunStore
from tmas.sweep import Study, SweepSpec, run_sweep
from tmas.testing import Rule, SimScript, SimServer

Q = "What is 17*23?"

ALL = sorted(METHODS)


def example(method: str) -> dict[str, Any]:
    """The method's own small parameters (``Method.example_params``); a method that gives none is skipped, saying so."""
    params = METHODS[method].example_params
    if params is None:
        pytest.skip(f"{method} declares no example_params, so the wire tests cannot run it")
    return params


def declared_roles(method: str) -> set[str]:
    """The chat roles the method declares (its traits; embeddings are no chat call)."""
    return set(METHODS[method].traits.roles) - {"embedding"}


# A full sampling, every field away from the built-in defaults.
SAMPLING_TOML = """
[sampling]
temperature = 0.25
top_p = 0.9
max_tokens = 333
stop = ["<<END>>"]
top_k = 7
extra_body = { min_tokens = 3 }
"""
WANTED = {"temperature": 0.25, "top_p": 0.9, "max_tokens": 333, "stop": ["<<END>>"], "top_k": 7, "min_tokens": 3}


def toml(sim: SimServer, method: str, body: str = "", **params: Any) -> str:
    """A config file for ``method`` on ``sim`` with ``body`` appended."""
    merged = {**example(method), **params}
    inline = ", ".join(f"{k} = {_toml_value(v)}" for k, v in merged.items())
    return (
        f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "wire-model"\n\n'
        f'[method]\nname = "{method}"\nparams = {{ {inline} }}\n{body}'
    )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def settings_from(tmp_path: Path, text: str, env: dict[str, str] | None = None, **flags: Any) -> Settings:
    path = tmp_path / "tmas.toml"
    path.write_text(text)
    return load_settings(path, overrides=flags, environ=env or {})


def bodies_by_role(sim: SimServer) -> dict[str, list[dict[str, Any]]]:
    """The chat bodies received, by role; every one is checked for a well-formed message list."""
    out: dict[str, list[dict[str, Any]]] = {}
    for entry in sim.requests:
        if entry.endpoint != "chat":
            continue
        roles = [m["role"] for m in entry.body["messages"]]
        assert roles[-1] == "user" and set(roles) <= {"system", "user", "assistant"}, roles
        out.setdefault(entry.role, []).append(entry.body)
    return out


def assert_every_body(sim: SimServer, method: str, wanted: dict[str, Any], model: str = "wire-model") -> None:
    bodies = bodies_by_role(sim)
    # Every role it called is one it declares, and every one got the settings.
    assert bodies and set(bodies) <= declared_roles(method), set(bodies)
    for role, items in bodies.items():
        for body in items:
            assert body["model"] == model, role
            assert {k: body.get(k) for k in wanted} == wanted, role
            # No seed configured: each call gets its own reproducible one.
            assert isinstance(body["seed"], int), role


# ------------------------------------------------------------------------------------------ the merge itself
def test_merged_changes_only_the_fields_the_override_sets() -> None:
    route = Sampling(temperature=0.3, max_tokens=600, extra_body={"top_k": 5})
    seeded = Sampling().merged(Sampling(seed=11))
    # The per-call seed override of ProblemSession.chat: the bug was a full re-validation marking all fields set.
    assert seeded.model_fields_set == {"seed"}
    out = route.merged(seeded)
    assert (out.temperature, out.max_tokens, out.seed, out.extra_body) == (0.3, 600, 11, {"top_k": 5})
    assert out.model_fields_set == {"temperature", "max_tokens", "extra_body", "seed"}
    # A None read back from a full dump is no choice: it inherits.
    full = Sampling.model_validate(Sampling(top_p=0.5).model_dump())
    assert full.model_fields_set == set(Sampling.model_fields)
    assert route.merged(full).model_dump() == {**route.model_dump(), "top_p": 0.5}
    assert route.merged(Sampling(extra_body={"min_p": 0.1})).extra_body == {"top_k": 5, "min_p": 0.1}
    assert route.merged(None) is route and route.merged(Sampling()) is route


def test_a_partial_default_sampling_keeps_the_built_in_defaults() -> None:
    assert Settings(sampling=Sampling(top_p=0.5)).sampling == Sampling(temperature=0.7, top_p=0.5, max_tokens=2048)
    assert Settings.model_validate({"sampling": {"temperature": 0.1}}).sampling.max_tokens == 2048
    # An explicit None still says: leave it to the server.
    assert Settings.model_validate({"sampling": {"max_tokens": None}}).sampling.max_tokens is None


# ------------------------------------------------------------------------------------------ every method, every way
@pytest.mark.parametrize("method", ALL)
async def test_toml_sampling_reaches_every_role(sim: SimServer, tmp_path: Path, method: str) -> None:
    await asolve(Q, settings_from(tmp_path, toml(sim, method, SAMPLING_TOML)))
    assert_every_body(sim, method, WANTED)


@pytest.mark.parametrize("method", ALL)
async def test_environment_sampling_reaches_every_role(sim: SimServer, tmp_path: Path, method: str) -> None:
    env = {"TMAS_TEMPERATURE": "0.35", "TMAS_TOP_P": "0.8", "TMAS_MAX_TOKENS": "444", "TMAS_MODEL": "env-model"}
    await asolve(Q, settings_from(tmp_path, toml(sim, method), env))
    assert_every_body(sim, method, {"temperature": 0.35, "top_p": 0.8, "max_tokens": 444}, model="env-model")


@pytest.mark.parametrize("method", ALL)
def test_cli_flags_reach_every_role(
    sim: SimServer, tmp_path: Path, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    params = [arg for k, v in example(method).items() for arg in ("-p", f"{k}={json.dumps(v)}")]
    flags = ["--temperature", "0.45", "--top-p", "0.7", "--max-tokens", "555", "--model", "flag-model"]
    args = ["solve", Q, "-m", method, *params, "--base-url", sim.base_url, *flags]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    assert_every_body(sim, method, {"temperature": 0.45, "top_p": 0.7, "max_tokens": 555}, model="flag-model")


@pytest.mark.parametrize("method", ALL)
async def test_role_sampling_and_endpoint_fields_reach_their_role_only(
    sim: SimServer, tmp_path: Path, method: str
) -> None:
    roles = sorted(declared_roles(method))
    # Each role its own temperature and model; max_tokens and top_p still come from [sampling].
    body = SAMPLING_TOML + "".join(
        f'\n[roles.{role}]\nmodel = "model-{role}"\n[roles.{role}.sampling]\ntemperature = {0.05 * (i + 1):.2f}\n'
        for i, role in enumerate(roles)
    )
    await asolve(Q, settings_from(tmp_path, toml(sim, method, body)))
    bodies = bodies_by_role(sim)
    assert bodies and set(bodies) <= set(roles)
    for i, role in enumerate(roles):
        for b in bodies.get(role, []):
            assert b["model"] == f"model-{role}"
            assert (b["temperature"], b["top_p"], b["max_tokens"], b["top_k"]) == (
                pytest.approx(0.05 * (i + 1)),
                0.9,
                333,
                7,
            )


async def test_a_roles_context_length_bounds_its_calls_at_a_url_another_role_shares(
    sim: SimServer, tmp_path: Path
) -> None:
    # The refiner's window is set smaller than the server's; the solver, first at the same URL, keeps the default.
    body = "\n[sampling]\nmax_tokens = 4000\n[roles.refiner]\ncontext_length = 1200\n"
    await asolve(Q, settings_from(tmp_path, toml(sim, "self_refine", body, n=1, iterations=2)))
    bodies = bodies_by_role(sim)
    assert [b["max_tokens"] for b in bodies["solution"]] == [4000]
    assert bodies["refiner"] and all(b["max_tokens"] < 1200 for b in bodies["refiner"])


async def test_a_roles_context_length_stays_its_own_when_its_calls_go_first(sim: SimServer, tmp_path: Path) -> None:
    # The solver's window is set small and its call goes first: the refiner, at the same URL and model, has no window
    # of its own and keeps the default max_tokens (the server's own window holds it, as the solver's first call shows
    # in the reverse case above). Before, the solver's window was the replica's and bounded the refiner's calls too.
    body = "\n[sampling]\nmax_tokens = 4000\n[roles.solution]\ncontext_length = 1200\n"
    await asolve(Q, settings_from(tmp_path, toml(sim, "self_refine", body, n=1, iterations=2)))
    bodies = bodies_by_role(sim)
    assert bodies["solution"] and all(b["max_tokens"] < 1200 for b in bodies["solution"])
    assert [b["max_tokens"] for b in bodies["refiner"]] == [4000]


@pytest.mark.parametrize("method", ALL)
async def test_a_configured_seed_goes_plus_each_calls_sample_index(sim: SimServer, tmp_path: Path, method: str) -> None:
    # Sample j of a prompt goes with seed + j (sample 0, a call of one sample, with the seed as set), as vLLM draws
    # choice j of one request with n: sent as it is with every call, the parallel samples of one prompt came back
    # alike from a server that honours it.
    await asolve(
        Q, settings_from(tmp_path, toml(sim, method, SAMPLING_TOML + "seed = 1234\n")), run_dir=tmp_path / "run"
    )
    bodies = [b for items in bodies_by_role(sim).values() for b in items]
    assert bodies and all(b["temperature"] == 0.25 for b in bodies)
    with RunStore(tmp_path / "run", create=False) as store:
        sent = [(c.key.sample, store.call_sampling(c.call_id or 0)["seed"]) for c in store.calls()]
    assert any(sample == 0 and seed == 1234 for sample, seed in sent)
    assert all(seed == 1234 + sample for sample, seed in sent)
    assert sorted(b["seed"] for b in bodies) == sorted(seed for _, seed in sent)


async def test_derived_seeds_differ_between_parallel_samples(sim: SimServer, tmp_path: Path) -> None:
    await asolve(Q, settings_from(tmp_path, toml(sim, "majority", SAMPLING_TOML, k=4)))
    seeds = [b["seed"] for b in bodies_by_role(sim)["solution"]]
    assert len(set(seeds)) == 4


# ------------------------------------------------------------------------------------------ precedence
@pytest.mark.parametrize(
    ("env", "flags", "temperature", "max_tokens"),
    [
        ({}, {}, 0.25, 333),  # the file
        ({"TMAS_TEMPERATURE": "0.5"}, {}, 0.5, 333),  # environment over the file
        ({"TMAS_TEMPERATURE": "0.5"}, {"sampling.temperature": 0.6}, 0.6, 333),  # flags over the environment
        ({"TMAS_MAX_TOKENS": "50"}, {"sampling.max_tokens": 60}, 0.25, 60),
    ],
)
async def test_file_then_environment_then_flags(
    sim: SimServer, tmp_path: Path, env: dict[str, str], flags: dict[str, Any], temperature: float, max_tokens: int
) -> None:
    await asolve(Q, settings_from(tmp_path, toml(sim, "cot", SAMPLING_TOML), env, **flags))
    [body] = bodies_by_role(sim)["solution"]
    assert (body["temperature"], body["max_tokens"]) == (temperature, max_tokens)


@pytest.mark.parametrize(
    ("env", "flags", "wanted"),
    [
        ({"TMAS_TEMPERATURE": "0.3"}, {}, (0.3, None, 2048)),
        ({}, {"sampling.top_p": 0.5}, (0.7, 0.5, 2048)),
        ({}, {"sampling.max_tokens": 99}, (0.7, None, 99)),
    ],
)
async def test_setting_one_field_keeps_the_other_defaults(
    sim: SimServer, tmp_path: Path, env: dict[str, str], flags: dict[str, Any], wanted: tuple[Any, ...]
) -> None:
    # Before the fix a partial [sampling] replaced the whole default: max_tokens went unsent and unbounded.
    await asolve(Q, settings_from(tmp_path, toml(sim, "cot"), env, **flags))
    [body] = bodies_by_role(sim)["solution"]
    assert (body["temperature"], body.get("top_p"), body["max_tokens"]) == wanted


async def test_role_sampling_beats_the_default_from_any_source(sim: SimServer, tmp_path: Path) -> None:
    text = toml(sim, "self_refine", SAMPLING_TOML + "\n[roles.refiner.sampling]\ntemperature = 0.05\n")
    settings = settings_from(tmp_path, text, {"TMAS_TEMPERATURE": "0.5"}, **{"sampling.temperature": 0.6})
    await asolve(Q, settings)
    bodies = bodies_by_role(sim)
    assert {b["temperature"] for b in bodies["solution"]} == {0.6}
    assert {b["temperature"] for b in bodies["refiner"]} == {0.05}


async def test_tmas_local_preset_fills_only_what_the_user_left_alone(sim: SimServer, tmp_path: Path) -> None:
    # Built-in default sampling: every role gets the preset's temperature and max_tokens.
    await asolve(Q, settings_from(tmp_path, toml(sim, "tmas", "", preset="local")))
    bodies = bodies_by_role(sim)
    assert {(b["temperature"], b["max_tokens"]) for b in bodies["solution"]} == {(0.3, 640)}
    assert {(b["temperature"], b["max_tokens"]) for b in bodies["summary"]} == {(0.2, 220)}
    sim.reset()
    # The user's default temperature (flag) and a role's max_tokens win; the rest of the preset stays.
    body = "\n[roles.verifier.sampling]\nmax_tokens = 111\n"
    await asolve(Q, settings_from(tmp_path, toml(sim, "tmas", body, preset="local"), **{"sampling.temperature": 0.9}))
    bodies = bodies_by_role(sim)
    assert {(b["temperature"], b["max_tokens"]) for b in bodies["solution"]} == {(0.9, 640)}
    assert {(b["temperature"], b["max_tokens"]) for b in bodies["verifier"]} == {(0.9, 111)}


async def test_tmas_paper_preset_sends_its_sampling_unless_overridden(sim: SimServer, tmp_path: Path) -> None:
    await asolve(Q, settings_from(tmp_path, toml(sim, "tmas", "", preset="paper", iterations=1, n=1, m=1)))
    bodies = [b for items in bodies_by_role(sim).values() for b in items]
    assert bodies and all((b["temperature"], b["top_p"]) == (1.0, 0.95) for b in bodies)
    sim.reset()
    text = toml(sim, "tmas", "", preset="paper", iterations=1, n=1, m=1)
    await asolve(Q, settings_from(tmp_path, text, {"TMAS_TOP_P": "0.5"}))
    bodies = [b for items in bodies_by_role(sim).values() for b in items]
    assert bodies and all((b["temperature"], b["top_p"]) == (1.0, 0.5) for b in bodies)


async def test_tmas_method_param_sampling_beats_every_setting(sim: SimServer, tmp_path: Path) -> None:
    body = SAMPLING_TOML + "\n[roles.solution.sampling]\ntemperature = 0.05\nmax_tokens = 99\n"
    settings = settings_from(tmp_path, toml(sim, "tmas", body), **{"sampling.temperature": 0.6})
    settings.method.params["sampling"] = {"solution": {"temperature": 0.15}, "summary": {"max_tokens": 77}}
    await asolve(Q, settings)
    bodies = bodies_by_role(sim)
    assert {(b["temperature"], b["max_tokens"]) for b in bodies["solution"]} == {(0.15, 99)}
    assert {(b["temperature"], b["max_tokens"]) for b in bodies["summary"]} == {(0.6, 77)}
    assert {(b["temperature"], b["max_tokens"]) for b in bodies["verifier"]} == {(0.6, 333)}


async def test_embedded_model_defaults_reach_the_wire(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No endpoint: the run takes the embedded-model path (TMAS's local preset, the local server's model name and
    context window) with the sim server standing in for the started llama.cpp process."""

    class SimAsLocalReplicas:
        def __init__(self, cfg: Any, log_dir: Path | None = None) -> None:
            self.base_urls, self.model = [sim.base_url], "embedded-alias"

        async def __aenter__(self) -> SimAsLocalReplicas:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr("tmas.llm.local_server.LocalReplicas", SimAsLocalReplicas)
    # Two different answers, so the local preset's settled stop leaves both iterations (and every role) to run.
    answers = ["17*23 = 391.\n\n\\boxed{391}", "17*23 = 1360.\n\n\\boxed{1360}"]
    sim.set_script(SimScript(rules=[Rule(role="solution", replies=answers)]))
    settings = load_settings(None, environ={"TMAS_TOP_P": "0.85"}, overrides={"method.name": "tmas"})
    assert settings.uses_local_model
    result = await asolve(Q, settings, run_dir=tmp_path / "run")
    assert len(result.iterations) == 2  # the local preset's T = 2
    bodies = bodies_by_role(sim)
    assert set(bodies) == declared_roles("tmas")
    preset = {
        "solution": (0.3, 640),
        "verifier": (0.3, 400),
        "summary": (0.2, 220),
        "experience": (0.2, 450),
        "guideline": (0.2, 300),
    }
    for role, items in bodies.items():
        assert {(b["model"], b["top_p"], b["temperature"], b["max_tokens"]) for b in items} == {
            ("embedded-alias", 0.85, *preset[role])
        }, role


# ------------------------------------------------------------------------------------------ stored settings
@pytest.mark.parametrize("method", ["tmas", "self_refine"])
def test_resume_keeps_the_stored_sampling_and_takes_new_flags(
    sim: SimServer, tmp_path: Path, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    # A role with an endpoint field only: read back, its sampling is all None, which must neither wipe the default
    # sampling nor hide TMAS's local preset (max_tokens is left to the preset here).
    params = {"preset": "local"} if method == "tmas" else {}
    config = tmp_path / "cfg.toml"
    config.write_text(
        toml(sim, method, '[sampling]\ntemperature = 0.25\ntop_p = 0.9\n[roles.solution]\nmodel = "solver"\n', **params)
    )
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 17*23?"}\n')
    run_dir = tmp_path / "run"
    cli = CliRunner()
    out = cli.invoke(app, ["run", str(problems), "-o", str(run_dir), "--config", str(config)])
    assert out.exit_code == 0, out.output
    first = bodies_by_role(sim)
    sim.reset()
    more = str(example(method)["iterations"] + 1)
    out = cli.invoke(app, ["run", "--resume", str(run_dir), "-T", more, "--temperature", "0.55"])
    assert out.exit_code == 0, out.output
    second = bodies_by_role(sim)
    assert second, "the resumed run sent no call"
    max_tokens = {"solution": 640, "verifier": 400, "summary": 220, "experience": 450, "guideline": 300}
    for session, temperature in ((first, 0.25), (second, 0.55)):
        for role, items in session.items():
            wanted = (temperature, 0.9, max_tokens[role] if method == "tmas" else 2048)
            assert {(b["temperature"], b["top_p"], b["max_tokens"]) for b in items} == {wanted}, role
    assert {b["model"] for b in first["solution"] + second["solution"]} == {"solver"}


async def test_sweep_points_keep_the_sampling(sim: SimServer, tmp_path: Path) -> None:
    settings = settings_from(tmp_path, toml(sim, "cot", SAMPLING_TOML + '\n[roles.verifier]\nmodel = "checker"\n'))
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 17*23?", "answer": "391"}\n')
    study = Study(method="verify_refine", params={"n": 1, "iterations": 2}, grid={"m": [1, 2]})
    await run_sweep(SweepSpec(problems=str(problems), study=[study]), settings, tmp_path / "sweep")
    bodies = bodies_by_role(sim)
    assert set(bodies) == {"solution", "verifier", "corrector"}
    assert all((b["temperature"], b["max_tokens"], b["top_k"]) == (0.25, 333, 7) for v in bodies.values() for b in v)
    assert {b["model"] for b in bodies["verifier"]} == {"checker"}
    assert {b["model"] for b in bodies["solution"]} == {"wire-model"}


@pytest.mark.parametrize(
    ("body", "seeds"),
    [
        # A seed for the judge, or for every role, goes plus the run (run j: seed + j): under one seed the
        # --judge-runs of a server that honours it were one verdict counted again. The judge's temperature over the
        # default one.
        ("[sampling]\nseed = 1234\n[roles.judge.sampling]\nseed = 7\ntemperature = 0.0\n", [7, 8]),
        ("[sampling]\nseed = 1234\n[roles.judge.sampling]\ntemperature = 0.0\n", [1234, 1235]),
        # No seed configured: each judge run draws its own.
        ("[sampling]\ntemperature = 0.3\n[roles.judge.sampling]\ntemperature = 0.0\n", None),
    ],
)
async def test_the_judge_sends_the_sampling_configured_for_it(
    sim: SimServer, tmp_path: Path, body: str, seeds: list[int] | None
) -> None:
    settings = settings_from(tmp_path, f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "wire-model"\n{body}')
    async with open_model(settings) as llm:
        for run in range(2):
            await judge_once(llm, problem_id="p", problem="What is 1+1?", reference="2", student="2", run=run)
    judged = bodies_by_role(sim)["judge"]
    assert [b["temperature"] for b in judged] == [0.0, 0.0]
    if seeds is None:
        assert len({b["seed"] for b in judged}) == 2
    else:
        assert [b["seed"] for b in judged] == seeds


async def test_a_roles_context_length_bounds_no_other_role_when_that_role_calls_first(
    sim: SimServer, tmp_path: Path
) -> None:
    # The replica both roles reach took the refiner's window when the refiner called first, and the solver's
    # max_tokens of 4000 was then lowered below 1200 too.
    body = "\n[sampling]\nmax_tokens = 4000\n[roles.refiner]\ncontext_length = 1200\n"
    settings = settings_from(tmp_path, toml(sim, "self_refine", body, n=1, iterations=2))
    async with open_model(settings) as llm:
        for role in ("refiner", "solution"):
            reply = await llm.chat(role, [user(Q)])
            assert reply.ok, reply.error
    bodies = bodies_by_role(sim)
    assert [b["max_tokens"] for b in bodies["solution"]] == [4000]
    assert len(bodies["refiner"]) == 1 and bodies["refiner"][0]["max_tokens"] < 1200


async def test_a_judge_asked_again_after_an_unreadable_reply_changes_a_configured_seed(
    sim: SimServer, tmp_path: Path
) -> None:
    # A server that honours the seed would give the retry the same unreadable reply under the same seed.
    sim.set_script(
        SimScript(
            rules=[
                Rule(role="judge", pattern="<student>", replies=["undecided"], times=1),
                Rule(role="judge", pattern="<student>", replies=['{"reasoning": "r", "equivalent": true}']),
                Rule(role="judge", replies=["no rank"], times=1),
                Rule(role="judge", replies=["<answer>2</answer>"]),
            ]
        )
    )
    settings = settings_from(tmp_path, f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "m"\n[sampling]\nseed = 7\n')
    async with open_model(settings) as llm:
        verdict = await judge_once(llm, problem_id="p", problem="What is 1+1?", reference="2", student="2", run=0)
        rank = await judge_rank(llm, "p", ["Flu", "Cold"], "Common cold")
    assert (verdict.correct, verdict.attempts, rank) == (True, 2, (2, None))
    judged = bodies_by_role(sim)["judge"]
    for first, retry in (judged[0:2], judged[2:4]):
        assert first["messages"] == retry["messages"]
        assert first["seed"] == 7 and retry["seed"] != 7


async def test_a_methods_call_asked_again_after_an_unusable_reply_changes_a_configured_seed(
    sim: SimServer, tmp_path: Path
) -> None:
    # MATTRL asks again the coordinator's unreadable team (its own retries), a reviewer's unreadable review (its own
    # retries) and a specialist's echoing opinion (the echo guard): under the same seed a server that honours it would
    # answer each the same way.
    opinion = "A one- or two-sentence reflection, the core reasoning, and \\boxed{the final answer alone}"
    sim.set_script(
        SimScript(
            rules=[
                Rule(role="coordinator", replies=["no team here"], times=1),
                Rule(role="specialist", replies=[opinion], times=1),
                Rule(role="reviewer", replies=["no review here"], times=1),
            ]
        )
    )
    result = await asolve(Q, settings_from(tmp_path, toml(sim, "mattrl", "[sampling]\nseed = 7\n")))
    assert result.answer == "391"
    bodies = bodies_by_role(sim)
    for role in ("coordinator", "specialist", "reviewer"):
        # The first call sends the seed plus its sample index; its retry, the same prompt again, a seed no other call
        # of the role sent.
        first, *others = bodies[role]
        [retry] = [b for b in others if b["messages"] == first["messages"]]
        assert retry["seed"] not in {b["seed"] for b in bodies[role] if b is not retry}, role
        assert first["seed"] >= 7, role
