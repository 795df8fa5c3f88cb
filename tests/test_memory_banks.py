"""The experience and guideline banks' pure update functions, with hand-worked values."""

from __future__ import annotations

import json

import pytest

from tmas.agents.guideline import parse_guideline_update
from tmas.memory import (
    ExperienceBank,
    ExperienceEntry,
    ExperienceOp,
    GuidelineBank,
    Strategy,
    StrategyClassification,
    apply_experience_ops,
    apply_strategy_classifications,
    jaccard,
)


def bank(*contents: tuple[str, str]) -> ExperienceBank:
    entries = [ExperienceEntry(id=f"E{i + 1}", kind=kind, content=text) for i, (kind, text) in enumerate(contents)]  # type: ignore[arg-type]
    return ExperienceBank(entries=entries, next_id=len(entries) + 1)


def test_jaccard_hand_worked() -> None:
    assert jaccard("a b c", "a b d") == pytest.approx(2 / 4)
    assert jaccard("T(2) = 3", "t 2 3") == 1.0  # case and punctuation do not count
    assert jaccard("x y", "z") == 0.0
    assert jaccard("", "") == 1.0


def test_add_keep_refine_delete() -> None:
    old = bank(
        ("anchor", "T(2) = 3 by enumeration of the three tilings"),
        ("heuristic", "avoid assuming tiles are vertical only"),
        ("anchor", "T(3) = 5 from the extensions of T(2)"),
        ("anchor", "the recurrence has a coefficient two on T(n-2)"),
    )
    ops = [
        ExperienceOp(op="KEEP", id="E1"),
        ExperienceOp(op="REFINE", id="E2", content="never assume the 2x1 tile is only vertical: it gives T(4) = 6"),
        ExperienceOp(op="DELETE", id="E3"),
        ExperienceOp(op="ADD", kind="anchor", subtype="structural_rule", content="T(n) = T(n-1) + 2T(n-2) + T(n-4)"),
    ]
    new, report = apply_experience_ops(old, ops, iteration=5)
    assert [e.id for e in new.entries] == ["E1", "E2", "E4", "E5"]
    assert new.get("E2") is not None and new.get("E2").content.endswith("T(4) = 6")  # type: ignore[union-attr]
    assert new.get("E2").updated_at == 5 and new.get("E2").added_at == 0  # type: ignore[union-attr]
    assert new.get("E5") == ExperienceEntry(
        id="E5",
        kind="anchor",
        subtype="structural_rule",
        content="T(n) = T(n-1) + 2T(n-2) + T(n-4)",
        added_at=5,
        updated_at=5,
    )
    assert new.next_id == 6
    assert (report.added, report.refined, report.deleted) == (["E5"], ["E2"], ["E3"])
    assert sorted(report.kept) == ["E1", "E4"]  # E4 was not mentioned: kept by default
    assert old.next_id == 5 and len(old) == 4  # the input is not changed


def test_refine_with_merges_removes_the_absorbed_entries() -> None:
    old = bank(("anchor", "first"), ("anchor", "second"), ("anchor", "third"))
    new, report = apply_experience_ops(
        old, [ExperienceOp(op="REFINE", id="E1", content="first and second together", merges=["E2"])], iteration=1
    )
    assert [e.id for e in new.entries] == ["E1", "E3"]
    assert report.deleted == ["E2"]
    # An entry listed among its own merges is refined, not merged away nor refused.
    merges = ["E1", "E2"]
    new, report = apply_experience_ops(
        old, [ExperienceOp(op="REFINE", id="E1", content="first and second", merges=merges)], iteration=1
    )
    assert [e.content for e in new.entries] == ["first and second", "third"]
    assert (report.refined, report.deleted, report.rejected) == (["E1"], ["E2"], [])


def test_bad_operations_are_refused_and_reported() -> None:
    old = bank(("anchor", "alpha beta"))
    ops = [
        ExperienceOp(op="DELETE", id="E9"),
        ExperienceOp(op="REFINE", id="E1"),
        ExperienceOp(op="ADD", content="no kind given"),
        ExperienceOp(op="KEEP", id="E1"),
        ExperienceOp(op="DELETE", id="E1"),
    ]
    new, report = apply_experience_ops(old, ops, iteration=1)
    assert new.entries == old.entries
    assert len(report.rejected) == 4
    assert "E9: no such entry" in report.rejected[0]
    assert "already claimed by KEEP" in report.rejected[3]


def test_a_runaway_entry_is_refused_with_its_length_and_the_rest_of_the_update_applied() -> None:
    # A model on a server that does not enforce the reply's schema repeats one sentence inside "content": the entry
    # would ride in every later refine prompt. The ADD is refused, a REFINE of that length leaves its entry as it
    # was, and the update's other operations are applied.
    old = bank(("anchor", "alpha beta"))
    runaway = "Splitting 23 as 20 + 3 works. " * 100 + "So 391."  # 3,007 characters
    ops = [
        ExperienceOp(op="ADD", kind="anchor", content=runaway),
        ExperienceOp(op="REFINE", id="E1", content=runaway),
        ExperienceOp(op="ADD", kind="heuristic", content="adding without the carry gives 381"),
        ExperienceOp(op="ADD", kind="anchor", content="x" * 2000),  # at the limit: kept
    ]
    new, report = apply_experience_ops(old, ops, iteration=1)
    assert [(e.id, e.content) for e in new.entries] == [
        ("E1", "alpha beta"),
        ("E2", "adding without the carry gives 381"),
        ("E3", "x" * 2000),
    ]
    assert report.added == ["E2", "E3"] and report.kept == ["E1"] and report.refined == []
    assert report.rejected == [
        "ADD: content of 3007 characters, over the 2000 an entry may hold",
        "REFINE E1: content of 3007 characters, over the 2000 an entry may hold",
    ]


def test_a_new_strategy_described_at_runaway_length_is_refused() -> None:
    items = [
        StrategyClassification(
            rollout=1, strategy="Distribute over 20 + 3. " * 50 + "Add.", novelty=1
        ),  # 1,204 characters
        StrategyClassification(rollout=2, strategy="transfer matrix over column states", novelty=1),
    ]
    new, report = apply_strategy_classifications(GuidelineBank(), items, iteration=0, n_rollouts=2)
    assert [(s.id, s.description) for s in new.strategies] == [("G1", "transfer matrix over column states")]
    assert report.rejected == ["rollout 1: a strategy of 1204 characters, over the 1000 a description may hold"]


def test_a_new_strategy_stating_other_values_is_logged_beside_a_logged_one_worded_alike() -> None:
    # Jaccard 8 / 10 (0.8, above 0.7), but modulo 4 is another route than modulo 3: the agent's verdict 1 stands. The
    # same route reworded, stating the same value, still counts as another attempt of the logged one.
    logged = GuidelineBank(
        strategies=[
            Strategy(
                id="G1", description="work modulo 3 to restrict the residues of x", first_iteration=0, last_iteration=0
            )
        ],
        next_id=2,
    )
    items = [
        StrategyClassification(rollout=1, strategy="work modulo 4 to restrict the residues of x", novelty=1),
        StrategyClassification(rollout=2, strategy="work modulo 3 to restrict all the residues of x", novelty=1),
    ]
    new, report = apply_strategy_classifications(logged, items, iteration=1, n_rollouts=2)
    assert [s.id for s in new.strategies] == ["G1", "G2"] and report.added == ["G2"]
    assert report.deduplicated == ["rollout 2 (near-duplicate of G1)"] and report.repeated == {"G1": [2]}


def test_jaccard_dedup_keeps_the_earlier_entry() -> None:
    old = bank(("anchor", "the answer for the two by two block is three tilings"))
    # Word sets: 10 shared of 11 in the union -> 0.91, above 0.7; the heuristic of the same words is another kind.
    ops = [
        ExperienceOp(op="ADD", kind="anchor", content="the answer for the two by two block is three tilings total"),
        ExperienceOp(op="ADD", kind="anchor", content="a completely different verified statement"),
        ExperienceOp(op="ADD", kind="heuristic", content="the answer for the two by two block is three tilings"),
    ]
    new, report = apply_experience_ops(old, ops, iteration=2, dedup_threshold=0.7)
    assert [e.id for e in new.entries] == ["E1", "E3", "E4"]
    assert report.deduplicated == ["E2 (near-duplicate of E1)"]
    assert report.added == ["E3", "E4"]
    # A stricter threshold keeps it.
    loose, _ = apply_experience_ops(old, ops[:1], iteration=2, dedup_threshold=0.95)
    assert len(loose) == 2


def test_entries_stating_different_values_are_both_kept_whatever_words_they_share() -> None:
    # Two verified boundary cases: word sets share 13 of 17 words (Jaccard 0.76, above 0.7), but they state different
    # values (3, 12 against 4, 30): two facts, which the paper's prompt forbids merging. A rewording of the first,
    # stating the same values, is still its near-duplicate.
    first = "for n = 3 the count of valid colourings is 12, verified by listing all cases"
    ops = [
        ExperienceOp(
            op="ADD",
            kind="anchor",
            content="for n = 4 the count of valid colourings is 30, verified by listing all cases",
        ),
        ExperienceOp(
            op="ADD",
            kind="anchor",
            content="for n = 3 the count of all valid colourings is 12, verified by listing cases",
        ),
    ]
    assert jaccard(first, ops[0].content or "") == pytest.approx(13 / 17)
    new, report = apply_experience_ops(bank(("anchor", first)), ops, iteration=1, dedup_threshold=0.7)
    assert [e.id for e in new.entries] == ["E1", "E2"]
    assert report.added == ["E2"] and report.deduplicated == ["E3 (near-duplicate of E1)"]


def test_a_near_duplicate_at_the_threshold_is_dropped_and_its_id_never_given_again() -> None:
    old = bank(("anchor", "alpha beta gamma delta epsilon zeta eta theta"))
    # Word sets: 7 shared of 10 in the union, Jaccard 0.7 exactly: at the threshold, a near-duplicate.
    twin = ExperienceOp(op="ADD", kind="anchor", content="alpha beta gamma delta epsilon zeta eta iota kappa")
    new, report = apply_experience_ops(old, [twin], iteration=1, dedup_threshold=0.7)
    assert [e.id for e in new.entries] == ["E1"] and report.deduplicated == ["E2 (near-duplicate of E1)"]
    # E2 named the dropped addition: the next entry is E3, so an id always means one entry.
    other = ExperienceOp(op="ADD", kind="heuristic", content="check the base case before the recurrence")
    newer, report = apply_experience_ops(new, [other], iteration=2, dedup_threshold=0.7)
    assert [e.id for e in newer.entries] == ["E1", "E3"] and report.added == ["E3"]


def test_the_size_cap_refuses_the_latest_additions() -> None:
    old = bank(("anchor", "one"), ("anchor", "two"))
    ops = [ExperienceOp(op="ADD", kind="heuristic", content=word) for word in ("three", "four", "five")]
    new, report = apply_experience_ops(old, ops, iteration=1, max_entries=3)
    assert [e.content for e in new.entries] == ["one", "two", "three"]
    assert report.added == ["E3"]
    assert len(report.rejected) == 2 and "bank is full" in report.rejected[0]


def test_a_bank_over_the_cap_loses_none_of_its_entries() -> None:
    # A bank of 3 updated under a cap of 2 (one built under a larger cap): the addition is refused, and no entry the
    # bank held is dropped for it (only an explicit DELETE removes one).
    old = bank(("anchor", "one"), ("anchor", "two"), ("anchor", "three"))
    add = ExperienceOp(op="ADD", kind="anchor", content="four")
    new, report = apply_experience_ops(old, [add], iteration=1, max_entries=2)
    assert [e.content for e in new.entries] == ["one", "two", "three"]
    assert report.added == [] and report.rejected == ["ADD E4: the bank is full (2 entries)"]


def test_op_spellings_are_normalised() -> None:
    op = ExperienceOp.model_validate(
        {"op": "add", "kind": "Verified Anchor", "subtype": "Structural Reduction", "content": " x "}
    )
    assert (op.op, op.kind, op.subtype, op.content) == ("ADD", "anchor", "structural_reduction", "x")
    assert ExperienceOp.model_validate({"op": "ADD", "kind": "error-avoidance heuristic"}).kind == "heuristic"


def test_guideline_classifications() -> None:
    old = GuidelineBank(
        strategies=[Strategy(id="G1", description="direct recurrence on columns", first_iteration=0, last_iteration=0)],
        next_id=2,
    )
    items = [
        StrategyClassification(rollout=1, strategy="direct recurrence on columns", novelty=0, same_as="G1"),
        StrategyClassification(rollout=2, strategy="transfer matrix over column states", novelty=1),
        StrategyClassification(rollout=3, strategy="direct recurrence on the columns", novelty=1),  # near-duplicate
        StrategyClassification(rollout=4, strategy="", novelty=-1),
        StrategyClassification(rollout=5, strategy="x", novelty=1),  # only 4 rollouts
        StrategyClassification(rollout=2, strategy="again", novelty=1),  # classified twice
    ]
    new, report = apply_strategy_classifications(
        old, items, iteration=3, n_rollouts=4, scores={1: 0.5, 2: 1.0, 3: 0.25}
    )
    assert [s.id for s in new.strategies] == ["G1", "G2"]
    g1, g2 = new.strategies
    assert (g1.attempts, g1.last_iteration, g1.best_score) == (3, 3, 0.5)
    assert (g2.description, g2.first_iteration, g2.best_score) == ("transfer matrix over column states", 3, 1.0)
    assert report.added == ["G2"] and report.repeated == {"G1": [1, 3]} and report.undetermined == [4]
    assert len(report.rejected) == 2
    assert len(old) == 1


def test_rollouts_of_one_iteration_that_share_a_strategy_log_it_once() -> None:
    # Rollouts 1, 2 and 4 follow one strategy that is not logged, described in different words (no near-duplicates):
    # rollout 4 names rollout 2, which names rollout 1 (both after it in the reply), and rollout 3, placed first,
    # names rollout 5, whose verdict comes later in the reply and repeats G1. A rollout naming itself or a rollout
    # with no strategy is refused.
    old = GuidelineBank(
        strategies=[Strategy(id="G1", description="direct recurrence on columns", first_iteration=0, last_iteration=0)],
        next_id=2,
    )
    items = [
        StrategyClassification(rollout=3, strategy="", novelty=0, same_as="R5"),
        StrategyClassification(rollout=1, strategy="transfer matrix over column states", novelty=1),
        StrategyClassification(rollout=4, strategy="", novelty=0, same_as="rollout 2"),
        StrategyClassification(rollout=2, strategy="eigenvalues of the state matrix", novelty=0, same_as="[r1]"),
        StrategyClassification(rollout=5, strategy="", novelty=0, same_as="G1"),
        StrategyClassification(rollout=6, strategy="", novelty=0, same_as="R6"),
        StrategyClassification(rollout=7, strategy="", novelty=-1),
        StrategyClassification(rollout=8, strategy="", novelty=0, same_as="R7"),
    ]
    new, report = apply_strategy_classifications(
        old, items, iteration=2, n_rollouts=8, scores={1: 0.25, 2: 0.75, 3: 0.5, 4: 0.0, 5: 0.0}
    )
    assert [(s.id, s.description) for s in new.strategies] == [
        ("G1", "direct recurrence on columns"),
        ("G2", "transfer matrix over column states"),
    ]
    g1, g2 = new.strategies
    assert (g1.attempts, g1.best_score) == (3, 0.5)
    assert (g2.attempts, g2.first_iteration, g2.last_iteration, g2.best_score) == (3, 2, 2, 0.75)
    assert report.added == ["G2"] and report.repeated == {"G1": [5, 3], "G2": [2, 4]}
    assert report.undetermined == [7]
    assert report.rejected == [
        "rollout 8: 'same_as' 'R7' names no strategy logged or named by that rollout",
        "rollout 6: 'same_as' 'R6' names no strategy logged or named by that rollout",
    ]


def test_guideline_same_as_unknown_is_refused() -> None:
    new, report = apply_strategy_classifications(
        GuidelineBank(),
        [StrategyClassification(rollout=1, strategy="something", novelty=0, same_as="G7")],
        iteration=1,
        n_rollouts=1,
    )
    assert len(new) == 0 and "names no logged strategy" in report.rejected[0]


def test_ids_written_as_the_prompts_show_them_name_their_entries() -> None:
    # The experience and guideline prompts list each entry as "[E1] ..." / "- [G1] ...": a model that copies the id
    # with its brackets (or in lower case) still names that entry.
    old = bank(
        ("anchor", "T(2) = 3 by enumeration of the three tilings"),
        ("heuristic", "avoid assuming tiles are vertical only"),
        ("anchor", "T(3) = 5 from the extensions of T(2)"),
    )
    ops = [
        ExperienceOp.model_validate({"op": "DELETE", "id": "[E2]"}),
        ExperienceOp.model_validate({"op": "REFINE", "id": " [e1] ", "content": "T(2) = 3", "merges": ["[E3]"]}),
    ]
    new, report = apply_experience_ops(old, ops, iteration=2)
    assert [(e.id, e.content) for e in new.entries] == [("E1", "T(2) = 3")]
    assert (report.deleted, report.refined, report.rejected) == (["E2", "E3"], ["E1"], [])

    logged = GuidelineBank(
        strategies=[Strategy(id="G1", description="direct recurrence on columns", first_iteration=0, last_iteration=0)],
        next_id=2,
    )
    verdict = StrategyClassification.model_validate(
        {"rollout": 1, "strategy": "a generating function for the tilings", "novelty": 0, "same_as": "[G1]"}
    )
    credited, found = apply_strategy_classifications(logged, [verdict], iteration=1, n_rollouts=1)
    assert found.rejected == [] and found.repeated == {"G1": [1]}
    assert credited.strategies[0].attempts == 2


def test_an_entry_a_refinement_duplicates_is_reported_as_deduplicated_not_kept() -> None:
    # E1 is refined into the words of E2, which the update does not mention: the earlier entry (E1) stays, E2 goes
    # as its near-duplicate, and the report lists E2 among the deduplicated entries only, not among the kept ones.
    old = bank(
        ("anchor", "the first case gives two tilings"),
        ("anchor", "the answer for the two by two block is three tilings"),
        ("heuristic", "check the base case before the recurrence"),
    )
    refine = ExperienceOp(op="REFINE", id="E1", content="the answer for the two by two block is three tilings total")
    new, report = apply_experience_ops(old, [refine], iteration=1, dedup_threshold=0.7)
    assert [e.id for e in new.entries] == ["E1", "E3"]
    assert report.deduplicated == ["E2 (near-duplicate of E1)"]
    assert (report.refined, report.kept) == (["E1"], ["E3"])


def test_an_operation_that_writes_merges_as_null_or_as_one_id_is_read() -> None:
    # The prompt lists every field of an operation, "merges" optional and for REFINE only: a model that writes each
    # field, null where one does not apply (as "same_as" is asked of the guideline agent), or one id without a list,
    # means no merge or that one merge.
    old = bank(("anchor", "T(2) = 3 by enumeration of the three tilings"), ("anchor", "T(3) = 5 from T(2)"))
    ops = [
        ExperienceOp.model_validate(
            {"op": "ADD", "id": None, "kind": "heuristic", "subtype": None, "content": "tiles turn", "merges": None}
        ),
        ExperienceOp.model_validate({"op": "REFINE", "id": "E1", "content": "T(2) = 3, T(3) = 5", "merges": "[E2]"}),
    ]
    new, report = apply_experience_ops(old, ops, iteration=1)
    assert [(e.id, e.content) for e in new.entries] == [("E1", "T(2) = 3, T(3) = 5"), ("E3", "tiles turn")]
    assert (report.added, report.refined, report.deleted, report.rejected) == (["E3"], ["E1"], ["E2"], [])


def test_a_verdict_whose_strategy_is_null_is_read_as_one_without_a_description() -> None:
    # A rollout whose strategy cannot be made out (-1) is often given a null strategy: it is undetermined, not a
    # malformed item; a repeat (0) with a null strategy but a valid id is credited to that entry.
    logged = GuidelineBank(
        strategies=[Strategy(id="G1", description="direct recurrence on columns", first_iteration=0, last_iteration=0)],
        next_id=2,
    )
    update = parse_guideline_update(
        json.dumps(
            {
                "rollouts": [
                    {"rollout": 1, "strategy": None, "novelty": -1, "same_as": None},
                    {"rollout": 2, "strategy": None, "novelty": 0, "same_as": "G1"},
                ]
            }
        )
    )
    assert update.malformed == []
    new, report = apply_strategy_classifications(logged, update.items, iteration=1, n_rollouts=2)
    assert (report.undetermined, report.repeated, report.rejected) == ([1], {"G1": [2]}, [])
    assert new.strategies[0].attempts == 2
