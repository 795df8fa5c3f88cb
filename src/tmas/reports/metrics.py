"""Metrics per iteration: Pass@1 (paper, appendix A.2) and its standard error across problems, MV@k, selected-answer
accuracy, calls and tokens.

MV@k is plain majority vote over the first k candidates (all of them without k): the expected accuracy with ties
between answers split evenly, the same quantity as the frontier's MV@k at k = every sample (reports/frontier.py).
With ``pooled`` (majority vote, whose later iterations draw more samples and vote over all of them) it votes over
every candidate drawn up to the iteration, as the method does; otherwise over the iteration's own candidates.

Pass@1 and MV@k (not pooled) read the solutions an iteration's trajectories hold (:func:`held_at`): where a
refinement gave no answer and its trajectory went on from an earlier solution (Self-Refine, Verify-Refine), that
solution is the trajectory's rollout at the iteration, graded where it was written. Runs stored before that was
recorded read each iteration's own candidates. An iteration a budget stop cut short counts the rollouts that came
back alone: a trajectory it refused (``IterationRecord.held_over``) keeps its earlier solution in the method's own
vote, not in Pass@1 or MV@k (that solution was a rollout of the iteration it was written in). A sample stopped while
it streamed (online stopping, DeepConf's online mode: methods/online_stop.py) is no rollout: it was discarded by
design before it reached an answer, so it neither counts in Pass@1's n_i nor is one of the samples MV@k votes over
(:func:`samples_drawn`; it is no wrong vote either), here and in the frontier's MV@k (DeepConf's accuracies are over
the traces that ran to their end).

A problem that stopped early (adaptive stopping) keeps its last iteration's candidates at later iterations: that is
what the method would return, at no further cost. The tables run to the method's last iteration (its T) once a problem
has finished, so a run whose every problem stopped early still shows their answers there, as the paper's
per-iteration curves count them. A problem with no iteration at all (a failed run) scores 0.
A problem still mid-way (no result yet, see run_results.py) counts only at the iterations it finished; each
iteration's ``problems`` says how many labeled problems reached it.

What a problem spent is read from its stored calls where the run's store is at hand (:func:`run_spend`): every call
the server answered for it, a failed, cancelled or failed-then-asked-again one included, as the run's summary, the cost
table and the budget count them (:func:`spent_through`, the one count the tables, the frontier and the budget table
read). An iteration's record holds only the calls of the pass that finished it: a call that failed and was asked again
on resume is in none.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tmas.answer_classes import EquivalenceCheck, answer_classes, class_of
from tmas.grading.grades import SELECTED, Grades
from tmas.grading.judge import JUDGE_ROLE
from tmas.llm.types import Usage
from tmas.store.records import Candidate, IterationRecord, ProblemResult
from tmas.store.run_store import RunStore, Spent

# Per problem, what its stored calls spent in each iteration (None: calls of no iteration): :func:`run_spend`.
Spend = Mapping[str, Mapping[int | None, Spent]]


def run_spend(store: RunStore) -> Spend:
    """What each problem of ``store``'s run spent, by iteration: every stored call of the method's roles (the judge's,
    which grading stores in the run, apart), answered, failed, cancelled or failed and asked again, as the run's
    summary and the report's cost table count them."""
    return store.spent_by_iteration(JUDGE_ROLE, other_roles=True)


def pass_at_1(labels: Mapping[str, Sequence[Sequence[bool]]]) -> float:
    """Pass@1 as defined in the TMAS paper, appendix A.2.

    ``labels[problem][r]`` holds the correctness of each of the problem's n_i rollouts under judge run r.
    Pass@1^(r) = 1/|P| * sum_i c_i^(r) / n_i  (c_i^(r): rollouts judged correct in run r), and
    Pass@1 = 1/R * sum_r Pass@1^(r). A problem with no rollouts contributes 0.
    The rollouts are the solutions the problem's trajectories hold (:func:`held_at`): a failed call or a reply
    without an answer is a wrong one; a sample stopped by online stopping (DeepConf) is none, and not in n_i.
    """
    if not labels:
        return 0.0
    runs = max(len(per_run) for per_run in labels.values())
    if runs == 0:
        return 0.0
    total = 0.0
    for r in range(runs):
        share = 0.0
        for per_run in labels.values():
            rollouts = per_run[r] if r < len(per_run) else []
            share += sum(rollouts) / len(rollouts) if rollouts else 0.0
        total += share / len(labels)
    return total / runs


def pass_at_1_stderr(labels: Mapping[str, Sequence[Sequence[bool]]]) -> float:
    """The standard error of :func:`pass_at_1` across problems: the sample standard deviation (n - 1) of each
    problem's Pass@1 (its share of correct rollouts, averaged over judge runs) over sqrt(n); 0 with one problem, as
    the frontier's band. With p_i = 1/R * sum_r c_i^(r) / n_i (so that Pass@1 = 1/|P| * sum_i p_i):
    SE = s / sqrt(|P|), s^2 = 1/(|P| - 1) * sum_i (p_i - Pass@1)^2. The spread of a problem's n_i rollouts is in
    its p_i, so the one formula holds for any number of samples per problem."""
    if len(labels) < 2:
        return 0.0
    runs = max(len(per_run) for per_run in labels.values())
    if runs == 0:
        return 0.0
    shares = [
        sum(sum(rollouts) / len(rollouts) if rollouts else 0.0 for rollouts in per_run) / runs
        for per_run in labels.values()
    ]
    return statistics.stdev(shares) / math.sqrt(len(shares))


def vote_share(votes: Sequence[tuple[str | None, float]]) -> float | None:
    """Expected correctness of a plurality vote over all of ``votes`` (per sample: its answer's class key, None for a
    sample without an answer, and its correctness), ties between answers split evenly; an answer's correctness is the
    mean over the samples holding it. The frontier's MV@k (reports/frontier.py) at k = every sample. None when no
    sample has an answer."""
    members: dict[str, list[float]] = {}
    for key, correct in votes:
        if key is not None:
            members.setdefault(key, []).append(correct)
    if not members:
        return None
    most = max(len(v) for v in members.values())
    tied = [statistics.fmean(v) for v in members.values() if len(v) == most]
    return statistics.fmean(tied)


@dataclass
class IterationMetrics:
    iteration: int
    pass1: float
    # Standard error of Pass@1 across problems (pass_at_1_stderr); the spread across judge runs is pass1_runs.
    pass1_stderr: float
    pass1_runs: list[float]
    mv: float
    selected: float
    calls: int
    tokens: int
    cumulative_calls: int
    cumulative_tokens: int
    # The iteration's tokens by kind (tokens = prompt + completion; reasoning is part of completion).
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    # Mean cumulative tokens per problem over the problems that reached the iteration (or finished before it: at
    # everything they spent, spent_through): the x axis of Pass@1 against compute.
    tokens_per_problem: float
    problems: int


class OnProblems(Protocol):
    """A figure standing on some labeled problems: an iteration's metrics, a frontier point."""

    @property
    def problems(self) -> int: ...


def stands_on(m: OnProblems, labeled: int) -> str:
    """What a run's figure at ``m`` adds where it stands on fewer problems than the run's ``labeled`` ones (a run
    still mid-way, or stopped before every problem started): `` (k of n problems)``; else nothing."""
    return f" ({m.problems} of {labeled} problems)" if m.problems < labeled else ""


def short_of(metrics: RunMetrics, labeled: int) -> bool:
    """Whether some of a run's figures stand on fewer problems than its ``labeled`` ones: problems still mid-way or
    never started (a finished problem counts at every iteration, one that stopped early with its last answer)."""
    return any(m.problems < labeled for m in metrics.iterations if m.problems)


@dataclass
class FinalState:
    """A finished problem's final state: the Pass@1 of its last iteration (averaged over judge runs; None unlabeled)
    and the tokens (prompt and completion) it spent in all."""

    pass1: float | None
    tokens: int


@dataclass
class RunMetrics:
    iterations: list[IterationMetrics] = field(default_factory=list)
    labeled: int = 0
    unlabeled: int = 0
    judge_runs: int = 1
    mv_k: int | None = None
    # Each finished problem's final state, by problem id (a problem still mid-way has none): runs compared problem by
    # problem stand on the problems both finished.
    finals: dict[str, FinalState] = field(default_factory=dict)

    def at(self, iteration: int) -> IterationMetrics | None:
        return next((m for m in self.iterations if m.iteration == iteration), None)


def reached(result: ProblemResult, iteration: int) -> bool:
    """Whether the problem counts at ``iteration``: a finished problem always (its last answer stands), one still
    mid-way only up to the last iteration it finished."""
    if not result.in_progress:
        return True
    return any(record.iteration >= iteration for record in result.iterations)


def record_at(result: ProblemResult, iteration: int) -> IterationRecord | None:
    """The problem's record for ``iteration``, or its last earlier one (it stopped: its answer stands)."""
    chosen = None
    for record in result.iterations:
        if record.iteration <= iteration:
            chosen = record
    return chosen


def held_at(result: ProblemResult, record: IterationRecord) -> list[tuple[int, Candidate]]:
    """The solutions ``result``'s trajectories hold at ``record``'s iteration, each with the iteration it was written
    in (its grades' key): the record's candidates, except a refinement without an answer whose trajectory went on
    from an earlier solution (``meta.carried_from``: Self-Refine, Verify-Refine), read as that solution. A sample
    stopped while it streamed (``meta.stopped_early``: online stopping) holds none and is left out. A trajectory whose
    call a budget stop refused (``record.held_over``) votes in the method's selection with the solution it held
    before, but is no rollout of this iteration: Pass@1's n_i counts the calls that came back."""
    by_iteration = {rec.iteration: rec for rec in result.iterations}
    out = []
    for c in record.candidates:
        if c.meta.stopped_early:
            continue
        origin = by_iteration.get(c.meta.carried_from) if c.meta.carried_from is not None else None
        carried = next((o for o in origin.candidates if o.index == c.index), None) if origin else None
        out.append((origin.iteration, carried) if origin and carried else (record.iteration, c))
    return out


def samples_drawn(result: ProblemResult, through: int | None = None) -> list[tuple[int, Candidate]]:
    """Every sample ``result`` drew up to iteration ``through`` (None: all), each with its iteration: the samples a
    vote pools (majority vote's later iterations draw more), for MV@all and the frontier's MV@k. A sample stopped
    while it streamed (``meta.stopped_early``: online stopping) is left out, as :func:`held_at` leaves it out of
    Pass@1: it was discarded before it reached an answer, so it takes no place in a draw and gives no vote."""
    return [
        (record.iteration, c)
        for record in result.iterations
        if through is None or record.iteration <= through
        for c in record.candidates
        if not c.meta.stopped_early
    ]


def last_iteration(results: Sequence[ProblemResult]) -> int:
    """The last iteration any problem of ``results`` reached (-1: none reached one)."""
    return max((record.iteration for r in results for record in r.iterations), default=-1)


def iterations_shown(results: Sequence[ProblemResult], iterations: int | None = None) -> int:
    """How many iterations the tables show: up to the last any problem reached, and up to the method's last of
    ``iterations`` (its T) once a problem has finished (status done: it ran them all, or stopped early and keeps its
    answer through them). A run with problems only mid-way or failed shows what they reached."""
    reached_last = last_iteration(results) + 1
    if iterations is None or not any(r.status == "done" and r.iterations for r in results):
        return reached_last
    return max(reached_last, iterations)


def configured_iterations(params: dict[str, Any]) -> int | None:
    """The iterations (T) the run's method was set to run, from its stored parameters (None where not a count)."""
    value = params.get("iterations")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def compute_metrics(
    results: list[ProblemResult],
    grades: Grades,
    *,
    iterations: int | None = None,
    mv_k: int | None = None,
    classes: Mapping[str, Mapping[str, str]] | None = None,
    pooled: bool = False,
    spend: Spend | None = None,
) -> RunMetrics:
    """All per-iteration metrics of one run; only problems with grades (labeled) count toward accuracies.
    ``classes``: per problem, answer -> class key (:func:`answer_classes_of`), so MV@k groups answers by the grading
    rules' equivalence; without it, by normalized spelling and exact numbers. ``pooled``: MV@k votes over every
    candidate drawn up to each iteration (a method whose iterations add samples to one vote, traits.frontier ==
    "votes"), else over the iteration's own. ``iterations``: the method's T, to which the tables run
    (:func:`iterations_shown`). ``spend``: what the problems' stored calls spent (:func:`run_spend`), which the calls
    and tokens count; without it, the iteration records' (a run's calls asked again on resume are in none)."""
    labeled = labeled_results(results, grades)
    out = RunMetrics(labeled=len(labeled), unlabeled=len(grades.unlabeled), judge_runs=grades.runs, mv_k=mv_k)
    cumulative_calls = cumulative_tokens = 0
    for t in range(iterations_shown(results, iterations)):
        labels: dict[str, list[list[bool]]] = {}
        mv_hits = selected_hits = 0.0
        present = [r for r in labeled if reached(r, t)]
        for result in present:
            pid = result.problem_id
            record = record_at(result, t)
            own = held_at(result, record) if record else []
            labels[pid] = [[grades.correct((pid, i, c.index), r) for i, c in own] for r in range(grades.runs)]
            if record is None:
                continue
            it = record.iteration
            drawn = samples_drawn(result, it) if pooled else own
            keyed = [(vote_key(c, (classes or {}).get(pid)), i, c.index) for i, c in drawn[:mv_k]]
            for r in range(grades.runs):
                mv_hits += vote_share([(key, grades.correct((pid, i, index), r)) for key, i, index in keyed]) or 0.0
                selected_hits += grades.correct((pid, it, SELECTED), r)
        denominator = max(1, len(present) * grades.runs)
        # Cost counts every problem (labeled or not) and only iterations actually run.
        calls, usage = spent_in(results, t, spend)
        prompt, completion, reasoning = usage.prompt_tokens, usage.completion_tokens, usage.reasoning_tokens
        tokens = prompt + completion
        cumulative_calls += calls
        cumulative_tokens += tokens
        # Per problem, over the problems that count at t (labeled or not), as the accuracies count them: a problem
        # still mid-way that has not reached t neither adds its tokens nor counts as one.
        counted = [result for result in results if reached(result, t)]
        spent = sum(spent_through(result, t, _all_tokens, spend) for result in counted)
        per_run = [pass_at_1({pid: [runs[r]] for pid, runs in labels.items()}) for r in range(grades.runs)]
        out.iterations.append(
            IterationMetrics(
                iteration=t,
                pass1=pass_at_1(labels),
                pass1_stderr=pass_at_1_stderr(labels),
                pass1_runs=per_run,
                mv=mv_hits / denominator,
                selected=selected_hits / denominator,
                calls=calls,
                tokens=tokens,
                cumulative_calls=cumulative_calls,
                cumulative_tokens=cumulative_tokens,
                prompt_tokens=prompt,
                completion_tokens=completion,
                reasoning_tokens=reasoning,
                tokens_per_problem=spent / max(1, len(counted)),
                problems=len(present),
            )
        )
    out.finals = final_states(results, grades, {r.problem_id for r in labeled}, spend)
    return out


def spent_in(results: Sequence[ProblemResult], iteration: int, spend: Spend | None = None) -> tuple[int, Usage]:
    """The calls and usage of ``iteration`` over ``results``: their stored calls of it (``spend``), a problem still
    mid-way counting it only once finished; without ``spend``, the iteration's records."""
    if spend is None:
        ran = [record for result in results for record in result.iterations if record.iteration == iteration]
        return sum(record.calls for record in ran), sum((record.usage for record in ran), Usage())
    calls, usage = 0, Usage()
    for result in results:
        spent = spend.get(result.problem_id, {}).get(iteration)
        if spent is None or (result.in_progress and last_iteration([result]) < iteration):
            continue
        calls, usage = calls + spent.calls, usage + spent.usage
    return calls, usage


def final_states(
    results: Sequence[ProblemResult], grades: Grades, labeled: set[str], spend: Spend | None = None
) -> dict[str, FinalState]:
    """Each finished problem's :class:`FinalState`; a ``labeled`` one that failed before any iteration scores 0.
    ``spend``: as :func:`spent_through` reads it."""
    out = {}
    for result in results:
        if result.in_progress:
            continue
        pid = result.problem_id
        share = None
        if pid in labeled:
            record = record_at(result, last_iteration([result]))
            # As Pass@1 reads the last iteration: the solutions its trajectories hold (held_at).
            held = held_at(result, record) if record else []
            runs = [
                statistics.fmean(grades.correct((pid, i, c.index), r) for i, c in held) if held else 0.0
                for r in range(grades.runs)
            ]
            share = statistics.fmean(runs)
        out[pid] = FinalState(share, spent_through(result, None, _all_tokens, spend))
    return out


def _all_tokens(usage: Usage) -> int:
    return usage.prompt_tokens + usage.completion_tokens


def spent_through(
    result: ProblemResult, iteration: int | None, count: Callable[[Usage], int], spend: Spend | None = None
) -> int:
    """The tokens (as ``count`` counts a usage) ``result`` spent up to ``iteration`` (None: in all): its calls up to
    it, and where it had ended before ``iteration`` (it stopped early, or failed), everything it spent, an iteration
    a budget or an error cut short included, and the calls of a problem that failed before any iteration finished.
    A problem still mid-way counts its finished iterations.

    The one count of a problem's spend the tables, the frontier, the budget table and a budget's run read. With
    ``spend`` (:func:`run_spend`), its stored calls: every call the server answered for it, a failed, cancelled or
    failed-then-asked-again one included. Without it (no store at hand), its records and result's usage: the calls
    of the pass that solved it."""
    own = spend.get(result.problem_id) if spend is not None else None
    last = last_iteration([result])
    if result.in_progress:
        through: int | None = last if iteration is None else min(iteration, last)
    else:
        through = iteration if iteration is not None and last >= iteration else None
    if own is not None:
        return sum(
            count(spent.usage) for it, spent in own.items() if through is None or (it is not None and it <= through)
        )
    records = sum(count(record.usage) for record in result.iterations if through is None or record.iteration <= through)
    if through is not None:
        return records
    return max(records, count(result.usage))


def vote_key(candidate: Candidate, classes: Mapping[str, str] | None) -> str | None:
    """The class a candidate votes for, None when it has no vote (no answer, an empty one, or its call failed), as
    majority vote counts votes: the one key MV@all and the frontier's MV@k group answers by."""
    if not candidate.answer or candidate.error is not None:
        return None
    return class_of(candidate.answer, classes)


async def answer_classes_of(results: list[ProblemResult], check: EquivalenceCheck | None) -> dict[str, dict[str, str]]:
    """Per problem, each candidate answer of every iteration -> the key of its class of equal values, for
    :func:`compute_metrics` (``check``: e.g. ``tmas.answer_rules.RuleEquivalence``)."""
    out: dict[str, dict[str, str]] = {}
    for result in results:
        answers = [c.answer for record in result.iterations for c in record.candidates]
        out[result.problem_id] = await answer_classes(answers, check)
    return out


def labeled_results(results: list[ProblemResult], grades: Grades) -> list[ProblemResult]:
    """The problems accuracies count: those with grades, and labeled ones that failed before any iteration (as 0)."""
    graded = {key[0] for key in grades.verdicts}
    unlabeled = set(grades.unlabeled)
    return [r for r in results if r.problem_id in graded or (not r.iterations and r.problem_id not in unlabeled)]
