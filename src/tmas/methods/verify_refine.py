"""Verify-Refine, V-R (TMAS paper 4.1 and A.3): generate, verify, then a corrector revises from the previous solution
and its verification; N trajectories in parallel, none sees another.

Per iteration and trajectory i: iteration 0 writes a solution with TMAS's generation prompt, later ones send the
previous solution with its verification report to the corrector (role ``corrector``); the new solution then gets
``m`` verifications (TMAS's verification agent, role ``verifier``). Its score is their mean (1 / 0.5 / 0 scale) and
the answer is the best-scored candidate's (``select`` and ``select_from`` choose other rules: methods/selection.py).
With m > 1 the corrector is shown the most critical report (lowest score read; a failed verification call is no
report; where every call failed, the solution alone, said to be neither confirmed nor faulted). A correction's answer
is read from its solution under "## Solution" alone (``parse_refinement``, as in Self-Refine): text before the
heading that quotes the previous boxed answer is no new answer. The iteration's candidates are the verified solutions
of that iteration. A correction without an answer never silently replaces an
answered solution (``answer_reminder``, ``answer_fallback``): the trajectory holds that solution on, and it is
selected from in the iteration, with its score, in place of the correction (``meta.carried_from``).
A solution with no text is not sent to the verifiers: it is scored 0, recorded unverified, and no corrector is shown
it (its trajectory starts afresh, as after a failed call, unless it holds an answered solution on). A prompt a
trajectory sends again (the generation prompt afresh, a held solution with the same report) goes with a new seed where
one is configured (``tmas.methods.reasked``). A budget stop keeps what finished: a solution some of whose
verifications it refused is scored from those that came back (a failed one still counts 0), one it refused them all
is kept unverified and unscored, each noted in the iteration's record; a trajectory whose correction it refused
holds its solution of the iteration before, with its score, and is selected from with it there
(``IterationRecord.held_over``). A correction that echoed its instructions, whose retry the budget refused, is
recorded (unusable, ``meta.retry_refused``), and its trajectory holds its solution on as well, selected from in the
correction's place (``meta.carried_from``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, model_validator

from tmas.agents.baselines import correction_prompt, parse_refinement
from tmas.agents.solution import generation_prompt, parse_section
from tmas.agents.verification import (
    Verification,
    parse_verification,
    verification_prompt,
    verification_reply_model,
)
from tmas.methods.base import (
    Candidate,
    CandidateMeta,
    Iterations,
    Method,
    MethodParams,
    ProblemResult,
    ProblemSession,
    gather_all,
    gather_finished,
    read_as_stored,
)
from tmas.methods.call_count import CallCount, Instead, asked_again, count_calls
from tmas.methods.reasked import Reasked
from tmas.methods.selection import SelectFrom, SelectRule, proof_rule_error
from tmas.methods.state import FallbackState, MethodState
from tmas.methods.steps import (
    Chosen,
    carry,
    close_iteration,
    finish,
    hold,
    holds_previous,
    keeps_previous,
    notes_for,
    solve_call,
)
from tmas.methods.style_params import StyledParams
from tmas.methods.traits import Traits
from tmas.store.records import VerificationRecord


class VerifyRefineParams(StyledParams):
    style_roles: ClassVar[tuple[str, ...]] = ("solution", "corrector", "verifier")
    renamed: ClassVar[dict[str, str]] = {"pool": "select_from"}
    # Runs from before the answer fallback existed chose from the last candidates alone.
    before_added: ClassVar[dict[str, Any]] = {"answer_fallback": False}
    iterations: Iterations = 20
    n: int = Field(default=8, ge=1, le=256)
    # Verifications per solution (the paper's V-R uses one verifier).
    m: int = Field(default=1, ge=1, le=64)
    # Beyond the paper: which candidate is returned (see methods/selection.py); the default is the paper's.
    select: SelectRule = "best_score"
    select_from: SelectFrom = "last"
    # Beyond the paper: a correction with no extractable answer is asked once more with a reminder of the
    # required output; one still without an answer does not replace its trajectory's answered solution, and when the
    # last iteration has no answer, the best answered candidate of earlier iterations is returned, recorded as a
    # fallback.
    answer_reminder: bool = True
    answer_fallback: bool = True

    @model_validator(mode="after")
    def _rule_of_the_mode(self, info: ValidationInfo) -> VerifyRefineParams:
        if (why := proof_rule_error(self.select, self.mode)) is not None and not read_as_stored(info):
            raise ValueError(why)
        return self


class VerifyRefineState(FallbackState):
    """An iteration's mean score of the solutions its trajectories hold (None: none was scored), and its answer
    fallback, if any."""

    mean_score: float | None = None


@dataclass
class Verified:
    candidate: Candidate
    # The report the corrector sees next iteration; None when the budget stopped before any verification.
    report: Verification | None
    # Whether a verification call came back: without one the corrector is shown no report, not a placeholder that
    # would read as a verdict on the solution.
    reported: bool = True


class VerifyRefine(Method[VerifyRefineParams]):
    name: ClassVar[str] = "verify_refine"
    traits: ClassVar[Traits] = Traits(selects=True, roles=("solution", "verifier", "corrector"))
    example_params: ClassVar[dict[str, Any] | None] = {"n": 1, "m": 1, "iterations": 2}
    # The setting the TMAS paper ran this baseline with (4.1, A.3).
    paper_settings: ClassVar[dict[str, Any]] = {"n": 8, "m": 1}
    Params: ClassVar[type[MethodParams]] = VerifyRefineParams
    State: ClassVar[type[MethodState]] = VerifyRefineState
    embedded_defaults: ClassVar[dict[str, Any]] = {"n": 2, "iterations": 2, "style": "concise"}

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        return ["V-R"]

    def calls_per_problem(self) -> CallCount:
        """N solution + N x (T - 1) corrector + N x m x T verifier calls: N x T x (1 + m). A trajectory whose last
        solution failed or went unverified sends a solution call (asked again once at most) in place of its
        correction."""
        p, t = self.params, self.params.iterations
        roles = {"solution": p.n, "corrector": p.n * (t - 1), "verifier": p.n * p.m * t}
        solving = {"solution": p.n, "corrector": p.n * (t - 1)}  # verifications are never asked again
        reminded = {"corrector": p.n * (t - 1)} if p.answer_reminder else {}
        # A correction is asked at most twice (an echo), three times with the reminder; a solution call twice.
        afresh = Instead(p.n * (t - 1), {"corrector": 3 if p.answer_reminder else 2}, {"solution": 2})
        return count_calls(roles, again=asked_again(solving, reminded), instead=[afresh])

    async def solve(self, session: ProblemSession) -> ProblemResult:
        p = self.params
        latest: list[Verified | None] = [None] * p.n
        # The iteration each latest solution was written in.
        written = [0] * p.n
        asked = Reasked()
        chosen = Chosen()
        for t in range(p.iterations):
            session.begin_iteration(t)
            stepped = await gather_all(self._step(session, i, latest[i], asked) for i in range(p.n))
            done = [v for v in stepped if v is not None]
            if not done:
                break
            candidates = [v.candidate for v in done]
            # A trajectory whose correction the budget refused holds its solution on, and is selected from with it.
            refused = [i for i, v in enumerate(stepped) if v is None and latest[i] is not None]
            notes = notes_for(candidates, p.mode) + verification_notes(candidates, p.m)
            # The solutions the trajectories hold: a correction without an answer counts as the one it carries.
            holding = []
            for v in done:
                i, previous = v.candidate.index, latest[v.candidate.index]
                if previous is not None and holds_previous(v.candidate, previous.candidate):
                    notes.append(hold(v.candidate, previous.candidate, written[i]))
                    holding.append(previous.candidate)
                elif (
                    p.answer_fallback
                    and previous is not None
                    and keeps_previous(v.candidate, previous.candidate, p.mode)
                ):
                    notes.append(carry(v.candidate, previous.candidate, written[i]))
                    holding.append(previous.candidate)
                else:
                    latest[i], written[i] = v, t
                    holding.append(v.candidate)
            # Their mean score, with a carried solution's own score, as Pass@1 reads them: over the calls that came
            # back (a trajectory the budget refused is held over for the selection alone).
            scores = [c.score for c in holding if c.score is not None]
            state = VerifyRefineState(mean_score=sum(scores) / len(scores) if scores else None)
            chosen = await close_iteration(
                session,
                candidates,
                state,
                notes,
                planned=p.n,
                mode=p.mode,
                rule=p.select,
                select_from=p.select_from,
                fallback=p.answer_fallback,
                held_over=refused,
            )
            if session.budget_stop:
                break
        stopped = session.budget_stop is not None
        return finish(session, self.name, chosen.candidate, stopped=stopped, fallback=chosen.fallback)

    async def _step(self, session: ProblemSession, i: int, prev: Verified | None, asked: Reasked) -> Verified | None:
        """Trajectory i's solution (fresh or corrected) and its verifications; ``asked`` counts the prompts each
        trajectory sent."""
        p, q, mode = self.params, session.problem.question, self.params.mode
        if prev is None or prev.candidate.error is not None or prev.report is None:
            messages, role, kind = generation_prompt(q, mode, p.style_of("solution")), "solution", "generate"
            parse = parse_section
        else:
            report = prev.report
            feedback = report.feedback if prev.reported else None
            messages = correction_prompt(q, mode, prev.candidate.text, feedback, report.score, p.style_of("corrector"))
            # The corrected solution alone gives the answer: text before its heading may quote the old one.
            role, kind, parse = "corrector", "correct", parse_refinement
        remind = p.answer_reminder and kind == "correct"
        # A prompt this trajectory sent before (started afresh, or a held solution corrected again from the same
        # report) goes with a new seed where one is configured: the same one would draw the same unusable reply.
        candidate = await solve_call(
            session,
            role,
            messages,
            index=i,
            mode=mode,
            meta=CandidateMeta(prompt=kind),
            remind=remind,
            parse=parse,
            asked=asked,
        )
        if candidate is None:
            return None
        if candidate.error is not None:
            candidate.score = 0.0
            return Verified(candidate, None)
        if not candidate.text.strip():
            # Nothing to verify (a thinking model cut while it reasoned leaves no content): scored 0, unverified, and
            # with no report no corrector is shown it.
            candidate.score = 0.0
            candidate.meta.unverified = True
            return Verified(candidate, None)
        check = verification_prompt(q, candidate.text, mode, p.style_of("verifier"))
        shape = verification_reply_model(session.max_tokens("verifier"))
        came_back = await gather_finished(
            session.chat("verifier", check, sample=i * p.m + j, reply_model=shape) for j in range(p.m)
        )
        replies = [r for r in came_back if r is not None]
        if not replies:
            # The budget stopped every verification: the solution is finished but unverified: kept, unscored, and not
            # corrected from a report it never got.
            candidate.meta.unverified = True
            return Verified(candidate, None)
        # Where the budget stopped some, the candidate is scored from those that came back (the stop ends the run).
        reports = [
            parse_verification(r.content, truncated=r.truncated)
            if r.ok
            else Verification(feedback="(verification failed)", score=None)
            for r in replies
        ]
        for r, v in zip(replies, reports, strict=True):
            if r.ok and v.score is None:
                session.tally("verifier").unusable += 1
        score = sum(v.effective_score for v in reports) / len(reports)
        if mode == "numeric" and candidate.answer is None:
            score = 0.0
        candidate.score = score
        candidate.meta.verifications = [
            VerificationRecord(
                score=v.score,
                call_id=r.call_id,
                error=r.error if not r.ok else None,
                truncated=True if r.ok and r.truncated else None,
            )
            for v, r in zip(reports, replies, strict=True)
        ]
        answered = [r.ok for r in replies]
        return Verified(candidate, _most_critical(reports, answered), reported=any(answered))


def _most_critical(reports: list[Verification], answered: list[bool]) -> Verification:
    """The report the corrector is shown: the lowest-scored report that has a score; without one, the first reply
    that came back (its score unreadable); a failed call's placeholder, never shown, only when every call failed. A
    failed call counts 0 in the candidate's score but is no report: it must not hide the analysis of one that came
    back."""
    scored = [v for v in reports if v.score is not None]
    if scored:
        return min(scored, key=lambda v: v.effective_score)
    return next((v for v, ok in zip(reports, answered, strict=True) if ok), reports[0])


def verification_notes(candidates: list[Candidate], m: int) -> list[str]:
    """The iteration record's notes of solutions with no text (not verified), of solutions some or all of whose ``m``
    verifications the budget stopped (scored from those that came back, or unscored), and of verifications that
    failed or gave no readable score (each counted 0)."""
    notes = []
    for c in candidates:
        if c.error is None and not c.text.strip():
            notes.append(f"candidate {c.index}: no solution text; not verified, scored 0")
        elif c.meta.unverified:
            notes.append(f"candidate {c.index}: the budget stopped its verifications before any came back; unscored")
        elif c.meta.verifications is not None and len(c.meta.verifications) < m:
            came = len(c.meta.verifications)
            notes.append(
                f"candidate {c.index}: {came} of {m} verifications came back before the budget stop; scored from them"
            )
        for j, v in enumerate(c.meta.verifications or []):
            if v.error is not None:
                notes.append(f"candidate {c.index}, verifier {j}: call failed: {v.error}; counted 0")
            elif v.score is None:
                cut = " (cut at max_tokens, so not read)" if v.truncated else ""
                notes.append(f"candidate {c.index}, verifier {j}: no readable score{cut}; counted 0")
    return notes
