"""`tmas data lm-eval-task`: the lm-evaluation-harness task over a problem file (lm-eval itself runs it in
tests/test_serve_lm_eval.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from typer.testing import CliRunner

from tmas.cli.main import app
from tmas.data.lm_eval_task import BOXED_PATTERN


def test_the_command_writes_the_task_and_its_documents(tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    rows = [
        {"problem_id": "x1", "question": 'Say "{{ hi }}": 2+2?', "answer": 4},
        {"problem_id": "x2", "question": "3+3?", "answer": "6"},
    ]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tasks"
    done = CliRunner().invoke(
        app, ["data", "lm-eval-task", str(problems), "-o", str(out), "--name", "my_math", "--limit", "1"]
    )
    assert done.exit_code == 0, done.output
    task = yaml.safe_load((out / "my_math.yaml").read_text())
    assert task["task"] == "my_math" and task["output_type"] == "generate_until"
    assert task["dataset_kwargs"]["data_files"]["test"] == str((out / "my_math.jsonl").resolve())
    assert task["generation_kwargs"] == {"until": [], "max_gen_toks": 2048, "do_sample": True, "temperature": 0.7}
    assert task["filter_list"][0]["filter"][0]["regex_pattern"] == BOXED_PATTERN
    # The documents: the problem as given (its text is data for lm-eval's template, never template syntax here).
    [doc] = map(json.loads, (out / "my_math.jsonl").read_text().splitlines())
    assert doc == {"problem_id": "x1", "question": 'Say "{{ hi }}": 2+2?', "answer": "4"}


def test_the_last_boxed_answer_is_read_nested_braces_included() -> None:
    found = re.findall(BOXED_PATTERN, r"first \boxed{1}, then \boxed{\frac{1}{2}}")
    assert found[-1] == r"\frac{1}{2}"


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({"problem_id": "u", "question": "2+2?"}) + "\n")
    for args, says in [
        (["--name", "bad-name"], "task name 'bad-name'"),
        # Where the problem is, as a blank answer is said (before: its id alone).
        ([], f"{problems}:1: problem 'u' has no answer: lm-eval cannot score it"),
        (["--temperature", "3"], "--temperature must be within 0-2"),
    ]:
        done = CliRunner().invoke(app, ["data", "lm-eval-task", str(problems), "-o", str(tmp_path / "t"), *args])
        said = str(done.exception)
        assert done.exit_code != 0 and says in said and "\n" not in said


def test_a_blank_answer_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    # A blank answer matches no reply: before, the task was written and lm-eval scored every reply to it wrong.
    problems = tmp_path / "p.jsonl"
    rows = [
        {"problem_id": "x1", "question": "2+2?", "answer": "4"},
        {"problem_id": "x2", "question": "3+3?", "answer": "  "},
    ]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t"
    done = CliRunner().invoke(app, ["data", "lm-eval-task", str(problems), "-o", str(out)])
    said = str(done.exception)
    assert (
        done.exit_code != 0 and said.startswith(f"{problems}:2: problem 'x2' has a blank answer") and "\n" not in said
    )
    assert not out.exists()


def test_a_missing_answer_among_answered_ones_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    problems = tmp_path / "p.jsonl"
    rows = [
        {"problem_id": "x1", "question": "2+2?", "answer": "4"},
        {"problem_id": "x2", "question": "3+3?"},
        {"problem_id": "x3", "question": "4+4?"},
    ]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t"
    done = CliRunner().invoke(app, ["data", "lm-eval-task", str(problems), "-o", str(out)])
    assert done.exit_code != 0
    assert str(done.exception) == (
        f"{problems}:2: problem 'x2' has no answer: lm-eval cannot score it (nor 1 more problem after it)"
    )
    assert not out.exists()
