"""Where a run loses its answers, read from its own records: the report's section and the viewer's page.

Each part applies to a run by what its method declares (``traits``), never by its name:

- **selection** (a method whose answer follows a selection rule, ``traits.selects``): of the graded problems whose
  returned answer is wrong, those with a right solution among those the trajectories hold in the last iteration (as
  the method's selection reads them, :func:`tmas.methods.selection.held`: a refinement without an answer counts as
  the earlier solution its trajectory carries, ``meta.carried_from``, and in an iteration a budget stop cut short a
  trajectory whose call it refused, ``IterationRecord.held_over``, as the solution it held at the iteration before),
  those with right candidates only in earlier iterations (refinement lost them, or the rule passed them over), and
  those with none;
- **the verifier** (a method with a ``verifier`` role): of the verifications of right candidates and of wrong ones,
  the share that passed the candidate (score above 0.5: on the paper's 1 / 0.5 / 0 scale, "fully correct"), and the
  ROC area of the candidates' scores (roc.py). Verifications of candidates without an answer are left out and
  counted apart (such a candidate scores 0 by rule, whatever its verifier said), as are verifications without a score
  (the call failed, or no score could be read: the method counts them 0, the passes and the ROC area leave them out);
- **iterations** (a method whose frontier runs over iterations, ``traits.frontier``): of the steps from one
  iteration to the next, those that changed the answer the method would return, for the better (wrong to right),
  for the worse (right to wrong), or to another wrong answer. Answers compare by value (normalized spelling and
  exact numbers, as votes count answers before the grading rules merge them), and two answers both graded right are
  one answer however spelled (each equals the reference by the report's grading);
- **replies** (every method): each role's replies cut at max_tokens or without a usable answer or score
  (reply_quality.py's counts).

A candidate is right when at least half of the judge runs say so (as in roc.py); the returned answer is the selected
answer of the problem's last finished iteration, graded as the report grades it. Problems count as in metrics.py
(:func:`tmas.reports.metrics.labeled_results`): a problem that failed before any iteration has no right candidate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Protocol

from tmas.answer_classes import value_key
from tmas.grading.grades import SELECTED, Grades
from tmas.grading.run_results import load_results
from tmas.methods import method_traits
from tmas.methods.base import ReplyTally
from tmas.methods.selection import held
from tmas.reports.document import Document, Heading, Paragraph, Table
from tmas.reports.metrics import labeled_results
from tmas.reports.reply_quality import role_replies, share
from tmas.reports.roc import ScoreSeparation, score_separation
from tmas.store.records import Candidate, IterationRecord, ProblemResult
from tmas.store.run_store import RunStore

# The role whose verdicts the verifier part reads (TMAS's verification agent, Verify-Refine's verifier).
VERIFIER_ROLE = "verifier"
# A verification passes its candidate when its score is above this.
PASS_ABOVE = 0.5
# At most this many problems named per kind of loss in the report (the viewer links every one).
NAMED = 10


@dataclass
class SelectionLosses:
    """Graded problems by where the returned answer went wrong."""

    problems: int = 0
    returned_right: int = 0
    # Problem ids whose returned answer is wrong: with a right candidate in the last iteration; with right candidates
    # only in earlier iterations; with no right candidate at all.
    in_last: list[str] = field(default_factory=list)
    only_earlier: list[str] = field(default_factory=list)
    never_right: list[str] = field(default_factory=list)

    @property
    def passed_over(self) -> int:
        """Problems whose right answer was among the candidates while another was returned."""
        return len(self.in_last) + len(self.only_earlier)


@dataclass
class VerifierPasses:
    """The verifier's verdicts on right and on wrong candidates."""

    right: int = 0
    right_passed: int = 0
    wrong: int = 0
    wrong_passed: int = 0
    # Verifications without a score (failed, or unreadable), and those of candidates without an answer: left out.
    no_score: int = 0
    answerless: int = 0
    separation: ScoreSeparation | None = None


@dataclass
class AnswerChanges:
    """Steps from one iteration to the next, and the (problem, iteration) of each that changed the answer."""

    steps: int = 0
    better: list[tuple[str, int]] = field(default_factory=list)
    worse: list[tuple[str, int]] = field(default_factory=list)
    # Changed from a wrong answer to another wrong one.
    neither: list[tuple[str, int]] = field(default_factory=list)

    @property
    def changed(self) -> int:
        return len(self.better) + len(self.worse) + len(self.neither)


@dataclass
class WhereLost:
    """A run's losses, each part None where the method's traits say it does not apply (or the run has no data)."""

    selection: SelectionLosses | None = None
    verifier: VerifierPasses | None = None
    changes: AnswerChanges | None = None
    replies: dict[str, ReplyTally] = field(default_factory=dict)
    # Part ("selection", "verifier", "changes") -> why it is None.
    why_not: dict[str, str] = field(default_factory=dict)


def where_lost(method: str, results: list[ProblemResult], grades: Grades, replies: dict[str, ReplyTally]) -> WhereLost:
    """Every part that applies to a run of ``method`` (its results as load_results gives them, with texts and
    metas, graded by ``grades``; ``replies``: its reply counts per role, :func:`role_replies`)."""
    traits = method_traits(method)
    labeled = labeled_results(results, grades)
    out = WhereLost(replies=replies)
    if traits.selects:
        out.selection = selection_losses(labeled, grades)
    else:
        out.why_not["selection"] = f"{method} declares no selection rule choosing its answer among candidates"
    if VERIFIER_ROLE not in traits.roles:
        out.why_not["verifier"] = f"{method} has no {VERIFIER_ROLE} role"
    else:
        out.verifier = verifier_passes(labeled, grades)
        if out.verifier is None:
            out.why_not["verifier"] = "no graded candidate records a verification"
    if traits.frontier == "iterations":
        out.changes = answer_changes(labeled, grades)
    else:
        out.why_not["changes"] = f"{method} votes over one pool of samples: its iterations are no revisions"
    return out


def run_where_lost(run_dir: Path, method: str, grades: Grades) -> WhereLost:
    """:func:`where_lost` of the run in ``run_dir``, read from its store."""
    with RunStore(run_dir, read_only=True) as store:
        return where_lost(method, load_results(store), grades, role_replies(store))


def _right_candidate(pid: str, record: IterationRecord, grades: Grades) -> bool:
    return any(grades.majority_correct((pid, record.iteration, c.index)) for c in record.candidates)


def _held_last(result: ProblemResult) -> list[tuple[int, Candidate]]:
    """The solutions ``result``'s trajectories hold in its last iteration, as the method's selection chose from them
    (:func:`held`): a carried solution, and a held-over one where a budget stop refused the trajectory's call
    (``IterationRecord.held_over``), each with the iteration it was written in (its grades' key). Unlike Pass@1's
    reading (:func:`tmas.reports.metrics.held_at`), a held-over solution counts: it was among those the rule passed
    over. A sample stopped while it streamed (``meta.stopped_early``) holds none and is left out."""
    if not result.iterations:
        return []
    by_iteration = {record.iteration: record for record in result.iterations}
    rows = [by_iteration.get(t) for t in range(result.iterations[-1].iteration + 1)]
    solutions = held(
        [r.candidates if r else [] for r in rows], len(rows) - 1, [r.held_over if r else None for r in rows]
    )
    written = {id(c): record.iteration for record in result.iterations for c in record.candidates}
    return [(written[id(c)], c) for c in solutions if not c.meta.stopped_early]


def _right_held(result: ProblemResult, grades: Grades) -> bool:
    """Whether a solution the trajectories hold in the last iteration is right, each graded where it was written."""
    pid = result.problem_id
    return any(grades.majority_correct((pid, written, c.index)) for written, c in _held_last(result))


def selection_losses(labeled: list[ProblemResult], grades: Grades) -> SelectionLosses:
    out = SelectionLosses(problems=len(labeled))
    for result in labeled:
        pid, records = result.problem_id, result.iterations
        if records and grades.majority_correct((pid, records[-1].iteration, SELECTED)):
            out.returned_right += 1
        elif records and _right_held(result, grades):
            out.in_last.append(pid)
        elif any(_right_candidate(pid, record, grades) for record in records[:-1]):
            out.only_earlier.append(pid)
        else:
            out.never_right.append(pid)
    return out


def verifier_passes(labeled: list[ProblemResult], grades: Grades) -> VerifierPasses | None:
    """None when no candidate records a verification (a run stored before verifications were kept, or none ran)."""
    out = VerifierPasses()
    found = False
    for result in labeled:
        pid = result.problem_id
        for record in result.iterations:
            for cand in record.candidates:
                checks = cand.meta.verifications or []
                if cand.error is not None or not checks:
                    continue
                found = True
                if cand.answer is None:
                    out.answerless += len(checks)
                    continue
                right = grades.majority_correct((pid, record.iteration, cand.index))
                for check in checks:
                    if check.score is None:
                        out.no_score += 1
                        continue
                    passed = check.score > PASS_ABOVE
                    if right:
                        out.right, out.right_passed = out.right + 1, out.right_passed + passed
                    else:
                        out.wrong, out.wrong_passed = out.wrong + 1, out.wrong_passed + passed
    if not found:
        return None
    out.separation = score_separation(labeled, grades)
    return out


def _value(answer: str | None) -> str | None:
    return value_key(answer) if answer is not None and answer.strip() else None


def answer_changes(labeled: list[ProblemResult], grades: Grades) -> AnswerChanges:
    out = AnswerChanges()
    for result in labeled:
        pid = result.problem_id
        for before, after in pairwise(result.iterations):
            out.steps += 1
            it = after.iteration
            if _value(before.selected) == _value(after.selected):
                continue  # the answer did not change (a verdict that differs on it is the judge's, not the step's)
            was = grades.majority_correct((pid, before.iteration, SELECTED))
            now = grades.majority_correct((pid, it, SELECTED))
            if was and now:
                continue  # both equal the reference by the report's grading: one answer, spelled two ways
            if was != now:
                (out.better if now else out.worse).append((pid, it))
            else:
                out.neither.append((pid, it))
    return out


# ------------------------------------------------------------------------------------------ the report's section
class LossRun(Protocol):
    """What the section reads of an evaluated run (tmas.reports.report.RunEvaluation has it): its losses, found from
    the records its grades were given on (None: not graded)."""

    label: str
    losses: WhereLost | None


def _named(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:NAMED])
    return shown + (f" and {len(ids) - NAMED} more" if len(ids) > NAMED else "")


def _rate(passed: int, total: int) -> str:
    return f"{100 * passed / total:.1f}% ({passed} of {total})" if total else "-"


def where_lost_section(doc: Document, runs: Sequence[LossRun]) -> None:
    """Where each graded run of one benchmark loses its answers: one table per part, a row per run it applies to."""
    write_where_lost(doc, [(e.label, e.losses) for e in runs if e.losses is not None])


def write_where_lost(doc: Document, found: Sequence[tuple[str, WhereLost]]) -> None:
    """The section for ``found`` (per run, its label and losses): nothing at all, heading included, where no part
    has a row to show (no method of these runs selects, verifies or revises, and no run recorded reply counts)."""
    selection = [(label, w.selection) for label, w in found if w.selection is not None]
    verifier = [(label, w.verifier) for label, w in found if w.verifier is not None]
    changes = [(label, w.changes) for label, w in found if w.changes is not None and w.changes.steps]
    replies = [(label, w.replies) for label, w in found if w.replies]
    if not (selection or verifier or changes or replies):
        return
    doc.add(Heading(3, "Where the runs lose their answers"))
    doc.add(
        Paragraph(
            "From each run's own records. A candidate is right when at least half of the judge runs say so; the "
            "returned answer is the last finished iteration's. Each part shows the runs whose method it applies to."
        )
    )
    _selection_part(doc, selection)
    _verifier_part(doc, verifier)
    _changes_part(doc, changes)
    _replies_part(doc, replies)


def _selection_part(doc: Document, runs: list[tuple[str, SelectionLosses]]) -> None:
    if not runs:
        return
    doc.add(Heading(4, "Right answer among the candidates, another returned"))
    doc.add(
        Paragraph(
            "Shares of the run's graded problems (Problems). Wrong, right among the candidates: the returned answer is "
            "wrong though a right candidate was written, in the last iteration (among the solutions its trajectories "
            "hold, as the rule chose from them: the rule passed it over) or only in earlier ones (refinement lost "
            "it, or a rule choosing from every iteration passed it over). Wrong, no right candidate: no candidate of "
            "any iteration was right (a problem that failed before any iteration included)."
        )
    )
    rows = [
        [
            label,
            str(s.problems),
            share(s.returned_right, s.problems),
            share(s.passed_over, s.problems),
            share(len(s.in_last), s.problems),
            share(len(s.only_earlier), s.problems),
            share(len(s.never_right), s.problems),
        ]
        for label, s in runs
    ]
    headers = ["Run", "Problems", "Returned right", "Wrong, right among the candidates"]
    doc.add(
        Table([*headers, "of which in the last iteration", "of which only earlier", "Wrong, no right candidate"], rows)
    )
    named = []
    for label, s in runs:
        kinds = [
            f"{what} {_named(ids)}"
            for what, ids in (
                ("a right candidate in the last iteration, another returned:", s.in_last),
                ("right candidates only in earlier iterations:", s.only_earlier),
            )
            if ids
        ]
        if kinds:
            named.append(f"{label}: {'; '.join(kinds)}.")
    if named:
        doc.add(Paragraph(" ".join(named)))


def _verifier_part(doc: Document, runs: list[tuple[str, VerifierPasses]]) -> None:
    if not runs:
        return
    doc.add(Heading(4, "The verifier on right and on wrong candidates"))
    doc.add(
        Paragraph(
            "Passed: verifications scoring the candidate above 0.5 (on the 1 / 0.5 / 0 scale, fully correct). Left "
            "out: verifications without a score (failed or unreadable) and those of candidates without an answer. "
            "ROC area: of the candidates' scores, each the mean of its verifications with a score (the chance a "
            "right candidate outscores a wrong one)."
        )
    )
    rows = []
    for label, v in runs:
        auc = v.separation.auc if v.separation is not None else None
        rows.append(
            [
                label,
                _rate(v.right_passed, v.right),
                _rate(v.wrong_passed, v.wrong),
                "-" if auc is None else f"{auc:.3f}",
                str(v.no_score),
                str(v.answerless),
            ]
        )
    headers = ["Run", "Passed, right candidates", "Passed, wrong candidates", "ROC area"]
    doc.add(Table([*headers, "Without a score", "Of answerless candidates"], rows))


def _changes_part(doc: Document, runs: list[tuple[str, AnswerChanges]]) -> None:
    if not runs:
        return
    doc.add(Heading(4, "Iterations that changed the answer"))
    rows = [
        [
            label,
            str(c.steps),
            share(c.changed, c.steps),
            share(len(c.better), c.steps),
            share(len(c.worse), c.steps),
            share(len(c.neither), c.steps),
        ]
        for label, c in runs
    ]
    headers = ["Run", "Steps (problem x iteration after the first)", "Changed"]
    doc.add(Table([*headers, "Better (wrong to right)", "Worse (right to wrong)", "Wrong to another wrong"], rows))


def _replies_part(doc: Document, runs: list[tuple[str, dict[str, ReplyTally]]]) -> None:
    if not runs:
        return
    doc.add(Heading(4, "Replies cut or without an answer, by role"))
    rows = [
        [label, role, str(t.replies), share(t.truncated, t.replies), share(t.unusable, t.replies)]
        for label, replies in runs
        for role, t in replies.items()
    ]
    doc.add(Table(["Run", "Role", "Replies", "Cut at max_tokens", "No answer or score"], rows))
