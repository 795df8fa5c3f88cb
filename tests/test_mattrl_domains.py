"""MATTRL's education domain end to end (pre-test, teaching dialogue, post-test) and the case formats and metrics
of the medicine and education domains (RareBench / SuperGPQA import, Hit@k and MRR, Acc_pre / Acc_post)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import settings_for
from tmas.cli.main import app
from tmas.errors import InputError
from tmas.eval.case_formats import read_rarebench, read_supergpqa
from tmas.eval.diagnosis import UnreadableJudgement, judge_rank, name_rank, parse_judge_rank, ranking_metrics
from tmas.eval.teaching import teaching_metrics
from tmas.llm.client import LLMClient
from tmas.memory.embedders import EndpointEmbedder
from tmas.memory.experience_pool import ExperiencePool
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import Transcript
from tmas.methods.base import ProblemResult
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.testing import Rule, SimScript, SimServer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "mattrl"
QUESTION = "Which quantity stays the same in free fall?\nA) speed\nB) acceleration\nC) height"


async def teach(sim: SimServer, tmp_path: Path, gold: str, **params: Any) -> ProblemResult:
    settings = settings_for(sim, method={"name": "mattrl", "params": {"domain": "education", **params}})
    problem = Problem(problem_id="q1", question=QUESTION, answer=gold)
    store, settings, todo = prepare_run(tmp_path / "run", settings, [problem], resume=False)
    with store:
        summary = await run_problems(settings, todo, store, keep_results=True)
    return summary.results[0]


def bodies(sim: SimServer, role: str) -> list[str]:
    return [str(r.body["messages"][-1]["content"]) for r in sim.requests if r.endpoint == "chat" and r.role == role]


async def test_team_teaching_turns_a_wrong_pretest_into_a_right_posttest(sim: SimServer, tmp_path: Path) -> None:
    result = await teach(sim, tmp_path, "B", iterations=2)
    assert result.answer == "B" and len(result.iterations) == 3
    last = result.iterations[-1].state
    assert (last["pre"], last["pre_correct"], last["post"], last["post_correct"]) == ("A", False, "B", True)
    # student: pre-test, two replies, post-test; teachers: 3 analyses a round; coordinator: team, 2 plans, guidance.
    assert sim.stats().by_role == {"student": 4, "specialist": 6, "coordinator": 4}
    t = Transcript.model_validate(last["transcript"])
    assert [m.specialty for m in t.team] == ["Mathematics", "Engineering", "Physics"]
    assert [u.kind for u in t.utterances if u.agent == "coordinator"] == ["meeting", "meeting", "report"]
    assert t.final_answer == "B"
    # Teachers see the correct answer, the student never does.
    assert all("<correct_answer>\nB\n</correct_answer>" in b for b in bodies(sim, "specialist"))
    assert not any("correct_answer" in b for b in bodies(sim, "student"))
    # The student hears the planned question without its "ROUND k:" label.
    assert "Teacher: Which assumption in your reasoning would you test first?" in bodies(sim, "student")[2]
    assert "ROUND" not in bodies(sim, "student")[2]


async def test_single_teacher_asks_itself_and_gives_the_guidance(sim: SimServer, tmp_path: Path) -> None:
    result = await teach(sim, tmp_path, "B", iterations=2, teaching="single")
    assert result.answer == "B"
    assert sim.stats().by_role == {"student": 4, "specialist": 3}


async def test_a_right_pretest_skips_the_teaching(sim: SimServer, tmp_path: Path) -> None:
    result = await teach(sim, tmp_path, "A")
    [record] = result.iterations
    assert record.state["skipped"] and record.state["post"] == "A" and record.state["post_correct"]
    assert sim.stats().by_role == {"student": 1}


def test_rarebench_and_supergpqa_examples_import() -> None:
    cases = list(read_rarebench(EXAMPLES / "medicine_rarebench.jsonl"))
    assert [c.problem_id for c in cases] == ["med-1", "med-2", "med-3"]
    assert cases[0].answer == "Fabry disease | Anderson-Fabry disease" and cases[0].metadata == {
        "Department": "Nephrology"
    }
    assert cases[2].question.startswith("Observed phenotypes: Tall stature; Arachnodactyly")
    questions = list(read_supergpqa(EXAMPLES / "education_supergpqa.jsonl"))
    assert [q.answer for q in questions] == ["B", "C", "B"]  # edu-2 names its answer by text: "4" is option C
    assert questions[0].question.splitlines()[1:] == [
        "A) Its speed",
        "B) Its acceleration",
        "C) Its kinetic energy",
        "D) Its height",
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "q", "options": ["a"]}', "'options' must be a list of 2 to 10"),
        ('{"question": "q", "options": ["a", "b"], "answer": "Z"}', "neither an option's letter"),
        ("[1]", "expected a JSON object"),
    ],
)
def test_bad_supergpqa_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    source = tmp_path / "q.jsonl"
    source.write_text('{"question": "ok", "options": ["a", "b"], "answer_letter": "A"}\n' + line + "\n")
    with pytest.raises(InputError, match=f"q.jsonl:2: .*{message}"):
        list(read_supergpqa(source))


def test_name_rank_and_judge_replies() -> None:
    top = ["Gaucher disease", "Anderson-Fabry disease", "Wilson disease"]
    assert name_rank(top, "Fabry disease | anderson fabry disease") == 2
    assert name_rank(top, "Marfan syndrome") is None
    assert parse_judge_rank("<think>x</think><answer>3</answer>") == 3
    assert parse_judge_rank("<answer> No </answer>") is None
    for bad in ("3", "<answer>11</answer>"):
        with pytest.raises(UnreadableJudgement):
            parse_judge_rank(bad)


def test_ranking_metrics_worked_by_hand() -> None:
    # Ranks 1, 4, not found, 2: Hit@1 = 1/4, Hit@3 = 2/4, Hit@5 = Hit@10 = 3/4; MRR = (1 + 1/4 + 0 + 1/2) / 4 = 0.4375.
    assert ranking_metrics([1, 4, None, 2]) == {
        "hit@1": 0.25,
        "hit@3": 0.5,
        "hit@5": 0.75,
        "hit@10": 0.75,
        "mrr": 0.4375,
    }


def test_teaching_metrics_worked_by_hand() -> None:
    rows = [
        {"pre_correct": False, "post_correct": True},
        {"pre_correct": True, "post_correct": True},
        {"pre_correct": False, "post_correct": False},
        {"pre_correct": False, "post_correct": True},
    ]
    # Acc_pre = 1/4, Acc_post = 3/4, delta = 1/2.
    assert teaching_metrics(rows) == {"acc_pre": 0.25, "acc_post": 0.75, "delta": 0.5}


def test_cli_imports_runs_and_grades_medicine_cases(sim: SimServer, tmp_path: Path) -> None:
    runner = CliRunner()
    problems = tmp_path / "med.jsonl"
    out = runner.invoke(
        app, ["cases", "import", str(EXAMPLES / "medicine_rarebench.jsonl"), "-f", "rarebench", "-o", str(problems)]
    )
    assert out.exit_code == 0, out.output
    run = runner.invoke(
        app,
        [
            "run",
            str(problems),
            "--method",
            "mattrl",
            "--domain",
            "medicine",
            "-T",
            "2",
            "-o",
            str(tmp_path / "r"),
            "--base-url",
            sim.base_url,
        ],
    )
    assert run.exit_code == 0, run.output
    graded = runner.invoke(app, ["cases", "grade", str(tmp_path / "r")])
    assert graded.exit_code == 0, graded.output
    lines = [json.loads(line) for line in graded.output.splitlines()]
    # The simulated team always ranks Fabry disease first and Marfan syndrome fifth; Wilson disease fourth.
    assert [(r["problem_id"], r["rank"]) for r in lines[:3]] == [("med-1", 1), ("med-2", 4), ("med-3", 5)]
    assert lines[3] == {
        "cases": 3,
        "hit@1": 1 / 3,
        "hit@3": 1 / 3,
        "hit@5": 1.0,
        "hit@10": 1.0,
        "mrr": (1 + 1 / 4 + 1 / 5) / 3,
    }
    bodies_seen = [r.body for r in sim.requests if r.role == "specialist"]
    assert bodies_seen and all("<diagnosis>" in str(b["messages"][-1]["content"]) for b in bodies_seen)


async def test_team_teaching_with_experience_injects_hints_into_the_analyses(sim: SimServer, tmp_path: Path) -> None:
    entries = [
        PoolEntry(
            id="g1", action="Anchor on the definition", experience="Ask which quantity stays the same in free fall."
        ),
        PoolEntry(id="g2", action="Name the misconception", experience="Students confuse speed with acceleration."),
    ]
    async with LLMClient(settings_for(sim)) as llm:
        embed = EndpointEmbedder(llm)
        pool = ExperiencePool.create(tmp_path / "pool", embed.name)
        await pool.add(entries, embed)
        pool.save()
    result = await teach(sim, tmp_path, "B", iterations=1, pool=str(tmp_path / "pool"), top_k=1)
    assert result.answer == "B"
    analyses = bodies(sim, "specialist")
    assert len(analyses) == 3 and all(b.count("- ACTION:") == 1 and "<experience_hints>" in b for b in analyses)
    t = Transcript.model_validate(result.iterations[-1].state["transcript"])
    assert all(len(u.experience_ids) == 1 for u in t.utterances if u.agent.startswith("S"))
    assert not any("<experience_hints>" in b for b in bodies(sim, "student") + bodies(sim, "coordinator"))


async def test_the_judge_ranks_names_that_do_not_match_by_spelling(sim: SimServer) -> None:
    top = ["Gaucher disease", "Alpha-galactosidase A deficiency", "Wilson disease"]
    sim.set_script(
        SimScript(rules=[Rule(role="judge", replies=["<think>2 is Fabry by its enzyme.</think><answer>2</answer>"])])
    )
    async with LLMClient(settings_for(sim)) as llm:
        assert await judge_rank(llm, "c1", top, "Fabry disease") == (2, None)
        assert await judge_rank(llm, "c2", top, "Wilson disease") == (3, None)  # by spelling: no call
        sim.set_script(SimScript(rules=[Rule(role="judge", replies=["probably the second"])]))
        rank, why = await judge_rank(llm, "c3", top, "Fabry disease")
    assert rank is None and why is not None and why.startswith("judge reply has no <answer>No|1-10</answer>")
    judged = [r.body["messages"][-1]["content"] for r in sim.requests if r.role == "judge"]
    assert len(judged) == 1 + 2  # one call, then an unreadable reply and its retry
    assert (
        "[2] Alpha-galactosidase A deficiency" in judged[0] and "<reference>\nFabry disease\n</reference>" in judged[0]
    )
