"""Accuracy of the returned answer against completion tokens spent per problem: one frontier per run.

- Iterative methods (TMAS, the refinement baselines, CoT): one point per iteration t, at the accuracy of the answer
  selected after t and the mean cumulative completion tokens per problem up to t.
- Majority vote: MV@k for k = 1, 2, 4, ..., K from the K stored samples of each problem, as the exact expectation over
  a uniformly random subset of k samples (see :func:`mv_at_k`), at k times the problem's mean completion tokens per
  sample (what it spent on its samples over their number); a finished problem with fewer samples (a vote decided
  early) keeps its vote over all of them. A sample stopped while it streamed (online stopping) is none of the K, as
  it is no rollout of Pass@1 (metrics.samples_drawn): it takes no place in a draw, neither a vote nor a wrong answer;
  what it spent stays in its problem's tokens, shared among the samples that ran to their end. A vote weighted or
  filtered by the samples' confidence (``select`` other than ``vote``) returns what no plain vote does: its frontier
  is the answer it returned, one point per iteration (:func:`votes_frontier`).

What a problem spent is what its stored calls spent where the run's store gives them (``spend``, metrics.run_spend):
every completion token the server generated for it, a call that failed, was cancelled or failed
and was asked again on resume included, as the run's summary counts; so a method that retries much is charged for
it. Prompt tokens are not counted.

Each point carries the standard error of its accuracy across problems (the band) and the number of labeled problems
that reached it (a run still mid-way has fewer problems at later points). The equal-budget table reads each frontier
at fixed budgets: the best accuracy among its points at or under the budget.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tmas.grading.grades import SELECTED, Grades
from tmas.llm.types import Usage
from tmas.methods import method_traits
from tmas.reports.metrics import (
    Spend,
    labeled_results,
    last_iteration,
    reached,
    record_at,
    samples_drawn,
    spent_through,
    vote_key,
)
from tmas.store.records import Candidate, ProblemResult

# Completion tokens per problem at which the equal-budget table reads every frontier.
BUDGETS = (1000, 2000, 4000, 8000, 16000)


@dataclass(frozen=True)
class FrontierPoint:
    label: str  # "It3" or "MV@4"
    tokens: float  # mean (expected, for MV@k) cumulative completion tokens per problem
    accuracy: float
    stderr: float  # standard error of the accuracy across problems (0 with one problem)
    problems: int


def votes_frontier(method: str, params: Mapping[str, Any]) -> bool:
    """Whether a run's frontier is MV@k over its samples: its method's samples vote in one pool (traits.frontier ==
    "votes") by plain plurality. A vote weighted or filtered by confidence (majority vote's ``select`` =
    ``confidence_vote``, ``filtered_vote``) can return an answer no plain vote of its samples gives, so its frontier is
    the answer it returned, one point per iteration, as an iterative method's."""
    return method_traits(method).frontier == "votes" and params.get("select", "vote") == "vote"


def run_frontier(
    results: list[ProblemResult],
    grades: Grades,
    *,
    majority: bool,
    classes: Mapping[str, Mapping[str, str]] | None = None,
    spend: Spend | None = None,
) -> list[FrontierPoint]:
    """The run's frontier: MV@k points for a majority-vote run, one point per iteration otherwise. ``classes``: per
    problem, answer -> class key (metrics.answer_classes_of), so MV@k counts votes by value as the run did.
    ``spend``: what the problems' stored calls spent (metrics.run_spend); without it, their records'."""
    labeled = labeled_results(results, grades)
    return mv_frontier(labeled, grades, classes, spend) if majority else iteration_frontier(labeled, grades, spend)


def iteration_frontier(results: list[ProblemResult], grades: Grades, spend: Spend | None = None) -> list[FrontierPoint]:
    points = []
    for t in range(last_iteration(results) + 1):
        at = returned_by_problem(results, grades, t, spend)
        if at:
            points.append(_point(f"It{t}", [tokens for _, tokens in at.values()], [acc for acc, _ in at.values()]))
    return points


def returned_by_problem(
    results: list[ProblemResult], grades: Grades, iteration: int | None = None, spend: Spend | None = None
) -> dict[str, tuple[float, float]]:
    """Per problem that counts at ``iteration`` (None: its last), the correctness of the answer returned then and the
    completion tokens spent up to it (:func:`spent_through`, of ``spend`` where given); a problem that failed before
    any iteration returned nothing (0). With ``iteration`` None, what the run returned at all it spent: an iteration
    a budget or an error cut short after the last one included, as MV@k (:func:`mv_by_problem`) counts a problem."""
    out: dict[str, tuple[float, float]] = {}
    for result in results:
        t = iteration
        if t is None:
            t = max((rec.iteration for rec in result.iterations), default=0)
        if not reached(result, t):
            continue
        record = record_at(result, t)
        # One that stopped before t (its answer stands) or failed counts what the whole problem spent, an iteration
        # a budget or an error cut short included (spent_through); at its last answer (None) so does every problem.
        spent = float(spent_through(result, iteration, _completion, spend))
        if record is None:  # failed before any iteration: nothing returned
            out[result.problem_id] = (0.0, spent)
            continue
        out[result.problem_id] = (grades.share_correct((result.problem_id, record.iteration, SELECTED)), spent)
    return out


def _completion(usage: Usage) -> int:
    return usage.completion_tokens


def mv_frontier(
    results: list[ProblemResult],
    grades: Grades,
    classes: Mapping[str, Mapping[str, str]] | None = None,
    spend: Spend | None = None,
) -> list[FrontierPoint]:
    """MV@k for k = 1, 2, 4, ... and the largest K; a problem counts at MV@k as :func:`mv_by_problem` counts it."""
    largest = max((len(s) for s in _samples(results).values()), default=0)
    ks = [2**i for i in range(largest.bit_length())]
    if largest and ks[-1] != largest:
        ks.append(largest)
    points = []
    for k in ks:
        at = mv_by_problem(results, grades, k, classes, spend)
        if at:
            points.append(_point(f"MV@{k}", [tokens for _, tokens in at.values()], [acc for acc, _ in at.values()]))
    return points


def mv_by_problem(
    results: list[ProblemResult],
    grades: Grades,
    k: int,
    classes: Mapping[str, Mapping[str, str]] | None = None,
    spend: Spend | None = None,
) -> dict[str, tuple[float, float]]:
    """Per problem with at least k stored samples, MV@k (:func:`mv_at_k`) and its expected completion tokens: k times
    the problem's mean per sample, what it spent drawing its samples over their number (samples stopped online are
    none of them, :func:`tmas.reports.metrics.samples_drawn`, but what they spent counts; a sample's own usage holds
    each of its calls, an echo's retry included; the problem's spend also holds a call no sample came of, as the
    echoing first reply of a sample whose retry the budget refused, and with ``spend`` a sample's call that failed and
    was asked again on resume: :func:`spent_through`). A finished problem with fewer than k samples
    (its vote decided early, a budget stopped it) keeps its vote over all of them at every larger k, at their tokens,
    as a stopped problem keeps its answer on the iteration frontier; one still mid-way counts only up to the samples
    it drew. A problem that failed before any sample returned nothing (0), at every k, at what it spent."""
    out: dict[str, tuple[float, float]] = {}
    samples = _samples(results)
    for result in results:
        pid, drawn = result.problem_id, samples[result.problem_id]
        # At least the samples' own calls (a record that holds no usage of its own), those stopped online included.
        own = sum(c.usage.completion_tokens for record in result.iterations for c in record.candidates)
        spent = max(spent_through(result, None, _completion, spend), own)
        if not drawn and not result.in_progress:
            out[pid] = (0.0, float(spent))
            continue
        if len(drawn) < k and (result.in_progress or not drawn):
            continue
        size = min(k, len(drawn))
        groups, others = _answer_groups(pid, drawn, grades, (classes or {}).get(pid))
        # Expected tokens of a uniformly random k-subset: k times the mean per sample, spent / n.
        out[pid] = (mv_at_k(groups, others, size), size * spent / len(drawn))
    return out


def _samples(results: list[ProblemResult]) -> dict[str, list[tuple[int, Candidate]]]:
    # Every stored sample of every iteration (majority vote's later iterations draw more samples), but those stopped
    # online (samples_drawn).
    return {r.problem_id: samples_drawn(r) for r in results}


def mv_at_k(groups: Sequence[tuple[int, float]], others: int, k: int) -> float:
    """Expected accuracy of a plurality vote over k samples drawn without replacement from the stored ones.

    ``groups`` holds, per distinct answer, (how many samples give it, its correctness in [0, 1]); ``others`` counts
    the samples with no answer (they take a place in the draw but no vote). Ties between answers are broken
    uniformly at random (the same as: the tied answer drawn first wins, in a random draw order); a draw with no
    answer returns nothing and counts 0. Exact, by counting: answer j wins with v of its samples drawn in
    C(c_j, v) * sum over the other answers' draws x_i <= v of prod C(c_i, x_i) / (1 + #{x_i = v}) ways (times the
    ways to fill the rest with answerless samples), out of C(n, k).
    """
    n = sum(size for size, _ in groups) + others
    if not 1 <= k <= n:
        raise ValueError(f"MV@{k} needs 1 <= k <= {n} samples")
    expected = 0.0
    for j, (size_j, correct_j) in enumerate(groups):
        if correct_j == 0:
            continue
        rest = [size for i, (size, _) in enumerate(groups) if i != j]
        for v in range(1, min(size_j, k) + 1):
            wins = math.comb(size_j, v) * _tie_weighted_ways(rest, others, v, k - v)
            expected += correct_j * wins
    return expected / math.comb(n, k)


def _tie_weighted_ways(rest: list[int], others: int, v: int, room: int) -> float:
    """Ways to draw ``room`` more samples with every other answer drawn at most v times, each weighted by
    1 / (1 + number of answers drawn exactly v times)."""
    # An answer with fewer than v samples can neither beat nor tie j: by Vandermonde's identity its samples join the
    # answerless ones in one free pool, and only the answers that can reach v need counting one by one.
    free = others + sum(size for size in rest if size < v)
    # ways[(drawn, tied)]: draws from the answers seen so far, by samples drawn and answers tied at v.
    ways: dict[tuple[int, int], int] = {(0, 0): 1}
    for size in (size for size in rest if size >= v):
        step: dict[tuple[int, int], int] = {}
        for (drawn, tied), count in ways.items():
            for x in range(min(v, room - drawn) + 1):
                key = (drawn + x, tied + (x == v))
                step[key] = step.get(key, 0) + count * math.comb(size, x)
        ways = step
    return sum(count * math.comb(free, room - drawn) / (1 + tied) for (drawn, tied), count in ways.items())


def equal_budget(points: Sequence[FrontierPoint], budgets: Sequence[int] = BUDGETS) -> list[FrontierPoint | None]:
    """Per budget, the best point at or under it (None where the frontier never got that low)."""
    out: list[FrontierPoint | None] = []
    for budget in budgets:
        within = [p for p in points if p.tokens <= budget]
        out.append(max(within, key=lambda p: p.accuracy) if within else None)
    return out


def _answer_groups(
    pid: str, drawn: list[tuple[int, Candidate]], grades: Grades, classes: Mapping[str, str] | None
) -> tuple[list[tuple[int, float]], int]:
    """Distinct answers (by value) of a problem's samples as (count, correctness), and the number of answerless
    samples."""
    members: dict[str, list[float]] = {}
    others = 0
    for it, c in drawn:
        key = vote_key(c, classes)
        if key is None:
            others += 1
            continue
        members.setdefault(key, []).append(grades.share_correct((pid, it, c.index)))
    # An answer's correctness is the mean over its holders (they agree unless a judge was inconsistent).
    return [(len(v), statistics.fmean(v)) for v in members.values()], others


def _point(label: str, tokens: list[float], accuracy: list[float]) -> FrontierPoint:
    # Standard error of the mean across problems: SE = s / sqrt(n), s^2 = 1/(n - 1) * sum_i (a_i - mean)^2 over the
    # n problems' accuracies a_i (0 with one problem), as metrics.pass_at_1_stderr for Pass@1.
    stderr = statistics.stdev(accuracy) / math.sqrt(len(accuracy)) if len(accuracy) > 1 else 0.0
    return FrontierPoint(label, statistics.fmean(tokens), statistics.fmean(accuracy), stderr, len(accuracy))
