"""The pool build rehearsed offline: a MATTRL run on the simulated server, then ``build_pool`` over HTTP against the
same server with no scripted rule, so the simulator's default judge and summarizer replies are what the build reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import settings_for
from mattrl_runs import hand_worked_transcript, write_run
from test_pool_build import scripted_rules
from tmas.agents.overrides import packaged_source
from tmas.llm.factory import open_model
from tmas.memory.embedders import EndpointEmbedder
from tmas.memory.pool import Pool, PoolError
from tmas.memory.pool_entry import PoolEntry
from tmas.planning.pool_build import estimate_build
from tmas.pool.build import CREDITS_FILE, BuildConfig, build_dir_for, build_pool
from tmas.pool.outcomes import load_transcripts
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.testing import Rule, SimScript, SimServer

# The hand-worked transcript of tests/test_pool_credit.py: 5 specialist turns, which tests/test_pool_build.py scripts.
TURNS = hand_worked_transcript()

PROBLEMS = [
    Problem(problem_id="a", question="What is 17*23?", answer="391"),
    Problem(problem_id="b", question="What is 12*12+5?", answer="149"),
]


async def test_a_pool_built_on_the_simulator_holds_entries_of_the_runs_turns(tmp_path: Path) -> None:
    run = tmp_path / "run"
    pool_path = tmp_path / "pool"
    with SimServer(SimScript()) as sim:
        method = {"name": "mattrl", "params": {"iterations": 1, "team_size": 2}}
        store, settings, todo = prepare_run(
            run, settings_for(sim, method=method), PROBLEMS, resume=False, own_model=True
        )
        with store:
            await run_problems(settings, todo, store)
        run_requests = len(sim.requests)
        # The answer-grading judge grades the run, the turn judge scores it: both on the one "judge" role.
        config = BuildConfig(scheme="difference", grade_mode="judge", quantile=1.0)
        summary = await build_pool([run], pool_path, settings_for(sim), config)
        requests = [r for r in sim.requests[run_requests:] if r.endpoint == "chat"]

    notes: list[str] = []
    cases = await load_transcripts([run], settings_for(sim), grade_mode="rules", notes=notes)
    turns = {(c.problem.problem_id, t.turn, t.agent): t for c in cases for t in c.turns()}
    assert len(turns) == 4 and {t.specialty for t in turns.values()} == {"Arithmetic strategist", "Computation checker"}

    assert summary.defaulted_scores == 0 and summary.summarizer_echoes == 0, summary.notes
    assert (summary.cases, summary.turns, summary.kept) == (2, 4, 4)
    pool = Pool.open(pool_path)
    assert len(pool.entries) == summary.added == 8
    for entry in pool.entries:
        turn = turns[(entry.source_problem, entry.source_round, entry.source_agent)]
        assert entry.specialty == turn.specialty and entry.action.startswith(f"{turn.specialty}: ")
        assert entry.experience.startswith("Good practice: ")
    case_entries = sorted((e.source_problem, e.experience) for e in pool.entries if e.scope == "case")
    assert [text for _, text in case_entries] == [
        "Good practice: 17*23 was answered 391; the reference answer is 391.",
        "Good practice: 17*23 was answered 391; the reference answer is 391.",
        "Good practice: 12*12+5 was answered 149; the reference answer is 149.",
        "Good practice: 12*12+5 was answered 149; the reference answer is 149.",
    ]

    judge = [r.body["messages"][-1]["content"] for r in requests if r.role == "judge"]
    grading = [p for p in judge if "<student>" in p]
    scoring = [p for p in judge if "<target_turn " in p]
    rounds = [p for p in judge if "<this_round " in p]
    # One grading per problem, one score per turn, and per case F(both) and F of each specialist alone (Eq. 17).
    assert (len(grading), len(scoring), len(rounds), len(judge)) == (2, 4, 6, 12)
    assert sorted(
        (p.split("<problem>\n", 1)[1].split("\n", 1)[0], p.split('agent="', 1)[1].split('"', 1)[0]) for p in scoring
    ) == [("What is 12*12+5?", "S1"), ("What is 12*12+5?", "S2"), ("What is 17*23?", "S1"), ("What is 17*23?", "S2")]
    summarizer = [r.body["messages"][-1]["content"] for r in requests if r.role == "summarizer"]
    assert len(summarizer) == summary.summarizer_calls == 4
    # Each summarizer prompt shows the whole kept turn it distils, and every turn is distilled once.
    keys = _contribution_keys(summarizer)
    assert sorted(keys) == sorted((problem, agent) for problem, _, agent in turns)
    assert all(turns[(problem, 1, agent)].text in p for p, (problem, agent) in zip(summarizer, keys, strict=True))

    # Hand-worked from the replies: every turn is the first to reach the reference answer (score 4, s = 0.8); a
    # round's value is 5 with both specialists and 3 (2.5, halves up) with one silent, so q = 1.0 - 0.6 for each
    # and Eq. 16 shares the credit equally.
    credits = [json.loads(line) for line in (build_dir_for(pool_path) / CREDITS_FILE).read_text().splitlines()]
    assert {(c["G"], c["s"], round(c["q"], 9), c["c"]) for c in credits} == {(1.0, 0.8, 0.4, 0.5)}
    assert {c["judge_analysis"].split(" reached", 1)[1] for c in credits} == {
        " the reference answer 391 first.",
        " the reference answer 149 first.",
    }


def _contribution_keys(prompts: list[str]) -> list[tuple[str, str]]:
    """(problem id, agent) of each summarizer prompt, read from its problem and contribution sections."""
    ids = {p.question: p.problem_id for p in PROBLEMS}
    return [
        (ids[p.split("<problem>\n", 1)[1].split("\n", 1)[0]], p.split('<contribution round="1" agent="', 1)[1][:2])
        for p in prompts
    ]


async def test_the_summary_counts_the_calls_sent_and_those_replayed_from_the_build_store_apart(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [(Problem(problem_id="p1", question="What is 6*7?", answer="42"), TURNS, "42")])
    pool_path = tmp_path / "pool"
    sent: list[dict[str, int]] = []
    summaries = []
    with SimServer(SimScript(rules=scripted_rules())) as sim:
        # The difference scheme's 12 judge calls (5 turn scores, 7 coalitions) and a summary of each kept turn: the
        # top quarter (2 of 5) first, then every turn, whose first 2 summaries the store holds.
        for quantile in (0.25, 1.0, 1.0):
            before = len(sim.requests)
            config = BuildConfig(scheme="difference", grade_mode="rules", quantile=quantile)
            summaries.append(await build_pool([run], pool_path, settings_for(sim), config))
            roles = [r.role for r in sim.requests[before:] if r.endpoint == "chat"]
            sent.append({role: roles.count(role) for role in ("judge", "summarizer")})
    figures = [
        (s.judge_calls, s.judge_replayed_calls, s.summarizer_calls, s.summarizer_replayed_calls) for s in summaries
    ]
    # Before, each build said 12 judge calls and as many summarizer calls as it distilled, sent or not.
    assert figures == [(12, 0, 2, 0), (0, 12, 3, 2), (0, 12, 0, 5)]
    assert sent == [{"judge": 12, "summarizer": 2}, {"judge": 0, "summarizer": 3}, {"judge": 0, "summarizer": 0}]
    assert [s.added for s in summaries] == [2, 3, 0]


async def test_a_retry_after_an_unreadable_reply_goes_out_under_another_seed_and_is_replayed_as_itself(
    tmp_path: Path,
) -> None:
    run = write_run(tmp_path / "run", [(Problem(problem_id="p1", question="What is 6*7?", answer="42"), TURNS, "42")])
    pool_path = tmp_path / "pool"
    # The first summary and S1's first score of turn 1 are unreadable; asked again, each gets a usable reply.
    rules = [Rule(role="summarizer", replies=["no entries here"], times=1), *scripted_rules(flaky_for=(1, "S1"))]
    summaries = []
    sent = []
    with SimServer(SimScript(rules=rules)) as sim:
        settings = settings_for(sim, sampling__seed=5)
        for _ in range(2):
            before = len(sim.requests)
            config = BuildConfig(scheme="difference", grade_mode="rules", quantile=0.25)
            summaries.append(await build_pool([run], pool_path, settings, config))
            sent.append([r for r in sim.requests[before:] if r.endpoint == "chat"])
    first, again = sent
    asked: dict[str, list[int]] = {}
    for request in first:
        asked.setdefault(json.dumps(request.body["messages"]), []).append(request.body["seed"])
    # The unreadable summary and score are asked again, each under a seed of its own: the configured one would draw
    # the same reply from a server that honours it. Every other call sends the configured seed as it is.
    retried = [seeds for seeds in asked.values() if len(seeds) > 1]
    assert len(retried) == 2 and all(seeds[0] == 5 and seeds[1] != 5 and len(seeds) == 2 for seeds in retried)
    assert all(seeds == [5] for seeds in asked.values() if len(seeds) == 1)
    assert [r.role for r in first].count("summarizer") == 3
    # Rebuilt on the build store: nothing is sent, and each retry is answered by its own stored reply, not the
    # unreadable first one.
    assert again == []
    assert [(s.defaulted_scores, s.added) for s in summaries] == [(0, 2), (0, 0)]
    assert summaries[1].summarizer_replayed_calls == 3 and summaries[1].judge_replayed_calls == 13
    assert not [n for n in summaries[1].notes if "no usable summary" in n or "unusable" in n]


async def test_the_judge_and_summarizer_prompts_come_from_the_users_templates(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [(Problem(problem_id="p1", question="What is 6*7?", answer="42"), TURNS, "42")])
    pool_path = tmp_path / "pool"
    mine = tmp_path / "mine"
    mine.mkdir()
    names = ("mattrl_utterance_judge.j2", "mattrl_turn_value.j2", "mattrl_summarizer.j2")
    for name in names:
        (mine / name).write_text(packaged_source(name) + f"\nFROM-MY-TEMPLATE {name}\n", encoding="utf-8")
    config = BuildConfig(scheme="difference", grade_mode="rules")
    with SimServer(SimScript(rules=scripted_rules())) as sim:
        settings = settings_for(sim, prompts_dir=str(mine))
        summary = await build_pool([run], pool_path, settings, config)
        prompts = [r.body["messages"][-1]["content"] for r in sim.requests if r.endpoint == "chat"]
        stored = estimate_build([run], pool_path, settings, config).stored_calls
        # An edited template asks other calls: the build's store no longer counts as answering them.
        (mine / names[2]).write_text(packaged_source(names[2]) + "\nEDITED\n", encoding="utf-8")
        edited = estimate_build([run], pool_path, settings, config).stored_calls
    # Before, the folder was read by nothing: every prompt was the packaged template's. Now each of the 5 turn
    # scores, 7 coalition values (Eq. 17) and 2 summaries ends with its own template's last line.
    ends = [p.splitlines()[-1] for p in prompts]
    assert {end: ends.count(end) for end in ends} == {
        f"FROM-MY-TEMPLATE {names[0]}": 5,
        f"FROM-MY-TEMPLATE {names[1]}": 7,
        f"FROM-MY-TEMPLATE {names[2]}": 2,
    }
    assert (summary.judge_calls, summary.summarizer_calls, summary.added) == (12, 2, 2)
    assert (stored, edited) == (14, 0)


async def test_a_pool_another_embedding_model_made_is_refused_before_the_judges_first_call_when_no_model_is_named(
    tmp_path: Path,
) -> None:
    run = write_run(tmp_path / "run", [(Problem(problem_id="p1", question="What is 6*7?", answer="42"), TURNS, "42")])
    pool_path = tmp_path / "pool"
    with SimServer(SimScript(model="embed-a")) as first:
        async with open_model(settings_for(first, endpoint__model=None)) as llm:
            embed = EndpointEmbedder(llm)
            pool = Pool.create(pool_path, embed.name)
            await pool.add([PoolEntry(id="e0", action="Split a factor", experience="6*7 is 6*5 + 6*2.")], embed)
            pool.save()
    assert Pool.open(pool_path).meta.embedder == "endpoint:embed-a"
    # The endpoint names no model: only a reply says which one serves the embeddings. Before, the build sent its
    # 12 judge calls and 2 summaries, and learned the model from the embedding of its new entries, at the end.
    config = BuildConfig(scheme="difference", grade_mode="rules")
    with SimServer(SimScript(model="embed-b", rules=scripted_rules())) as second:
        with pytest.raises(PoolError) as refused:
            await build_pool([run], pool_path, settings_for(second, endpoint__model=None), config)
        sent = [r.endpoint for r in second.requests]
    assert str(refused.value) == (
        f"{pool_path}: pool built with embedding model 'endpoint:embed-a', "
        "but the embedding role now gets 'endpoint:embed-b'"
    )
    assert sent == ["embeddings"]
    assert [e.id for e in Pool.open(pool_path).entries] == ["e0"]
    # The same server's model is the pool's: the build runs, its one check an embedding request of its own.
    with SimServer(SimScript(model="embed-a", rules=scripted_rules())) as same:
        summary = await build_pool([run], pool_path, settings_for(same, endpoint__model=None), config)
        roles = [r.role for r in same.requests if r.endpoint == "chat"]
    assert (summary.judge_calls, summary.summarizer_calls, summary.added) == (12, 2, 2)
    assert len(roles) == 14
    assert Pool.open(pool_path).meta.embedder == "endpoint:embed-a"
