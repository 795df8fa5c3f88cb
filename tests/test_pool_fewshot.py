"""The few-shot control (paper 003, Table 6): k exemplars per problem, never the problem itself, reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tmas.agents.overrides import packaged_source
from tmas.cli.main import app
from tmas.errors import InputError
from tmas.pool.fewshot import with_exemplars
from tmas.problems import Problem


def test_three_exemplars_prepended_as_data() -> None:
    exemplars = [Problem(problem_id=f"e{i}", question=f"Exemplar {{{{ {i} }}}}?", answer=str(i)) for i in range(5)]
    problems = [Problem(problem_id="e0", question="What is 2+2?", answer="4")]
    [shot] = with_exemplars(problems, exemplars, k=3, seed=1)
    used = shot.metadata["few_shot"]
    assert len(used) == 3 and "e0" not in used
    assert shot.question.count("Final answer:") == 3 and shot.question.rstrip().endswith("What is 2+2?")
    assert "{{ 1 }}" in shot.question or "{{ 2 }}" in shot.question  # exemplar text stays data
    assert shot.answer == "4" and shot.problem_id == "e0"
    assert with_exemplars(problems, exemplars, k=3, seed=1) == [shot]


def test_too_few_exemplars() -> None:
    with pytest.raises(InputError, match="at least 3 labelled exemplars"):
        with_exemplars([Problem(problem_id="p", question="q")], [Problem(problem_id="e", question="x", answer="1")])


def test_a_problem_never_gets_its_own_question_under_another_id() -> None:
    # The same question in the exemplar file under another id (two generated files): never its own exemplar.
    problem = Problem(problem_id="a-s2", question="Count the tilings of a 2 x 5 board.", answer="8")
    exemplars = [Problem(problem_id="a-s1", question="count the tilings of a 2 x  5 board.", answer="8")]
    exemplars += [Problem(problem_id=f"e{i}", question=f"Other {i}?", answer=str(i)) for i in range(3)]
    for seed in range(10):
        [shot] = with_exemplars([problem], exemplars, k=3, seed=seed)
        assert "a-s1" not in shot.metadata["few_shot"]
    with pytest.raises(InputError, match="-k 0: give at least 1"):
        with_exemplars([problem], exemplars, k=0)


def test_the_command_writes_the_exemplars_with_the_users_template(tmp_path: Path) -> None:
    (tmp_path / "build.jsonl").write_text(
        "".join(
            json.dumps({"problem_id": f"e{i}", "question": f"What is {i}+1?", "answer": str(i + 1)}) + "\n"
            for i in range(3)
        )
    )
    (tmp_path / "test.jsonl").write_text(json.dumps({"problem_id": "t1", "question": "What is 9+1?"}) + "\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    template = packaged_source("fewshot_question.j2").replace("Now the problem to solve:", "MY OWN WORDING:")
    (mine / "fewshot_question.j2").write_text(template, encoding="utf-8")
    args = ["pool", "fewshot", str(tmp_path / "test.jsonl"), "--exemplars", str(tmp_path / "build.jsonl")]
    out = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "shots.jsonl"), "--prompts-dir", str(mine)])
    assert out.exit_code == 0, out.output
    [shot] = [json.loads(line) for line in (tmp_path / "shots.jsonl").read_text().splitlines()]
    # Before, the command took no --prompts-dir, and a prompts_dir configured was read by nothing.
    assert shot["question"].endswith("MY OWN WORDING:\nWhat is 9+1?") and "Now the problem" not in shot["question"]
