"""Selection rules and pools (methods/selection.py): hand-made candidate sets, then TMAS and Verify-Refine in process
on the scripted model with each rule; a renamed parameter's record in the run store goes through the simulated
server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from conftest import scripted_settings
from scripted_runs import by_role, solve_in_process
from tmas.api import asolve
from tmas.methods.base import Candidate, Fallback, ProblemResult
from tmas.methods.confidence import Confidence
from tmas.methods.selection import (
    ConfidenceVote,
    FallbackFrom,
    candidates_from,
    lacks_confidence,
    select,
    select_answered,
)
from tmas.methods.tmas_params import TMASParams
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript


def cand(i: int, answer: str | None, score: float | None, error: str | None = None) -> Candidate:
    return Candidate(index=i, text=f"text {i}", answer=answer, score=score, error=error)


def test_best_score_takes_the_top_score_and_breaks_ties_by_shared_answer_then_order() -> None:
    pool = [cand(0, "4", 1.0), cand(1, "7", 0.5), cand(2, "5", 1.0), cand(3, " 5 ", 1.0)]
    assert select(pool, "numeric", "best_score") is pool[2]
    # Two answers tied in score and in count: the earliest in pool order.
    assert select([cand(0, "1", 0.5), cand(1, "2", 0.5)], "numeric", "best_score").index == 0  # type: ignore[union-attr]


def test_votes_count_answers_and_scores() -> None:
    # "7": two votes, scores 0 + 0.5 = 0.5; "9": one vote, score 1.0.
    pool = [cand(0, "7", 0.0), cand(1, "9", 1.0), cand(2, "7", 0.5)]
    assert select(pool, "numeric", "best_score") is pool[1]
    # Plurality: "7"; its best-scored holder is returned.
    assert select(pool, "numeric", "vote") is pool[2]
    # Summed scores: 1.0 for "9" beats 0.5 for "7".
    assert select(pool, "numeric", "score_weighted_vote") is pool[1]


def test_vote_ties_go_to_the_larger_score_sum_then_to_the_first_holder() -> None:
    # One vote each: "3" has the larger score.
    pool = [cand(0, "2", 0.5), cand(1, "3", 1.0)]
    assert select(pool, "numeric", "vote") is pool[1]
    # One vote each and equal scores: the answer held first in pool order.
    assert select([cand(0, "2", 0.5), cand(1, "3", 0.5)], "numeric", "vote").index == 0  # type: ignore[union-attr]


def test_weighted_vote_ties_go_to_more_votes_then_to_the_first_holder() -> None:
    # "4": 0.5 + 0.5 = 1.0 over two votes; "8": 1.0 over one vote. Equal sums: more votes win.
    pool = [cand(0, "8", 1.0), cand(1, "4", 0.5), cand(2, "4", 0.5)]
    assert select(pool, "numeric", "score_weighted_vote") is pool[1]
    # Equal sums (0.3 + 0.6 vs 0.9, float noise included) and equal votes: the first holder in pool order.
    pool = [cand(0, "1", 0.3), cand(1, "2", 0.45), cand(2, "1", 0.6), cand(3, "2", 0.45)]
    assert select(pool, "numeric", "score_weighted_vote") is pool[2]


def test_failed_and_answerless_candidates() -> None:
    failed = cand(0, "6", 1.0, error="HTTP 500")
    answerless = cand(1, None, 1.0)
    answered = cand(2, "3", 0.0)
    for rule in ("best_score", "vote", "score_weighted_vote"):
        assert select([failed, answerless, answered], "numeric", rule) is answered  # type: ignore[arg-type]
        # No answer anywhere: the votes fall back to the best score among calls that succeeded.
        assert select([failed, answerless, cand(3, None, 0.5)], "numeric", rule) is answerless  # type: ignore[arg-type]
        assert select([failed], "numeric", rule) is None  # type: ignore[arg-type]
    # Proof mode has no answers to count: every rule is the best score.
    proofs = [cand(0, None, 0.5), cand(1, None, 1.0)]
    assert select(proofs, "proof", "vote") is proofs[1]


def test_pools() -> None:
    it0 = [cand(0, "7", 1.0), cand(1, "7", 1.0)]
    it1 = [cand(0, "5", 0.5), cand(1, "6", 0.0)]
    assert candidates_from([it0, it1], "last") == it1
    # Newest iteration first, then by index.
    assert candidates_from([it0, it1], "all") == [*it1, *it0]
    assert candidates_from([], "all") == []
    assert select(candidates_from([it0, it1], "last"), "numeric") is it1[0]
    assert select(candidates_from([it0, it1], "all"), "numeric") is it0[0]
    # A tie across iterations goes to the newer candidate.
    newer = [cand(0, "7", 1.0)]
    assert select(candidates_from([it0, newer], "all"), "numeric") is newer[0]


def sure(i: int, answer: str | None, tail: float, mean: float | None = None, score: float | None = None) -> Candidate:
    """A candidate with the given tail (and mean) confidence."""
    conf = Confidence(mean=tail if mean is None else mean, lowest_group=tail, tail=tail, tokens=10, window=4)
    return Candidate(index=i, text=f"text {i}", answer=answer, score=score, confidence=conf)


def test_confidence_vote_weighs_each_answer_by_its_summed_confidence() -> None:
    # "7": two votes, V = 1.0 + 1.5 = 2.5; "9": one vote, V = 3.0.
    pool = [sure(0, "7", 1.0), sure(1, "9", 3.0), sure(2, "7", 1.5)]
    assert select(pool, "numeric", "vote") is pool[0]
    assert select(pool, "numeric", "confidence_vote") is pool[1]
    # The measure decides: by the mean, "7" (4 + 4) outweighs "9" (1).
    pool = [sure(0, "7", 1.0, mean=4.0), sure(1, "9", 3.0, mean=1.0), sure(2, "7", 1.0, mean=4.0)]
    assert select(pool, "numeric", "confidence_vote", confidence=ConfidenceVote(measure="mean")) is pool[0]
    # Equal sums (2 + 1 against 3): more votes, then the answer held first.
    assert select([sure(0, "9", 3.0), sure(1, "7", 2.0), sure(2, "7", 1.0)], "numeric", "confidence_vote").index == 1  # type: ignore[union-attr]
    assert select([sure(0, "9", 2.0), sure(1, "7", 2.0)], "numeric", "confidence_vote").index == 0  # type: ignore[union-attr]


def test_filtered_vote_keeps_the_most_confident_share() -> None:
    # "7": three votes of 1.0 (V = 3.0) outweigh "9" (2.5) when all vote.
    pool = [sure(0, "7", 1.0), sure(1, "9", 2.5), sure(2, "7", 1.0), sure(3, "7", 1.0)]
    assert select(pool, "numeric", "confidence_vote") is pool[0]
    assert select(pool, "numeric", "filtered_vote", confidence=ConfidenceVote(share=1.0)) is pool[0]
    # eta = 0.25 of 4: ceil(1) = 1 votes, the most confident: "9".
    assert select(pool, "numeric", "filtered_vote", confidence=ConfidenceVote(share=0.25)) is pool[1]
    # eta = 0.5: ceil(2) = 2 vote: 2.5 and, of the tied 1.0s, the first in pool order: V(9) = 2.5 > V(7) = 1.0.
    assert select(pool, "numeric", "filtered_vote", confidence=ConfidenceVote(share=0.5)) is pool[1]
    # eta = 0.9: ceil(3.6) = 4: everyone votes, as in the weighted vote.
    assert select(pool, "numeric", "filtered_vote", confidence=ConfidenceVote(share=0.9)) is pool[0]
    with pytest.raises(ValueError, match="share"):
        ConfidenceVote(share=0.0)


def test_filtered_vote_keeps_exactly_the_share_where_it_is_whole() -> None:
    # eta = 0.28 of 25 is 7 (0.28 x 25 in floating point is 7.000000000000001, whose ceiling is 8). The 8 most
    # confident: "9" x 3, "7" x 4, "9", all at 2.0; 17 "5"s at 1.0. Of the first 7, V(7) = 8.0 > V(9) = 6.0; an eighth
    # voter would tie "9" at 8.0 with as many votes, and "9" came first.
    pool = [
        *(sure(i, "9", 2.0) for i in range(3)),
        *(sure(i, "7", 2.0) for i in range(3, 7)),
        sure(7, "9", 2.0),
        *(sure(i, "5", 1.0) for i in range(8, 25)),
    ]
    assert select(pool, "numeric", "filtered_vote", confidence=ConfidenceVote(share=0.28)) is pool[3]


def test_confidence_rules_fall_back_to_the_plain_vote_without_confidence() -> None:
    # "9" is the more confident answer, but candidate 2 has no confidence: every candidate then votes plainly.
    pool = [sure(0, "7", 1.0), sure(1, "9", 3.0), cand(2, "7", None)]
    assert lacks_confidence(pool) and not lacks_confidence(pool[:2])
    for rule in ("confidence_vote", "filtered_vote"):
        assert select(pool, "numeric", rule) is pool[0]  # type: ignore[arg-type]
    # Failed and answerless candidates need no confidence.
    assert not lacks_confidence([*pool[:2], cand(3, None, None), cand(4, "7", None, error="HTTP 500")])


def test_unknown_rule_is_a_clear_error() -> None:
    with pytest.raises(ValidationError, match="select"):
        TMASParams(select="median")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="select_from"):
        TMASParams(select_from="some")  # type: ignore[arg-type]


def test_the_old_name_of_select_from_still_works_and_says_so() -> None:
    old = TMASParams.model_validate({"pool": "all", "n": 2})
    assert (old.select_from, old.n) == ("all", 2) and "pool" not in old.model_dump()
    assert old.notices() == {
        "renamed_parameter_pool": "method parameter 'pool' is now called 'select_from'; the old name still works"
    }
    assert TMASParams.model_validate({"select_from": "all"}).notices() == {}
    with pytest.raises(ValidationError, match="'pool' is the old name of 'select_from': give one of them"):
        TMASParams.model_validate({"pool": "all", "select_from": "last"})


# ---------------------------------------------------------------------------------------------- methods
# Verifier verdicts by the answer the solution boxes: 7 is scored 1, 5 is scored 0.
VERIFIER_RULES = [
    Rule(role="verifier", pattern=r"boxed\{7\}", replies=["## Analysis\nFine.\n\n## Score\nScore: 1"]),
    Rule(role="verifier", pattern=r"boxed\{5\}", replies=["## Analysis\nWrong.\n\n## Score\nScore: 0"]),
]
Q = "What is 17*23?"
RENAMED = "method parameter 'pool' is now called 'select_from'; the old name still works"


def scripted(method: str, rules: list[Rule], **params: Any) -> ScriptedModel:
    return ScriptedModel(SimScript(rules=rules), scripted_settings(method={"name": method, "params": params}))


async def solve_with(method: str, solutions: list[str], **params: Any) -> tuple[ProblemResult, ScriptedModel]:
    model = scripted(method, [Rule(role="solution", replies=solutions), *VERIFIER_RULES], **params)
    return await solve_in_process(model, Q), model


@pytest.mark.parametrize(("rule", "expected"), [("best_score", "7"), ("vote", "5"), ("score_weighted_vote", "7")])
async def test_tmas_returns_what_its_rule_selects(rule: str, expected: str) -> None:
    solutions = ["So \\boxed{5}.", "So \\boxed{5}.", "So \\boxed{7}."]
    result, model = await solve_with("tmas", solutions, n=3, m=1, iterations=1, select=rule)
    assert sorted(c.answer or "" for c in result.iterations[0].candidates) == ["5", "5", "7"]
    assert [c.score for c in result.iterations[0].candidates if c.answer == "7"] == [1.0]
    assert result.answer == expected and result.iterations[0].selected == expected
    # The rule changes what is returned, never what is asked: three solutions and three verifications.
    assert by_role(model)["solution"] == 3 and by_role(model)["verifier"] == 3


# Iteration 0 writes two 7s (scored 1), iteration 1 two 5s (scored 0): calls of iteration 1 come after those of
# iteration 0, so the scripted replies are consumed in that order.
SEVENS_THEN_FIVES = ["So \\boxed{7}.", "So \\boxed{7}.", "So \\boxed{5}.", "So \\boxed{5}."]


@pytest.mark.parametrize(
    ("key", "select_from", "expected"),
    [("select_from", "last", "5"), ("select_from", "all", "7"), ("pool", "all", "7")],
)
async def test_tmas_select_from_reaches_back_to_earlier_iterations(key: str, select_from: str, expected: str) -> None:
    params = {key: select_from}
    result, model = await solve_with("tmas", SEVENS_THEN_FIVES, n=2, m=1, iterations=2, **params)
    assert [sorted(c.answer or "" for c in r.candidates) for r in result.iterations] == [["7", "7"], ["5", "5"]]
    assert result.iterations[0].selected == "7"
    assert result.answer == expected and result.iterations[1].selected == expected
    assert len(model.calls_of("solution")) == 4
    # The old name is the problem's one-line notice.
    assert result.notices == [RENAMED] * (key == "pool")


@pytest.mark.parametrize("key", ["select_from", "pool"])
async def test_the_run_store_keeps_the_notice_once_and_the_parameter_under_its_new_name(
    tmp_path: Path, key: str
) -> None:
    script = SimScript(rules=[Rule(role="solution", replies=SEVENS_THEN_FIVES), *VERIFIER_RULES])
    params = {"n": 2, "m": 1, "iterations": 2, key: "all"}
    model = ScriptedModel(script, scripted_settings(method={"name": "tmas", "params": params}))
    result = await asolve(Q, run_dir=tmp_path / "run", model=model)
    renamed = [RENAMED] * (key == "pool")
    assert result.answer == "7" and result.notices == renamed
    with RunStore(tmp_path / "run", create=False) as store:
        assert list(store.notices().values()) == renamed
        assert store.get_meta("method")["params"]["select_from"] == "all"


@pytest.mark.parametrize(("params", "expected"), [({}, "7"), ({"select": "vote"}, "5")])
async def test_verify_refine_select_parameter(params: dict[str, Any], expected: str) -> None:
    solutions = ["So \\boxed{5}.", "So \\boxed{5}.", "So \\boxed{7}."]
    result, model = await solve_with("verify_refine", solutions, n=3, m=1, iterations=1, **params)
    assert sorted(c.answer or "" for c in result.iterations[0].candidates) == ["5", "5", "7"]
    assert result.answer == expected
    assert by_role(model)["verifier"] == 3


@pytest.mark.parametrize(("select_from", "expected"), [("last", "5"), ("all", "7")])
async def test_verify_refine_select_from_parameter(select_from: str, expected: str) -> None:
    # One trajectory: a 7 (scored 1), then the corrector's 5 (scored 0).
    rules = [
        Rule(role="solution", replies=["So \\boxed{7}."]),
        Rule(role="corrector", replies=["So \\boxed{5}."]),
        *VERIFIER_RULES,
    ]
    model = scripted("verify_refine", rules, n=1, iterations=2, select_from=select_from)
    result = await solve_in_process(model, Q)
    assert [r.candidates[0].answer for r in result.iterations] == ["7", "5"]
    assert result.answer == expected
    assert by_role(model) == {"solution": 1, "corrector": 1, "verifier": 2}


def test_the_fallback_takes_the_rule_over_all_earlier_iterations_or_the_latest_answered_one() -> None:
    # Iteration 0 agrees on 7 twice; iteration 1 says 9 once (its other candidate has no answer); the last none.
    it0 = [cand(0, "7", None), cand(1, "7", None)]
    it1 = [cand(0, "9", None), cand(1, None, None)]
    it2 = [cand(0, None, None), cand(1, None, None)]
    # "all": the vote over the four earlier candidates, 7 (2 votes) against 9 (1): iteration 0's first holder.
    chosen, info = select_answered([it0, it1, it2], "last", "numeric", "vote")
    assert chosen is it0[0]
    assert info == Fallback(iteration=0, candidate=0, answer="7", reason="no answered candidate in the last iteration")
    # "latest": the vote of iteration 1 alone, the latest with an answer.
    chosen, info = select_answered([it0, it1, it2], "last", "numeric", "vote", fallback_from="latest")
    assert chosen is it1[0] and info is not None and (info.iteration, info.answer) == (1, "9")
    # An iteration with no answered candidate is passed over: iteration 0's vote, then.
    chosen, info = select_answered([it0, it2, it2], "last", "numeric", "vote", fallback_from="latest")
    assert chosen is it0[0] and info is not None and info.iteration == 0


def test_fallback_ties_go_to_the_latest_iteration_then_the_earliest_candidate() -> None:
    it0, it1, last = [cand(0, "7", None)], [cand(0, "9", None)], [cand(0, None, None)]
    # One vote each: over every earlier candidate, newest iteration first, 9's holder comes first.
    hows: tuple[FallbackFrom, ...] = ("all", "latest")
    for how in hows:
        chosen, info = select_answered([it0, it1, last], "last", "numeric", "vote", fallback_from=how)
        assert chosen is it1[0] and info is not None and info.iteration == 1
    # Within one iteration: a failed call never votes; 5 and 3 tie, 5's holder (candidate 1) comes first.
    tied = [cand(0, "4", None, error="HTTP 500"), cand(1, "5", None), cand(2, "3", None)]
    chosen, info = select_answered([tied, last], "last", "numeric", "vote", fallback_from="latest")
    assert chosen is tied[1] and info is not None and info.candidate == 1


def test_with_scores_the_fallback_rule_reads_them() -> None:
    it0, it1, last = [cand(0, "7", 1.0)], [cand(0, "9", 0.5), cand(1, "8", 0.75)], [cand(0, None, 0.0)]
    # best_score over every earlier candidate: 7 (1.0); over the latest answered iteration alone: 8 (0.75).
    assert select_answered([it0, it1, last], "last", "numeric")[0] is it0[0]
    assert select_answered([it0, it1, last], "last", "numeric", fallback_from="latest")[0] is it1[1]
    # Off, or in proof mode, or with an answer in the last iteration: no fallback.
    assert select_answered([it0, it1, last], "last", "numeric", fallback=False) == (last[0], None)
    assert select_answered([it0, it1, last], "last", "proof")[1] is None
    assert select_answered([it0, it1], "last", "numeric", fallback_from="latest") == (it1[1], None)


def test_in_proof_mode_a_last_iteration_whose_calls_all_failed_falls_back_to_an_earlier_proof() -> None:
    it0, it1 = [cand(0, None, 0.5)], [cand(0, None, 0.5), cand(1, None, 1.0)]
    failed = [cand(0, None, None, error="HTTP 500"), cand(1, None, None, error="HTTP 500")]
    chosen, info = select_answered([it0, it1, failed], "last", "proof")
    assert chosen is it1[1]
    assert info == Fallback(iteration=1, candidate=1, answer=None, reason="no usable candidate in the last iteration")
    assert select_answered([it0, it1, failed], "last", "proof", fallback=False) == (None, None)


def test_unscored_vote_is_the_plain_majority_with_ties_to_the_first_holder() -> None:
    # 7 and 9 tie at two votes; 7's first holder (candidate 1) comes before 9's (candidate 2).
    pool = [cand(0, None, None), cand(1, "7", None), cand(2, "9", None), cand(3, "9", None), cand(4, "7.0", None)]
    assert select(pool, "numeric", "vote") is pool[1]
    # No answer at all: the first candidate whose call succeeded.
    bare = [cand(0, None, None, error="HTTP 500"), cand(1, None, None), cand(2, None, None)]
    assert select(bare, "numeric", "vote") is bare[1] and select(bare, "proof", "vote") is bare[1]


def test_in_proof_mode_a_candidate_without_text_holds_no_proof() -> None:
    # A thinking model cut while it reasoned leaves no content: at a tied score it is no proof to return, and a last
    # iteration of such candidates alone falls back to an earlier proof as one whose calls failed does.
    empty = Candidate(index=0, text="", score=0.0)
    written = cand(1, None, 0.0)
    assert select([empty, written], "proof") is written
    earlier = [cand(0, None, 0.5)]
    chosen, info = select_answered([earlier, [empty]], "last", "proof")
    assert chosen is earlier[0]
    assert info == Fallback(iteration=0, candidate=0, answer=None, reason="no usable candidate in the last iteration")
