"""Which candidate a verifying method returns: the selection rule (``select``) and the candidates it selects from
(``select_from``).

Rules (``select``):

- ``best_score``: the paper's rule (TMAS Algorithm 1, line 22): the highest score. Ties: the answer most of the tied
  candidates share, then the earliest candidate in candidate order.
- ``vote``: plurality of the extracted answers, counted by value (below). Ties between answers: the larger sum of
  scores, then the answer whose first holder comes earliest in candidate order.
- ``score_weighted_vote``: the answer with the largest sum of scores over the candidates that give it. Ties: more
  votes, then the earliest first holder in candidate order.

Confidence rules (``ConfidenceRule``, beyond the papers: DeepConf, Fu et al. 2025, section 4's offline voting), read
from each candidate's confidence (methods/confidence.py) by the measure ``ConfidenceVote.measure`` names:

- ``confidence_vote``: confidence-weighted majority vote, V(a) = sum of the confidences of the candidates that give
  answer a; the largest V(a) wins. Ties: more votes, then the earliest first holder in candidate order.
- ``filtered_vote``: confidence filtering, then the weighted vote: only the most confident share eta of the answered
  candidates vote (``ConfidenceVote.share``; DeepConf's 10 % and 90 %), the top ceil(eta x n) of them, at least
  one; ties at the cut go to the earlier candidate in candidate order.

Where any answered candidate has no confidence (the server sent no log-probabilities), both count plain votes
(``vote``) instead: confidences of some candidates only would weigh against the others for want of data, not of
certainty (:func:`lacks_confidence` tells the caller, which notes it).

Answers count by value, not spelling: ``0.5``, ``1/2`` and ``\\frac{1}{2}`` are one answer. ``classes`` maps each
answer to its class, as :func:`tmas.answer_classes.answer_classes` builds it (normalized spelling and exact numbers,
then the grading rules' equivalence across the few groups left); without it, the spelling and exact-number stage
alone groups them. The same grouping decides which answer "most tied candidates share" in ``best_score``.

For every vote the returned candidate is the winning answer's best-scored holder (ties: earliest in candidate order).

Every rule skips candidates whose call failed, and in proof mode candidates without text (no proof to return); in
numeric mode it prefers candidates that have an answer, and where no candidate has one (or in proof mode, where there
are no answers to count) every vote rule reads as ``best_score``. A missing score counts 0, so a baseline without
scores returns its first usable candidate in candidate order there. A method that offers ``select`` refuses a vote or
confidence rule in proof mode (:func:`proof_rule_error`) rather than run one that would read as ``best_score``.

Answer fallback (``select_answered``, beyond the paper; every method that falls back uses it): when the candidates
it selects from hold no answered one (numeric mode), or no usable one at all (proof mode: every call failed or wrote
no text), the answer comes from an answered (a usable) candidate of the earlier iterations, recorded as a fallback
(its iteration, candidate, answer and why). Which one (``fallback_from``):

- ``all`` (TMAS, Verify-Refine, RSE): the rule applied to every earlier candidate, as ``select_from = "all"`` orders
  them (newest iteration first), so a vote counts the answers of all earlier iterations;
- ``latest`` (Self-Refine, PaCoRe): the rule applied to the latest earlier iteration that has an answered candidate
  alone. Each round of these rewrites the one before it, so an older round's answer is an older draft and must not
  outvote the newer ones.

With the fallback off, the rule reads those candidates alone, as Algorithm 1's line 22 does.

Without scores (the baselines' candidates), ``vote`` is the plain majority vote (self-consistency): the most
frequent answer, ties to the answer whose first holder comes earliest, and that first holder is returned.

Which candidates (``select_from``, called ``pool`` before): ``last`` is the last iteration's candidates; ``all`` is
every iteration's, ordered newest iteration first, then by candidate index, so "earliest in candidate order" prefers
the latest, most refined candidate.

An iteration's candidates, where ``last`` and the ``latest`` fallback read one iteration, are the solutions its
trajectories hold (:func:`held`): in Self-Refine and Verify-Refine a refinement without an answer leaves its
trajectory on its earlier answered solution (``meta.carried_from``), and that solution is the trajectory's vote (its
score, its answer) in that iteration, not the answerless reply. Where a budget stop cut the iteration short, a
trajectory whose refinement it refused (``IterationRecord.held_over``) votes with the solution it held at the
iteration before, so the refinements that came back never outvote the trajectories the stop left standing (TMAS has
no trajectories: its candidate i of one iteration goes on from no candidate i of the last, and its cut iteration
votes over what came back). ``all`` counts every solution once, where it was written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from tmas.answer_classes import class_of
from tmas.methods.base import Candidate, Fallback
from tmas.methods.confidence import ConfidenceMeasure

SelectRule = Literal["best_score", "vote", "score_weighted_vote"]
ConfidenceRule = Literal["confidence_vote", "filtered_vote"]
SelectFrom = Literal["last", "all"]
FallbackFrom = Literal["all", "latest"]
SELECT_RULES: tuple[SelectRule, ...] = get_args(SelectRule)
CONFIDENCE_RULES: tuple[ConfidenceRule, ...] = get_args(ConfidenceRule)
SELECT_FROM: tuple[SelectFrom, ...] = get_args(SelectFrom)


@dataclass(frozen=True)
class ConfidenceVote:
    """How the confidence rules read the candidates: which measure weighs a vote, and which share votes at all in
    ``filtered_vote``."""

    measure: ConfidenceMeasure = "tail"
    share: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"the confidence share must be in (0, 1], not {self.share}")


# Scores are means of a few verifier verdicts: equal within float noise means tied.
_EPS = 1e-9


def candidates_from(iterations: Sequence[Sequence[Candidate]], select_from: SelectFrom) -> list[Candidate]:
    """The candidates a rule chooses from, given each iteration's candidates oldest first, in candidate order."""
    if not iterations:
        return []
    if select_from == "last":
        return list(iterations[-1])
    return [c for candidates in reversed(iterations) for c in candidates]


def proof_rule_error(rule: str, mode: str) -> str | None:
    """Why ``select = rule`` does not apply in ``mode`` (None where it does): in proof mode a candidate's answer is
    its proof, no two are counted equal, so only the verifier scores (``best_score``) tell them apart."""
    if mode == "numeric" or rule == "best_score":
        return None
    return (
        f"select={rule} counts equal answers and mode=proof has none, no two proofs being counted equal: proofs are"
        " chosen by verifier score, select=best_score"
    )


def held(
    iterations: Sequence[Sequence[Candidate]], t: int, held_over: Sequence[Sequence[int] | None] = ()
) -> list[Candidate]:
    """The solutions the trajectories hold at iteration ``t`` (an index of ``iterations``, oldest first), in
    trajectory (candidate index) order: each candidate, except a refinement without an answer whose trajectory went
    on from an earlier solution (``meta.carried_from``, Self-Refine and Verify-Refine), which is that solution, the
    candidate of the same index in the iteration it names.

    ``held_over``: per iteration (as ``iterations``; missing or None: none), the trajectories whose call a budget stop
    refused there (``IterationRecord.held_over``): each has no candidate in that iteration and holds what it held at
    the iteration before, which is its solution there too. A record stored before either existed reads as its
    candidates."""
    out = []
    for c in iterations[t]:
        origin = c.meta.carried_from
        source = iterations[origin] if origin is not None and 0 <= origin < len(iterations) else []
        out.append(next((o for o in source if o.index == c.index), c))
    over = held_over[t] if t < len(held_over) else None
    if over and t > 0:
        before = {c.index: c for c in held(iterations, t - 1, held_over)}
        out += [before[i] for i in over if i in before]
        out.sort(key=lambda c: c.index)  # stable: trajectory order, as a whole iteration has it
    return out


def select(
    candidates: Sequence[Candidate],
    mode: str,
    rule: SelectRule | ConfidenceRule = "best_score",
    classes: Mapping[str, str] | None = None,
    confidence: ConfidenceVote | None = None,
) -> Candidate | None:
    """The candidate ``rule`` returns from ``candidates`` (in candidate order); None when no candidate is usable
    (every call failed; in proof mode, none wrote text). ``classes``: answer -> the key of its class of equal values;
    ``confidence``: how the confidence rules read the candidates (the defaults without it). See the module
    docstring."""
    usable = [c for c in candidates if c.error is None]
    if mode != "numeric":
        # The text is the proof: a reply with none (a thinking model cut while it reasoned) has no proof to return.
        usable = [c for c in usable if c.text.strip()]
    answered = [c for c in usable if c.answer is not None]
    if mode == "numeric" and answered:
        usable = answered
    if not usable:
        return None
    if rule == "best_score" or mode != "numeric" or not answered:
        return _best_score(usable, mode, classes)
    if rule in CONFIDENCE_RULES and lacks_confidence(usable):
        rule = "vote"
    how = confidence or ConfidenceVote()
    if rule == "filtered_vote":
        ranked = sorted(usable, key=lambda c: -_confidence(c, how))  # stable: ties keep candidate order
        # Rounded before the ceiling: 0.28 x 25 is 7.000000000000001 in floating point, and 7 vote, not 8.
        kept = {id(c) for c in ranked[: max(1, math.ceil(round(how.share * len(usable), 9)))]}
        usable = [c for c in usable if id(c) in kept]
    groups: dict[str, list[Candidate]] = {}
    for c in usable:
        groups.setdefault(class_of(c.answer or "", classes), []).append(c)
    # Dicts keep insertion order: the group index is the position of the answer's first holder among the candidates.
    order = {key: position for position, key in enumerate(groups)}

    def standing(key: str) -> tuple[float, float, int]:
        votes = len(groups[key])
        if rule == "vote":
            return (votes, sum(_score(c) for c in groups[key]), -order[key])
        if rule == "score_weighted_vote":
            return (sum(_score(c) for c in groups[key]), votes, -order[key])
        return (sum(_confidence(c, how) for c in groups[key]), votes, -order[key])

    winner = max(groups, key=lambda key: _rounded(standing(key)))
    return _top_scored(groups[winner])


def _best_score(candidates: list[Candidate], mode: str, classes: Mapping[str, str] | None) -> Candidate:
    best = max(_score(c) for c in candidates)
    tied = [c for c in candidates if abs(_score(c) - best) < _EPS]
    if mode == "numeric":
        counts: dict[str, int] = {}
        for c in tied:
            if c.answer is not None:
                key = class_of(c.answer, classes)
                counts[key] = counts.get(key, 0) + 1
        if counts:
            top = max(counts.values())
            tied = [c for c in tied if c.answer is not None and counts[class_of(c.answer, classes)] == top]
    return tied[0]


def select_answered(
    iterations: Sequence[Sequence[Candidate]],
    select_from: SelectFrom,
    mode: str,
    rule: SelectRule | ConfidenceRule = "best_score",
    classes: Mapping[str, str] | None = None,
    *,
    fallback: bool = True,
    fallback_from: FallbackFrom = "all",
    confidence: ConfidenceVote | None = None,
    held_over: Sequence[Sequence[int] | None] = (),
) -> tuple[Candidate | None, Fallback | None]:
    """The candidate ``rule`` returns from ``select_from`` of ``iterations`` (oldest first); when it has no answer
    (numeric mode) or there is none (proof mode: every call failed or wrote no text) and ``fallback`` is on, an
    answered (a usable) candidate of the earlier iterations instead, as ``fallback_from`` says (see the module
    docstring).

    The second value describes a fallback that happened (None otherwise): the iteration and index of the candidate
    returned, its answer, and why. ``classes`` must cover the answers of every iteration. ``held_over``: per
    iteration, the trajectories a budget stop refused there (:func:`held`).
    """
    # An iteration's vote is over the solutions the trajectories hold then (a carried one counts where the reply that
    # kept it had no answer, a held-over one where the stop refused the trajectory's call); "all" reads every
    # solution written, each once.
    last = len(iterations) - 1
    pool = held(iterations, last, held_over) if iterations and select_from == "last" else None
    chosen = select(
        pool if pool is not None else candidates_from(iterations, select_from), mode, rule, classes, confidence
    )

    def holds(c: Candidate | None) -> bool:
        # Numeric mode: an answer; proof mode: a usable candidate at all (the proof is the answer).
        return c is not None and (mode != "numeric" or c.answer is not None)

    if not fallback or holds(chosen):
        return chosen, None
    earlier = iterations[:-1]
    # ``select`` prefers answered candidates; over every earlier one, ties go to the latest, most refined answer.
    latest = [held(earlier, t, held_over) for t in reversed(range(len(earlier)))]
    pools = [candidates_from(earlier, "all")] if fallback_from == "all" else latest
    picks = (select(pool, mode, rule, classes, confidence) for pool in pools)
    backup = next((c for c in picks if holds(c)), None)
    if backup is None:
        return chosen, None
    where = next(t for t, candidates in enumerate(earlier) if any(c is backup for c in candidates))
    lacking = "no answered candidate" if mode == "numeric" else "no usable candidate"
    reason = f"{lacking} in the " + ("last iteration" if select_from == "last" else "iterations")
    return backup, Fallback(iteration=where, candidate=backup.index, answer=backup.answer, reason=reason)


def lacks_confidence(candidates: Sequence[Candidate]) -> bool:
    """Whether an answered candidate of ``candidates`` that succeeded has no confidence (the confidence rules then
    count plain votes instead)."""
    return any(c.confidence is None for c in candidates if c.error is None and c.answer is not None)


def _confidence(c: Candidate, how: ConfidenceVote) -> float:
    return c.confidence.value(how.measure) if c.confidence is not None else 0.0


def _top_scored(holders: list[Candidate]) -> Candidate:
    best = max(_score(c) for c in holders)
    return next(c for c in holders if abs(_score(c) - best) < _EPS)


def _score(c: Candidate) -> float:
    return c.score or 0.0


def _rounded(standing: tuple[float, float, int]) -> tuple[float, float, int]:
    # Score sums compare as equal when they differ only by float noise.
    return (round(standing[0], 9), round(standing[1], 9), standing[2])
