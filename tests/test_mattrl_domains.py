"""MATTRL's education domain end to end (pre-test, teaching dialogue, post-test) and the case formats and metrics
of the medicine and education domains (RareBench / SuperGPQA import, Hit@k and MRR, Acc_pre / Acc_post)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import scripted_settings
from scripted_runs import by_role, last_user_prompts, run_scripted, scripted_run
from tmas.agents.templates import prompt
from tmas.api import arun
from tmas.cli.main import app
from tmas.data.case_import import read_cases, read_rarebench, read_supergpqa
from tmas.errors import InputError
from tmas.grading.diagnosis import UnreadableJudgement, judge_rank, name_rank, parse_judge_rank, ranking_metrics
from tmas.grading.teaching import teaching_metrics
from tmas.memory.embedders import EndpointEmbedder
from tmas.memory.pool import Pool
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import Transcript
from tmas.methods.base import ProblemResult
from tmas.methods.mattrl_teaching import SINGLE_FALLBACK, TEAM_FALLBACK
from tmas.pool.build import CREDITS_FILE, BuildConfig, build_dir_for, build_pool
from tmas.pool.outcomes import LabelledTranscript, transcript_of
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript
from tmas.view.credits import load_credits

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "mattrl"
QUESTION = "Which quantity stays the same in free fall?\nA) speed\nB) acceleration\nC) height"


METADATA = {"field": "Physics", "difficulty": "easy"}


async def teach(tmp_path: Path, gold: str, **params: Any) -> tuple[ProblemResult, ScriptedModel]:
    """The education team teaching one question of gold ``gold``: a whole run into ``tmp_path / "run"``, in process
    on a scripted model (the result, and the model holding its calls)."""
    settings = scripted_settings(method={"name": "mattrl", "params": {"domain": "education", **params}})
    model = ScriptedModel(SimScript(), settings)
    problem = Problem(problem_id="q1", question=QUESTION, answer=gold, metadata=METADATA)
    await scripted_run(model, tmp_path / "run", [problem])
    with RunStore(tmp_path / "run", create=False) as store:
        [record] = store.results()
    return ProblemResult.model_validate(record), model


def build_model(rules: list[Rule]) -> ScriptedModel:
    """The judge and summarizer of a pool build, in process, answering with ``rules``."""
    return ScriptedModel(SimScript(rules=rules), scripted_settings())


async def teach_in_process(gold: str, **params: Any) -> tuple[ProblemResult, ScriptedModel]:
    problem = Problem(problem_id="q1", question=QUESTION, answer=gold, metadata=METADATA)
    return await run_scripted("mattrl", question=problem, domain="education", **params)


async def test_team_teaching_turns_a_wrong_pretest_into_a_right_posttest() -> None:
    result, model = await teach_in_process("B", iterations=2)
    assert result.answer == "B" and len(result.iterations) == 3
    last = result.iterations[-1].state
    assert (last["pre"], last["pre_correct"], last["post"], last["post_correct"]) == ("A", False, "B", True)
    # student: pre-test, two replies, post-test; teachers: 3 analyses a round; coordinator: team, 2 plans, guidance.
    assert by_role(model) == {"student": 4, "specialist": 6, "coordinator": 4}
    t = Transcript.model_validate(last["transcript"])
    assert [m.specialty for m in t.team] == ["Mathematics", "Engineering", "Physics"]
    # C.4.2: a Diagnostician, a Pedagogy Strategist, a Subject Matter Expert, and no forced leader.
    assert [m.role for m in t.team] == ["Diagnostician", "Pedagogy Strategist", "Subject Matter Expert"]
    assert not any(m.leader for m in t.team)
    assert [u.kind for u in t.utterances if u.agent == "coordinator"] == ["meeting", "meeting", "report"]
    assert t.final_answer == "B"
    # Teachers see the correct answer, the student never does.
    assert all("<correct_answer>\nB\n</correct_answer>" in b for b in last_user_prompts(model, "specialist"))
    # C.1: the teachers (and the coordinator's plan and guidance) are told the pre-test was wrong.
    teachers = last_user_prompts(model, "specialist") + last_user_prompts(model, "coordinator")[1:]
    assert all("Correct: no\n</student_pretest>" in b for b in teachers)
    student = last_user_prompts(model, "student")
    assert not any("correct_answer" in b for b in student)
    # The student hears the planned question without its "ROUND k:" label.
    assert "Teacher: Which assumption in your reasoning would you test first?" in student[2]
    assert "ROUND" not in student[2]


async def test_single_teacher_asks_itself_and_gives_the_guidance() -> None:
    result, model = await teach_in_process("B", iterations=2, teaching="single")
    assert result.answer == "B"
    assert by_role(model) == {"student": 4, "specialist": 3}


async def test_a_right_pretest_skips_the_teaching() -> None:
    result, model = await teach_in_process("A")
    [record] = result.iterations
    assert record.state["skipped"] and record.state["post"] == "A" and record.state["post_correct"]
    assert by_role(model) == {"student": 1}


async def test_a_pretest_that_copies_out_its_options_text_is_read() -> None:
    # The student answers right and copies the option out after its letter ("Answer: A) speed"). That is option A:
    # the pre-test is right, so the teaching is skipped and the post-test reuses it (C.1). Unread, the case counted
    # a wrong pre-test and was taught.
    rules = [Rule(role="student", replies=["Speed does not change here.\nAnswer: A) speed"], times=1)]
    problem = Problem(problem_id="q1", question=QUESTION, answer="A", metadata=METADATA)
    result, model = await run_scripted("mattrl", question=problem, rules=rules, domain="education")
    [record] = result.iterations
    assert (record.state["pre"], record.state["pre_correct"], record.state["post"]) == ("A", True, "A")
    assert by_role(model) == {"student": 1} and record.notes == []


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
        ('{"question": "q", "options": ["a", null], "answer": "A"}', "each option must be a non-empty text"),
        ('{"question": "q", "options": ["a", "b"], "answer": "A", "id": null}', "'id' must be a non-empty text"),
    ],
)
def test_bad_supergpqa_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    source = tmp_path / "q.jsonl"
    source.write_text('{"question": "ok", "options": ["a", "b"], "answer_letter": "A"}\n' + line + "\n")
    with pytest.raises(InputError, match=f"q.jsonl:2: .*{message}"):
        list(read_supergpqa(source))


def test_a_numeric_answer_names_the_option_of_its_value(tmp_path: Path) -> None:
    source = tmp_path / "q.jsonl"
    rows = [
        {"question": "q1", "options": [1, 2, 3, 4], "answer": "3"},  # text answer, numeric options
        {"question": "q2", "options": ["1", "2", "3", "4"], "answer": 2},  # number answer, text options
        {"question": "q3", "options": ["0.25", "0.5", "1"], "answer": 0.5},
        {"question": "q4", "options": ["1", "2.0", "3"], "answer": "2"},  # the same value written otherwise
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert [c.answer for c in read_supergpqa(source)] == ["C", "B", "B", "B"]
    # A value no option has, or one two options share, names none.
    for options, answer in (([1, 2], 3), (["2", "2.0", "5"], "2.00")):
        source.write_text(json.dumps({"question": "q", "options": options, "answer": answer}) + "\n")
        with pytest.raises(InputError, match=r"q.jsonl:1: the answer .* is neither an option's letter nor"):
            list(read_supergpqa(source))


def test_imported_cases_are_what_tmas_run_reads(tmp_path: Path) -> None:
    source = tmp_path / "q.jsonl"
    source.write_text('{"id": "a", "question": "q", "options": ["x", "y"]}\n' * 2, encoding="utf-8")
    with pytest.raises(InputError, match=r"q.jsonl:2: the id 'a' is given to two cases \(first at line 1\)"):
        read_cases(read_supergpqa, source)
    source.write_text('{"id": "m", "question": "q"}\n\n{"case_id": "m", "Phenotype": ["a"]}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"q.jsonl:3: the id 'm' is given to two cases \(first at line 1\)"):
        read_cases(read_rarebench, source)
    source.write_text("\n", encoding="utf-8")
    with pytest.raises(InputError, match="no case in the file"):
        read_cases(read_rarebench, source)


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


def test_cli_imports_runs_and_grades_medicine_cases(tmp_path: Path) -> None:
    runner = CliRunner()
    problems = tmp_path / "med.jsonl"
    out = runner.invoke(
        app, ["cases", "import", str(EXAMPLES / "medicine_rarebench.jsonl"), "-f", "rarebench", "-o", str(problems)]
    )
    assert out.exit_code == 0, out.output
    # The run as `tmas run med.jsonl --method mattrl --domain medicine -T 2` makes it, in process.
    settings = scripted_settings(method={"name": "mattrl", "params": {"domain": "medicine", "iterations": 2}})
    model = ScriptedModel(SimScript(), settings)
    asyncio.run(arun(problems, tmp_path / "r", model=model))
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
    asked = last_user_prompts(model, "specialist")
    assert asked and all("<diagnosis>" in prompt for prompt in asked)
    # A run of another method is no case run: said, not graded as medicine at 0.
    asyncio.run(arun(problems, tmp_path / "cot", model=ScriptedModel(SimScript(), scripted_settings())))
    other = runner.invoke(app, ["cases", "grade", str(tmp_path / "cot")])
    assert isinstance(other.exception, InputError) and "not a run of --method mattrl --domain" in str(other.exception)
    # A run stopped before it wrote anything: said, and its empty store file left empty (it was given the schema).
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "run.sqlite").touch()
    empty = runner.invoke(app, ["cases", "grade", str(tmp_path / "empty")])
    assert str(empty.exception) == f"{tmp_path / 'empty'}: holds no run to grade: it was stopped before its first call"
    assert (tmp_path / "empty" / "run.sqlite").stat().st_size == 0


def entry(id_: str, role: str, **keys: str) -> PoolEntry:
    return PoolEntry(id=id_, action=f"Key {id_}", experience=f"Lesson {id_}.", domain="education", role=role, **keys)


async def test_team_teaching_with_experience_injects_hints_into_the_analyses(tmp_path: Path) -> None:
    # C.1.1: each teacher retrieves by its role, the question's subject (Physics) and difficulty (easy).
    entries = [
        entry("d1", "Diagnostician", difficulty="easy"),
        entry("d2", "Diagnostician", difficulty="hard"),
        entry("s1", "Pedagogy Strategist"),
        entry("x1", "Subject Matter Expert", scope="case", subject="Chemistry", difficulty="easy"),
        entry("x2", "Subject Matter Expert", scope="case", subject="Physics", difficulty="hard"),
        PoolEntry(id="m1", action="Key m1", experience="A math lesson.", role="Subject Matter Expert"),
    ]
    embed = EndpointEmbedder(ScriptedModel(settings=scripted_settings()))
    pool = Pool.create(tmp_path / "pool", embed.name)
    await pool.add(entries, embed)
    pool.save()
    result, model = await teach_in_process("B", iterations=1, pool=str(tmp_path / "pool"), top_k=2)
    assert result.answer == "B"
    analyses = last_user_prompts(model, "specialist")
    assert len(analyses) == 3 and all("<experience_hints>" in b for b in analyses)
    # The question's texts were embedded to search the pool, as an endpoint's embeddings are asked for.
    assert model.embedded
    t = Transcript.model_validate(result.iterations[-1].state["transcript"])
    # The Diagnostician: both of its role's entries, the same difficulty first; the Strategist: its one entry; the
    # subject expert: only the Physics entry (another subject's specific entry and the math entry never come).
    assert {u.agent: u.experience_ids for u in t.utterances if u.agent.startswith("S")} == {
        "S1": ["d1", "d2"],
        "S2": ["s1"],
        "S3": ["x2"],
    }
    diagnostician = next(b for b in analyses if "You are the Diagnostician" in b)
    assert "- ACTION: Key d1" in diagnostician
    # C.4.5: the teacher is told how to use the lessons: match the student's error to theirs, adapt, never copy.
    assert "never copy them word for word" in diagnostician
    assert "adapt that to this student's own reasoning" in diagnostician
    assert not any("Key x1" in b or "Key m1" in b for b in analyses)
    others = last_user_prompts(model, "student") + last_user_prompts(model, "coordinator")
    assert not any("<experience_hints>" in b for b in others)


async def test_a_pool_given_to_a_single_teacher_is_said_to_be_unused(tmp_path: Path) -> None:
    # The single teacher (C.4.3, the paper's Single Agent) teaches without experience: a pool named with it is not
    # read, and the run says so rather than passing for a single teacher with experience.
    embed = EndpointEmbedder(ScriptedModel(settings=scripted_settings()))
    pool = Pool.create(tmp_path / "pool", embed.name)
    await pool.add([entry("d1", "Diagnostician")], embed)
    pool.save()
    result, model = await teach_in_process("B", iterations=1, teaching="single", pool=str(tmp_path / "pool"))
    assert result.notices == [
        f"pool={tmp_path / 'pool'} is not used with teaching=single: the single teacher teaches without experience"
        " (the paper's Single Agent); teaching=team teaches with it"
    ]
    assert not any("<experience_hints>" in b for b in last_user_prompts(model, "specialist"))
    assert model.embedded == []
    # The team reads it, and says nothing of the kind.
    team, _ = await teach_in_process("B", iterations=1, pool=str(tmp_path / "pool"))
    assert team.notices == []


async def test_the_simulated_judge_matches_diagnoses_from_its_prompt() -> None:
    """With no script, the simulator answers the diagnosis prompt in the layout it asks for: a rewording of the
    reference is matched at its rank, a condition not in the list is not; answer grading keeps its JSON reply."""
    llm = ScriptedModel(SimScript(), scripted_settings())
    top = ["Gaucher disease type I", "Fabry disease, classic form", "Wilson disease"]
    assert name_rank(top, "Fabry disease") is None  # the judge is asked
    assert await judge_rank(llm, "c1", top, "Fabry disease") == (2, None)
    assert await judge_rank(llm, "c2", top, "Anderson-Fabry | Gaucher disease") == (1, None)
    assert await judge_rank(llm, "c3", top, "Pompe disease") == (None, None)
    assert await judge_rank(llm, "c4", top, "Gaucher disease type II") == (None, None)
    assert len(last_user_prompts(llm, "judge")) == 4
    asked = prompt("judge_user.j2", system_name="judge_system.j2", problem="1+1", reference="2", student="2")
    graded = await llm.chat("judge", asked)
    assert json.loads(graded.content)["equivalent"] is True


async def test_the_judge_ranks_names_that_do_not_match_by_spelling() -> None:
    top = ["Gaucher disease", "Alpha-galactosidase A deficiency", "Wilson disease"]
    llm = ScriptedModel(
        SimScript(rules=[Rule(role="judge", replies=["<think>2 is Fabry by its enzyme.</think><answer>2</answer>"])]),
        scripted_settings(),
    )
    assert await judge_rank(llm, "c1", top, "Fabry disease") == (2, None)
    assert await judge_rank(llm, "c2", top, "Wilson disease") == (3, None)  # by spelling: no call
    llm.script = SimScript(rules=[Rule(role="judge", replies=["probably the second"])])
    rank, why = await judge_rank(llm, "c3", top, "Fabry disease")
    assert rank is None and why is not None and why.startswith("judge reply has no <answer>No|1-3</answer>")
    judged = last_user_prompts(llm, "judge")
    assert len(judged) == 1 + 2  # one call, then an unreadable reply and its retry
    assert (
        "[2] Alpha-galactosidase A deficiency" in judged[0] and "<reference>\nFabry disease\n</reference>" in judged[0]
    )


async def test_the_judge_is_told_how_many_diagnoses_it_sees_and_a_rank_past_them_is_no_rank() -> None:
    """A differential may hold fewer than ten names: the prompt says how many, and a rank the list does not have
    (7 of 3) is unreadable and asked again, not graded as a hit at rank 7."""
    top = ["Gaucher disease", "Alpha-galactosidase A deficiency", "Wilson disease"]
    llm = ScriptedModel(
        SimScript(
            rules=[
                Rule(role="judge", replies=["<answer>7</answer>"], times=1),
                Rule(role="judge", replies=["<answer>2</answer>"]),
            ]
        ),
        scripted_settings(),
    )
    assert await judge_rank(llm, "c1", top, "Fabry disease") == (2, None)
    judged = last_user_prompts(llm, "judge")
    assert len(judged) == 2
    assert "Above are 3 predicted diagnoses" in judged[0] and "rank number from 1 to 3," in judged[0]
    assert "ten" not in judged[0] and "1-10" not in judged[0]
    with pytest.raises(UnreadableJudgement):
        parse_judge_rank("<answer>4</answer>", 3)
    assert parse_judge_rank("<answer>3</answer>", 3) == 3


def rubric(c: int, i: int, r: int, clarity: int) -> str:
    return json.dumps(
        {
            "correctness_score": c,
            "information_gain_score": i,
            "relevance_score": r,
            "clarity_score": clarity,
            "analysis": "scripted",
        }
    )


async def test_an_education_build_credits_the_teachers_never_the_student(tmp_path: Path) -> None:
    result, _ = await teach(tmp_path, "B", iterations=2)
    assert result.iterations[-1].state["post_correct"]  # G = 1: the post-test is right
    summary_entries = [
        {
            "class": "GUIDANCE",
            "action": "Diagnostician error analysis, Physics, easy: name the misread term",
            "experience": "Good practice: ask which definition the student used. [helpful]",
            "scope": "general",
        },
        {
            "class": "STRATEGY",
            "action": "Diagnostician questioning, Physics, easy: test one assumption",
            "experience": "Good practice: contrast two quantities under one condition.",
            "scope": "subject",
        },
    ]
    model = build_model(
        [
            # C.4.6 by role: Diagnostician 5,5,5,5 -> 5 (s = 1); Strategist 4,3,3,2 -> 3.1 -> 3 (s = 0.6);
            # Subject Matter Expert 2,2,2,3 -> 2.2 -> 2 (s = 0.4).
            Rule(role="judge", pattern='role="Diagnostician">', replies=[rubric(5, 5, 5, 5)]),
            Rule(role="judge", pattern='role="Pedagogy Strategist">', replies=[rubric(4, 3, 3, 2)]),
            Rule(role="judge", pattern='role="Subject Matter Expert">', replies=[rubric(2, 2, 2, 3)]),
            Rule(role="summarizer", replies=[json.dumps({"entries": summary_entries})]),
        ]
    )
    config = BuildConfig(lam=0.5, gamma=0.5, grade_mode="rules")
    summary = await build_pool([tmp_path / "run"], tmp_path / "pool", model.settings, config, model=model)
    rows = [json.loads(line) for line in (build_dir_for(tmp_path / "pool") / CREDITS_FILE).read_text().splitlines()]
    # Only the three teachers' turns, in dialogue rounds 1 and 2: the student's pre-test, replies and post-test
    # are context, never credited.
    assert sorted((row["turn"], row["agent"]) for row in rows) == [(t, a) for t in (1, 2) for a in ("S1", "S2", "S3")]
    r = {(row["turn"], row["agent"]): row for row in rows}
    # Dialogue round k is turn k (round 0 is the pre-test): the viewer places each credit by its round.
    assert {(row["turn"], row["round"]) for row in rows} == {(1, 1), (2, 2)}
    shown = load_credits([build_dir_for(tmp_path / "pool")])
    assert shown[(str((tmp_path / "run").resolve()), "q1", 1, "S1")] == pytest.approx(0.75)
    # Naive scheme, G = 1, lambda = 0.5. Turn 1: c = s / 2.0 = 0.5, 0.3, 0.2 (Eq. 11); education decays from the
    # first turn (C.1), so w_1 = 1 and w_2 = 0.5. r = 0.5 s + 0.5 w c:
    # turn 1: 0.5 + 0.25 = 0.75, 0.3 + 0.15 = 0.45, 0.2 + 0.1 = 0.3; turn 2: 0.5 + 0.125 = 0.625, 0.375, 0.25.
    expected = {(1, "S1"): 0.75, (1, "S2"): 0.45, (1, "S3"): 0.3, (2, "S1"): 0.625, (2, "S2"): 0.375, (2, "S3"): 0.25}
    assert {k: row["r"] for k, row in r.items()} == pytest.approx(expected)
    assert r[(1, "S1")]["w"] == 1.0 and r[(2, "S1")]["w"] == 0.5 and r[(1, "S2")]["s"] == pytest.approx(0.6)
    assert summary.kept == 2 and [k for k, row in r.items() if row["kept"]] == [(1, "S1"), (2, "S1")]
    judged = last_user_prompts(model, "judge")
    assert len(judged) == 6 and all("<student_pretest>\nAnswer: A" in b for b in judged)
    assert not any("math problem" in b for b in judged + last_user_prompts(model, "summarizer"))
    # The round-2 judge sees round 1's question and the student's reply as the dialogue so far.
    round2 = next(b for b in judged if '<teacher_utterance round="2" role="Diagnostician">' in b)
    assert "<dialogue_so_far>\nTeacher: Which assumption in your reasoning would you test first?\nStudent: " in round2
    pool = Pool.open(tmp_path / "pool")
    assert sorted((e.role, e.subject, e.difficulty, e.category, e.scope) for e in pool.entries) == [
        ("Diagnostician", "Physics", "easy", "GUIDANCE", "general"),
        ("Diagnostician", "Physics", "easy", "GUIDANCE", "general"),
        ("Diagnostician", "Physics", "easy", "STRATEGY", "case"),
        ("Diagnostician", "Physics", "easy", "STRATEGY", "case"),
    ]
    # The same question taught again: every entry was distilled from it, knowing its answer, so none is retrieved.
    alone, teaching = await teach(tmp_path / "alone", "B", iterations=1, pool=str(tmp_path / "pool"))
    assert not any("<experience_hints>" in b for b in last_user_prompts(teaching, "specialist"))
    assert "experience retrieval: 4 pool entries distilled from this problem left out" in alone.iterations[-1].notes
    # Table 3's MATTRL condition, rehearsed on the same question (asked for): the team teaches again with the pool;
    # only the Diagnostician's role has entries.
    again, teaching = await teach(
        tmp_path / "again", "B", iterations=1, pool=str(tmp_path / "pool"), pool_same_problem=True
    )
    analyses = last_user_prompts(teaching, "specialist")
    diagnostician = next(b for b in analyses if "\nYou are the Diagnostician" in b)
    assert diagnostician.count("- ACTION: Diagnostician") == 4
    assert sum("<experience_hints>" in b for b in analyses) == 1
    used = Transcript.model_validate(again.iterations[-1].state["transcript"])
    assert sorted(i for u in used.utterances for i in u.experience_ids) == sorted(e.id for e in pool.entries)
    # The ids are entries of this pool: the transcript names it, for the pool's prune.
    assert used.pool == str((tmp_path / "pool").resolve())


@pytest.mark.slow
def test_report_shows_each_domains_metrics_beside_the_papers(tmp_path: Path) -> None:
    runner = CliRunner()

    def invoke(*args: str) -> str:
        out = runner.invoke(app, list(args))
        assert out.exit_code == 0, out.output
        return out.output

    # The simulated student answers A before teaching and the option the teachers point to (the gold) after.
    education = tmp_path / "SuperGPQA-300.jsonl"
    golds = ["A", "B", "C", "B"]
    education.write_text(
        "".join(
            json.dumps({"problem_id": f"q{i}", "question": QUESTION, "answer": g}) + "\n" for i, g in enumerate(golds)
        )
    )
    medicine = tmp_path / "med.jsonl"
    invoke("cases", "import", str(EXAMPLES / "medicine_rarebench.jsonl"), "-f", "rarebench", "-o", str(medicine))
    for domain, problems in (("education", education), ("medicine", medicine)):
        # Each run as `tmas run FILE -m mattrl --domain DOMAIN -T 1` makes it, on a scripted model.
        settings = scripted_settings(method={"name": "mattrl", "params": {"domain": domain, "iterations": 1}})
        asyncio.run(arun(problems, tmp_path / domain, model=ScriptedModel(SimScript(), settings)))
    invoke(
        *("report", str(tmp_path / "education"), str(tmp_path / "medicine"), "-o", str(tmp_path / "report")),
        *("--grade", "rules", "--paper-model", "GPT-5"),
    )
    markdown = (tmp_path / "report" / "report.md").read_text()
    # MATTRL paper, section 4 "Metrics": Hit@k = the share of cases whose gold disease is within the top k, MRR = the
    # mean of 1/rank; Delta Acc = Acc_post - Acc_pre. The team ranks the three golds 1st, 4th and 5th:
    # Hit@1 = Hit@3 = 1/3, Hit@5 = Hit@10 = 3/3, MRR = (1 + 1/4 + 1/5) / 3 = 0.483.
    assert "| Run | Cases | Hit@1 | Hit@3 | Hit@5 | Hit@10 | MRR |" in markdown
    assert "| 3 | 0.33 | 0.33 | 1.00 | 1.00 | 0.48 |" in markdown
    # One of four golds is A: Acc_pre = 1/4; all four are right after teaching: Acc_post = 1; Delta Acc = 3/4.
    assert "| Run | Cases | Acc_pre | Acc_post | ΔAcc |" in markdown and "| 4 | 0.25 | 1.00 | 0.75 |" in markdown
    # The education run is the paper's Multi-Agent on SuperGPQA-300 (Table 3): Acc_post 0.73, Delta Acc 0.29, in %.
    assert "| Multi-Agent | GPT-5 | - | acc_post | 73.00 | 100.00 | +27.00 | MATTRL Table 3 |" in markdown
    assert "| Multi-Agent | GPT-5 | - | delta_acc | 29.00 | 75.00 | +46.00 | MATTRL Table 3 |" in markdown


async def test_failed_teaching_calls_are_noted_in_their_rounds_record() -> None:
    # The single teacher's first question and the student's first reply fail (a 400 is not retried): the round
    # goes on with what it has, and its record says which call failed.
    rules = [
        Rule(role="specialist", pattern="Ask your question for round 1", fault="http_400"),
        Rule(role="student", pattern="Reply to the teacher", fault="http_400", times=1),
    ]
    problem = Problem(problem_id="q1", question=QUESTION, answer="B", metadata=METADATA)
    result, _ = await run_scripted(
        "mattrl", question=problem, rules=rules, domain="education", teaching="single", iterations=2
    )
    first = result.iterations[1].notes
    assert any(n.startswith("round 1: the teacher's question failed") for n in first)
    assert any(n.startswith("round 1: the student's reply failed") for n in first)
    assert not any("failed" in n for n in result.iterations[2].notes)


async def test_a_plan_that_drafts_later_rounds_asks_each_round_its_own_question() -> None:
    # The coordinator's round-1 plan drafts both rounds' questions (as C.4.4's first planning prompt asks for the
    # whole dialogue). Round 1 asks the student its ROUND 1 question, not the last line's ROUND 2 one, and the
    # judge and summarizer of round 2's turns read that question as round 1's.
    plan = "ROUND 1: What does acceleration measure?\n**ROUND 2:** Which option names that quantity?"
    rules = [Rule(role="coordinator", pattern="for round 1 of the dialogue", replies=[plan])]
    problem = Problem(problem_id="q1", question=QUESTION, answer="B", metadata=METADATA)
    result, model = await run_scripted("mattrl", question=problem, rules=rules, domain="education", iterations=2)
    first_reply = last_user_prompts(model, "student")[1]
    assert "Teacher: What does acceleration measure?\n</conversation>" in first_reply
    assert "Which option names" not in first_reply
    transcript = transcript_of(result.iterations, "q1")
    assert transcript is not None
    case = LabelledTranscript("run", problem, transcript, outcome=1.0)
    later = [turn for turn in case.turns() if turn.round == 2]
    assert later and all(
        [q for q, _ in case.teaching_view(turn).dialogue] == ["What does acceleration measure?"] for turn in later
    )
    assert not any("ROUND" in n for r in result.iterations for n in r.notes)


async def test_a_plan_without_its_round_label_is_asked_whole_and_noted() -> None:
    rules = [Rule(role="coordinator", pattern="for round 1 of the dialogue", replies=["What does speed measure?"])]
    problem = Problem(problem_id="q1", question=QUESTION, answer="B", metadata=METADATA)
    result, model = await run_scripted("mattrl", question=problem, rules=rules, domain="education", iterations=2)
    assert "Teacher: What does speed measure?\n</conversation>" in last_user_prompts(model, "student")[1]
    assert "round 1: the plan has no 'ROUND 1:' line; its whole reply is asked" in result.iterations[1].notes
    assert not any("ROUND" in n for n in result.iterations[2].notes)


@pytest.mark.parametrize(
    ("teaching", "failing", "asked"),
    [
        ("single", Rule(role="specialist", pattern="Ask your question for round 1", fault="http_400"), SINGLE_FALLBACK),
        ("team", Rule(role="coordinator", pattern="for round 1 of the dialogue", fault="http_400"), TEAM_FALLBACK),
    ],
)
async def test_the_generic_question_asked_in_a_failed_round_is_the_dialogue_experience_construction_reads(
    teaching: str, failing: Rule, asked: str
) -> None:
    # Round 1's question call fails: the student is asked a generic question, and the judge and summarizer of
    # round 2's turns see that question (not an empty or unusable one) as round 1's in the dialogue so far.
    problem = Problem(problem_id="q1", question=QUESTION, answer="B", metadata=METADATA)
    result, model = await run_scripted(
        "mattrl", question=problem, rules=[failing], domain="education", teaching=teaching, iterations=2
    )
    assert f"Teacher: {asked}" in last_user_prompts(model, "student")[1]
    transcript = transcript_of(result.iterations, "q1")
    assert transcript is not None
    case = LabelledTranscript("run", problem, transcript, outcome=1.0)
    later = [turn for turn in case.turns() if turn.round == 2]
    assert later
    for turn in later:
        [(question, reply)] = case.teaching_view(turn).dialogue
        assert question == asked and reply
    assert any(n.endswith(f"the generic question {asked!r} is asked") for n in result.iterations[1].notes)


async def test_the_student_is_taught_from_its_own_pretest_with_its_roles_model_and_sampling() -> None:
    # C.1: one student (GPT-4o, temperature 0.3) takes the pre-test and is then taught; the teachers (GPT-5) ask
    # about the answer and reasoning it gave, so its replies and its post-test are written knowing them.
    roles = {
        "student": {"model": "student-model", "sampling": {"temperature": 0.3, "max_tokens": 900}},
        "specialist": {"model": "teacher-model"},
    }
    problem = Problem(problem_id="q1", question=QUESTION, answer="B", metadata=METADATA)
    result, model = await run_scripted(
        "mattrl", question=problem, domain="education", iterations=2, teaching="single", settings={"roles": roles}
    )
    assert result.answer == "B"
    calls = model.calls_of("student")
    assert len(calls) == 4
    assert {(c.body["model"], c.body["temperature"], c.body["max_tokens"]) for c in calls} == {
        ("student-model", 0.3, 900)
    }
    assert {c.body["model"] for c in model.calls_of("specialist")} == {"teacher-model"}
    pre = calls[0].body["messages"][-1]["content"]
    assert "<your_pretest>" not in pre
    pretest = result.iterations[0].candidates[0].text
    assert pretest.endswith("Answer: A")
    # Both replies and the post-test show the pre-test reply the student itself wrote, before the conversation.
    for call in calls[1:]:
        asked = call.body["messages"][-1]["content"]
        assert f"<your_pretest>\n{pretest}\n</your_pretest>" in asked
        assert asked.index("<your_pretest>") < asked.index("<conversation>")


async def test_an_education_build_keeps_the_top_quarter_of_each_teaching_interaction(tmp_path: Path) -> None:
    # C.1: "From each scored teaching interaction, the top-ranked (25%) utterances are selected": the quantile is
    # taken within each case, not over the turns of all cases (section 4.1's rule for the other domains).
    other = "Which force keeps a satellite in orbit?\nA) friction\nB) gravity\nC) lift"
    problems = [
        Problem(problem_id="q1", question=QUESTION, answer="B", metadata=METADATA),
        Problem(problem_id="q2", question=other, answer="B", metadata=METADATA),
    ]
    settings = scripted_settings(method={"name": "mattrl", "params": {"domain": "education", "iterations": 1}})
    await scripted_run(ScriptedModel(SimScript(), settings), tmp_path / "run", problems)
    scores = {"q1": (5, 4, 3), "q2": (2, 1, 1)}
    roles = ("Diagnostician", "Pedagogy Strategist", "Subject Matter Expert")
    asked = {"q1": "free fall", "q2": "satellite"}
    rules = [
        Rule(role="judge", pattern=f'(?=.*{asked[pid]})(?=.*role="{role}">)', replies=[rubric(s, s, s, s)])
        for pid, by_role in scores.items()
        for role, s in zip(roles, by_role, strict=True)
    ]
    rules.append(Rule(role="summarizer", replies=[json.dumps({"entries": []})]))
    model = build_model(rules)
    config = BuildConfig(grade_mode="rules")
    summary = await build_pool([tmp_path / "run"], tmp_path / "pool", model.settings, config, model=model)
    rows = [json.loads(line) for line in (build_dir_for(tmp_path / "pool") / CREDITS_FILE).read_text().splitlines()]
    assert len(rows) == 6 and {row["G"] for row in rows} == {1.0}
    # One round, G = 1, lambda 0.4: r = 0.4 s + 0.6 * 1 * 1 * s / sum(s). q1: s = 1, 0.8, 0.6 (sum 2.4) gives
    # r = 0.65, 0.52, 0.39; q2: s = 0.4, 0.2, 0.2 (sum 0.8) gives r = 0.46, 0.23, 0.23. Over all six turns the top
    # 25 % (ceil(1.5) = 2) would be q1's 0.65 and 0.52; within each case (ceil(0.75) = 1) it is each Diagnostician.
    r = {(row["problem_id"], row["agent"]): row["r"] for row in rows}
    expected = {"q1": (0.65, 0.52, 0.39), "q2": (0.46, 0.23, 0.23)}
    assert r == pytest.approx({(pid, f"S{i}"): v for pid, rs in expected.items() for i, v in enumerate(rs, 1)})
    assert sorted((row["problem_id"], row["agent"]) for row in rows if row["kept"]) == [("q1", "S1"), ("q2", "S1")]
    assert summary.kept == 2


async def test_a_single_teacher_teaches_whatever_embedding_model_built_the_unused_pool(tmp_path: Path) -> None:
    Pool.create(tmp_path / "pool", "endpoint:other-embedder")
    result, model = await teach_in_process("B", iterations=1, teaching="single", pool=str(tmp_path / "pool"))
    assert result.status == "done" and result.error is None
    assert [n.split(":")[0] for n in result.notices] == [f"pool={tmp_path / 'pool'} is not used with teaching=single"]
    assert model.embedded == []


async def test_a_pretest_the_budget_stopped_the_teaching_after_is_kept_and_answers() -> None:
    # One call: the pre-test (A, wrong) comes back, the team's formation is refused. The pre-test is the case's answer
    # until a post-test gives another (each teaching round's record selects it): kept, not lost with a failed case.
    problem = Problem(problem_id="q1", question=QUESTION, answer="B", metadata=METADATA)
    result, model = await run_scripted(
        "mattrl", question=problem, domain="education", iterations=2, settings={"budget": {"calls": 1}}
    )
    assert by_role(model) == {"student": 1}
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "A")
    [record] = result.iterations
    assert record.selected == "A" and [c.meta.stage for c in record.candidates] == ["pre-test"]
    assert (record.state["pre"], record.state["pre_correct"]) == ("A", False)
    assert result.text == model.calls[0].reply.content
    assert record.notes[-1] == "stopped: budget spent (1 calls of a budget of 1) in iteration 0"


@pytest.mark.parametrize(
    ("teaching", "iterations", "calls", "turns", "cut", "stages"),
    [
        # Team of 3: the pre-test, the team, then two of round 1's three analyses before the third is refused.
        ("team", 2, 4, [("S1", "opinion"), ("S2", "opinion")], "2 of 3 analyses came back", []),
        # The analyses and the planned question came back; the student's reply is refused.
        (
            "team",
            2,
            6,
            [("S1", "opinion"), ("S2", "opinion"), ("S3", "opinion"), ("coordinator", "meeting")],
            "the student's reply was refused",
            [],
        ),
        # The last round's student reply came back; the closing guidance is refused.
        (
            "team",
            1,
            7,
            [
                ("S1", "opinion"),
                ("S2", "opinion"),
                ("S3", "opinion"),
                ("coordinator", "meeting"),
                ("student", "opinion"),
            ],
            "the closing guidance was refused",
            ["dialogue"],
        ),
        # A single teacher's question came back; the student's reply is refused.
        ("single", 2, 2, [("S1", "opinion")], "the student's reply was refused", []),
        # The closing guidance came back; the post-test is refused.
        (
            "single",
            1,
            4,
            [("S1", "opinion"), ("student", "opinion"), ("S1", "report")],
            "the post-test was refused",
            ["dialogue"],
        ),
    ],
)
async def test_a_teaching_round_the_budget_cut_keeps_its_finished_turns(
    teaching: str, iterations: int, calls: int, turns: list[tuple[str, str]], cut: str, stages: list[str]
) -> None:
    problem = Problem(problem_id="q1", question=QUESTION, answer="B", metadata=METADATA)
    result, model = await run_scripted(
        "mattrl",
        question=problem,
        domain="education",
        teaching=teaching,
        iterations=iterations,
        settings={"budget": {"calls": calls}},
    )
    assert len(model.calls) == calls
    assert (result.status, result.stopped_reason, result.answer) == ("done", "budget", "A")
    # Round 1 was cut: its record keeps the turns that came back (each with its call), and its calls.
    assert [r.iteration for r in result.iterations] == [0, 1]
    record = result.iterations[1]
    t = Transcript.model_validate(record.state["transcript"])
    said = t.by_round(1)
    assert [(u.agent, u.kind) for u in said] == turns
    answered = {c.reply.call_id: c.reply.content for c in model.calls}
    assert all(u.call_id in answered and u.text == answered[u.call_id] for u in said)
    assert [c.meta.stage for c in record.candidates] == stages
    assert record.calls == calls - 1 - (teaching == "team")
    assert (record.selected, record.state["pre"], record.state.get("post")) == ("A", "A", None)
    assert record.notes[-1] == (
        f"stopped: budget spent ({calls} calls of a budget of {calls}) in iteration 1; round 1 was cut by the budget"
        f" ({cut}): its finished turns are kept, and the pre-test's answer stands"
    )
    assert result.text == model.calls[0].reply.content


async def test_a_teaching_round_the_budget_refused_whole_leaves_no_record() -> None:
    # The pre-test, the team, round 1 whole (3 analyses, the plan, the student's reply: 7 calls); round 2's first
    # analysis is refused. Nothing of round 2 came back: no record of it, and round 1's says where the run stopped.
    problem = Problem(problem_id="q1", question=QUESTION, answer="B", metadata=METADATA)
    result, model = await run_scripted(
        "mattrl", question=problem, domain="education", iterations=2, settings={"budget": {"calls": 7}}
    )
    assert len(model.calls) == 7 and result.stopped_reason == "budget" and result.answer == "A"
    assert [r.iteration for r in result.iterations] == [0, 1]
    assert result.iterations[1].notes[-1] == "stopped: budget spent (7 calls of a budget of 7) in iteration 2"
