"""Can the verifier carry selection? The ROC area of candidate scores against correctness (the paper's B.4 question),
and the same of the candidates' confidence from log-probabilities (DeepConf).

Every candidate with a score and an extracted answer counts once (answerless candidates are scored 0 by rule, not by
the verifier, so they are left out and counted apart); it is correct when at least half of the judge runs say so.
A candidate's score is what its verifiers gave it (:func:`tmas.reports.analysis.verification_score`): the mean of its
readable verifications. A verification without a score (its call failed, or no score could be read from its reply)
said nothing of the candidate, so it is left out and counted, not read as 0 as the method's selection score reads it;
a candidate none of whose verifications holds a score is left out with them.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tmas.grading.grades import Grades
from tmas.reports.analysis import verification_score
from tmas.reports.metrics import labeled_results
from tmas.store.records import Candidate, ProblemResult


@dataclass
class ScoreSeparation:
    available: bool
    reason: str = ""
    auc: float | None = None
    right: int = 0
    wrong: int = 0
    right_mean: float | None = None
    wrong_mean: float | None = None
    # Scored candidates left out because they have no extracted answer.
    answerless: int = 0
    # Verifications of candidates with an answer left out because they hold no score (failed or unreadable).
    unread: int = 0


def roc_area(right: Sequence[float], wrong: Sequence[float]) -> float | None:
    """Area under the ROC curve: the chance that a random right candidate outscores a random wrong one, ties
    counting one half (the Mann-Whitney U statistic over |right| * |wrong|). None when either side is empty."""
    if not right or not wrong:
        return None
    ordered = sorted(wrong)
    wins = 0.0
    for score in right:
        below = bisect.bisect_left(ordered, score)
        ties = bisect.bisect_right(ordered, score) - below
        wins += below + 0.5 * ties
    return wins / (len(right) * len(wrong))


def score_separation(results: list[ProblemResult], grades: Grades) -> ScoreSeparation:
    return _separation(
        results,
        grades,
        verification_score,
        "no scored candidate with an answer (the method records no verifier scores)",
        count_unread=True,
    )


def confidence_separation(results: list[ProblemResult], grades: Grades, measure: str) -> ScoreSeparation:
    """The same question of the candidates' confidence (DeepConf's ``measure``: methods/confidence.py): does the
    model's own certainty tell right answers from wrong ones?"""
    return _separation(
        results,
        grades,
        lambda cand: cand.confidence.value(measure) if cand.confidence is not None else None,
        "no candidate with an answer has a confidence (the run asked for no log-probabilities, or got none)",
    )


def _separation(
    results: list[ProblemResult],
    grades: Grades,
    value_of: Callable[[Candidate], float | None],
    none: str,
    *,
    count_unread: bool = False,
) -> ScoreSeparation:
    right: list[float] = []
    wrong: list[float] = []
    answerless = unread = 0
    for result in labeled_results(results, grades):
        for record in result.iterations:
            for cand in record.candidates:
                if cand.error is not None:
                    continue
                if count_unread and cand.answer is not None:
                    unread += sum(v.score is None for v in cand.meta.verifications or [])
                value = value_of(cand)
                if value is None:
                    continue
                if cand.answer is None:
                    answerless += 1
                    continue
                correct = grades.majority_correct((result.problem_id, record.iteration, cand.index))
                (right if correct else wrong).append(value)
    if not right and not wrong:
        return ScoreSeparation(False, none, answerless=answerless, unread=unread)
    out = ScoreSeparation(True, right=len(right), wrong=len(wrong), answerless=answerless, unread=unread)
    out.auc = roc_area(right, wrong)
    out.right_mean = statistics.fmean(right) if right else None
    out.wrong_mean = statistics.fmean(wrong) if wrong else None
    if out.auc is None:
        out.reason = "every measured candidate is " + ("right" if right else "wrong") + ": no ROC area"
    return out
