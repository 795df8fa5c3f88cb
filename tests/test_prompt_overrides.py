"""Prompt templates users override (``prompts_dir``): checked at start against the variables the role renders them
with (one line naming the file and the variable), used by the run, recorded by their hash; ``tmas prompts``."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.agents.overrides import check_overrides, packaged_source, packaged_variables
from tmas.agents.templates import prompts_from, render
from tmas.api import asolve
from tmas.cli.main import app
from tmas.config import load_settings
from tmas.errors import ConfigError, InputError
from tmas.llm.types import Completion, Message
from tmas.problems import Problem
from tmas.runner import RunSetup
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript, SimServer

MARK = "ZQX-OVERRIDE-MARK"


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_packaged_verifier_template_is_rendered_with_the_question_and_solution() -> None:
    assert {"question", "solution", "mode", "style"} <= packaged_variables("tmas_verify.j2")


def test_an_override_with_a_missing_variable_names_the_file_and_the_variable(tmp_path: Path) -> None:
    # The verifier's template without the solution it is meant to check.
    text = packaged_source("tmas_verify.j2").replace("{{ solution }}", "(the solution)")
    path = write(tmp_path / "mine", "tmas_verify.j2", text)
    with pytest.raises(ConfigError) as err:
        check_overrides(tmp_path / "mine")
    message = str(err.value)
    assert message.startswith(f"{path}: missing variable 'solution'") and "\n" not in message


def test_an_override_with_an_unknown_variable_names_the_file_and_the_variable(tmp_path: Path) -> None:
    text = packaged_source("tmas_verify.j2") + "\n{{ soluton }}\n"
    path = write(tmp_path / "mine", "tmas_verify.j2", text)
    with pytest.raises(ConfigError) as err:
        check_overrides(tmp_path / "mine")
    message = str(err.value)
    assert message.startswith(f"{path}: unknown variable 'soluton'") and "\n" not in message


def test_an_override_of_no_packaged_template_and_a_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path / "a", "tmas_verifyy.j2", "{{ question }}")
    with pytest.raises(ConfigError, match=r"no packaged prompt template of this name \(did you mean 'tmas_verify.j2'"):
        check_overrides(tmp_path / "a")
    path = write(tmp_path / "b", "tmas_verify.j2", "{% if question %}")
    with pytest.raises(ConfigError, match=f"^{path}: line 1: "):
        check_overrides(tmp_path / "b")
    with pytest.raises(ConfigError, match="prompts_dir is not a directory"):
        check_overrides(tmp_path / "none")


@pytest.mark.parametrize("use", ["{{ question | shout }}", "{% if question is shouted %}{% endif %}"])
def test_an_override_with_an_unknown_filter_or_test_names_the_file_and_line(tmp_path: Path, use: str) -> None:
    # Jinja finds an unknown filter or test when it compiles, which reading the variables does: a one-line error.
    text = packaged_source("tmas_verify.j2").replace("{{ question }}", "{{ question }}\n" + use, 1)
    path = write(tmp_path / "mine", "tmas_verify.j2", text)
    line = text.splitlines().index(use) + 1
    with pytest.raises(ConfigError) as err:
        check_overrides(tmp_path / "mine")
    message = str(err.value)
    assert message.startswith(f"{path}: line {line}: no ") and "\n" not in message


def test_an_override_replaces_the_packaged_template_only_inside_its_block(tmp_path: Path) -> None:
    write(tmp_path / "mine", "tmas_verify.j2", packaged_source("tmas_verify.j2") + f"\n{MARK}\n")
    [override] = check_overrides(tmp_path / "mine")
    assert override.sha256 == hashlib.sha256((tmp_path / "mine" / "tmas_verify.j2").read_bytes()).hexdigest()
    variables = {"question": "q", "solution": "s", "mode": "numeric", "style": "paper"}
    with prompts_from(tmp_path / "mine"):
        assert render("tmas_verify.j2", **variables).endswith(MARK)
    assert MARK not in render("tmas_verify.j2", **variables)


async def test_a_run_with_an_overridden_template_sends_it_and_records_its_hash(tmp_path: Path) -> None:
    path = write(tmp_path / "mine", "tmas_verify.j2", packaged_source("tmas_verify.j2") + f"\n{MARK}\n")
    params = {"n": 1, "m": 1, "iterations": 1}
    settings = scripted_settings(method={"name": "tmas", "params": params}, prompts_dir=str(tmp_path / "mine"))
    model = ScriptedModel(SimScript(), settings)
    await asolve("What is 17*23?", model=model, run_dir=tmp_path / "run")
    sent = {call.role: call.messages[-1].content for call in model.calls}
    assert MARK in sent["verifier"] and MARK not in sent["solution"]
    with RunStore(tmp_path / "run", create=False) as store:
        assert store.get_meta("prompt_overrides") == {"tmas_verify.j2": hashlib.sha256(path.read_bytes()).hexdigest()}
    # A run without overrides records that it has none.
    plain = ScriptedModel(SimScript(), scripted_settings(method={"name": "cot"}))
    await asolve("What is 17*23?", model=plain, run_dir=tmp_path / "plain")
    with RunStore(tmp_path / "plain", create=False) as store:
        assert store.get_meta("prompt_overrides") == {}


@dataclass
class EditingModel(ScriptedModel):
    """A scripted model that, as the first solution call reaches it, writes ``edit`` over the file ``path``: a user
    editing an override while a run goes on."""

    path: Path | None = None
    edit: str = ""

    async def chat(self, role: str, messages: Sequence[Message], **kwargs: Any) -> Completion:
        if role == "solution" and self.path is not None and not self.calls_of("solution"):
            self.path.write_text(self.edit, encoding="utf-8")
            os.utime(self.path, (time.time() + 60, time.time() + 60))  # a later mtime, however coarse the clock
        return await super().chat(role, messages, **kwargs)


async def test_a_run_renders_the_overrides_as_its_start_read_them_and_records_their_hash(tmp_path: Path) -> None:
    # Before, the templates were read again as calls rendered them: a verifier template edited while the run went on
    # reached its verifier calls, and the run recorded the hash of the text it had checked, not of the text it sent.
    text = packaged_source("tmas_verify.j2") + f"\n{MARK}\n"
    path = write(tmp_path / "mine", "tmas_verify.j2", text)
    params = {"n": 1, "m": 1, "iterations": 1}
    settings = scripted_settings(method={"name": "tmas", "params": params}, prompts_dir=str(tmp_path / "mine"))
    model = EditingModel(SimScript(), settings, path=path, edit=text.replace(MARK, "ZQX-EDITED-MEANWHILE"))
    await asolve("What is 17*23?", model=model, run_dir=tmp_path / "run")
    [verifier] = [call.messages[-1].content for call in model.calls_of("verifier")]
    assert MARK in verifier and "ZQX-EDITED-MEANWHILE" not in verifier
    with RunStore(tmp_path / "run", create=False) as store:
        assert store.get_meta("prompt_overrides") == {"tmas_verify.j2": hashlib.sha256(text.encode()).hexdigest()}


async def test_a_bad_override_stops_a_run_before_its_directory_exists(tmp_path: Path) -> None:
    write(tmp_path / "mine", "tmas_generate.j2", "{{ problem }}")
    model = ScriptedModel(SimScript(), scripted_settings(prompts_dir=str(tmp_path / "mine")))
    with pytest.raises(ConfigError, match="unknown variable 'problem'"):
        await asolve("What is 17*23?", model=model, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists() and model.calls == []


async def test_an_override_reading_a_missing_attribute_stops_a_run_before_any_call(tmp_path: Path) -> None:
    # It used to pass the check, then fail the first verifier call of every problem with an UndefinedError.
    text = packaged_source("tmas_verify.j2").replace("{{ solution }}", "{{ solution.text }}", 1)
    path = write(tmp_path / "mine", "tmas_verify.j2", text)
    line = next(n for n, row in enumerate(text.splitlines(), 1) if "{{ solution.text }}" in row)
    params = {"n": 1, "m": 1, "iterations": 1}
    settings = scripted_settings(method={"name": "tmas", "params": params}, prompts_dir=str(tmp_path / "mine"))
    model = ScriptedModel(SimScript(), settings)
    with pytest.raises(ConfigError, match=f"^{path}: line {line}: UndefinedError: .*'text'"):
        await asolve("What is 17*23?", model=model, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists() and model.calls == []


def test_prompts_dir_from_the_config_file_and_the_environment(tmp_path: Path) -> None:
    config = write(tmp_path, "tmas.toml", 'prompts_dir = "my-prompts"\n')
    assert load_settings(config, environ={}).prompts_dir == "my-prompts"
    assert load_settings(None, environ={"TMAS_PROMPTS_DIR": "/p"}).prompts_dir == "/p"


@pytest.mark.slow
def test_the_prompts_commands(tmp_path: Path) -> None:
    cli = CliRunner()
    listed = cli.invoke(app, ["prompts", "list"])
    assert listed.exit_code == 0 and "tmas_verify.j2\n" in listed.output
    shown = cli.invoke(app, ["prompts", "show", "tmas_verify"])
    assert shown.exit_code == 0 and shown.output == packaged_source("tmas_verify.j2")
    write(tmp_path / "mine", "tmas_verify.j2", shown.output + f"{MARK}\n")
    diffed = cli.invoke(app, ["prompts", "diff", str(tmp_path / "mine")])
    assert diffed.exit_code == 0 and f"+{MARK}" in diffed.output and "# tmas_verify.j2  sha256 " in diffed.output
    marked = cli.invoke(app, ["prompts", "list", "--prompts-dir", str(tmp_path / "mine")])
    assert "tmas_verify.j2  (overridden)" in marked.output
    write(tmp_path / "bad", "tmas_verify.j2", "{{ question }}")
    failed = cli.invoke(app, ["prompts", "diff", str(tmp_path / "bad")])
    assert failed.exit_code != 0 and isinstance(failed.exception, ConfigError)


def test_a_misspelt_packaged_template_name_names_the_one_it_is_close_to() -> None:
    # Before, `tmas prompts show tmas_verfy` said only that no such template exists, as a misspelt file in a
    # prompts_dir or a config key already named what it is close to.
    with pytest.raises(ConfigError) as err:
        packaged_source("tmas_verfy.j2")
    assert str(err.value) == (
        "no packaged prompt template named 'tmas_verfy.j2' (did you mean 'tmas_verify'? see `tmas prompts list`)"
    )
    with pytest.raises(ConfigError) as err:
        packaged_source("zzzzqq.j2")
    assert str(err.value) == "no packaged prompt template named 'zzzzqq.j2' (see `tmas prompts list`)"


HINTS = '{% include "_mattrl_hints.j2" %}'
# An override reads what its role passes, in the shapes the role passes it; a mistake there used to pass the check and
# then fail every problem of the run. (file, text replaced, replacement)
BROKEN = [
    ("tmas_verify.j2", "{{ question }}", "{{ question.nope }}"),
    ("tmas_verify.j2", "{{ solution }}", "{{ solution.nope() }}"),
    ("_tmas_rollouts.j2", "{{ r.summary }}", "{{ r.nope }}"),
    ("tmas_experience.j2", "{{ max_entries }}", "{{ max_entries|length }}"),
    ("mattrl_opinion.j2", "{{ member.specialty }}", "{{ member['nope'] }}"),
    ("tmas_refine.j2", "{{ question }}", "{{ question }} {{ rollouts[7].solution }}"),
    ("edu_teacher.j2", HINTS, HINTS + " {{ member.specialty }}"),
]


@pytest.mark.parametrize(("name", "old", "new"), BROKEN, ids=[f"{b[0]}:{b[2]}" for b in BROKEN])
def test_an_override_that_fails_to_render_is_refused_at_start_naming_its_file_and_line(
    tmp_path: Path, name: str, old: str, new: str
) -> None:
    source = packaged_source(name)
    assert old in source
    text = source.replace(old, new, 1)
    line = next(n for n, row in enumerate(text.splitlines(), 1) if new in row)
    path = write(tmp_path / "mine", name, text)
    with pytest.raises(ConfigError) as err:
        check_overrides(tmp_path / "mine")
    message = str(err.value)
    assert message.startswith(f"{path}: line {line}: ") and "\n" not in message, message


@pytest.mark.parametrize(
    ("name", "old", "new"),
    [
        ("tmas_verify.j2", "{{ question }}", "{{ question.strip() }}"),
        ("tmas_verify.j2", "{{ solution }}", "{{ solution|trim|replace('\\t', ' ') }}"),
        ("_tmas_rollouts.j2", "{{ r.summary }}", "{{ r.summary.strip() }} ({{ loop.index }} of {{ rollouts|length }})"),
        ("edu_teacher.j2", HINTS, HINTS + "{% if member %} {{ member.specialty }}{% endif %}"),
    ],
)
def test_an_override_using_string_methods_and_filters_on_its_data_passes(
    tmp_path: Path, name: str, old: str, new: str
) -> None:
    source = packaged_source(name)
    assert old in source
    write(tmp_path / "mine", name, "Read the data below first.\n" + source.replace(old, new, 1))
    assert [o.name for o in check_overrides(tmp_path / "mine")] == [name]


def test_every_packaged_template_passes_the_check_as_its_own_override(tmp_path: Path) -> None:
    from tmas.agents.overrides import packaged_names

    for name in packaged_names():
        write(tmp_path / "all", name, packaged_source(name))
    assert len(check_overrides(tmp_path / "all")) == len(packaged_names())


@pytest.mark.parametrize("command", ["eval", "data filter", "pool build", "report"])
def test_a_judge_template_override_is_refused_by_every_command_that_grades(
    sim: SimServer, tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, judge_user.j2 in the prompts folder was accepted and read by nothing: every grading rendered the packaged
    # judge, and the run's verdicts were not the ones the user had written the judge for.
    path = write(tmp_path / "mine", "judge_user.j2", packaged_source("judge_user.j2") + f"\n{MARK}\n")
    problems = write(tmp_path, "p.jsonl", '{"id": "p0", "question": "What is 17*23?", "answer": "391"}\n')
    out = tmp_path / "out"
    given = {
        "eval": ["eval", str(problems), "-o", str(out), "-m", "cot", "--prompts-dir", str(path.parent)],
        "data filter": ["data", "filter", str(problems), "-o", str(out), "--prompts-dir", str(path.parent)],
        "pool build": ["pool", "build", str(tmp_path / "run"), "-o", str(out), "--prompts-dir", str(path.parent)],
        # The config's or the environment's folder: the report has no flag of its own for it.
        "report": ["report", str(tmp_path / "run"), "-o", str(out)],
    }[command]
    monkeypatch.setenv("TMAS_PROMPTS_DIR", str(path.parent))
    result = CliRunner().invoke(app, [*given, "--base-url", sim.base_url])
    assert isinstance(result.exception, ConfigError) and str(result.exception) == (
        f"{path}: grading always renders the packaged judge_user.j2 (a run's verdicts are stored and reused by its"
        " later gradings and reports); take it out of the prompts folder"
    )
    assert sim.requests == [] and not out.exists()


def test_the_prompts_commands_say_which_templates_grading_renders(tmp_path: Path) -> None:
    cli = CliRunner()
    listed = cli.invoke(app, ["prompts", "list"])
    assert "judge_user.j2  (grading: always the packaged one)\n" in listed.output
    assert "tmas_verify.j2\n" in listed.output
    shown = cli.invoke(app, ["prompts", "show", "judge_user"])
    assert shown.exit_code == 0 and shown.stdout == packaged_source("judge_user.j2")
    assert shown.stderr == (
        "tmas: judge_user.j2 is a grading template: every grading renders the packaged one, and refuses an override\n"
    )
    write(tmp_path / "mine", "judge_user.j2", packaged_source("judge_user.j2") + f"\n{MARK}\n")
    diffed = cli.invoke(app, ["prompts", "diff", str(tmp_path / "mine")])
    assert isinstance(diffed.exception, ConfigError) and "grading always renders" in str(diffed.exception)
    # An unchanged copy (a folder copied whole from the packaged templates) changes nothing and passes.
    write(tmp_path / "copy", "judge_user.j2", packaged_source("judge_user.j2"))
    assert cli.invoke(app, ["prompts", "diff", str(tmp_path / "copy")]).exit_code == 0


async def test_a_judge_template_override_is_refused_by_a_run_of_the_library(tmp_path: Path) -> None:
    path = write(tmp_path / "mine", "judge_system.j2", packaged_source("judge_system.j2") + f"\n{MARK}\n")
    model = ScriptedModel(SimScript(), scripted_settings(prompts_dir=str(path.parent)))
    with pytest.raises(ConfigError, match=f"^{path}: grading always renders the packaged judge_system.j2 "):
        await asolve("What is 17*23?", model=model, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists() and model.calls == []


async def test_a_resume_refuses_an_override_edited_after_its_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the resume's check read the overrides, then the run read them again: a template edited in between
    # (while the estimate's gate waited, say) was sent to the problems left and recorded as the run's, beside
    # finished problems solved with the text the check had compared.
    text = packaged_source("tmas_verify.j2") + f"\n{MARK}\n"
    path = write(tmp_path / "mine", "tmas_verify.j2", text)
    params = {"n": 1, "m": 1, "iterations": 1}
    settings = scripted_settings(method={"name": "tmas", "params": params}, prompts_dir=str(tmp_path / "mine"))
    problems = [Problem(problem_id=f"p{i}", question=f"What is {i + 17}*23?") for i in range(2)]
    run_dir = tmp_path / "run"
    await scripted_run(ScriptedModel(SimScript(), settings), run_dir, problems)
    with sqlite3.connect(run_dir / "run.sqlite") as db:  # stopped when p0 had finished and p1 had not begun
        db.execute("DELETE FROM results WHERE problem_id = 'p1'")
        db.execute("DELETE FROM calls WHERE problem_id = 'p1'")
    checked = RunSetup.check_resume
    edited = text.replace(MARK, "ZQX-EDITED-MEANWHILE")

    def then_edit(self: RunSetup, *args: Any) -> None:
        checked(self, *args)
        path.write_text(edited, encoding="utf-8")

    monkeypatch.setattr(RunSetup, "check_resume", then_edit)
    model = ScriptedModel(SimScript(), settings)
    with pytest.raises(InputError) as refused:
        await scripted_run(model, run_dir)
    sha = {t: hashlib.sha256(t.encode()).hexdigest() for t in (text, edited)}
    assert str(refused.value) == (
        f"{run_dir}: 1 finished problem was solved with prompt template tmas_verify.j2 {json.dumps(sha[text][:12])}"
        f" (now {json.dumps(sha[edited][:12])}): resumed so, what finished would stay of the run's old settings;"
        " resume without the change, or start a new run for it"
    )
    assert model.calls == []
    with RunStore(run_dir, create=False) as store:
        assert store.get_meta("prompt_overrides") == {"tmas_verify.j2": sha[text]}
        assert [r.problem_id for r in store.results()] == ["p0"]
