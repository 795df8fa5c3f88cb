"""The model option group: declared once, the same flags on every command that takes it, and
each flag reaches the request bodies the simulated server receives and the settings the run records."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from conftest import isolate, run_tmas
from tmas.agents.overrides import packaged_source
from tmas.cli import main as cli
from tmas.cli.main import app
from tmas.cli.options import FLAG_KEYS, GROUP, ModelFlags
from tmas.config import load_settings
from tmas.errors import ConfigError, InputError
from tmas.store.run_store import RunStore
from tmas.sweep import resumed_sweep
from tmas.testing import SimServer

GROUP_COMMANDS = (
    "solve",
    "run",
    "eval",
    "sweep",
    "serve",
    "data filter",
    "cases grade",
    "pool search",
    "pool build",
    "pool prune",
    "pool router train",
)
MARK = "ZQX-GROUP-PROMPT-MARK"


def _commands() -> dict[str, Any]:
    """The click commands typer builds (typer vendors its own click, so they are read by attribute)."""
    root: Any = typer.main.get_command(app)
    found = {}
    for path in GROUP_COMMANDS:
        command = root
        for name in path.split():
            command = command.commands[name]
        found[path] = command
    return found


def _group_options(command: Any) -> dict[str, tuple[tuple[str, ...], str | None]]:
    """The group's options of ``command``: parameter name -> (its flags, its help)."""
    return {
        p.name: (tuple(p.opts), getattr(p, "help", None))
        for p in command.params
        if isinstance(p, typer.core.TyperOption) and p.name in GROUP
    }


def test_every_command_with_the_group_has_all_its_flags_spelled_alike() -> None:
    commands = _commands()
    reference = _group_options(commands["run"])
    assert set(reference) == set(GROUP) == {"config", *FLAG_KEYS}
    assert "--prompts-dir" in reference["prompts_dir"][0]
    for name, command in commands.items():
        assert _group_options(command) == reference, name
        # No command declares a flag of the group a second time under another parameter name.
        spelled = [opt for p in command.params for opt in p.opts]
        assert len(spelled) == len(set(spelled)), name


def test_each_flag_maps_to_one_settings_key() -> None:
    flags = ModelFlags(temperature=0.3, budget_calls=9, prompts_dir="p")
    overrides = flags.overrides("cot")
    assert {k: v for k, v in overrides.items() if v is not None} == {
        "sampling.temperature": 0.3,
        "budget.calls": 9,
        "prompts_dir": "p",
        "method.name": "cot",
    }
    assert set(overrides) == {*FLAG_KEYS.values(), "method.name"}


@pytest.mark.parametrize("flag", ["--base-url", "--model", "--api-key-env", "--prompts-dir", "--local-model"])
def test_a_text_flag_given_empty_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sim: SimServer, flag: str
) -> None:
    # --base-url "$URL" with URL unset would start the embedded model; --prompts-dir "" would use the packaged prompts.
    isolate(monkeypatch, tmp_path)
    args = [*_command_args("run", tmp_path), "--base-url", sim.base_url, "--dry-run", flag, " "]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, InputError)
    assert str(result.exception) == f"{flag} is empty: give a value, or leave the flag out"


@pytest.mark.parametrize("urls", [",", " , ,"])
def test_a_base_url_of_commas_and_no_url_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sim: SimServer, urls: str
) -> None:
    # Read as no endpoint, it would start the embedded local model.
    isolate(monkeypatch, tmp_path)
    result = CliRunner().invoke(app, [*_command_args("run", tmp_path), "--dry-run", "--base-url", urls])
    assert isinstance(result.exception, InputError)
    assert str(result.exception) == f"--base-url {urls!r} holds no URL: give one, or several comma-separated"


def test_a_base_url_of_commas_in_the_environment_or_a_config_file_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "cfg.toml"
    config.write_text('[endpoint]\nbase_url = ","\n[roles.judge]\nbase_url = ","\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"cfg.toml: bad value for 'endpoint.base_url': ',' holds no URL"):
        load_settings(config, environ={})
    with pytest.raises(ConfigError, match=r"TMAS_BASE_URL.*',,' holds no URL"):
        load_settings(None, environ={"TMAS_BASE_URL": ",,"})
    assert load_settings(None, environ={"TMAS_BASE_URL": "http://a/v1, http://b/v1,"}).endpoint.base_url == [
        "http://a/v1",
        "http://b/v1",
    ]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://", "'http://' names no host"),
        ("http://:8000/v1", "'http://:8000/v1' names no host"),
        ("http://127.0.0.1:99999/v1", "'http://127.0.0.1:99999/v1' is not a valid URL (Port out of range 0-65535)"),
        ("http://gpu1:80a/v1", "'http://gpu1:80a/v1' is not a valid URL (Port could not be cast to integer value"),
        ("http://[::1/v1", "'http://[::1/v1' is not a valid URL (Invalid IPv6 URL)"),
        ("http://gpu 1:8000/v1", "'http://gpu 1:8000/v1' holds a space"),
    ],
)
def test_a_base_url_no_connection_can_be_made_to_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    sim: SimServer,
    url: str,
    said: str,
) -> None:
    # Before, 'http://' ended in a traceback at the first call, and a bad port or host was sent six times over and
    # counted the problem failed.
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(sys, "argv", ["tmas", *_command_args("run", tmp_path), "--base-url", url, "--yes"])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"tmas: error: bad value for --base-url: {said}")
    assert not (tmp_path / "out").exists()
    config = tmp_path / "cfg.toml"
    config.write_text(f'[roles.judge]\nbase_url = "{url}"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_settings(config, environ={})
    assert str(caught.value).startswith(f"{config}: bad value for 'roles.judge.base_url': {said}")


@pytest.mark.parametrize("urls", ["", "   "])
def test_an_empty_base_url_in_a_config_file_or_the_environment_is_refused(tmp_path: Path, urls: str) -> None:
    # Read as no endpoint, it would start the embedded local model in place of the server the user meant to name.
    config = tmp_path / "cfg.toml"
    config.write_text(f'[endpoint]\nbase_url = "{urls}"\nmodel = "m"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_settings(config, environ={})
    assert str(caught.value) == (
        f"{config}: bad value for 'endpoint.base_url': {urls!r} holds no URL: give one (several comma-separated),"
        " or leave the key out"
    )
    config.write_text(f'[roles.judge]\nbase_url = "{urls}"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"cfg.toml: bad value for 'roles.judge.base_url': '.*' holds no URL"):
        load_settings(config, environ={})
    if urls:  # an empty variable is an unset one
        with pytest.raises(ConfigError, match=r"^environment \(TMAS_BASE_URL\): bad value for 'endpoint.base_url'"):
            load_settings(None, environ={"TMAS_BASE_URL": urls})
    # Leaving the key out still asks for the embedded model.
    config.write_text('[endpoint]\nmodel = "m"\n', encoding="utf-8")
    assert load_settings(config, environ={"TMAS_BASE_URL": ""}).uses_local_model


def test_a_role_base_url_of_no_url_is_refused_as_the_file_is_read(tmp_path: Path) -> None:
    # Unset, the role takes the default endpoint's URLs; an empty list failed the role's first call, mid-run.
    config = tmp_path / "cfg.toml"
    config.write_text("[roles.judge]\nbase_url = []\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_settings(config, environ={})
    assert str(caught.value) == (
        f"{config}: bad value for 'roles.judge.base_url': [] holds no URL: give one or several, or leave the key out"
        " for the default endpoint's"
    )
    config.write_text('[endpoint]\nbase_url = "http://a/v1"\n[roles.judge]\nmodel = "j"\n', encoding="utf-8")
    assert load_settings(config, environ={}).roles["judge"].base_url is None


@pytest.mark.parametrize("table", ["endpoint", "roles.judge"])
@pytest.mark.parametrize(("value", "shown"), [("5", "5"), ('["http://a/v1", 5]', "['http://a/v1', 5]")])
def test_a_base_url_that_is_no_string_says_a_url_or_a_list_of_them_is_expected(
    tmp_path: Path, table: str, value: str, shown: str
) -> None:
    # Before, a number was said to be no "valid list", though one URL string is as good.
    config = tmp_path / "cfg.toml"
    config.write_text(f"[{table}]\nbase_url = {value}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_settings(config, environ={})
    assert str(caught.value) == (
        f"{config}: bad value for '{table}.base_url': expected a URL string or a list of them, got {shown}"
    )


def test_a_bad_variable_is_named_alone_among_those_given(tmp_path: Path) -> None:
    env = {"TMAS_BASE_URL": "http://a/v1", "TMAS_MODEL": "m", "TMAS_TEMPERATURE": "0.6x", "TMAS_MAX_TOKENS": "4096"}
    with pytest.raises(ConfigError) as caught:
        load_settings(None, environ=env)
    assert str(caught.value) == (
        "environment (TMAS_TEMPERATURE): bad value for 'sampling.temperature': Input should be a valid number,"
        " unable to parse string as a number"
    )
    # A check across keys names every variable given: any of them may be the one to change.
    with pytest.raises(ConfigError, match=r"^environment \(TMAS_BASE_URL, TMAS_BUDGET_POOL\): bad value for 'budget'"):
        load_settings(None, environ={"TMAS_BASE_URL": "http://a/v1", "TMAS_BUDGET_POOL": "true"})


def _group_args(sim: SimServer, tmp_path: Path) -> list[str]:
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "system_math.j2").write_text(packaged_source("system_math.j2") + f"\n{MARK}\n", encoding="utf-8")
    config = tmp_path / "cfg.toml"
    config.write_text("[sampling]\ntemperature = 0.9\n[budget]\ncalls = 400\n", encoding="utf-8")
    return [
        *("--config", str(config), "--base-url", sim.base_url, "--model", "group-model"),
        *("--api-key-env", "TMAS_GROUP_TEST_KEY", "--concurrency", "3", "--problems-in-flight", "2"),
        *("--prompts-dir", str(prompts)),
        *("--temperature", "0.35", "--top-p", "0.8", "--max-tokens", "444", "--seed", "11"),
        *("--budget-tokens", "900000", "--budget-calls", "50", "--budget-count", "total", "--budget-pool"),
    ]


def _command_args(command: str, tmp_path: Path) -> list[str]:
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 17*23?", "answer": "391"}\n', encoding="utf-8")
    out = str(tmp_path / "out")
    return {
        "solve": ["solve", "What is 17*23?", "-m", "cot", "--run-dir", out],
        "run": ["run", str(problems), "-o", out, "-m", "cot"],
        "eval": ["eval", str(problems), "-o", out, "-m", "cot", "--grade", "rules"],
        "sweep": ["sweep", "--problems", str(problems), "-o", out, "-m", "cot", "--no-report"],
    }[command]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["solve", "run", "eval", "sweep"])
def test_each_flag_of_the_group_reaches_the_wire_and_the_run(
    sim: SimServer, tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("TMAS_GROUP_TEST_KEY", "sk-group")
    result = CliRunner().invoke(app, [*_command_args(command, tmp_path), *_group_args(sim, tmp_path)])
    assert result.exit_code == 0, result.output
    bodies = sim.chat_bodies()
    assert bodies
    for body in bodies:
        assert body["model"] == "group-model"
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.35, 0.8, 444)
        assert MARK in body["messages"][0]["content"]
    keys = {entry.authorization for entry in sim.requests if entry.endpoint == "chat"}
    assert keys == {"Bearer sk-group"}
    stores = sorted((tmp_path / "out").rglob("run.sqlite"))
    assert len(stores) == 1
    with RunStore(stores[0].parent, create=False) as store:
        stored: dict[str, Any] = store.get_meta("settings")
    assert stored["endpoint"]["base_url"] == [sim.base_url]
    assert stored["endpoint"]["api_key_env"] == "TMAS_GROUP_TEST_KEY"
    assert (stored["concurrency"], stored["problems_in_flight"], stored["seed"]) == (3, 2, 11)
    assert stored["prompts_dir"] == str(tmp_path / "prompts")
    assert stored["budget"] == {"tokens": 900000, "calls": 50, "count": "total", "pool": True}
    # The flags were put over the config file's values, which the file alone would have set.
    assert stored["sampling"]["temperature"] == 0.35


# ------------------------------------------------------------------------------------------ the library's rules
def test_sweep_budget_precedence() -> None:
    from tmas.config import Budget
    from tmas.sweep import sweep_budget

    configured = Budget(tokens=1000, calls=None)
    # A grid without a budget takes the configured one (config file, environment and flags) whole.
    assert sweep_budget(Budget(), configured, {}) == configured
    # A grid's own budget beats the configured one; the flags given now beat the grid's, field by field.
    grid = Budget(tokens=500, calls=7)
    assert sweep_budget(grid, configured, {}) == grid
    assert sweep_budget(grid, configured, {"calls": 3}) == Budget(tokens=500, calls=3)


def test_resume_settings_put_the_flags_over_the_stored_ones_and_read_no_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tmas.config import Settings
    from tmas.runner import resume_settings

    stored = Settings.model_validate({"sampling": {"temperature": 0.25, "top_p": 0.9}, "method": {"name": "cot"}})
    monkeypatch.setenv("TMAS_TOP_P", "0.5")
    merged = resume_settings(
        stored, ModelFlags(temperature=0.55).overrides(), stored_at=Path("run"), params={"iterations": 3}
    )
    assert (merged.sampling.temperature, merged.sampling.top_p) == (0.55, 0.9)
    assert merged.method.params == {"iterations": 3} and merged.method.name == "cot"


async def test_api_resume_takes_new_iterations_and_sampling_on_the_wire(sim: SimServer, tmp_path: Path) -> None:
    from tmas.api import aresume, arun
    from tmas.config import load_settings

    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 17*23?"}\n', encoding="utf-8")
    settings = load_settings(
        None,
        {"endpoint.base_url": sim.base_url, "method.name": "self_refine", "method.params": {"n": 1, "iterations": 1}},
        environ={},
    )
    first = await arun(problems, tmp_path / "run", settings)
    assert first.to_dict()["done"] == 1
    sim.reset()
    await aresume(tmp_path / "run", {"sampling.temperature": 0.55}, params={"iterations": 2})
    bodies = sim.chat_bodies()
    # One more iteration: the refiner is called again, with the temperature given on resume.
    assert bodies and {b["temperature"] for b in bodies} == {0.55}
    assert "refiner" in {entry.role for entry in sim.requests}


def test_tmas_pool_and_tmas_experience_are_one_command_group(tmp_path: Path) -> None:
    root: Any = typer.main.get_command(app)
    pool, experience = root.commands["pool"], root.commands["experience"]
    assert set(pool.commands) == set(experience.commands) >= {"build", "prune", "show", "search", "router", "fewshot"}
    # The old name still runs the commands: a folder that is no pool is refused alike by both.
    outputs = [CliRunner().invoke(app, [name, "show", str(tmp_path)]) for name in ("pool", "experience")]
    assert outputs[0].exit_code == outputs[1].exit_code != 0
    assert str(outputs[0].exception) == str(outputs[1].exception)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "sweep"])
def test_the_judge_asks_the_run_s_model_as_the_run_s_flags_set_it(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("TMAS_GROUP_TEST_KEY", "sk-group")
    args = [a for a in _command_args(command, tmp_path) if a not in ("--grade", "rules", "--no-report")]
    args += ["--grade", "judge", "--judge-runs", "1", "--temperature", "0.35", "--max-tokens", "4096"]
    endpoint = ["--base-url", sim.base_url, "--model", "group-model", "--api-key-env", "TMAS_GROUP_TEST_KEY"]
    result = CliRunner().invoke(app, [*args, *endpoint])
    assert result.exit_code == 0, result.output
    judged = [entry for entry in sim.requests if entry.role == "judge"]
    assert len(judged) == 1
    # The run's endpoint, model name, key and sampling (a thinking model judging needs the run's max_tokens).
    assert judged[0].body["model"] == "group-model" and judged[0].authorization == "Bearer sk-group"
    assert (judged[0].body["temperature"], judged[0].body["max_tokens"]) == (0.35, 4096)


@pytest.mark.slow
def test_tmas_report_asks_the_judge_named_without_a_default_endpoint(
    sim: SimServer, sim2: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    run_dir = tmp_path / "out"
    ran = CliRunner().invoke(app, [*_command_args("run", tmp_path), "--base-url", sim.base_url, "--model", "run-model"])
    assert ran.exit_code == 0, ran.output
    judge_only = tmp_path / "judge.toml"
    judge_only.write_text(f'[roles.judge]\nbase_url = "{sim2.base_url}"\nmodel = "judge-y"\n', encoding="utf-8")
    report = ["report", str(run_dir), "--grade", "judge", "--judge-runs", "1"]
    asked = {}
    # --judge-model alone: the run's endpoint, under the judge's model name; a config naming the judge role's own
    # endpoint alone: that endpoint, and nothing started for the other roles.
    for name, extra in (("model", ["--judge-model", "judge-x"]), ("config", ["--config", str(judge_only)])):
        sim.reset()
        sim2.reset()
        result = CliRunner().invoke(app, [*report, "-o", str(tmp_path / name), *extra])
        assert result.exit_code == 0, result.output
        asked[name] = [
            (server, e.body["model"]) for server in (sim, sim2) for e in server.requests if e.role == "judge"
        ]
        with RunStore(run_dir, create=False) as store:
            store.delete_grades()
    assert asked == {"model": [(sim, "judge-x")], "config": [(sim2, "judge-y")]}


@pytest.mark.slow
def test_a_grid_files_sampling_and_budget_sit_under_every_flag(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 17*23?", "answer": "391"}\n', encoding="utf-8")
    grid = tmp_path / "grid.toml"
    grid.write_text(
        f'problems = "{problems}"\n[budget]\ntokens = 100000\n'
        "[sampling]\ntemperature = 0.33\ntop_k = 40\nmin_p = 0.2\nseed = 42\n"
        '[[study]]\nname = "s"\nmethod = "cot"\n',
        encoding="utf-8",
    )
    config = tmp_path / "cfg.toml"
    config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\n', encoding="utf-8")
    out = tmp_path / "sweep"
    flags = ["--top-k", "20", "--seed", "3", "--budget-tokens", "5000", "--budget-pool", "--no-report"]
    result = CliRunner().invoke(app, ["sweep", str(grid), "-o", str(out), "--config", str(config), *flags])
    assert result.exit_code == 0, result.output
    [body] = sim.chat_bodies()
    # --top-k over the grid's top_k; --seed is the run's seed, so the grid's sampling seed is still sent.
    assert (body["temperature"], body["top_k"], body["min_p"], body["seed"]) == (0.33, 20, 0.2, 42)
    [store_file] = out.rglob("run.sqlite")
    with RunStore(store_file.parent, create=False) as store:
        stored: dict[str, Any] = store.get_meta("settings")
    assert stored["budget"] == {"tokens": 5000, "calls": None, "count": "completion", "pool": True}
    assert stored["seed"] == 3
    # Resumed with the config file read afresh: the grid's sampling is laid on it again, under a flag given now.
    _, settings = resumed_sweep(out, ModelFlags(min_p=0.1).overrides(), config=config)
    assert settings.sampling.temperature == 0.33 and settings.sampling.seed == 42
    assert (settings.sampling.top_k, settings.sampling.min_p) == (40, 0.1)


@pytest.mark.slow
def test_a_sweep_point_keeps_the_config_files_params_of_its_method(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate(monkeypatch, tmp_path)
    config = tmp_path / "cfg.toml"
    config.write_text(
        f'[endpoint]\nbase_url = "{sim.base_url}"\n'
        '[method]\nname = "tmas"\n'
        "params = { n = 3, m = 1, iterations = 1, sampling = { solution = { temperature = 0.11 } } }\n",
        encoding="utf-8",
    )
    args = [*_command_args("sweep", tmp_path), "--config", str(config)]
    # The point's own params win (n from the grid); the rest are the config file's, as tmas run keeps them.
    args = [a if a != "cot" else "tmas" for a in args] + ["-g", "n=2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    bodies = [entry.body for entry in sim.requests if entry.role == "solution"]
    assert len(bodies) == 2 and {b["temperature"] for b in bodies} == {0.11}


def test_a_grid_axis_given_twice_is_refused(tmp_path: Path) -> None:
    args = [*_command_args("sweep", tmp_path), "-g", "k=2", "-g", "k=3"]
    result = CliRunner().invoke(app, [a if a != "cot" else "majority" for a in args])
    assert isinstance(result.exception, InputError) and "--grid k is given twice" in str(result.exception)


def test_a_parameter_given_twice_is_refused(tmp_path: Path) -> None:
    # As a grid axis given twice: the later value would otherwise replace the earlier without a word.
    args = [*_command_args("run", tmp_path), "--dry-run", "-p", "iterations=2", "-p", " iterations=3"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, InputError)
    assert str(result.exception) == "--param iterations is given twice: give it once"


@pytest.mark.parametrize(
    ("method", "given", "shown"),
    [
        (
            "tmas",
            ["-p", "iterations=2", "--iterations", "3"],
            "--param iterations and --iterations both set iterations",
        ),
        (
            "tmas",
            ["--no-experience", "-p", "no_experience=false"],
            "--param no_experience and --no-experience both set no_experience",
        ),
        ("mattrl", ["-p", 'domain="math"', "--domain", "code"], "--param domain and --domain both set domain"),
    ],
)
def test_a_parameter_given_by_param_and_by_its_flag_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, method: str, given: list[str], shown: str
) -> None:
    # Before, the flag's value replaced the --param one without a word.
    isolate(monkeypatch, tmp_path)
    args = [*_command_args("run", tmp_path), "--base-url", "http://127.0.0.1:9/v1", "--dry-run", *given]
    result = CliRunner().invoke(app, [a if a != "cot" else method for a in args])
    assert isinstance(result.exception, InputError), result.output
    assert str(result.exception) == f"{shown}: give one of them"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--temperature", "-1"], "--temperature: Input should be greater than or equal to 0"),
        (["--top-p", "5"], "--top-p: Input should be less than or equal to 1"),
        (["--budget-count", "all"], "--budget-count: Input should be 'completion' or 'total'"),
        (["--concurrency", "0"], "--concurrency: Input should be greater than or equal to 1"),
    ],
)
def test_a_bad_flag_value_names_the_flag_as_typed(sim: SimServer, given: list[str], said: str) -> None:
    out = run_tmas("solve", "What is 2+2?", "--base-url", sim.base_url, "--temperature", "0.5", *given, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"tmas: error: bad value for {said}"
    assert sim.stats().total_requests == 0


def test_a_bad_flag_value_on_resume_names_the_flag_as_typed(sim: SimServer, tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 2+2?"}\n', encoding="utf-8")
    made = run_tmas("run", str(problems), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url)
    assert made.returncode == 0, made.stderr
    out = run_tmas("run", "--resume", str(tmp_path / "run"), "--max-tokens", "0", text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "tmas: error: bad value for --max-tokens: Input should be greater than or equal to 1"
    )


@pytest.mark.parametrize(
    ("given", "flag"), [(["-T", "3"], "--iterations (-T)"), (["-p", "iterations=3"], "--param iterations")]
)
def test_iterations_given_to_a_method_of_one_round_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, given: list[str], flag: str
) -> None:
    # Before, cot ran its one call as without it, the flag dropped without a word.
    isolate(monkeypatch, tmp_path)
    args = [*_command_args("run", tmp_path), "--base-url", "http://127.0.0.1:9/v1", "--dry-run"]
    result = CliRunner().invoke(app, [*args, *given])
    assert isinstance(result.exception, InputError), result.output
    assert str(result.exception) == f"{flag} does not apply to method 'cot': it runs one round; leave it out"
    # One round is what it runs: said so, it is no contradiction.
    assert CliRunner().invoke(app, [*args, "-T", "1"]).exit_code == 0
    assert CliRunner().invoke(app, [*[a if a != "cot" else "majority" for a in args], *given]).exit_code == 0


@pytest.mark.parametrize("command", ["solve", "run", "sweep"])
def test_iterations_a_config_file_gives_a_method_of_one_round_is_refused(
    sim: SimServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    # Before, the file's [method] params reached cot and it ran its one call as without them, without a word.
    isolate(monkeypatch, tmp_path)
    config = tmp_path / "tmas.toml"
    config.write_text(
        f'[endpoint]\nbase_url = "{sim.base_url}"\n[method]\nname = "cot"\nparams = {{ iterations = 3 }}\n',
        encoding="utf-8",
    )
    args = [*_command_args(command, tmp_path), "--config", str(config), "--yes"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == (
        f"{config}: method.params.iterations does not apply to method 'cot': it runs one round; leave it out"
    )
    assert sim.stats().total_requests == 0
    if command != "sweep":  # a sweep takes its params from --param and --grid, and has no -T
        # A flag given over the file's value replaces it: nothing is dropped.
        again = CliRunner().invoke(app, [*args, "-T", "1"])
        assert again.exit_code == 0, again.output


def test_iterations_a_config_file_gives_on_resume_is_refused(sim: SimServer, tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 2+2?"}\n', encoding="utf-8")
    made = run_tmas("run", str(problems), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url)
    assert made.returncode == 0, made.stderr
    sent = sim.stats().total_requests
    config = tmp_path / "again.toml"
    config.write_text(
        f'[endpoint]\nbase_url = "{sim.base_url}"\n[method]\nname = "cot"\nparams = {{ iterations = 4 }}\n',
        encoding="utf-8",
    )
    out = run_tmas("run", "--resume", str(tmp_path / "run"), "--config", str(config), text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"tmas: error: {config}: method.params.iterations does not apply to method 'cot': it runs one round; leave"
        " it out"
    )
    assert sim.stats().total_requests == sent


def test_iterations_given_to_the_resume_of_a_method_of_one_round_is_refused(sim: SimServer, tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 2+2?"}\n', encoding="utf-8")
    made = run_tmas("run", str(problems), "-o", str(tmp_path / "run"), "-m", "cot", "--base-url", sim.base_url)
    assert made.returncode == 0, made.stderr
    sent = sim.stats().total_requests
    out = run_tmas("run", "--resume", str(tmp_path / "run"), "-T", "4", text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "tmas: error: --iterations (-T) does not apply to method 'cot': it runs one round; leave it out"
    )
    assert sim.stats().total_requests == sent


@pytest.mark.parametrize(
    ("command", "why"),
    [
        (["cases", "grade"], "without --judge (names are matched by spelling)"),
        (["pool", "prune"], "without --runs (only the runs' answers are graded)"),
    ],
)
def test_model_flags_of_a_command_that_asks_no_model_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: list[str], why: str
) -> None:
    # Before, they were read by nothing and dropped without a word.
    isolate(monkeypatch, tmp_path)
    given = ["--base-url", "http://127.0.0.1:9/v1", "--temperature", "0.2"]
    result = CliRunner().invoke(app, [*command, str(tmp_path / "missing"), *given])
    assert isinstance(result.exception, InputError), result.output
    assert str(result.exception) == f"--base-url, --temperature: the command asks no model {why}; leave them out"
    # Without them, the command goes on to its own work (here: the folder that is not there).
    result = CliRunner().invoke(app, [*command, str(tmp_path / "missing")])
    assert result.exception is not None and "the command asks no model" not in str(result.exception)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["-m", "tmas", "-T", "0"], "bad value for --iterations (-T): Input should be greater than or equal to 1"),
        (["-m", "mattrl", "-T", "21"], "bad value for --iterations (-T): Input should be less than or equal to 20"),
        (
            ["-m", "mattrl", "--domain", "physics"],
            "bad value for --domain: unknown MATTRL domain 'physics' (known: math, medicine, education)",
        ),
    ],
)
def test_a_bad_method_flag_value_names_the_flag_as_typed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, given: list[str], said: str
) -> None:
    # Before: "method 'tmas': bad value (...) for 'iterations'", the parameter the flag sets.
    isolate(monkeypatch, tmp_path)
    args = ["solve", "What is 2+2?", "--base-url", "http://127.0.0.1:9/v1", "--dry-run", *given]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, InputError), result.output
    assert str(result.exception) == said


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        ('[roles.verifer]\nmodel = "m"\n', "unknown role 'verifer' in [roles] (method 'tmas' takes: solution,"),
        ('[method]\nname = "tmass"\n', "unknown method 'tmass' (known: cot, majority,"),
        ("[method.params]\niterations = 0\n", "method 'tmas': bad value (Input should be greater than or equal to 1)"),
        ("[method.params]\niterationz = 2\n", "method 'tmas': unknown parameter 'iterationz' (did you mean"),
    ],
)
def test_what_the_working_directorys_config_file_gets_wrong_is_said_of_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, toml: str, said: str
) -> None:
    # Before, these lines named neither the file nor that a file gave them: a ./tmas.toml the command line does not
    # show left the user looking for a flag they never typed.
    isolate(monkeypatch, tmp_path)
    Path("tmas.toml").write_text(toml)
    result = CliRunner().invoke(app, ["solve", "What is 2+2?", "--base-url", "http://127.0.0.1:9/v1", "--dry-run"])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception).startswith(f"tmas.toml: {said}")
    # A flag that replaces what the file gives leaves nothing of it to refuse.
    if "tmass" in toml or "iterations" in toml:
        fixed = ["-m", "cot"] if "tmass" in toml else ["-T", "2"]
        args = ["solve", "What is 2+2?", "--base-url", "http://127.0.0.1:9/v1", "--dry-run", *fixed]
        assert CliRunner().invoke(app, args).exit_code == 0


@pytest.mark.parametrize(
    ("method", "values"),
    [
        ("majority", "'vote', 'confidence_vote' or 'filtered_vote'"),
        ("tmas", "'best_score', 'vote', 'score_weighted_vote', 'confidence_vote' or 'filtered_vote'"),
    ],
)
def test_a_select_rule_it_does_not_know_is_said_with_every_rule_the_method_takes(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    sim: SimServer,
    method: str,
    values: str,
) -> None:
    # Before, the first rule set of the parameter's type alone, under pydantic's name for it: "bad value (Input should
    # be 'vote') for \"select.literal['vote']\"", as though majority took no confidence rule.
    isolate(monkeypatch, tmp_path)
    args = ["solve", "What is 17*23?", "-m", method, "-p", "select=bogus", "--base-url", sim.base_url, "--dry-run"]
    monkeypatch.setattr(sys, "argv", ["tmas", *args])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"tmas: error: method {method!r}: bad value (Input should be {values}) for 'select'"


@pytest.mark.parametrize("value", ['{"temperature": 0.3,}', "[1, 2"])
def test_a_param_value_that_is_broken_json_is_said_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sim: SimServer, value: str
) -> None:
    # Before, it was taken as text, and the method said only that it wanted a dictionary (or a list) there.
    isolate(monkeypatch, tmp_path)
    args = ["solve", "What is 17*23?", "-p", f"sampling={value}", "--base-url", sim.base_url, "--dry-run"]
    monkeypatch.setattr(sys, "argv", ["tmas", *args])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"tmas: error: --param sampling: {value!r} is not valid JSON ("), line
