"""MATTRL, multi-agent deliberation with a test-time experience pool (paper 003, sections 3.1-3.3, appendices A-B).

- Stage I (:meth:`MATTRL._form_team`): the coordinator recruits at most ``team_size`` specialists, one of them the
  leader (education: C.4.2's roles, checked, no forced leader); unusable JSON is retried once, then a default team
  is used; the record says which.
- Stage II (rounds r = 0 .. R_max - 1, one iteration record each): every specialist not yet converged retrieves its
  top-K pool entries for the case and its current context and gives its opinion. Math: every attempt is reviewed by
  each other specialist (B.4 JSON); it is accepted only when every verdict is accept and no issue remains. A
  specialist converges when its attempt is accepted, or when a revision keeps its answer while no peer raised a
  fatal or major issue (nothing changes under critique: this project's reading of B.3). Medicine: each specialist
  gives a strict top-10, each other specialist critiques it (A.4: agreements, disagreements, changes; the final
  round has no reviews), and a specialist converges when its list no longer changes. The meeting step then turns
  the round's updates into a bulletin (math: new, de-duplicated issues; medicine: each list's changes and new
  review points) and each specialist's own feedback for the next round.
  Deliberation halts when all have converged or at R_max.
- Stage III (:meth:`MATTRL._decide`, in the last round's record): the coordinator reads every round's opinions
  (Eq. 7, fitted to its context window) and writes the discussion report and the decision in tags, with one
  rewrite pass when the tags are missing; failing that, the team's majority answer.

Every record's ``state["transcript"]`` is the :class:`Transcript` so far (experience construction reads it).
The education domain (pre-test, teaching dialogue, post-test) is :mod:`tmas.methods.mattrl_teaching`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, Field

from tmas.agents.echo import EchoGuard
from tmas.agents.mattrl_decision import Decision, decision_prompt, discussion_record, parse_decision, rewrite_prompt
from tmas.agents.mattrl_opinion import opinion_answer, opinion_prompt, parse_differential
from tmas.agents.mattrl_review import (
    DifferentialReview,
    DifferentialReviewReply,
    Review,
    ReviewReply,
    accepted,
    differential_review_prompt,
    parse_differential_review,
    parse_review,
    review_prompt,
    unreadable_differential_review,
    unreadable_review,
)
from tmas.agents.mattrl_teaching import difficulty_of, subject_of
from tmas.agents.mattrl_team import TeamReply, default_team, parse_team, recruit_prompt, teaching_role
from tmas.agents.output import AgentOutputError
from tmas.agents.solution import SolutionOutput, parse_solution
from tmas.answers import last_boxed, normalize_answer
from tmas.errors import LLMError
from tmas.llm.tokens import CHARS_PER_TOKEN
from tmas.llm.types import Completion, Message
from tmas.memory.embedders import Embedder, embedder_for
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.similarity import jaccard
from tmas.memory.transcript import TeamMember, Transcript, Utterance
from tmas.methods.base import (
    BudgetExhausted,
    Candidate,
    Iterations,
    Method,
    MethodParams,
    ProblemResult,
    ProblemSession,
    gather_all,
)
from tmas.methods.call_count import CallCount, count_calls
from tmas.methods.echo_retry import chat_guarded
from tmas.methods.mattrl_teaching import teach, teaching_tier
from tmas.methods.param_flags import cli_flag
from tmas.methods.state import MATTRLState, MethodState, SeatRecord
from tmas.methods.steps import solve_call
from tmas.methods.traits import Traits

if TYPE_CHECKING:  # the pool needs numpy and faiss (the `pool` extra): imported only when a pool is configured
    from tmas.memory.pool import Pool

# A parsed peer review: a math review or a medicine critique of a differential.
ReviewT = TypeVar("ReviewT", Review, DifferentialReview)
# Call sample numbers: distinct per call of one iteration, so each gets its own cache slot and sampling seed. The
# coordinator's decision (and its rewrite) count from _DECISION_SAMPLE, clear of its team formation's attempts (0 to
# ``retries``), which share its role and, when the decision comes in round 0, its iteration. Runs stored before it
# had the decision at samples 0 and 1: replayed now, their decision calls are not found and are sent again.
_REVIEW_SAMPLE, _RETRY_OFFSET, _DECISION_SAMPLE = 1000, 500, 3000
_DUPLICATE_ISSUE = 0.8  # word-set Jaccard at which two issues say the same thing
# Tokens kept free beside the decision prompt and its reply, as TMAS keeps beside its rollouts.
_PROMPT_MARGIN_TOKENS = 256


class MATTRLParams(MethodParams):
    # R_max, the most deliberation rounds (paper: 3).
    iterations: Annotated[Iterations, Field(le=20)] = 3
    domain: Literal["math", "medicine", "education"] = Field(
        default="math", json_schema_extra=cli_flag("--domain", "MATTRL's domain: math, medicine or education.")
    )
    # Education: one teacher, or a recruited team (with experience when a pool is given).
    teaching: Literal["single", "team"] = "team"
    # n, the most specialists the coordinator may recruit.
    team_size: int = Field(default=3, ge=1, le=9)
    # The experience pool folder (None: no experience), its embedder, and K entries per retrieval (paper: 8).
    pool: str | None = None
    embedder: Literal["endpoint", "local"] = "endpoint"
    top_k: int = Field(default=8, ge=1, le=64)
    # Extra attempts at an unusable team or review reply before the default team / an unreadable review.
    retries: int = Field(default=1, ge=0, le=3)
    # Medicine: also put the team's Borda-pooled top-10 into the meeting bulletin. This project's option, not the
    # paper's (A.4 shares each member's changes and the peer reviews); off by default, since a pooled list
    # invites every member to converge on it (herding).
    pooled_differential: bool = False


@dataclass
class Seat:
    """A specialist and where it stands in the deliberation."""

    index: int
    member: TeamMember
    attempt: str = ""
    answer: str | None = None
    # The answer before this round's revision (convergence compares the two).
    previous_answer: str | None = None
    top10: list[str] = field(default_factory=list)
    # Medicine: the differential before this round's revision (the bulletin shares the change).
    previous_top10: list[str] = field(default_factory=list)
    accepted: bool = False
    converged: bool = False
    # The feedback addressed to it by the last meeting (JSON text), for its next revision.
    feedback: str = ""


@dataclass
class Retriever:
    pool: Pool
    embed: Embedder
    k: int


class MATTRL(Method[MATTRLParams]):
    name: ClassVar[str] = "mattrl"
    traits: ClassVar[Traits] = Traits(roles=("coordinator", "specialist", "reviewer", "student", "embedding"))
    example_params: ClassVar[dict[str, Any] | None] = {"team_size": 2, "iterations": 2}
    # The setting of the MATTRL paper (4.1).
    paper_settings: ClassVar[dict[str, Any]] = {"team_size": 3, "iterations": 3}
    Params: ClassVar[type[MethodParams]] = MATTRLParams
    State: ClassVar[type[MethodState]] = MATTRLState
    embedded_defaults: ClassVar[dict[str, Any]] = {"iterations": 2, "team_size": 2}

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        if params.get("domain") == "education" and params.get("teaching") == "single":
            return ["Single Agent"]
        pool = params.get("pool")
        if not pool:
            return ["Multi-Agent"]
        scheme = next((s for s in ("naive", "difference", "shapley") if s in str(pool).lower()), None)
        return ["MATTRL"] + ([f"MATTRL ({scheme} credit)"] if scheme else [])

    def calls_per_problem(self) -> CallCount:
        """Math: a recruit call, then per round an opinion per specialist and a review of each by each other
        specialist, then the decision: 2 + R x n^2 with n specialists and R rounds. Deliberation stops when everyone
        has converged, so this is an upper bound; unusable replies are retried (``retries``), raising the ceiling to
        (1 + retries) + R x (n + n(n - 1)(1 + retries)) + 2 (the decision's one rewrite pass included). Medicine
        has no reviews: 2 + R x n. Education: a right pre-test ends the case after 1 call; otherwise single teacher
        2R + 3, team 2 + R x (n + 2) + 2 (formation, per round n analyses, a plan and the student's reply, then
        guidance and post-test)."""
        p = self.params
        n, rounds, tries = p.team_size, p.iterations, 1 + p.retries
        if p.domain == "education":
            if p.teaching == "single":
                roles = {"student": rounds + 2, "specialist": rounds + 1}
                return count_calls(roles, "at most: a right pre-test ends the case after 1 call", upper=roles)
            roles = {"student": rounds + 2, "coordinator": 1 + rounds + 1, "specialist": n * rounds}
            upper = {**roles, "coordinator": tries + rounds + 1}
            note = "at most: a right pre-test ends the case after 1 call; team formation may retry"
            return count_calls(roles, note, upper)
        reviews = n * (n - 1) * rounds if p.domain == "math" else 0
        roles = {"coordinator": 2, "specialist": n * rounds, "reviewer": reviews}
        upper = {"coordinator": tries + 2, "specialist": n * rounds, "reviewer": reviews * tries}
        note = "at most, with the full team for every round: deliberation stops once every specialist has converged"
        return count_calls(roles, note, upper)

    def __init__(self, params: MethodParams) -> None:
        super().__init__(params)
        self._pool: Pool | None = None

    async def solve(self, session: ProblemSession) -> ProblemResult:
        p = self.params
        retriever = self._retriever(session)
        if p.domain == "education":
            metadata = session.problem.metadata
            subject, difficulty = subject_of(metadata), difficulty_of(metadata)

            async def retrieve(member: TeamMember, context: str, notes: list[str]) -> list[PoolEntry]:
                tier = teaching_tier(teaching_role(member.role) or member.role, subject, difficulty)
                return await self._hints(retriever, member, [context], notes, tier)

            return await teach(
                session,
                rounds=p.iterations,
                team=p.teaching == "team",
                form_team=self._form_team,
                retrieve=retrieve,
                name=self.name,
            )
        session.begin_iteration(0)
        notes: list[str] = []
        transcript = Transcript(problem_id=session.problem.problem_id, domain=p.domain)
        transcript.team = await self._form_team(session, notes)
        seats = [Seat(i, m) for i, m in enumerate(transcript.team)]
        seen_issues: list[str] = []
        decision: Decision | None = None
        stopped = False
        for r in range(p.iterations):
            if r:
                session.begin_iteration(r)
            active = [s for s in seats if not s.converged]
            bulletin = next((u.text for u in reversed(transcript.utterances) if u.kind == "meeting"), "")
            # Built once per round, before anyone speaks, so every prompt of the round sees the same team state.
            snapshot = "\n\n".join(
                f"{s.member.id} ({s.member.specialty}), accepted:\n{s.attempt}" for s in seats if s.accepted
            )
            spoke: dict[str, tuple[Candidate, Utterance]] = {}
            reviews: dict[str, list[Review]] = {}
            critiques: dict[str, list[DifferentialReview]] = {}
            start = len(notes)
            try:
                try:
                    await gather_all(
                        self._opinion(session, s, r, snapshot, bulletin, retriever, spoke, notes) for s in active
                    )
                finally:
                    # Replies arrive in any order; the transcript and the notes list them in seat order, so a
                    # resumed run (replayed calls return at once) records exactly what the first run did.
                    transcript.utterances += [spoke[s.member.id][1] for s in active if s.member.id in spoke]
                    notes[start:] = sorted(notes[start:])
                if p.domain == "math":
                    reviews = await self._review_round(session, active, seats, r, transcript, notes)
                elif p.domain == "medicine" and r < p.iterations - 1 and not all(s.converged for s in seats):
                    # Reviews feed the next round's revisions; the final round has none to feed.
                    critiques = await self._differential_reviews(session, active, seats, r, transcript, notes)
                last = r == p.iterations - 1 or all(s.converged for s in seats)
                if last:
                    decision = await self._decide(session, seats, r, transcript, notes)
                    transcript.final_answer = decision.answer
                elif p.domain == "medicine":
                    self._medicine_meeting(seats, active, critiques, r, transcript, seen_issues)
                else:
                    self._meeting(seats, active, reviews, r, transcript, seen_issues)
            except BudgetExhausted:
                # Keep what the round finished; the team's majority stands in for the decision it could not make.
                stopped = last = True
                notes.append(f"stopped: {session.budget_stop}; the team's majority answer is used")
            candidates = [
                self._candidate(s, *spoke[s.member.id], reviews.get(s.member.id, []), r)
                for s in active
                if s.member.id in spoke
            ]
            session.end_iteration(
                candidates,
                selected=decision.answer if decision else self._majority(seats),
                state=self._state(r, seats, transcript, decision),
                notes=notes,
            )
            notes = []
            if last:
                break
        chosen = decision.answer if decision else self._majority(seats) if stopped else None
        text = (decision.proof or decision.report) if decision else ""
        if decision and decision.top10:
            text = "\n".join(f"[{i}] {name}" for i, name in enumerate(decision.top10, start=1))
        result = session.result(self.name, answer=chosen, text=text)
        if stopped:
            session.budget_stopped(result)
        if chosen is None:
            result.status = "failed"
            result.error = "the team reached no answer"
        return result

    # ---- Stage I --------------------------------------------------------------------------------

    async def _form_team(self, session: ProblemSession, notes: list[str]) -> list[TeamMember]:
        p = self.params
        messages = recruit_prompt(session.problem.question, p.domain, p.team_size)
        for attempt in range(1 + p.retries):
            reply = await session.chat("coordinator", messages, sample=attempt, reply_model=TeamReply)
            why = reply.error or ("reply truncated at max_tokens" if reply.truncated else None)
            if why is None:
                try:
                    team, repairs = parse_team(reply.content, p.domain, p.team_size)
                except AgentOutputError as exc:
                    session.tally("coordinator").unusable += 1
                    why = str(exc)
                else:
                    notes.extend(f"team formation: {note}" for note in repairs)
                    return team
            notes.append(f"team formation attempt {attempt + 1}: unusable reply: {why}")
        notes.append("team formation: no usable team from the coordinator; the default team is used")
        return default_team(p.domain, p.team_size, subject_of(session.problem.metadata))

    # ---- Stage II -------------------------------------------------------------------------------

    def _retriever(self, session: ProblemSession) -> Retriever | None:
        p = self.params
        if p.pool is None:
            return None
        from tmas.memory.pool import Pool

        embed = embedder_for(p.embedder, session.llm)
        if self._pool is None:
            self._pool = Pool.open(Path(p.pool), embed.name)
        return Retriever(self._pool, embed, p.top_k)

    @staticmethod
    async def _hints(
        retriever: Retriever | None,
        member: TeamMember,
        context: list[str],
        notes: list[str],
        tier: Callable[[PoolEntry], int | None] | None = None,
    ) -> list[PoolEntry]:
        """The top-K entries for the case, the specialist and its current context (B.9), keyed by ``tier`` when
        given (education: role, subject, difficulty)."""
        if retriever is None:
            return []
        parts = [context[0], f"Specialist: {member.specialty}. {member.description}", *context[1:]]
        try:
            hits = await retriever.pool.search("\n\n".join(c for c in parts if c), retriever.k, retriever.embed, tier)
        except LLMError as exc:
            notes.append(f"{member.id}: experience retrieval failed, no hints this round: {exc}")
            return []
        return [entry for entry, _ in hits]

    async def _opinion(
        self,
        session: ProblemSession,
        seat: Seat,
        r: int,
        snapshot: str,
        bulletin: str,
        retriever: Retriever | None,
        spoke: dict[str, tuple[Candidate, Utterance]],
        notes: list[str],
    ) -> None:
        """The specialist's opinion of round ``r``, into ``spoke`` with its utterance (kept if the round stops)."""
        p, question = self.params, session.problem.question
        context = [question, seat.attempt, seat.feedback] if seat.attempt else [question]
        hints = await self._hints(retriever, seat.member, context, notes)
        messages = opinion_prompt(
            question,
            seat.member,
            p.domain,
            round_=r,
            previous=seat.attempt,
            feedback=seat.feedback,
            snapshot=snapshot,
            bulletin=bulletin,
            hints=hints,
        )
        # A solution-like call (methods/steps.py): the echo guard, extraction and tally of every solution writer; an
        # opinion's answer is its boxed value (math) or its top diagnosis (medicine).
        said = await solve_call(
            session,
            "specialist",
            messages,
            index=seat.index,
            mode="numeric" if p.domain == "math" else p.domain,
            parse=partial(_read_opinion, domain=p.domain),
        )
        if said is None:
            # The budget refused the call: the round keeps what finished (see solve).
            raise BudgetExhausted(session.budget_stop or "budget spent")
        if said.meta.get("echo_retry"):
            notes.append(
                f"{seat.member.id}: the opinion's {said.meta['echo_retry']} echoed the instructions; asked again"
            )
        seat.previous_answer, previous_top10 = seat.answer, seat.top10
        seat.previous_top10 = previous_top10
        if said.meta.get("echo"):
            notes.append(f"{seat.member.id}: the retried opinion echoed the instructions too; keeps its attempt")
        elif said.error or not said.text.strip():
            notes.append(f"{seat.member.id}: opinion call failed ({said.error or 'empty reply'}); keeps its attempt")
        else:
            if said.meta.get("truncated"):
                notes.append(f"{seat.member.id}: opinion truncated at max_tokens")
            seat.attempt = said.text.strip()
            seat.answer = said.answer
            if p.domain == "medicine":
                seat.top10 = parse_differential(seat.attempt)
                if len(seat.top10) < 10:
                    notes.append(f"{seat.member.id}: differential has {len(seat.top10)} of 10 diagnoses")
                # Medicine converges when a specialist's differential no longer changes between rounds.
                seat.converged = r > 0 and bool(seat.top10) and seat.top10 == previous_top10
            elif seat.answer is None:
                notes.append(f"{seat.member.id}: opinion states no final answer")
        spoke[seat.member.id] = (
            said,
            Utterance(
                round=r,
                agent=seat.member.id,
                kind="opinion",
                text=said.text,
                answer=seat.answer if said.error is None else None,
                call_id=said.call_id,
                experience_ids=[h.id for h in hints],
            ),
        )

    async def _review_round(
        self,
        session: ProblemSession,
        active: list[Seat],
        seats: list[Seat],
        r: int,
        transcript: Transcript,
        notes: list[str],
    ) -> dict[str, list[Review]]:
        """B.4: every active attempt reviewed by every other specialist; then acceptance and convergence."""
        pairs = [(t, s) for t in active for s in seats if s is not t and t.attempt]
        start = len(notes)
        done = await gather_all(
            self._review(session, reviewer, target, len(seats), notes) for target, reviewer in pairs
        )
        notes[start:] = sorted(notes[start:])  # in a fixed order, whatever order the reviews came back in
        reviews: dict[str, list[Review]] = {s.member.id: [] for s in active}
        for (target, _), (review, reply) in zip(pairs, done, strict=True):
            reviews[target.member.id].append(review)
            transcript.utterances.append(
                Utterance(
                    round=r,
                    agent=review.reviewer,
                    kind="review",
                    text=reply.content if reply is not None else review.analysis,
                    target=target.member.id,
                    answer=review.verdict,
                    call_id=reply.call_id if reply is not None else None,
                )
            )
        for seat in active:
            own = reviews[seat.member.id]
            seat.accepted = accepted(own)
            serious = any(i.severity in ("fatal", "major") for rv in own for i in rv.issues)
            kept = (
                r > 0
                and seat.answer is not None
                and normalize_answer(seat.answer) == normalize_answer(seat.previous_answer or "")
            )
            seat.converged = seat.accepted or (kept and not serious and all(rv.verdict != "reject" for rv in own))
        return reviews

    async def _review(
        self, session: ProblemSession, reviewer: Seat, target: Seat, team: int, notes: list[str]
    ) -> tuple[Review, Completion | None]:
        review, reply, why = await self._ask_reviewer(
            session,
            review_prompt(session.problem.question, reviewer.member, target.member, target.attempt),
            _REVIEW_SAMPLE + target.index * team + reviewer.index,
            ReviewReply,
            lambda r: parse_review(r.content, reviewer.member.id, target.member.id, truncated=r.truncated),
            lambda rv: [("analysis", rv.analysis), *((f"issue {i.type}", f"{i.note} {i.fix}") for i in rv.issues)],
        )
        if review is not None:
            return review, reply
        notes.append(f"review of {target.member.id} by {reviewer.member.id}: unusable ({why}); counted as revise")
        return unreadable_review(reviewer.member.id, target.member.id, why), reply

    async def _ask_reviewer(
        self,
        session: ProblemSession,
        messages: list[Message],
        sample: int,
        reply_model: type[BaseModel],
        parse: Callable[[Completion], ReviewT],
        fields: Callable[[ReviewT], list[tuple[str, str | None]]],
    ) -> tuple[ReviewT | None, Completion | None, str]:
        """One peer review, asked again (within ``retries``) when the call failed, the reply could not be read or it
        echoed its instructions; (None, the last reply, why) when no attempt gave a usable review."""
        guard = EchoGuard.of(messages)
        why = ""
        reply: Completion | None = None
        for attempt in range(1 + self.params.retries):
            reply = await session.chat(
                "reviewer", messages, sample=sample + attempt * _RETRY_OFFSET, reply_model=reply_model
            )
            if not reply.ok:
                why = reply.error or "call failed"
                continue
            try:
                review = parse(reply)
            except AgentOutputError as exc:
                # Counted per reply, so the report's parse-failure share per role compares runs with and without
                # structured outputs.
                session.tally("reviewer").unusable += 1
                why = str(exc)
                continue
            echoed = guard.first_echo(fields(review))
            if echoed is not None:
                # A review that repeats its instructions is no review: asked again, never counted or shared.
                session.tally("reviewer").echo += 1
                why = f"its {echoed} echoes the prompt's instructions"
                continue
            return review, reply, ""
        return None, reply, why

    def _meeting(
        self,
        seats: list[Seat],
        active: list[Seat],
        reviews: dict[str, list[Review]],
        r: int,
        transcript: Transcript,
        seen_issues: list[str],
    ) -> None:
        """The meeting step: each specialist's own feedback, and a bulletin of the round's new, distinct issues."""
        lines: list[str] = []
        for seat in active:
            own = reviews.get(seat.member.id, [])
            fresh = []
            for review in own:
                for issue in review.issues:
                    key = f"{issue.note} {issue.fix}"
                    if any(jaccard(key, seen) >= _DUPLICATE_ISSUE for seen in seen_issues):
                        continue
                    seen_issues.append(key)
                    fresh.append(issue)
            hints = sorted({rv.alt_hint.strip() for rv in own if rv.alt_hint and rv.alt_hint.strip()})
            seat.feedback = json.dumps(
                {
                    "verdicts": {rv.reviewer: rv.verdict for rv in own},
                    "issues": [i.model_dump() for rv in own for i in rv.issues],
                    "alt_hints": hints,
                },
                ensure_ascii=False,
            )
            status = "accepted" if seat.accepted else ("converged" if seat.converged else "open")
            lines.append(f"{seat.member.id} ({seat.member.specialty}): {status}, answer {seat.answer or 'none'}")
            lines += [f"  - [{i.severity} {i.type}] {i.note}" + (f" Fix: {i.fix}" if i.fix else "") for i in fresh]
        transcript.utterances.append(Utterance(round=r, agent="coordinator", kind="meeting", text="\n".join(lines)))

    async def _differential_reviews(
        self,
        session: ProblemSession,
        active: list[Seat],
        seats: list[Seat],
        r: int,
        transcript: Transcript,
        notes: list[str],
    ) -> dict[str, list[DifferentialReview]]:
        """A.4: every active differential critiqued by every other specialist (agreements, disagreements,
        changes)."""
        pairs = [(t, s) for t in active for s in seats if s is not t and t.attempt]
        start = len(notes)
        done = await gather_all(
            self._critique(session, reviewer, target, len(seats), notes) for target, reviewer in pairs
        )
        notes[start:] = sorted(notes[start:])
        critiques: dict[str, list[DifferentialReview]] = {s.member.id: [] for s in active}
        for (target, _), (review, reply) in zip(pairs, done, strict=True):
            critiques[target.member.id].append(review)
            transcript.utterances.append(
                Utterance(
                    round=r,
                    agent=review.reviewer,
                    kind="review",
                    text=reply.content if reply is not None and reply.ok else review.analysis,
                    target=target.member.id,
                    call_id=reply.call_id if reply is not None else None,
                )
            )
        return critiques

    async def _critique(
        self, session: ProblemSession, reviewer: Seat, target: Seat, team: int, notes: list[str]
    ) -> tuple[DifferentialReview, Completion | None]:
        review, reply, why = await self._ask_reviewer(
            session,
            differential_review_prompt(session.problem.question, reviewer.member, target.member, target.attempt),
            _REVIEW_SAMPLE + target.index * team + reviewer.index,
            DifferentialReviewReply,
            lambda r: parse_differential_review(r.content, reviewer.member.id, target.member.id, truncated=r.truncated),
            lambda rv: [
                ("analysis", rv.analysis),
                *(("agreement", point) for point in rv.agreements),
                *(("disagreement", point) for point in rv.disagreements),
                *(("change", point) for point in rv.changes),
            ],
        )
        if review is not None:
            return review, reply
        notes.append(f"review of {target.member.id} by {reviewer.member.id}: unusable ({why}); nothing shared")
        return unreadable_differential_review(reviewer.member.id, target.member.id, why), reply

    def _medicine_meeting(
        self,
        seats: list[Seat],
        active: list[Seat],
        critiques: dict[str, list[DifferentialReview]],
        r: int,
        transcript: Transcript,
        seen: list[str],
    ) -> None:
        """Eq. 6 for medicine: each specialist's change to its differential (Delta O_s) and the round's peer-review
        points not raised before, de-duplicated; each specialist's own reviews become its feedback."""
        lines: list[str] = []
        for seat in active:
            own = critiques.get(seat.member.id, [])
            seat.feedback = json.dumps(
                [
                    {
                        "reviewer": rv.reviewer,
                        "analysis": rv.analysis,
                        "agreements": rv.agreements,
                        "disagreements": rv.disagreements,
                        "changes": rv.changes,
                    }
                    for rv in own
                    if rv.readable
                ],
                ensure_ascii=False,
            )
            lines.append(f"{seat.member.id} ({seat.member.specialty}): {self._differential_change(seat)}")
            for rv in own:
                for label, points in (("disagrees", rv.disagreements), ("asks to change", rv.changes)):
                    for point in points:
                        if any(jaccard(point, old) >= _DUPLICATE_ISSUE for old in seen):
                            continue
                        seen.append(point)
                        lines.append(f"  - {rv.reviewer} {label}: {point}")
        if self.params.pooled_differential:
            pooled = self._pooled_differential(seats)
            if pooled:
                lines.append("Team differential by Borda count (pooled_differential option): " + "; ".join(pooled))
        transcript.utterances.append(Utterance(round=r, agent="coordinator", kind="meeting", text="\n".join(lines)))

    @staticmethod
    def _differential_change(seat: Seat) -> str:
        """Delta O_s (Eq. 5) of a differential: what entered and what left the list this round."""
        if not seat.top10:
            return "no readable differential"
        before = {n.lower() for n in seat.previous_top10}
        after = {n.lower() for n in seat.top10}
        if not seat.previous_top10:
            return "proposed " + "; ".join(seat.top10)
        added = [n for n in seat.top10 if n.lower() not in before]
        dropped = [n for n in seat.previous_top10 if n.lower() not in after]
        if not added and not dropped:
            return "unchanged" if seat.top10 == seat.previous_top10 else "reordered its list"
        parts = [f"added {'; '.join(added)}"] if added else []
        parts += [f"dropped {'; '.join(dropped)}"] if dropped else []
        return ", ".join(parts)

    @staticmethod
    def _pooled_differential(seats: list[Seat]) -> list[str]:
        """Medicine: the team's ten best diagnoses by Borda count (rank 1 earns 10 points, rank 10 earns 1)."""
        points: Counter[str] = Counter()
        spelled: dict[str, str] = {}
        for seat in seats:
            for rank, name in enumerate(seat.top10[:10]):
                points[name.lower()] += 10 - rank
                spelled.setdefault(name.lower(), name)
        return [spelled[k] for k, _ in points.most_common(10)]

    # ---- Stage III ------------------------------------------------------------------------------

    async def _decide(
        self, session: ProblemSession, seats: list[Seat], r: int, transcript: Transcript, notes: list[str]
    ) -> Decision:
        domain = self.params.domain
        summary = self._summary(session, seats, transcript)
        messages = decision_prompt(session.problem.question, domain, summary)
        guard = EchoGuard.of(messages)

        def echo_of(reply: Completion) -> str | None:
            found = parse_decision(reply.content, domain)
            return "final answer" if found is not None and guard.echoes_answer(found.answer) else None

        guarded = await chat_guarded(session, "coordinator", messages, echo_of, sample=_DECISION_SAMPLE)
        reply = guarded.reply
        if guarded.first_echo is not None:
            notes.append("decision: the final answer echoed the prompt's instructions; asked again")
        decision = parse_decision(reply.content, domain) if reply.ok and guarded.echo is None else None
        final = reply
        if decision is None and reply.ok and reply.content.strip() and guarded.echo is None:
            notes.append("decision: the required tags are missing; asked for one rewrite")
            final = await session.chat(
                "coordinator", rewrite_prompt(reply.content, domain), sample=_DECISION_SAMPLE + 1
            )
            decision = parse_decision(final.content, domain) if final.ok else None
        if decision is None:
            boxed = last_boxed(reply.content) if domain == "math" and reply.ok and guarded.echo is None else None
            pooled = self._pooled_differential(seats)
            decision = Decision(report=reply.content if reply.ok else "", answer=boxed or self._majority(seats))
            if pooled:
                decision.top10, decision.answer = pooled, pooled[0]
            source = (
                "its boxed answer"
                if boxed
                else "the team's pooled differential"
                if pooled
                else "the team's majority answer"
            )
            why = reply.error or (
                "its answer echoed the instructions twice" if guarded.echo else "no tags after the rewrite"
            )
            notes.append(f"decision: unreadable ({why}); {source} is used")
        transcript.utterances.append(
            Utterance(round=r, agent="coordinator", kind="report", text=decision.report, call_id=reply.call_id)
        )
        transcript.utterances.append(
            Utterance(
                round=r,
                agent="coordinator",
                kind="decision",
                text=final.content if final.ok else "",
                answer=decision.answer,
                call_id=final.call_id,
            )
        )
        return decision

    def _summary(self, session: ProblemSession, seats: list[Seat], transcript: Transcript) -> str:
        """What the chair reads (Eq. 7: the union of every specialist's opinions over every round, B.5): each
        specialist's final status and answer, then every round's opinions, fitted to the coordinator's context
        window (older rounds shortened first) when the window is known."""
        status = [
            f"{s.member.id} {s.member.specialty} ({s.member.role or 'member'}): "
            f"{'accepted' if s.accepted else 'converged' if s.converged else 'unresolved'}; "
            f"answer: {s.answer or 'none'}"
            for s in seats
        ]
        names = {s.member.id: f"{s.member.id} {s.member.specialty}" for s in seats}
        rounds: dict[int, list[tuple[str, str]]] = {}
        for u in transcript.utterances:
            if u.kind == "opinion" and u.agent in names and u.text.strip():
                rounds.setdefault(u.round, []).append((names[u.agent], u.text.strip()))
        return discussion_record(
            status, [(r + 1, said) for r, said in sorted(rounds.items())], self._report_budget(session)
        )

    def _report_budget(self, session: ProblemSession) -> int | None:
        """Characters of discussion the decision prompt can hold: the coordinator's window less its reply and a
        margin, less the prompt around the discussion; None when the window is unknown."""
        window = session.context_window("coordinator")
        if window is None:
            return None
        reply = session.max_tokens("coordinator") or window // 4
        frame = decision_prompt(session.problem.question, self.params.domain, "")
        tokens = window - reply - _PROMPT_MARGIN_TOKENS
        return max(0, int(tokens * CHARS_PER_TOKEN) - sum(len(m.content) for m in frame))

    # ---- records --------------------------------------------------------------------------------

    @staticmethod
    def _majority(seats: list[Seat]) -> str | None:
        """The answer most specialists hold; ties go to the leader's, then to the earliest seat's."""
        answers = {s.index: normalize_answer(s.answer) for s in seats if s.answer}
        if not answers:
            return None
        counts = Counter(answers.values())
        top = max(counts.values())
        order = sorted(seats, key=lambda s: (not s.member.leader, s.index))
        return next(s.answer for s in order if s.index in answers and counts[answers[s.index]] == top)

    @staticmethod
    def _candidate(seat: Seat, said: Candidate, opinion: Utterance, reviews: list[Review], r: int) -> Candidate:
        """The seat's candidate of round ``r``: its opinion (from the solution step) with where the seat stands."""
        meta: dict[str, Any] = {
            "member": seat.member.id,
            "specialty": seat.member.specialty,
            "round": r,
            "accepted": seat.accepted,
            "converged": seat.converged,
            "experience_ids": opinion.experience_ids,
            **said.meta,
        }
        if seat.top10:
            meta["top10"] = seat.top10
        # The share of peers that accepted the attempt (math), so reports can rank attempts.
        score = sum(rv.verdict == "accept" for rv in reviews) / len(reviews) if reviews else None
        return said.model_copy(update={"answer": opinion.answer, "score": score, "meta": meta})

    @staticmethod
    def _state(r: int, seats: list[Seat], transcript: Transcript, decision: Decision | None) -> dict[str, Any]:
        members = [
            SeatRecord(id=s.member.id, answer=s.answer, accepted=s.accepted, converged=s.converged) for s in seats
        ]
        state = MATTRLState(round=r, members=members, transcript=transcript)
        if decision is not None:
            state.decision = decision
        return state.stored()


def _read_opinion(content: str, mode: str, *, domain: str) -> SolutionOutput:
    """An opinion as a solution: the whole reply, and the answer it states (:func:`opinion_answer`); in math, where
    it came from (boxed or a final-answer statement)."""
    parsed = parse_solution(content, mode)
    return parsed.model_copy(update={"text": content, "answer": opinion_answer(content, domain)})
