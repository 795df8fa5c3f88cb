"""``prune_pool``: a near-duplicate merged, an entry aged out, an entry whose retrieval correlates with wrong
answers removed; the thresholds as documented in tmas.pool.lifecycle. Embeddings from the simulated server."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import scripted_settings
from mattrl_runs import write_run
from tmas.errors import InputError
from tmas.memory.embedders import EndpointEmbedder
from tmas.memory.pool import Pool, PoolError
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import TeamMember, Transcript, Utterance
from tmas.pool.lifecycle import (
    EntryUsage,
    PruneConfig,
    duplicate_groups,
    prune_pool,
    recency_weight,
    wrong_correlated,
)
from tmas.problems import Problem
from tmas.store.run_lock import RunLock
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript


def entry(id_: str, action: str, experience: str, reward: float = 0.5) -> PoolEntry:
    return PoolEntry(id=id_, action=action, experience=experience, reward=reward)


def used(problem_id: str, ids: list[str], pool: Path) -> Transcript:
    """A problem's transcript whose one opinion was given the entries ``ids`` of the pool at ``pool``."""
    return Transcript(
        problem_id=problem_id,
        pool=str(pool.resolve()),
        team=[TeamMember(id="S1", specialty="algebra", leader=True)],
        utterances=[Utterance(round=0, agent="S1", kind="opinion", text="attempt", experience_ids=ids)],
        final_answer="1",
    )


async def make_pool(path: Path, model: ScriptedModel) -> None:
    """The pool the tests prune, embedded by ``model`` (the simulator's embeddings, in process)."""
    embed = EndpointEmbedder(model)
    pool = Pool.create(path, embed.name)
    await pool.add(
        [
            entry("keep", "Check small cases", "Good practice: try n = 1, 2, 3 before a general argument.", 0.9),
            entry("dup", "Check small cases", "Good practice: try n = 1, 2, 3 before a general argument!", 0.4),
            entry("wrong", "Guess from the pattern", "Pitfall: extrapolate the first two terms."),
            entry("old", "Draw the figure", "Good practice: sketch the triangle and mark the given angles."),
            entry("fine", "Verify the final answer", "Good practice: substitute the result back into the equation."),
        ],
        embed,
    )
    pool.save()
    # The "old" entry dates from version 1; the pool is now at version 12: weight 0.8^11 = 0.086 < 0.1.
    pool.meta.version = 11
    pool.save()
    assert pool.meta.version == 12
    pool.update([e.model_copy(update={"added_version": 12}) for e in pool.entries if e.id != "old"])
    pool.save()


async def test_prune_merges_ages_out_and_drops_wrong_correlated(tmp_path: Path) -> None:
    pool_path = tmp_path / "pool"
    model = ScriptedModel(SimScript(), scripted_settings())
    await make_pool(pool_path, model)
    # Six graded problems: p1-p3 wrong and all retrieved "wrong"; p4-p6 right and retrieved "fine"; p1 also "fine".
    # Base wrong rate 3/6 = 0.5. "wrong": 3 uses, 3 wrong: 1.0 >= 0.5 + 0.3 -> removed.
    # "fine": 4 uses, 1 wrong: 0.25 -> kept.
    cases = []
    for i in range(1, 7):
        ids = ["wrong"] if i <= 3 else ["fine"]
        if i == 1:
            ids.append("fine")
        problem = Problem(problem_id=f"p{i}", question=f"Question {i}?", answer="1")
        cases.append((problem, used(f"p{i}", ids, pool_path), "2" if i <= 3 else "1"))
    run = write_run(tmp_path / "run", cases)

    summary = await prune_pool(pool_path, [run], model.settings, PruneConfig(grade_mode="rules"), model=model)
    assert summary.base_wrong_rate == pytest.approx(0.5)
    assert summary.wrong == ["wrong"]
    assert summary.merged == {"keep": ["dup"]}
    assert summary.stale == ["old"]
    assert (summary.before, summary.after) == (5, 2)
    pool = Pool.open(pool_path)
    assert sorted(e.id for e in pool.entries) == ["fine", "keep"]
    assert pool.meta.version == 14
    fine = pool.get("fine")
    assert fine is not None and (fine.retrieved, fine.retrieved_wrong) == (4, 1)
    # The pool still answers searches after the removals.
    hits = await pool.search("substitute the result back", 1, EndpointEmbedder(model))
    assert hits[0][0].id == "fine"


async def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    pool_path = tmp_path / "pool"
    await make_pool(pool_path, ScriptedModel(SimScript(), scripted_settings()))
    summary = await prune_pool(pool_path, [], None, PruneConfig(dry_run=True))
    assert summary.merged == {"keep": ["dup"]} and summary.stale == ["old"] and summary.wrong == []
    assert len(Pool.open(pool_path)) == 5


def test_rules_by_hand() -> None:
    e = PoolEntry(id="x", action="a", experience="b", added_version=3)
    assert recency_weight(e, 5, 0.8) == pytest.approx(0.64)  # 0.8^(5-3)
    assert recency_weight(e, 3, 0.8) == 1.0
    usage = {"a": EntryUsage(uses=2, wrong=2), "b": EntryUsage(uses=4, wrong=3), "c": EntryUsage(uses=4, wrong=2)}
    # base 0.4, margin 0.3: needs >= 3 uses and a wrong rate >= 0.7: "b" (0.75) only; "a" has too few uses.
    assert wrong_correlated(usage, 0.4, 3, 0.3) == ["b"]


async def test_prune_grades_the_runs_with_a_judge_of_ones_own_without_an_endpoint(tmp_path: Path) -> None:
    pool_path = tmp_path / "pool"
    await make_pool(pool_path, ScriptedModel(SimScript(), scripted_settings()))
    # p1-p3 answer 2 to a reference of 1, every one retrieving "wrong": by the rules "wrong" goes. The judge, a model
    # whose settings name no endpoint, calls every answer right: nothing is wrong, and "wrong" stays.
    cases = []
    for i in range(1, 7):
        problem = Problem(problem_id=f"p{i}", question=f"Question {i}?", answer="1")
        cases.append((problem, used(f"p{i}", ["wrong"] if i <= 3 else ["fine"], pool_path), "2" if i <= 3 else "1"))
    run = write_run(tmp_path / "run", cases)
    judge = ScriptedModel(SimScript(rules=[Rule(role="judge", replies=['{"reasoning": "r", "equivalent": true}'])]))
    assert not judge.settings.endpoint.base_url
    summary = await prune_pool(pool_path, [run], None, PruneConfig(grade_mode="judge"), model=judge)
    assert summary.base_wrong_rate == 0.0 and summary.wrong == []
    assert len(judge.calls_of("judge")) == 6
    assert "wrong" in {e.id for e in Pool.open(pool_path).entries}


async def test_a_prune_that_changes_nothing_saves_no_version_so_repeated_prunes_age_nothing(tmp_path: Path) -> None:
    pool_path = tmp_path / "pool"
    model = ScriptedModel(SimScript(), scripted_settings())
    embed = EndpointEmbedder(model)
    pool = Pool.create(pool_path, embed.name)
    await pool.add([entry("only", "Check small cases", "Good practice: try n = 1, 2, 3 first.")], embed)
    assert pool.save() == 1
    # Each prune finds nothing to merge, drop or count. Were each to save a version, the entry of version 1 would
    # weigh 0.8^11 = 0.086 < 0.1 at the twelfth and go, with no build in between.
    for _ in range(12):
        summary = await prune_pool(pool_path, [], None, PruneConfig())
        assert (summary.before, summary.after, summary.version) == (1, 1, 1)
    assert [e.id for e in Pool.open(pool_path).entries] == ["only"] and Pool.open(pool_path).meta.version == 1
    # A prune that removes something saves a new version, as before.
    pool = Pool.open(pool_path)
    await pool.add([entry("twin", "Check small cases", "Good practice: try n = 1, 2, 3 first!", 0.1)], embed)
    assert pool.save() == 2
    summary = await prune_pool(pool_path, [], None, PruneConfig())
    assert summary.merged == {"only": ["twin"]} and summary.version == 3 == Pool.open(pool_path).meta.version


async def test_a_prune_while_a_build_or_a_prune_of_its_pool_runs_is_refused_before_its_calls(tmp_path: Path) -> None:
    pool_path = tmp_path / "pool"
    await make_pool(pool_path, ScriptedModel(SimScript(), scripted_settings()))
    problem = Problem(problem_id="p1", question="Question 1?", answer="1")
    run = write_run(tmp_path / "run", [(problem, used("p1", ["wrong"], pool_path), "2")])
    judge = ScriptedModel(SimScript(rules=[Rule(role="judge", replies=['{"reasoning": "r", "equivalent": true}'])]))
    build_dir = tmp_path / "pool.build"
    build_dir.mkdir()
    for holder in ("tmas pool build", "tmas pool prune"):
        # Another process writing the pool holds its writers' lock (taken here as that process would).
        held = f"{pool_path}: {holder} (pid {os.getpid()}) is writing this pool; wait for it to end or stop it"
        with RunLock(build_dir, doing=holder), pytest.raises(InputError, match=re.escape(held)):
            await prune_pool(pool_path, [run], None, PruneConfig(grade_mode="judge"), model=judge)
        assert judge.calls == []
        assert len(Pool.open(pool_path)) == 5 and Pool.open(pool_path).meta.version == 13
    # A dry run saves nothing: it reads beside a writer.
    with RunLock(build_dir, doing="tmas pool build"):
        assert (await prune_pool(pool_path, [], None, PruneConfig(dry_run=True))).stale == ["old"]
    # Once the other has ended, the prune runs: "dup" merged, "old" aged out, its one answer graded by the judge.
    summary = await prune_pool(pool_path, [run], None, PruneConfig(grade_mode="judge"), model=judge)
    assert (summary.after, summary.version, len(judge.calls_of("judge"))) == (3, 14, 1)


async def test_a_prune_of_a_folder_without_a_pool_makes_no_build_store_beside_it(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="no experience pool here"):
        await prune_pool(tmp_path / "none", [], None, PruneConfig())
    assert not (tmp_path / "none.build").exists()


async def two_pools_sharing_ids(tmp_path: Path, model: ScriptedModel) -> tuple[Path, Path]:
    """Pools "a" and "b", each with entries "e1" and "e2" of its own (as two builds from the same runs make them, one
    per credit scheme: their ids come from the same source turns)."""
    embed = EndpointEmbedder(model)
    paths = []
    for name, texts in (
        ("a", [("Check small cases", "Try n = 1, 2, 3 first."), ("Draw the figure", "Mark the given angles.")]),
        ("b", [("Factor the polynomial", "Look for a common root."), ("Guess the pattern", "Extend two terms.")]),
    ):
        pool = Pool.create(tmp_path / name, embed.name)
        await pool.add([entry(f"e{i}", action, exp) for i, (action, exp) in enumerate(texts, start=1)], embed)
        pool.save()
        paths.append(tmp_path / name)
    return paths[0], paths[1]


async def test_a_prune_counts_only_the_retrievals_from_its_own_pool_when_pools_share_entry_ids(tmp_path: Path) -> None:
    model = ScriptedModel(SimScript(), scripted_settings())
    pool_a, pool_b = await two_pools_sharing_ids(tmp_path, model)
    # Run A retrieved from pool a: a1-a3 right with e1, a4 wrong with e2. Run B from pool b: b1, b2 wrong with e2,
    # b3, b4 right with e1. Answers "2" are wrong (gold "1").
    cases_a = [
        (Problem(problem_id=f"a{i}", question=f"A {i}?", answer="1"), used(f"a{i}", [ids], pool_a), answer)
        for i, ids, answer in ((1, "e1", "1"), (2, "e1", "1"), (3, "e1", "1"), (4, "e2", "2"))
    ]
    cases_b = [
        (Problem(problem_id=f"b{i}", question=f"B {i}?", answer="1"), used(f"b{i}", [ids], pool_b), answer)
        for i, ids, answer in ((1, "e2", "2"), (2, "e2", "2"), (3, "e1", "1"), (4, "e1", "1"))
    ]
    runs = [write_run(tmp_path / "run-a", cases_a), write_run(tmp_path / "run-b", cases_b)]
    config = PruneConfig(grade_mode="rules")

    summary = await prune_pool(pool_a, runs, None, config, model=model)
    # Pool a's own problems: base 1/4 = 0.25; e1 3 uses, 0 wrong; e2 1 use, 1 wrong (under 3 uses: judged not).
    # Before, run B's retrievals of pool b's e2 were counted as pool a's: e2 3 uses, 3 wrong, a rate of 1.0 above
    # the mixed base 3/8 + 0.3, and pool a's e2 was removed.
    assert summary.base_wrong_rate == pytest.approx(0.25) and summary.wrong == []
    assert f"4 problems retrieved from another pool, {pool_b.resolve()}: not counted" in summary.notes
    assert {e.id: (e.retrieved, e.retrieved_wrong) for e in Pool.open(pool_a).entries} == {"e1": (3, 0), "e2": (1, 1)}

    summary = await prune_pool(pool_b, runs, None, config, model=model)
    # Pool b's: base 2/4 = 0.5; e1 2 uses, 0 wrong; e2 2 uses, 2 wrong.
    assert summary.base_wrong_rate == pytest.approx(0.5) and summary.wrong == []
    assert {e.id: (e.retrieved, e.retrieved_wrong) for e in Pool.open(pool_b).entries} == {"e1": (2, 0), "e2": (2, 2)}


@pytest.mark.parametrize("dry_run", [False, True])
async def test_a_prune_by_runs_that_never_retrieved_from_its_pool_is_refused_and_saves_nothing(
    tmp_path: Path, dry_run: bool
) -> None:
    model = ScriptedModel(SimScript(), scripted_settings())
    pool_a, pool_b = await two_pools_sharing_ids(tmp_path, model)
    cases: list[tuple[Problem, Transcript | None, str | None]] = [
        (Problem(problem_id=f"b{i}", question=f"B {i}?", answer="1"), used(f"b{i}", ["e1"], pool_b), "1")
        for i in range(1, 4)
    ]
    run = write_run(tmp_path / "run-b", cases)
    opened = Pool.open(pool_a)
    opened.update([e.model_copy(update={"retrieved": 5, "retrieved_wrong": 2}) for e in opened.entries])
    opened.save()
    files = {f.name: f.read_bytes() for f in pool_a.iterdir()}

    # Before, every counter was set to 0 from none of its retrievals and a new version saved (every entry a
    # version older).
    message = (
        f"{pool_a}: no graded problem of the runs {run} retrieved from this pool (they retrieved from "
        f"{pool_b.resolve()}); nothing pruned"
    )
    with pytest.raises(InputError, match=f"^{re.escape(message)}$"):
        await prune_pool(pool_a, [run], None, PruneConfig(grade_mode="rules", dry_run=dry_run), model=model)
    assert {f.name: f.read_bytes() for f in pool_a.iterdir()} == files


async def test_a_run_recorded_before_transcripts_named_their_pool_counts_for_its_pool_parameter(
    tmp_path: Path,
) -> None:
    model = ScriptedModel(SimScript(), scripted_settings())
    pool_a, pool_b = await two_pools_sharing_ids(tmp_path, model)
    runs = []
    for name, pool, answer in (("a", pool_a, "1"), ("b", pool_b, "2"), ("none", None, "2")):
        # Transcripts without their pool, as runs wrote them before; the run's parameters name it (or none).
        cases = [
            (
                Problem(problem_id=f"{name}{i}", question=f"{name} {i}?", answer="1"),
                used(f"{name}{i}", ["e1"], tmp_path).model_copy(update={"pool": None}),
                answer,
            )
            for i in range(1, 4)
        ]
        run = write_run(tmp_path / f"run-{name}", cases)
        with RunStore(run, create=False) as store:
            params = {"pool": str(pool)} if pool is not None else {}
            store.set_meta("method", {"name": "mattrl", "params": params})
        runs.append(run)

    summary = await prune_pool(pool_a, runs, None, PruneConfig(grade_mode="rules"), model=model)
    # Run a's three right problems only: e1 3 uses, 0 wrong; run b's three wrong ones went to pool b, and the run
    # without a pool to none. Before, all nine counted: e1 9 uses, 6 wrong.
    assert summary.base_wrong_rate == 0.0 and summary.wrong == []
    assert f"{tmp_path / 'run-none'}: 3 problems retrieved from no experience pool, not counted" in summary.notes
    assert {e.id: (e.retrieved, e.retrieved_wrong) for e in Pool.open(pool_a).entries} == {"e1": (3, 0), "e2": (0, 0)}


def test_near_duplicates_merge_only_within_the_keys_retrieval_reads() -> None:
    """Three unit vectors: rows 0 and 1 identical (cosine 1), row 2 orthogonal. Retrieval gives an entry only to
    specialists of its domain and (education) its role, subject-specific ones only for their subject, and ranks by
    difficulty: a merge across those keys would take the only entry some specialist could get."""
    vectors = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=np.float32)

    def edu(id_: str, reward: float, **keys: str) -> PoolEntry:
        return PoolEntry(id=id_, action="a", experience=id_, reward=reward, domain="education", **keys)

    same = [edu("d1", 0.9, role="Diagnostician"), edu("d2", 0.5, role="Diagnostician"), edu("x", 0.1)]
    assert duplicate_groups(same, vectors, 0.92) == {"d1": ["d2"]}
    for other in (
        {"role": "Pedagogy Strategist"},
        {"role": "Diagnostician", "subject": "Physics"},
        {"role": "Diagnostician", "difficulty": "hard"},
        {"role": "Diagnostician", "scope": "case"},
    ):
        apart = [same[0], edu("d2", 0.5, **other), same[2]]
        # Before, d2 was merged into d1 whatever its keys: specialists of d2's keys lost it.
        assert duplicate_groups(apart, vectors, 0.92) == {}, other
    math_twin = same[1].model_copy(update={"domain": "math", "role": ""})
    assert duplicate_groups([same[0], math_twin, same[2]], vectors, 0.92) == {}
