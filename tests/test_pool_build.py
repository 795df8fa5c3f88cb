"""``build_pool`` on a scripted model in process (one that goes away part way, too):
scripted judge and summarizer replies, the simulator's embeddings; the credits it writes match the hand-worked
values of tests/test_pool_credit.py, the pool it writes is read back by the pool's own search, and a rebuild
replays every call from the build store."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from mattrl_runs import hand_worked_transcript, write_run
from scripted_runs import GoneModel, by_role
from tmas.errors import InputError
from tmas.llm.model import EndpointUnreachable
from tmas.llm.types import Completion, Message
from tmas.memory.embedders import EndpointEmbedder
from tmas.memory.pool import Pool, PoolError
from tmas.memory.transcript import Utterance
from tmas.planning.pool_build import estimate_build
from tmas.pool.build import CREDITS_FILE, BuildConfig, BuildSummary, build_dir_for, build_pool
from tmas.pool.lifecycle import PruneConfig, prune_pool
from tmas.pool.scoring import NO_OP
from tmas.problems import Problem, question_hash
from tmas.store.run_lock import RunLock
from tmas.testing import Rule, ScriptedModel, SimScript

TEXTS = {1: {"S1": "R1-S1", "S2": "R1-S2", "S3": "R1-S3"}, 2: {"S1": "R2-S1", "S2": "R2-S2"}}
# Judge scores of 5 (tests/test_pool_credit.py): s = 0.8, 0.2, 0.0 in turn 1; 1.0, 0.0 in turn 2.
SCORES = {1: {"S1": 4, "S2": 1, "S3": 0}, 2: {"S1": 5, "S2": 0}}
# F_t(S) * 5 for every non-empty coalition.
VALUES = {
    1: {("S1",): 2, ("S2",): 0, ("S3",): 0, ("S1", "S2"): 4, ("S1", "S3"): 2, ("S2", "S3"): 2, ("S1", "S2", "S3"): 4},
    2: {("S1",): 5, ("S2",): 0, ("S1", "S2"): 5},
}


def _judge(score: int) -> str:
    return json.dumps({"analysis": "scripted", "score": score})


def _coalition_pattern(turn: int, members: tuple[str, ...]) -> str:
    ahead = [rf'(?=.*<this_round number="{turn}">)']
    for agent, text in TEXTS[turn].items():
        if agent in members:
            ahead.append(f"(?=.*{re.escape(text)})")
        else:
            ahead.append(rf'(?=.*agent="{agent}"[^>]*>\s*{re.escape(NO_OP)})')
    return "".join(ahead)


def scripted_rules(
    *, garbage_for: tuple[int, str] | None = None, flaky_for: tuple[int, str] | None = None
) -> list[Rule]:
    rules: list[Rule] = []
    for turn, by_agent in SCORES.items():
        for agent, score in by_agent.items():
            pattern = f'<target_turn round="{turn}" agent="{agent}"'
            if (turn, agent) == garbage_for:
                replies = ["no idea", "still no JSON", "score: high"]
            elif (turn, agent) == flaky_for:
                replies = ["I would say four", _judge(score)]
            else:
                replies = [_judge(score)]
            rules.append(Rule(role="judge", pattern=pattern, replies=replies))
    for turn, values in VALUES.items():
        for members, value in values.items():
            rules.append(Rule(role="judge", pattern=_coalition_pattern(turn, members), replies=[_judge(value)]))
    for turn, by_agent in TEXTS.items():
        for agent in by_agent:
            entry = {
                "action": f"Lesson from turn {turn} of {agent}",
                "experience": f"Good practice: factor products before adding ({agent} turn {turn}).",
                "scope": "general",
            }
            rules.append(
                Rule(
                    role="summarizer",
                    pattern=f'<contribution round="{turn}" agent="{agent}"',
                    replies=[json.dumps({"entries": [entry]})],
                )
            )
    return rules


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    return write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])


def scripted(rules: list[Rule]) -> ScriptedModel:
    """A judge and summarizer answering with ``rules``, in process."""
    return ScriptedModel(SimScript(rules=rules), scripted_settings())


async def build(run_dirs: list[Path], pool: Path, config: BuildConfig, model: ScriptedModel) -> BuildSummary:
    """``build_pool`` on ``model``."""
    return await build_pool(run_dirs, pool, model.settings, config, model=model)


def credits(pool: Path) -> dict[tuple[int, str], dict[str, object]]:
    lines = (build_dir_for(pool) / CREDITS_FILE).read_text().splitlines()
    return {(row["turn"], row["agent"]): row for row in map(json.loads, lines)}


async def test_difference_build_matches_hand_values_and_search_reads_it(tmp_path: Path, run_dir: Path) -> None:
    beta = 15 * math.log(2)
    model = scripted(scripted_rules())
    config = BuildConfig(scheme="difference", lam=0.5, gamma=0.5, beta=beta, grade_mode="rules")
    pool_path = tmp_path / "pool"
    summary = await build([run_dir], pool_path, config, model)
    assert (summary.cases, summary.turns, summary.kept, summary.added) == (1, 5, 2, 2)
    c = credits(pool_path)
    # Eq. 17 + 16 + 12 worked by hand in tests/test_pool_credit.py.
    assert c[(1, "S1")]["q"] == pytest.approx(0.4) and c[(1, "S3")]["q"] == pytest.approx(0.0)
    assert c[(1, "S1")]["r"] == pytest.approx(0.4 + 16 / 129)
    assert c[(1, "S2")]["r"] == pytest.approx(0.1 + 16 / 129)
    assert c[(2, "S1")]["r"] == pytest.approx(0.5 + 0.5 * 32768 / 32769)
    assert c[(1, "S1")]["G"] == 1.0 and c[(1, "S1")]["w"] == pytest.approx(0.5)
    assert [k for k, row in c.items() if row["kept"]] == [(1, "S1"), (2, "S1")]

    judge_bodies = [call.body for call in model.calls_of("judge")]
    # 5 turn scores + turn 1: F(123), F(23), F(13), F(12) + turn 2: F(12), F(2), F(1) (F of nobody is 0).
    assert len(judge_bodies) == 12
    assert {b["temperature"] for b in judge_bodies} == {0.7} and {b["max_tokens"] for b in judge_bodies} == {256}
    # S2's turn-1 review of S1 is part of S2's turn.
    s2 = next(b for b in judge_bodies if '<target_turn round="1" agent="S2"' in b["messages"][-1]["content"])
    assert "R1-S2-review" in s2["messages"][-1]["content"] and "[review of S1]" in s2["messages"][-1]["content"]
    assert len(model.calls_of("summarizer")) == 2

    pool = Pool.open(pool_path)
    assert {(e.source_round, e.source_agent) for e in pool.entries} == {(1, "S1"), (2, "S1")}
    entry = next(e for e in pool.entries if e.source_round == 2)
    assert entry.reward == pytest.approx(0.5 + 0.5 * 32768 / 32769)
    assert entry.tags == ["difference"] and entry.specialty == "algebra" and entry.source_problem == "p1"
    assert entry.source_question == question_hash("What is 6*7?")
    hits = await pool.search("factor products before adding (S1 turn 2)", 1, EndpointEmbedder(model))
    assert hits[0][0].id == entry.id

    # A rebuild replays every call from the build store and adds nothing twice.
    chat_before = len(model.calls)
    again = await build([run_dir], pool_path, config, model)
    assert len(model.calls) == chat_before
    assert (again.added, again.already_in_pool) == (0, 2)
    assert len(Pool.open(pool_path)) == 2
    # Nothing new: no new version (every entry would age by one for the prune's recency rule).
    assert again.version == Pool.open(pool_path).meta.version == 1


async def test_shapley_build_uses_every_coalition(tmp_path: Path, run_dir: Path) -> None:
    model = scripted(scripted_rules())
    config = BuildConfig(
        scheme="shapley", lam=0.5, gamma=0.5, beta=15 * math.log(2), permutations=6, grade_mode="rules", tau=0.6
    )
    summary = await build([run_dir], tmp_path / "pool", config, model)
    c = credits(tmp_path / "pool")
    assert c[(1, "S1")]["q"] == pytest.approx(7 / 15)
    assert c[(1, "S2")]["q"] == pytest.approx(4 / 15)
    assert c[(1, "S1")]["r"] == pytest.approx(0.4 + 32 / 146)
    # Eq. 13 with tau = 0.6: r(1, S1) = 0.619 and r(2, S1) = 1.0 pass.
    assert summary.kept == 2
    # 5 turn scores + 7 non-empty coalitions of turn 1 + 3 of turn 2.
    assert len(model.calls_of("judge")) == 15


async def test_unparseable_judge_is_retried_then_defaulted_and_recorded(tmp_path: Path, run_dir: Path) -> None:
    model = scripted(scripted_rules(garbage_for=(1, "S3"), flaky_for=(1, "S2")))
    config = BuildConfig(scheme="naive", lam=0.5, gamma=0.5, grade_mode="rules", retries=2)
    summary = await build([run_dir], tmp_path / "pool", config, model)
    c = credits(tmp_path / "pool")
    # S2: the first reply is no JSON, the retry parses (s = 0.2): the naive r of the hand-worked example.
    assert c[(1, "S2")]["r"] == pytest.approx(0.15) and c[(1, "S2")]["judge_defaulted"] is None
    # S3: three unusable replies (1 + 2 retries), then the default 0, recorded.
    assert c[(1, "S3")]["s"] == 0.0
    assert "3 judge replies unusable" in str(c[(1, "S3")]["judge_defaulted"])
    assert summary.defaulted_scores == 1 and any("turn 1 of S3" in n for n in summary.notes)
    target = '<target_turn round="1" agent="S3"'
    s3 = [call for call in model.calls_of("judge") if target in call.messages[-1].content]
    assert len(s3) == 3
    assert c[(1, "S1")]["r"] == pytest.approx(0.6) and c[(2, "S1")]["r"] == pytest.approx(1.0)


async def test_wrong_team_and_unlabelled_problems(tmp_path: Path) -> None:
    wrong = Problem(problem_id="p1", question="What is 6*7?", answer="43")
    unlabelled = Problem(problem_id="p2", question="What is 6*7?")
    run = write_run(
        tmp_path / "run",
        [(wrong, hand_worked_transcript("p1"), "42"), (unlabelled, hand_worked_transcript("p2"), "42")],
    )
    config = BuildConfig(lam=0.5, gamma=0.5, grade_mode="rules")
    summary = await build([run], tmp_path / "pool", config, scripted(scripted_rules()))
    assert summary.cases == 1 and any("p2: no gold answer" in n for n in summary.notes)
    c = credits(tmp_path / "pool")
    # G = 0: r = lambda s only.
    assert c[(1, "S1")]["G"] == 0.0 and c[(1, "S1")]["r"] == pytest.approx(0.4)


async def test_runs_with_no_labelled_mattrl_problem_are_refused_before_any_call_and_make_no_pool(
    tmp_path: Path,
) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    single = write_run(tmp_path / "cot", [(problem, None, "42")], method="cot")
    unlabelled = write_run(
        tmp_path / "mattrl", [(Problem(problem_id="p2", question="What is 6*7?"), hand_worked_transcript("p2"), "42")]
    )
    model = scripted(scripted_rules())
    said = "no finished MATTRL problem with a gold answer; a pool is built from MATTRL runs on labelled problems"
    # Before, each build saved an empty pool (version 0) and a MATTRL run on it retrieved no hint.
    for runs in ([single], [single, unlabelled]):
        with pytest.raises(InputError) as err:
            estimate_build(runs, tmp_path / "pool", model.settings, BuildConfig(grade_mode="rules"))
        assert str(err.value) == f"{', '.join(map(str, runs))}: {said}"
        with pytest.raises(InputError) as err:
            await build(runs, tmp_path / "pool", BuildConfig(grade_mode="rules"), model)
        assert str(err.value) == f"{', '.join(map(str, runs))}: {said}"
    assert model.calls == [] and not (tmp_path / "pool").exists()


@pytest.mark.slow
async def test_medicine_outcome_is_the_reciprocal_rank_of_the_gold_diagnosis(tmp_path: Path) -> None:
    record = "Patient record: angiokeratomas, acroparesthesia."
    problem = Problem(problem_id="m1", question=record, answer="Fabry disease")
    update = {"domain": "medicine", "final_answer": "Gaucher disease"}
    transcript = hand_worked_transcript("m1").model_copy(update=update)
    decision = {"top10": ["Gaucher disease", "fabry  disease", "Pompe disease"]}
    run = write_run(tmp_path / "run", [(problem, transcript, "Gaucher disease")], last_state={"decision": decision})
    rules = [
        Rule(role="judge", replies=[_judge(5)]),
        Rule(role="summarizer", replies=[json.dumps({"entries": [{"action": "a", "experience": "b"}]})]),
    ]
    model = scripted(rules)
    await build([run], tmp_path / "pool", BuildConfig(lam=0.5, gamma=0.5, grade_mode="rules"), model)
    prompts = [call.messages[-1].content for call in model.calls]
    c = credits(tmp_path / "pool")
    # Gold at rank 2 (spelling-insensitive): G = 1/2. Turn 2, S1 and S2 both scored 1.0: c = 0.5 each (Eq. 11),
    # r = 0.5 * 1 + 0.5 * 0.5 * 1 * 0.5 = 0.625.
    assert c[(1, "S1")]["G"] == pytest.approx(0.5)
    assert c[(2, "S1")]["r"] == pytest.approx(0.625)
    assert all("diagnostic case" in p and "math problem" not in p for p in prompts)
    assert any("partly correct (outcome score 0.50 of 1)" in p for p in prompts)
    # Each turn is judged against the team's ranked list that G is read from, not its first name alone.
    scored = [p for p in prompts if "<target_turn" in p]
    final = "<team_final_answer>\n[1] Gaucher disease\n[2] fabry  disease\n[3] Pompe disease\n</team_final_answer>"
    assert scored and all(final in p for p in scored)


async def test_a_build_cut_off_by_an_unreachable_endpoint_resumes_from_its_store(tmp_path: Path, run_dir: Path) -> None:
    config = BuildConfig(scheme="difference", lam=0.5, gamma=0.5, grade_mode="rules")
    # The summarizer's endpoint cannot be reached: the build stops at its first call.
    broken = GoneModel(SimScript(rules=scripted_rules()), scripted_settings(), gone_roles=frozenset({"summarizer"}))
    with pytest.raises(EndpointUnreachable):
        await build([run_dir], tmp_path / "pool", config, broken)
    assert len(broken.calls_of("judge")) == len(broken.calls) == 12 and not (tmp_path / "pool").exists()
    model = scripted(scripted_rules())
    summary = await build([run_dir], tmp_path / "pool", config, model)
    # The judge's 12 calls are replayed from POOL.build/, only the summarizer's are asked.
    assert by_role(model) == {"summarizer": 2}
    assert summary.added == 2


@pytest.mark.slow
async def test_a_synonym_diagnosis_is_matched_by_the_judge_and_credited(tmp_path: Path) -> None:
    problem = Problem(problem_id="m1", question="Patient record: angiokeratomas.", answer="Fabry disease")
    transcript = hand_worked_transcript("m1").model_copy(update={"domain": "medicine"})
    decision = {"top10": ["Alpha-galactosidase A deficiency", "Gaucher disease"]}
    run = write_run(tmp_path / "run", [(problem, transcript, decision["top10"][0])], last_state={"decision": decision})
    verdict = "<think>Alpha-galactosidase A deficiency is Fabry disease by its enzyme.</think><answer>1</answer>"
    rules = [
        Rule(role="judge", pattern="<reference>", replies=[verdict]),
        Rule(role="judge", replies=[_judge(5)]),
        Rule(role="summarizer", replies=[json.dumps({"entries": [{"action": "a", "experience": "b"}]})]),
    ]
    model = scripted(rules)
    config = BuildConfig(lam=0.5, gamma=0.5, grade_mode="rules")
    await build([run], tmp_path / "pool", config, model)
    asked = [call.messages[-1].content for call in model.calls_of("judge")]
    matcher = [a for a in asked if "<reference>" in a]
    # Spelling finds no match, so the judge is asked once, with the differential and the reference.
    assert len(matcher) == 1
    assert "[1] Alpha-galactosidase A deficiency" in matcher[0] and "<reference>\nFabry disease\n" in matcher[0]
    c = credits(tmp_path / "pool")
    # G = 1/1 = 1. Every judge score is 5 (s = 1). Turn 2 (S1, S2): c = 1/2 (Eq. 11), w = 1:
    # r = 0.5 * 1 + 0.5 * 1 * 1 * 0.5 = 0.75. Turn 1 (S1, S2, S3): c = 1/3, w = 0.5^(2-1) = 0.5:
    # r = 0.5 + 0.5 * 1 * 0.5 / 3 = 7/12. By spelling alone G would be 0 and every r = 0.5.
    assert c[(2, "S1")]["G"] == 1.0
    assert c[(2, "S1")]["r"] == pytest.approx(0.75)
    assert c[(1, "S3")]["r"] == pytest.approx(7 / 12)
    # The verdict is stored in the run itself: another build replays it, with no new matcher call.
    await build([run], tmp_path / "pool2", config, model)
    assert len([call for call in model.calls_of("judge") if "<reference>" in str(call.body)]) == 1
    assert credits(tmp_path / "pool2")[(2, "S1")]["G"] == 1.0
    # Spelling only (--match spelling): the synonym is missed and G = 0.
    spelled = BuildConfig(lam=0.5, gamma=0.5, grade_mode="rules", match="spelling")
    await build([run], tmp_path / "pool3", spelled, model)
    assert credits(tmp_path / "pool3")[(2, "S1")]["r"] == pytest.approx(0.5)


def test_a_pool_needs_a_directory_of_its_own() -> None:
    with pytest.raises(InputError, match="give the pool a directory of its own"):
        build_dir_for(Path("/"))
    assert build_dir_for(Path("pools/math")).name == "math.build"


async def test_a_bad_pool_target_is_said_before_any_call(tmp_path: Path, run_dir: Path) -> None:
    model = ScriptedModel(SimScript(), scripted_settings())
    taken = tmp_path / "taken"
    taken.write_text("", encoding="utf-8")
    with pytest.raises(InputError, match="a file, not a pool directory"):
        await build([run_dir], taken, BuildConfig(), model)
    # A run given twice would count its cases twice over.
    with pytest.raises(InputError, match="run directory given twice"):
        await build([run_dir, run_dir.parent / "." / run_dir.name], tmp_path / "pool", BuildConfig(), model)
    assert model.calls == [] and not (tmp_path / "pool.build").exists()


async def test_a_pool_folder_that_is_a_run_directory_is_refused_before_any_call(tmp_path: Path, run_dir: Path) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    other = write_run(tmp_path / "other", [(problem, hand_worked_transcript(), "42")])
    model = scripted(scripted_rules())
    # Before, either build sent its calls and wrote entries.jsonl, vectors.f32 and meta.json among the run's files.
    for target, said in (
        (run_dir.parent / "." / run_dir.name, "one of the runs the build reads"),
        (other, "a run directory (it holds run.sqlite)"),
    ):
        with pytest.raises(InputError, match=re.escape(f"-o {target}: {said}; give the pool a directory of its own")):
            await build([run_dir], target, BuildConfig(grade_mode="rules"), model)
        assert sorted(p.name for p in target.iterdir()) == ["run.sqlite"]
        assert not target.with_name(target.name + ".build").exists()
    assert model.calls == []


async def test_a_specialist_that_did_not_speak_is_neither_judged_nor_credited(tmp_path: Path) -> None:
    # Round 1 (turn 2): S3's opinion call failed, so the method recorded an empty opinion with no answer (as it does
    # for an echoed or broken reply). In round 0 (turn 1) S3's opinion failed too, but it still reviewed S1.
    transcript = hand_worked_transcript()
    utterances = [u for u in transcript.utterances if not (u.agent == "S3" and u.round == 0)]
    utterances[3:3] = [
        Utterance(round=0, agent="S3", kind="opinion", text="", answer=None),
        Utterance(round=0, agent="S3", kind="review", target="S1", text="R1-S3-review check 6*7"),
    ]
    utterances.insert(-1, Utterance(round=1, agent="S3", kind="opinion", text="", answer=None))
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, transcript.model_copy(update={"utterances": utterances}), "42")])
    # A judge that would score an empty turn highly: crediting it would take turn 2's share from S1.
    rules = [Rule(role="judge", pattern='<target_turn round="2" agent="S3"', replies=[_judge(5)])]
    model = scripted(rules + scripted_rules())
    summary = await build([run], tmp_path / "pool", BuildConfig(lam=0.5, gamma=0.5, grade_mode="rules"), model)
    judged = [call.messages[-1].content for call in model.calls_of("judge")]
    assert not any('<target_turn round="2" agent="S3"' in b for b in judged)
    # S3's turn 1 is its review alone.
    [s3] = [b for b in judged if '<target_turn round="1" agent="S3"' in b]
    target = s3.split('<target_turn round="1" agent="S3"', 1)[1]
    assert target.split(">", 1)[1].lstrip().startswith("[review of S1]\nR1-S3-review check 6*7")
    c = credits(tmp_path / "pool")
    assert sorted(c) == [(1, "S1"), (1, "S2"), (1, "S3"), (2, "S1"), (2, "S2")] and summary.turns == 5
    # Eq. 11 over the turn's speakers only: s = 1.0 and 0.0, c(S1) = 1 / (1 + 1e-8); w_2 = 1, G = 1:
    # r = 0.5 * 1 + 0.5 * 1 * 1 * c = 1.0.
    assert c[(2, "S1")]["c"] == pytest.approx(1.0) and c[(2, "S1")]["r"] == pytest.approx(1.0)
    pool = Pool.open(tmp_path / "pool")
    assert (2, "S3") not in {(e.source_round, e.source_agent) for e in pool.entries}


async def test_a_pool_of_another_embedding_model_is_said_before_the_judges_first_call(
    tmp_path: Path, run_dir: Path
) -> None:
    # The pool was made by an endpoint embedder of another model; this build's embedding role asks sim-model.
    Pool.create(tmp_path / "pool", "endpoint:other-embedder")
    model = scripted(scripted_rules())
    refused = "embedding model 'endpoint:other-embedder', but the embedding role now gets 'endpoint:sim-model'"
    with pytest.raises(PoolError, match=refused):
        await build([run_dir], tmp_path / "pool", BuildConfig(grade_mode="rules"), model)
    assert model.calls == []


async def test_a_second_build_of_a_pool_while_one_runs_is_refused_before_its_calls(
    tmp_path: Path, run_dir: Path
) -> None:
    # Another process building the same pool holds its build store (its lock is taken here as that process would).
    build_dir = build_dir_for(tmp_path / "pool")
    build_dir.mkdir()
    model = scripted(scripted_rules())
    held = f"tmas pool build (pid {os.getpid()}) is writing this pool; wait for it to end or stop it"
    with RunLock(build_dir, doing="tmas pool build"), pytest.raises(InputError, match=re.escape(held)):
        await build([run_dir], tmp_path / "pool", BuildConfig(grade_mode="rules"), model)
    assert model.calls == [] and not (tmp_path / "pool").exists()
    # Once it has ended, the build runs.
    assert (await build([run_dir], tmp_path / "pool", BuildConfig(grade_mode="rules"), model)).added > 0


@dataclass
class _BuildingJudge(ScriptedModel):
    """A prune's grading judge whose first call waits for ``during`` (a build of the same pool) to end: the two
    interleaved as two processes would, the build between the prune's reading of the pool and its save."""

    during: Callable[[], Awaitable[BuildSummary]] | None = None
    outcome: BuildSummary | InputError | None = None

    async def chat(self, role: str, messages: Sequence[Message], **kwargs: Any) -> Completion:
        during, self.during = self.during, None
        if during is not None:
            try:
                self.outcome = await during()
            except InputError as exc:
                self.outcome = exc
        return await super().chat(role, messages, **kwargs)


async def test_a_build_while_a_prune_of_its_pool_runs_is_refused_so_neither_loses_the_others_save(
    tmp_path: Path,
) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    first = write_run(tmp_path / "first", [(problem, hand_worked_transcript(), "42")])
    second = write_run(tmp_path / "second", [(problem, hand_worked_transcript(), "42")])
    pool_path = tmp_path / "pool"
    assert (await build([first], pool_path, BuildConfig(grade_mode="rules"), scripted(scripted_rules()))).added == 2
    judge = _BuildingJudge(
        SimScript(rules=[Rule(role="judge", replies=['{"reasoning": "r", "equivalent": true}'])]),
        during=lambda: build([second], pool_path, BuildConfig(grade_mode="rules"), scripted(scripted_rules())),
    )
    # The prune merges the first build's two entries (every pair is similar enough at this cosine) and saves.
    config = PruneConfig(grade_mode="judge", duplicate_cosine=0.0001)
    # A run that retrieved from the pool: its grading's judge call is where the build starts.
    used = hand_worked_transcript().model_copy(update={"pool": str(pool_path.resolve())})
    pruned = await prune_pool(
        pool_path, [write_run(tmp_path / "used", [(problem, used, "42")])], None, config, model=judge
    )
    # Before, the build ran, reported its 2 entries added as version 2, and the prune's save of version 2 (the pool
    # as it had read it, less one) left the pool without them.
    assert isinstance(judge.outcome, InputError)
    assert f"{pool_path}: tmas pool prune (pid {os.getpid()}) is writing this pool" in str(judge.outcome)
    assert (pruned.before, pruned.after, pruned.version) == (2, 1, 2)
    pool = Pool.open(pool_path)
    assert pool.meta.version == 2 and len(pool) == 1
    # The prune ended: the build runs and its entries stay.
    added = await build([second], pool_path, BuildConfig(grade_mode="rules"), scripted(scripted_rules()))
    assert (added.added, added.version) == (2, 3) and len(Pool.open(pool_path)) == 3


async def test_a_build_from_runs_already_read_does_not_bring_back_what_a_prune_removed(tmp_path: Path) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    first = write_run(tmp_path / "first", [(problem, hand_worked_transcript(), "42")])
    second = write_run(tmp_path / "second", [(problem, hand_worked_transcript(), "42")])
    pool_path = tmp_path / "pool"
    assert (await build([first], pool_path, BuildConfig(grade_mode="rules"), scripted(scripted_rules()))).added == 2
    # The prune merges the two entries (every pair is similar enough at this cosine): one goes.
    pruned = await prune_pool(pool_path, [], None, PruneConfig(duplicate_cosine=0.0001))
    [(keeper, [gone])] = pruned.merged.items()
    assert pruned.after == 1 and Pool.open(pool_path).meta.removed == [gone]
    # The pool extended with a new run, the first read again: the first's summaries are replayed into the same two
    # entries, of which the pruned one is not added again. Before, it came back as a new entry of the new version,
    # so every rebuild undid the prune (an aged-out entry came back young, a wrong-correlated one came back).
    again = await build([first, second], pool_path, BuildConfig(grade_mode="rules"), scripted(scripted_rules()))
    assert (again.added, again.already_in_pool, again.removed_before) == (2, 1, 1)
    assert f"{pool_path}: 1 entries a prune removed are not added again: {gone}" in again.notes
    ids = {e.id for e in Pool.open(pool_path).entries}
    assert len(ids) == 3 and keeper in ids and gone not in ids
