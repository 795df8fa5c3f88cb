"""The paper's analyses of a run: B.4 verification-score dynamics, B.3 unique guidelines against epsilon,
C's trace of experience entries, and the cost/benefit of adaptive stopping.

Method state is read defensively: a method that stores no scores or banks yields an analysis that says so.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from tmas.grading.grades import Grades
from tmas.methods.state import BankState
from tmas.reports.metrics import RunMetrics
from tmas.store.records import BUDGET_STOP, Candidate, IterationRecord, ProblemResult


# ------------------------------------------------------------------------------------------ B.4
@dataclass
class ScoreDynamics:
    """Verification scores of ever-correct vs never-correct problems (paper, appendix B.4)."""

    available: bool
    reason: str = ""
    ever_correct: list[str] = field(default_factory=list)
    never_correct: list[str] = field(default_factory=list)
    # Per iteration: group mean of the problems' mean verification score (None where the group has no scores).
    ever_by_iteration: list[float | None] = field(default_factory=list)
    never_by_iteration: list[float | None] = field(default_factory=list)
    per_problem: dict[str, float] = field(default_factory=dict)
    ever_mean: float | None = None
    never_mean: float | None = None
    # Delta(wrong - correct) = never-correct mean - ever-correct mean, as the paper reports it.
    delta: float | None = None
    u_statistic: float | None = None
    p_value: float | None = None


def verification_score(cand: Candidate) -> float | None:
    """What the verifiers gave a candidate: the mean of its readable verification scores; None when it was never
    verified (its call failed, its reply was empty) or no verification of it could be read. Not ``cand.score``,
    which is the method's selection score: 0 by rule for a failed call or, in numeric mode, a reply without an
    answer, and with each unreadable verification counted 0. A candidate without verification records (a run
    stored before they were kept) reads its stored score."""
    if cand.error is not None or cand.meta.unverified:
        return None
    if cand.meta.verifications is None:
        return cand.score
    read = [v.score for v in cand.meta.verifications if v.score is not None]
    return statistics.fmean(read) if read else None


def score_dynamics(results: list[ProblemResult], grades: Grades) -> ScoreDynamics:
    """B.4: per problem, the mean verification score (:func:`verification_score`) over all its iterations and
    rollouts, ever-correct problems (a rollout right in at least half of the judge runs) against never-correct."""
    graded_ids = {key[0] for key in grades.verdicts}
    scores: dict[str, dict[int, list[float]]] = {}
    ever: dict[str, bool] = {}
    for result in (r for r in results if r.problem_id in graded_ids):
        pid = result.problem_id
        ever[pid] = False
        for record in result.iterations:
            it = record.iteration
            for cand in record.candidates:
                ever[pid] = ever[pid] or grades.majority_correct((pid, it, cand.index))
                score = verification_score(cand)
                if score is not None:
                    scores.setdefault(pid, {}).setdefault(it, []).append(score)
    if not scores:
        return ScoreDynamics(False, "the method records no candidate scores (e.g. no verifier)")
    out = ScoreDynamics(True)
    out.ever_correct = [p for p in ever if ever[p] and p in scores]
    out.never_correct = [p for p in ever if not ever[p] and p in scores]
    last = max(it for per in scores.values() for it in per)
    for group, series in ((out.ever_correct, out.ever_by_iteration), (out.never_correct, out.never_by_iteration)):
        for t in range(last + 1):
            values = [statistics.fmean(scores[p][t]) for p in group if t in scores[p]]
            series.append(statistics.fmean(values) if values else None)
    # Per problem: the mean over all iterations and rollouts (Figure 7).
    out.per_problem = {p: statistics.fmean([s for v in per.values() for s in v]) for p, per in scores.items()}
    ever_values = [out.per_problem[p] for p in out.ever_correct]
    never_values = [out.per_problem[p] for p in out.never_correct]
    out.ever_mean = statistics.fmean(ever_values) if ever_values else None
    out.never_mean = statistics.fmean(never_values) if never_values else None
    if out.ever_mean is not None and out.never_mean is not None:
        out.delta = out.never_mean - out.ever_mean
        from scipy.stats import mannwhitneyu

        test = mannwhitneyu(never_values, ever_values, alternative="two-sided")
        out.u_statistic, out.p_value = float(test.statistic), float(test.pvalue)
    else:
        out.reason = "one of the groups is empty: no test"
    return out


# ------------------------------------------------------------------------------------------ B.3
def _bank_entries(record: IterationRecord, bank: Literal["experience", "guideline"]) -> list[tuple[str, str]] | None:
    """A bank's entries in an iteration's state as (id, text) pairs (ids survive rewording by the bank's agent);
    None when the state keeps no such bank (a method whose ``State`` is no ``BankState``)."""
    try:
        banks = BankState.model_validate(record.state)
    except ValidationError:
        return None  # not the banks of a method that keeps them: read as none
    if f"{bank}_bank" not in banks.model_fields_set:
        return None
    if bank == "guideline":
        return [(s.id, s.description) for s in banks.guideline_bank.strategies]
    return [(e.id, e.content) for e in banks.experience_bank.entries]


@dataclass
class GuidelineDiversity:
    available: bool
    reason: str = ""
    epsilon: float | None = None
    per_problem: dict[str, int] = field(default_factory=dict)
    mean_unique: float | None = None


def unique_guidelines(results: list[ProblemResult], method: dict[str, Any] | None) -> GuidelineDiversity:
    """Unique guideline texts per problem over all iterations (paper, appendix B.3), with the run's epsilon (from
    its stored ``method``, where the method has one)."""
    params = (method or {}).get("params", {})
    epsilon = params.get("epsilon")
    per_problem: dict[str, int] = {}
    for result in results:
        seen: set[str] = set()
        found = False
        for record in result.iterations:
            entries = _bank_entries(record, "guideline")
            if entries is None:
                continue
            found = True
            seen.update(ident for ident, _ in entries)
        if found:
            per_problem[result.problem_id] = len(seen)
    if not per_problem:
        return GuidelineDiversity(False, "no guideline bank in the iteration state (the method keeps none)")
    return GuidelineDiversity(
        True,
        epsilon=float(epsilon) if isinstance(epsilon, int | float) else None,
        per_problem=per_problem,
        mean_unique=statistics.fmean(per_problem.values()),
    )


# ------------------------------------------------------------------------------------------ C
@dataclass
class TraceRow:
    iteration: int
    correct: int
    rollouts: int
    # Among rollouts that saw the experience bank (TMAS "exploit" mode, from the candidate's meta), if known.
    exploit_correct: int | None
    exploit_rollouts: int | None
    new_entries: list[str]


@dataclass
class ExperienceTrace:
    """One problem's correct rollouts per iteration next to the experience entries each iteration added (Table 12).

    An entry added after iteration t is first visible to the exploit rollouts of iteration t + 1.
    """

    problem_id: str
    available: bool
    reason: str = ""
    rows: list[TraceRow] = field(default_factory=list)


def experience_trace(result: ProblemResult, grades: Grades) -> ExperienceTrace:
    pid = result.problem_id
    trace = ExperienceTrace(pid, True)
    known: set[str] = set()
    any_bank = False
    for record in result.iterations:
        it = record.iteration
        cands = record.candidates
        hits = [grades.majority_correct((pid, it, c.index)) for c in cands]
        modes = [c.meta.mode for c in cands]
        exploit = [h for h, m in zip(hits, modes, strict=True) if m == "exploit"]
        entries = _bank_entries(record, "experience")
        new: list[str] = []
        if entries is not None:
            any_bank = True
            new = [text for ident, text in entries if ident not in known]
            known.update(ident for ident, _ in entries)
        known_modes = any(m is not None for m in modes)
        trace.rows.append(
            TraceRow(
                it,
                sum(hits),
                len(cands),
                sum(exploit) if known_modes else None,
                len(exploit) if known_modes else None,
                new,
            )
        )
    if not any_bank:
        trace.available = False
        trace.reason = "no experience bank in the iteration state (the method keeps none)"
    return trace


def most_improved(results: list[ProblemResult], grades: Grades) -> ProblemResult | None:
    """The problem whose correct-rollout share rose most from its first to its last iteration (a case to trace)."""
    best, best_gain = None, 0.0
    for result in results:
        records = result.iterations
        if len(records) < 2:
            continue
        pid = result.problem_id

        def share(record: IterationRecord, pid: str = pid) -> float:
            cands = record.candidates
            hits = sum(grades.majority_correct((pid, record.iteration, c.index)) for c in cands)
            return hits / len(cands) if cands else 0.0

        gain = share(records[-1]) - share(records[0])
        if gain > best_gain:
            best, best_gain = result, gain
    return best


# ------------------------------------------------------------------------------------------ adaptive stopping
@dataclass
class StoppingSummary:
    stopped: int
    reasons: dict[str, int]
    mean_stop_iteration: float | None
    # The mean calls a stopped problem cost (majority vote's Beta stop ends within an iteration).
    mean_calls: float | None = None
    # Samples stopped while they streamed (online stopping), and the completion tokens that saved (estimated).
    stopped_traces: int = 0
    stopped_tokens_saved: int = 0

    @property
    def any(self) -> bool:
        """Whether the run stopped anything early: a problem, or a sample while it streamed."""
        return bool(self.stopped or self.stopped_traces)

    # Against a run of the same method and parameters without stopping, when one is given: tokens (prompt and
    # completion) saved per problem.
    tokens_saved: int | None = None
    tokens_saved_share: float | None = None
    pass1_lost: float | None = None
    # The problems both runs finished, which the comparison stands on.
    compared: int | None = None


def stopping_summary(results: list[ProblemResult]) -> StoppingSummary:
    """Problems stopped early by the method's own rule, why, and at which iteration on average; samples stopped while
    they streamed. A problem the budget stopped is none: the budget table counts it (reports/budget_table.py)."""
    stopped = [r for r in results if r.stopped_reason and r.stopped_reason != BUDGET_STOP]
    reasons: dict[str, int] = {}
    for r in stopped:
        reasons[str(r.stopped_reason)] = reasons.get(str(r.stopped_reason), 0) + 1
    stop_its = [max(rec.iteration for rec in r.iterations) for r in stopped if r.iterations]
    calls = [r.calls for r in stopped]
    return StoppingSummary(
        len(stopped),
        reasons,
        statistics.fmean(stop_its) if stop_its else None,
        mean_calls=statistics.fmean(calls) if calls else None,
        stopped_traces=sum(r.stopped_traces for r in results),
        stopped_tokens_saved=sum(r.stopped_tokens_saved for r in results),
    )


def stopping_tradeoff(summary: StoppingSummary, metrics: RunMetrics, full: RunMetrics) -> None:
    """Fill in tokens saved and final Pass@1 lost against ``full``, a run of the same method without stopping, over
    the problems both runs finished (one still mid-way, or never started, in either is left out: it has no final
    state to compare), and on how many problems that stands."""
    common = sorted(set(metrics.finals) & set(full.finals))
    if not common:
        return
    # A stopped problem's final state is its last answer, as it would stand at every later iteration.
    mine = statistics.fmean(metrics.finals[p].tokens for p in common)
    theirs = statistics.fmean(full.finals[p].tokens for p in common)
    summary.compared = len(common)
    summary.tokens_saved = round(theirs - mine)
    summary.tokens_saved_share = (theirs - mine) / theirs if theirs else None
    lost = [
        before - after
        for p in common
        if (before := full.finals[p].pass1) is not None and (after := metrics.finals[p].pass1) is not None
    ]
    summary.pass1_lost = statistics.fmean(lost) if lost else None
