"""The echo guard. An agent output whose answer or content repeats its own prompt's instructions
(not the problem) is rejected, counted per role as an ``echo``, asked again once, and never enters an answer, a bank
or a pool. Unit checks on real prompts, then the methods in process on the scripted model; then a run's report and
the pool builds, in process too."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from mattrl_runs import hand_worked_transcript, write_run
from scripted_runs import by_role, solve_in_process
from test_mattrl_domains import build_model, rubric, teach
from test_pool_build import scripted_rules
from tmas.agents.echo import DATA_BLOCK, ECHO_SHARE, NGRAM, EchoGuard, split_prompt, tokens
from tmas.agents.experience import experience_prompt
from tmas.agents.rollouts import RolloutView
from tmas.agents.solution import generation_prompt
from tmas.agents.summary import summary_prompt
from tmas.agents.verification import Verification
from tmas.api import asolve
from tmas.grading.grades import GradeConfig
from tmas.llm.types import Message
from tmas.memory.experience_bank import ExperienceBank
from tmas.memory.pool import Pool
from tmas.methods.base import ProblemResult
from tmas.pool.build import BuildConfig, build_pool
from tmas.problems import Problem
from tmas.reports.report import build_report
from tmas.testing import Rule, ScriptedCall, ScriptedModel, SimScript

Q = "What is 17*23?"
# A problem that shares words with the instructions: quoting it is still honest.
WORDY = (
    "Keep it short: a farmer plants 17 rows with 23 trees each and wants every number worked out by hand. "
    "How many trees does the farmer plant?"
)
# Sentences of the current templates, as a small model returns them.
CONCISE_ECHO = "Finish with one last line that holds nothing but the final answer you computed"
EXPERIENCE_ECHO = "a transformation that turns the problem or a sub-problem into a simpler or better understood one"


def test_split_prompt_takes_the_tagged_blocks_as_data() -> None:
    messages = generation_prompt(Q, "numeric", "concise")
    instructions, data = split_prompt(messages)
    assert data == f"<problem>\n{Q}\n</problem>"
    assert Q not in instructions and "Keep it short" in instructions and "careful mathematician" in instructions


def test_an_honest_solution_quoting_the_problem_passes() -> None:
    guard = EchoGuard.of(generation_prompt(WORDY, "numeric", "concise"))
    honest = f"The problem: {WORDY}\nRows times trees: 17*23 = 340 + 51 = 391.\n\\boxed{{391}}"
    assert guard.solution_echo(honest, "391") is None
    assert guard.share(honest) < 0.1


def test_a_solution_whose_answer_or_text_is_instruction_text_is_an_echo() -> None:
    guard = EchoGuard.of(generation_prompt(Q, "numeric", "concise"))
    assert guard.solution_echo("\\boxed{the final answer you computed}", "the final answer you computed") == "answer"
    assert guard.solution_echo(f"{CONCISE_ECHO}, written inside \\boxed{{391}}.", "391") == "solution text"
    assert guard.solution_echo("17*23 = 391.\n\\boxed{391}", "391") is None


def test_an_example_answer_in_the_instructions_is_caught_unless_the_data_holds_it() -> None:
    """The case once seen: the old concise prompt showed \\boxed{42}, and a candidate answered 42 to 17*23."""
    old = "Finish with one last line holding the final answer alone inside \\boxed{}, for example: \\boxed{42}"

    def guard(problem: str) -> EchoGuard:
        return EchoGuard.of([Message(role="user", content=f"<problem>\n{problem}\n</problem>\n\n{old}")])

    assert guard(Q).echoes_answer("42") and guard(Q).echoes_answer(" 42 ")
    assert not guard(Q).echoes_answer("391")
    assert not guard("What is 6*7? (The answer is 42 or close to it.)").echoes_answer("42")


def test_an_example_answer_whose_box_holds_a_literal_brace_is_caught() -> None:
    # A case split opens a literal brace it never closes (\left\{ ... \right.): it groups nothing, and the box
    # around it ends at its own closing brace, so the value it shows is read, not only the last box's; a copy
    # restyled (\dfrac for \frac) shares too few word runs with the instructions for the text check to see it.
    shown = (
        "Write a function in a box, for example \\boxed{f(x) = \\left\\{ \\frac{1}{2} \\right.}, and a number"
        " alone, for example \\boxed{7}."
    )
    guard = EchoGuard.of([Message(role="user", content=f"<problem>\n{Q}\n</problem>\n\n{shown}")])
    assert guard.echoes_answer("f(x) = \\left\\{ \\dfrac{1}{2} \\right.")
    assert guard.echoes_answer("7")
    assert not guard.echoes_answer("f(x) = \\left\\{ \\dfrac{1}{3} \\right.")


def test_bank_entries_copying_the_instructions_are_caught_and_own_words_are_not() -> None:
    views = [RolloutView(number=1, solution="17*23 = 391.\n\\boxed{391}", summary="## Verdict\nright", score_text="1")]
    guard = EchoGuard.of(experience_prompt(Q, views, ExperienceBank(), 35))
    assert guard.echoes_text(EXPERIENCE_ECHO)
    assert guard.echoes_text("The mistake, with the reason it is wrong")  # a field description, copied
    assert not guard.echoes_text("Splitting 23 as 20 + 3 gives 17*20 + 17*3 = 340 + 51 = 391, confirmed by both.")
    assert not guard.echoes_text("17*23 = 391")  # quotes the rollout (data), too short to judge otherwise


def reference_share(messages: list[Message], text: str) -> float:
    """The text check as defined: the share of the text's trigrams among the instructions' less the data's."""

    def grams(words: list[str]) -> list[tuple[str, ...]]:
        return [tuple(words[i : i + 3]) for i in range(len(words) - 2)]

    instructions, data = split_prompt(messages)
    only = set(grams(tokens(instructions))) - set(grams(tokens(data)))
    text_grams = grams(tokens(text))
    return sum(g in only for g in text_grams) / len(text_grams) if text_grams else 0.0


def test_the_guard_looks_up_data_lazily_and_from_cache_with_the_verdicts_of_the_definition() -> None:
    """The guard keeps the instructions' trigrams only and looks each one up in the data's words when an output
    holds it; blocks and whole prompts are cached by content. Its verdicts are the definition's, on long prompts
    whose data shares phrases with the instructions, for fields made of runs of instruction and data words."""
    rng = random.Random(5)
    rollouts = [
        RolloutView(
            number=k,
            solution=f"Following the standards, a careful solution {k}: 17*23 = 391 written out by hand. " * 40,
            summary="## Validated Steps\n- the product\n## Remaining Flaws\n- none found\n## Verdict\nsound",
            score_text="0.9",
        )
        for k in range(1, 9)
    ]
    verifications = [
        Verification(feedback=f"Report {j}: the final answer is right, each step checked. " * 30, score=1.0)
        for j in range(8)
    ]
    prompts = [
        experience_prompt(Q, rollouts, ExperienceBank(), 35),
        summary_prompt(Q, "17*23 = 391 by hand, the final answer 391.", verifications),
        generation_prompt(WORDY, "numeric", "concise"),
    ]

    def run(words: list[str]) -> str:
        at = rng.randrange(len(words))
        return " ".join(words[at : at + rng.randrange(2, 12)])

    verdicts: list[bool] = []
    for messages in prompts:
        instructions, data = split_prompt(messages)
        sources = [tokens(instructions), tokens(data)]
        for _ in range(60):
            text = " ".join(run(rng.choice(sources)) for _ in range(rng.randrange(1, 4)))
            expected = reference_share(messages, text)
            # A first guard, then the cached one: both give the definition's share.
            assert EchoGuard.of(messages).share(text) == expected
            assert EchoGuard.of(list(messages)).share(text) == expected
            if len(tokens(text)) >= NGRAM:  # shorter fields are judged as whole runs
                assert EchoGuard.of(messages).echoes_text(text) == (expected >= ECHO_SHARE)
            verdicts.append(expected >= ECHO_SHARE)
    assert EchoGuard.of(prompts[0]) is EchoGuard.of(list(prompts[0]))
    assert any(verdicts) and not all(verdicts)
    # A trigram across two data blocks (the first one's closing tag, the second one's opening tag and first word)
    # is data, as in the blocks' joined text.
    across = [
        Message(role="user", content="<alpha>\nbeta\n</alpha>\n<gamma>\ndelta\n</gamma>\nWrite alpha gamma delta.")
    ]
    assert reference_share(across, "alpha gamma delta") == EchoGuard.of(across).share("alpha gamma delta") == 0.0
    assert EchoGuard.of(across).share("write alpha gamma") == 1.0


# ---------------------------------------------------------------------------------------------- methods
async def solve(
    method: str, rules: list[Rule], question: str = Q, **params: Any
) -> tuple[ProblemResult, ScriptedModel]:
    model = ScriptedModel(SimScript(rules=rules), scripted_settings(method={"name": method, "params": params}))
    return await solve_in_process(model, question), model


async def run_tmas(rules: list[Rule], question: str = Q, **params: Any) -> tuple[ProblemResult, ScriptedModel]:
    # One iteration that runs every agent: the memory agents' echoes are under test too.
    params = {"n": 1, "m": 1, "iterations": 1, "style": "concise", "skip_final_memory": False, **params}
    return await solve("tmas", rules, question, **params)


def solution_calls(model: ScriptedModel) -> list[ScriptedCall]:
    return model.calls_of("solution")


async def test_a_solution_writing_its_blocks_closing_tag_stays_data_and_its_answer_is_graded_as_written() -> None:
    # A solver that wraps its work in the tags it was shown, closing the block in the middle of its solution.
    tagged = (
        "<solution>\nSplit the product.\n</solution>\n"
        "Seventeen rows of twenty three give three hundred forty plus fifty one, so the product is 391.\n\\boxed{391}"
    )
    quoting = (
        "## Validated Steps\n- seventeen rows of twenty three give three hundred forty plus fifty one\n"
        "## Remaining Flaws\n- none found\n## Verdict\nThe product is right."
    )
    result, model = await run_tmas(
        [Rule(role="solution", replies=[tagged], times=1), Rule(role="summary", replies=[quoting])], n=1
    )
    # The summary quotes the part of the solution after its tag: data, so it is no echo and is kept.
    [summary_call] = model.calls_of("summary")
    solution_block = next(
        m.group(0) for m in DATA_BLOCK.finditer(summary_call.messages[-1].content) if m.group(1) == "solution"
    )
    assert "three hundred forty plus fifty one" in solution_block and "&lt;/solution&gt;" in solution_block
    record = result.iterations[0]
    assert record.replies["summary"].echo == 0 and "summary_echo" not in result.counters
    assert record.candidates[0].meta.summary == quoting
    # What is graded and stored is the reply as written, not the prompt's inert copy.
    assert result.answer == "391" and record.candidates[0].answer == "391"
    assert "</solution>" in record.candidates[0].text and "&lt;" not in record.candidates[0].text


async def test_tmas_rejects_an_echoed_answer_asks_again_once_and_counts_it() -> None:
    echo = f"{CONCISE_ECHO}.\n\\boxed{{the final answer you computed}}"
    result, model = await run_tmas([Rule(role="solution", replies=[echo], times=1)])
    first, retry = solution_calls(model)
    # The same question again, as a distinct call: its own seed, so the model samples anew.
    assert first.messages == retry.messages and first.sampling.seed != retry.sampling.seed
    assert result.answer == "391"
    record = result.iterations[0]
    assert record.replies["solution"].echo == 1 and record.replies["solution"].replies == 2
    assert result.counters["solution_echo"] == 1
    assert record.candidates[0].answer == "391" and record.candidates[0].error is None
    assert any("echoed the prompt's instructions; asked again" in note for note in record.notes)


async def test_tmas_never_takes_an_answer_that_echoes_twice() -> None:
    echo = f"{CONCISE_ECHO}.\n\\boxed{{the final answer you computed}}"
    result, model = await run_tmas([Rule(role="solution", replies=[echo])])
    assert len(solution_calls(model)) == 2 and result.answer is None and result.status == "failed"
    candidate = result.iterations[0].candidates[0]
    assert candidate.answer is None and candidate.meta.echo == "answer" and "echoed" in (candidate.error or "")
    # No rollout: nothing is verified, summarised or handed to the memory agents.
    assert {c.role for c in model.calls} == {"solution"}
    assert result.iterations[0].replies["solution"].echo == 2 and result.counters["solution_echo"] == 2


async def test_an_honest_reply_quoting_the_problem_is_not_an_echo() -> None:
    honest = f"Restating: {WORDY}\nSo 17*23 = 340 + 51 = 391 trees.\n\\boxed{{391}}"
    result, model = await run_tmas([Rule(role="solution", replies=[honest])], WORDY, n=2)
    assert len(solution_calls(model)) == 2 and result.answer == "391"
    assert result.iterations[0].replies["solution"].echo == 0 and "solution_echo" not in result.counters


async def test_an_experience_entry_that_echoes_the_instructions_never_enters_the_bank() -> None:
    honest = "Writing 23 as 20 + 3 splits the product into 340 + 51, which both verifiers confirmed."
    ops = [
        {"op": "ADD", "kind": "anchor", "subtype": "structural_reduction", "content": EXPERIENCE_ECHO},
        {"op": "ADD", "kind": "anchor", "subtype": "intermediate_result", "content": honest},
    ]
    reply = "```json\n" + json.dumps({"operations": ops}) + "\n```"
    # Both the first reply and the retry echo: the echoing operation is dropped, the honest one applied.
    result, model = await run_tmas([Rule(role="experience", replies=[reply])], n=2)
    experience = model.calls_of("experience")
    assert len(experience) == 2 and experience[0].messages == experience[1].messages
    record = result.iterations[0]
    contents = [e["content"] for e in record.state["experience_bank"]["entries"]]
    assert contents == [honest]
    update = record.state["experience_update"]
    assert update["status"] == "applied" and len(update["echo_dropped"]) == 1
    assert "operation 1 (ADD)" in update["echo_dropped"][0]
    assert record.replies["experience"].echo == 2 and result.counters["experience_echo"] == 2


async def test_a_guideline_strategy_that_echoes_the_instructions_is_dropped_after_one_retry() -> None:
    echo = "the mathematical framework, the key structural insight and the angle of attack"
    reply = json.dumps({"rollouts": [{"rollout": 1, "strategy": echo, "novelty": 1, "same_as": None}]})
    result, _ = await run_tmas([Rule(role="guideline", replies=[reply], times=1)])
    record = result.iterations[0]
    # The retry (the sim's own guideline agent) names a real strategy; the echo never reached the log.
    strategies = [s["description"] for s in record.state["guideline_bank"]["strategies"]]
    assert len(strategies) == 1 and echo not in strategies
    assert record.replies["guideline"].echo == 1 and result.counters["guideline_echo"] == 1


async def test_a_baseline_asks_again_on_an_echo_and_votes_without_it(tmp_path: Path) -> None:
    echo = f"{CONCISE_ECHO}.\n\\boxed{{the final answer you computed}}"
    settings = scripted_settings(method={"name": "majority", "params": {"k": 2, "style": "concise"}})
    model = ScriptedModel(SimScript(rules=[Rule(role="solution", replies=[echo], times=1)]), settings)
    result = await asolve(Q, model=model, run_dir=tmp_path / "run")
    seeds = [call.body["seed"] for call in model.calls_of("solution")]
    assert len(seeds) == len(set(seeds)) == 3 and result.answer == "391"
    record = result.iterations[0]
    assert record.replies["solution"].echo == 1
    assert all(c.answer == "391" and c.error is None for c in record.candidates)
    assert sum("asked again" in note for note in record.notes) == 1
    # The report's per-role table counts it: 3 replies (2 samples and 1 retry), 1 echo.
    paths = await build_report([tmp_path / "run"], tmp_path / "report", GradeConfig(), None, grade=False)
    markdown = paths["markdown"].read_text(encoding="utf-8")
    assert "| Role | Replies | No answer/score | Truncated | Answer stated, no box | Echo |" in markdown
    assert "| solution | 3 | 0.0% (0) | 0.0% (0) | 0.0% (0) | 33.3% (1) |" in markdown


async def test_mattrl_opinions_and_reviews_that_echo_are_asked_again() -> None:
    opinion = "A one- or two-sentence reflection, the core reasoning, and \\boxed{the final answer alone}"
    review = {"analysis": "what holds up first, then the targeted criticism", "verdict": "accept", "issues": []}
    rules = [
        Rule(role="specialist", replies=[opinion], times=1),
        Rule(role="reviewer", replies=[json.dumps(review)], times=1),
    ]
    result, model = await solve("mattrl", rules)
    assert result.answer == "391"
    assert by_role(model) == {"coordinator": 2, "specialist": 4, "reviewer": 7}
    record = result.iterations[0]
    assert record.replies["specialist"].echo == 1 and record.replies["reviewer"].echo == 1
    opinions = [u for u in record.state["transcript"]["utterances"] if u["kind"] == "opinion"]
    assert [u["answer"] for u in opinions] == ["391"] * 3
    # The echoing review never counted as a verdict: every kept review is the sim's own.
    reviews = [u for u in record.state["transcript"]["utterances"] if u["kind"] == "review"]
    assert len(reviews) == 6 and not any("targeted criticism" in u["text"] for u in reviews)


async def test_a_summarizer_entry_that_echoes_the_instructions_never_enters_the_pool(tmp_path: Path) -> None:
    echo = {
        "action": "a short key naming the move",
        "experience": "Good practice: when to make the move and what to watch for",
        "scope": "general",
    }
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])
    # Turn 2 of S1 is kept (tests/test_pool_build.py); its summarizer echoes in the reply and the retry.
    echoing = Rule(
        role="summarizer", pattern='<contribution round="2" agent="S1"', replies=[json.dumps({"entries": [echo]})]
    )
    model = ScriptedModel(SimScript(rules=[echoing.model_copy(update={"times": 2}), *scripted_rules()]))
    config = BuildConfig(scheme="difference", lam=0.5, gamma=0.5, beta=15 * math.log(2), grade_mode="rules")
    summary = await build_pool([run], tmp_path / "pool", scripted_settings(), config, model=model)
    assert len(model.calls_of("summarizer")) == 3
    assert summary.summarizer_echoes == 2 and summary.added == 1
    pool = Pool.open(tmp_path / "pool")
    assert [(e.source_round, e.source_agent) for e in pool.entries] == [(1, "S1")]
    assert not any("naming the move" in e.action for e in pool.entries)


@pytest.mark.parametrize(
    "retry",
    [
        Rule(role="summarizer", pattern='<contribution round="2" agent="S1"', replies=["No entries."], times=2),
        Rule(role="summarizer", pattern='<contribution round="2" agent="S1"', fault="http_400", times=2),
    ],
    ids=["unreadable", "failed"],
)
async def test_a_summarizer_retry_that_fails_after_an_echo_keeps_the_first_replys_other_entries(
    tmp_path: Path, retry: Rule
) -> None:
    echo = {
        "action": "a short key naming the move",
        "experience": "Good practice: when to make the move and what to watch for",
        "scope": "general",
    }
    honest = {
        "action": "Recheck the product by splitting a factor",
        "experience": "Good practice: 6*7 as 6*5 plus 6*2 confirms 42 before it is stated.",
        "scope": "general",
    }
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])
    # Turn 2 of S1 is kept: its first summary holds an echoing entry and an honest one; both retries are unusable.
    first = Rule(
        role="summarizer",
        pattern='<contribution round="2" agent="S1"',
        replies=[json.dumps({"entries": [echo, honest]})],
        times=1,
    )
    model = ScriptedModel(SimScript(rules=[first, retry, *scripted_rules()]))
    config = BuildConfig(scheme="difference", lam=0.5, gamma=0.5, beta=15 * math.log(2), grade_mode="rules")
    summary = await build_pool([run], tmp_path / "pool", scripted_settings(), config, model=model)
    assert len(model.calls_of("summarizer")) == 4 and summary.summarizer_echoes == 1
    pool = Pool.open(tmp_path / "pool")
    kept = [(e.source_round, e.action) for e in pool.entries if e.source_round == 2]
    assert kept == [(2, honest["action"])]
    assert any("the echoing reply's other entries are kept" in note for note in summary.notes)


async def test_a_medicine_peer_review_that_echoes_is_asked_again_and_never_shared() -> None:
    """A.4's critique of a differential is checked like a math review: its analysis and every point."""
    echo = {
        "analysis": "Analysis: first where you concur, then the disagreements that matter most.",
        "agreements": ["Each one specific point of the differential you concur with and why."],
        "disagreements": None,
        "changes": ["A diagnosis to add, drop or move, and to which rank."],
    }
    rules = [Rule(role="reviewer", replies=[json.dumps(echo)], times=1)]
    result, model = await solve("mattrl", rules, domain="medicine", iterations=2)
    assert result.status == "done", result.error
    first = result.iterations[0]
    # Six critiques in round 1, one of them asked twice; none in the final round.
    assert by_role(model)["reviewer"] == 7 and first.replies["reviewer"].echo == 1
    utterances = first.state["transcript"]["utterances"]
    reviews = [u for u in utterances if u["kind"] == "review"]
    assert len(reviews) == 6 and not any("disagreements that matter most" in u["text"] for u in reviews)
    # Neither the bulletin nor any author's feedback carries the echoed points.
    specialist = [c.messages[-1].content for c in model.calls_of("specialist")]
    assert not any("to which rank" in text or "you concur with" in text for text in specialist[3:])
    assert not any("to which rank" in u["text"] for u in utterances if u["kind"] == "meeting")


async def test_an_education_summarizer_entry_that_echoes_never_enters_the_pool(tmp_path: Path) -> None:
    """C.4.7's entries are checked like the math summarizer's: an echo is asked again once, then dropped."""
    result, _ = await teach(tmp_path, "B", iterations=2)
    assert result.iterations[-1].state["post_correct"]
    echo = {
        "class": "GUIDANCE",
        "action": "the teacher's role, the kind of action, the teaching situation it fits",
        "experience": "Good practice: how to find the error, guide the student, address a misconception",
        "scope": "general",
    }
    honest = {
        "class": "STRATEGY",
        "action": "Diagnostician questioning, Physics, easy: test one assumption",
        "experience": "Good practice: contrast two quantities under one condition.",
        "scope": "subject",
    }
    model = build_model(
        [
            # Only the Diagnostician's turns are kept (score 5; the others score 2).
            Rule(role="judge", pattern='role="Diagnostician">', replies=[rubric(5, 5, 5, 5)]),
            Rule(role="judge", replies=[rubric(2, 2, 2, 2)]),
            # Round 1's summary echoes in the reply and in the retry; round 2's is the team's own words.
            Rule(
                role="summarizer",
                pattern='<teacher_utterance round="1"',
                replies=[json.dumps({"entries": [echo]})],
                times=2,
            ),
            Rule(role="summarizer", replies=[json.dumps({"entries": [honest]})]),
        ]
    )
    config = BuildConfig(lam=0.5, gamma=0.5, grade_mode="rules")
    summary = await build_pool([tmp_path / "run"], tmp_path / "pool", model.settings, config, model=model)
    assert len(model.calls_of("summarizer")) == 3
    assert summary.summarizer_echoes == 2 and summary.added == 1
    pool = Pool.open(tmp_path / "pool")
    assert [(e.source_round, e.category, e.action) for e in pool.entries] == [(2, "STRATEGY", honest["action"])]
