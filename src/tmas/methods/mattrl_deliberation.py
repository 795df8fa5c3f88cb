"""MATTRL Stage II's peer review and meeting (paper 003, section 3.1, A.4, B.4), one kind per domain that
deliberates: the domain's declaration (:mod:`tmas.methods.mattrl_domains`) names its kind.

- :class:`VerdictReview` (math, B.4): every attempt is reviewed by each other specialist (JSON verdict and issues);
  it is accepted only when every verdict is accept and no issue remains. A specialist converges when its attempt is
  accepted, or when a revision keeps its answer while no peer raised a fatal or major issue and at least one peer's
  review was readable (nothing changes under critique: this project's reading of B.3). The meeting's bulletin lists
  the round's new, de-duplicated issues.
- :class:`DifferentialCritique` (medicine, A.4): each specialist's strict top-10 is critiqued by each other
  specialist (agreements, disagreements, changes; the final round has no reviews), and a specialist converges when
  its list no longer changes. The bulletin shares each list's change and the new review points.

Each meeting also writes every specialist's own feedback for its next revision.

A specialist whose opinion call failed this round (an error, an echo, an empty reply) has not spoken: Eq. 5's
"no further changes" needs a revised opinion to compare, so it is not converged, its earlier attempt is not reviewed
again, the bulletin says it did not speak, and it keeps the feedback it has yet to answer for the next round.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from pydantic import BaseModel

from tmas.agents.echo import EchoGuard
from tmas.agents.mattrl_opinion import parse_differential
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
from tmas.agents.output import AgentOutputError
from tmas.answers import normalize_answer
from tmas.llm.types import Completion, Message
from tmas.memory.similarity import jaccard
from tmas.memory.transcript import TeamMember, Transcript, Utterance
from tmas.methods.base import BudgetExhausted, ProblemSession, gather_all

# A parsed peer review: a math review or a medicine critique of a differential.
ReviewT = TypeVar("ReviewT", Review, DifferentialReview)
# Call sample numbers of the reviews: clear of the opinions' (the seat index), each retry further on.
REVIEW_SAMPLE, RETRY_OFFSET = 1000, 500
_DUPLICATE_ISSUE = 0.8  # word-set Jaccard at which two issues say the same thing
# The bulletin's line for a specialist whose opinion call failed this round.
SILENT = "did not speak this round (its opinion call failed)"


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
    # Whether it gave a usable opinion this round (None: converged before the round, so not asked). A seat whose
    # opinion call failed has not spoken: its earlier attempt is neither reviewed again nor counted as converged.
    spoke: bool | None = None
    # The feedback addressed to it by the last meeting (JSON text), for its next revision.
    feedback: str = ""
    # Whether its attempt was cut at max_tokens in the middle of its last line (which is then unfinished).
    cut: bool = False


class ReviewParams(Protocol):
    """What a peer review reads of the method's parameters."""

    @property
    def retries(self) -> int: ...

    @property
    def pooled_differential(self) -> bool: ...


# Seat id -> the reviews of its attempt this round.
Reviews = dict[str, list[Any]]


class ReviewRefused(BudgetExhausted):
    """The budget refused a review's retry: the unusable review its reply that came back gives, and that reply (its
    call was answered and spent), kept in the round's transcript; the stop goes on up as any other."""

    def __init__(self, detail: str, review: Review | DifferentialReview, reply: Completion | None) -> None:
        super().__init__(detail)
        self.review = review
        self.reply = reply


class PeerReview(ABC):
    """One domain's peer review and meeting step of Stage II."""

    def __init__(self, params: ReviewParams) -> None:
        self.params = params

    @staticmethod
    @abstractmethod
    def calls(n: int, rounds: int) -> int:
        """Reviewer calls of ``rounds`` rounds of a team of ``n``, every specialist active throughout."""

    @abstractmethod
    def read_opinion(self, seat: Seat, r: int, notes: list[str]) -> None:
        """What a usable opinion of round ``r`` changes in its seat besides its attempt and answer."""

    @abstractmethod
    async def review(
        self,
        session: ProblemSession,
        active: list[Seat],
        seats: list[Seat],
        r: int,
        transcript: Transcript,
        notes: list[str],
        reviews: Reviews,
        *,
        final: bool,
    ) -> None:
        """The round's reviews of the active attempts into ``reviews`` (``final``: the last round R_max allows). When
        the budget stops the round, ``reviews`` holds the seats all of whose reviews came back, each judged as in a
        finished round, and the stop goes on up."""

    @abstractmethod
    def meeting(
        self, seats: list[Seat], active: list[Seat], reviews: Reviews, r: int, transcript: Transcript, seen: list[str]
    ) -> None:
        """The meeting step after a round that was not the last: each seat's feedback, and the bulletin."""

    def score(self, reviews: Sequence[Any]) -> float | None:
        """A candidate's score from its reviews (None: the reviews give none)."""
        return None

    async def gather(
        self,
        active: list[Seat],
        pairs: list[tuple[Seat, Seat]],
        one: Callable[[Seat, Seat], Awaitable[tuple[ReviewT, Completion | None]]],
        r: int,
        transcript: Transcript,
        notes: list[str],
        reviews: dict[str, list[ReviewT]],
    ) -> None:
        """The reviews of round ``r``, ``one(target, reviewer)`` for each (target, reviewer) pair, all at once, into
        ``reviews``: the id of each of the ``active`` seats -> its reviews, each in the transcript. Reviews and their
        notes are listed in pair order, whatever order they came back in. When the budget stops the round, the reviews
        that finished are in the transcript all the same (their calls were answered and spent), and so is a review
        whose retry the budget refused (:class:`ReviewRefused`: its unusable reply, which did not finish it);
        ``reviews`` holds the seats all of whose reviews came back, a note says how many came back of each other
        seat's, and the stop goes on up."""
        done: dict[int, tuple[ReviewT, Completion | None]] = {}
        refused: set[int] = set()

        async def keep(i: int, target: Seat, reviewer: Seat) -> None:
            try:
                done[i] = await one(target, reviewer)
            except ReviewRefused as stop:
                done[i] = (cast(ReviewT, stop.review), stop.reply)
                refused.add(i)
                raise

        start = len(notes)
        try:
            await gather_all(keep(i, target, reviewer) for i, (target, reviewer) in enumerate(pairs))
        finally:
            notes[start:] = sorted(notes[start:])
            got: dict[str, list[ReviewT]] = {s.member.id: [] for s in active}
            for i, (target, _) in enumerate(pairs):
                if i not in done:
                    continue
                review, reply = done[i]
                if i not in refused:
                    got[target.member.id].append(review)
                transcript.utterances.append(
                    Utterance(
                        round=r,
                        agent=review.reviewer,
                        kind="review",
                        text=_review_text(review, reply),
                        target=target.member.id,
                        answer=review.verdict if isinstance(review, Review) else None,
                        call_id=reply.call_id if reply is not None else None,
                    )
                )
            asked = Counter(target.member.id for target, _ in pairs)
            for seat in active:
                own = got[seat.member.id]
                if len(own) == asked[seat.member.id]:
                    reviews[seat.member.id] = own
                else:
                    notes.append(f"{seat.member.id}: {len(own)} of {asked[seat.member.id]} reviews came back")

    async def ask(
        self,
        session: ProblemSession,
        messages: list[Message],
        sample: int,
        reply_model: type[BaseModel],
        parse: Callable[[Completion], ReviewT],
        fields: Callable[[ReviewT], list[tuple[str, str | None]]],
    ) -> tuple[ReviewT | None, Completion | None, str, bool]:
        """One peer review, asked again (within ``retries``) when the call failed, the reply could not be read or it
        echoed its instructions; (None, the last reply, why, refused) when no attempt gave a usable review, ``refused``
        where the budget refused a retry (the reply is then the last that came back). A first call the budget refuses
        raises :class:`BudgetExhausted`: nothing of the review came back."""
        guard = EchoGuard.of(messages)
        why = ""
        reply: Completion | None = None
        for attempt in range(1 + self.params.retries):
            try:
                reply = await session.chat(
                    "reviewer",
                    messages,
                    sample=sample + attempt * RETRY_OFFSET,
                    reply_model=reply_model,
                    attempt=attempt,
                )
            except BudgetExhausted:
                if reply is None:
                    raise
                return None, reply, why, True
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
            return review, reply, "", False
        return None, reply, why, False

    @staticmethod
    def unusable(
        session: ProblemSession,
        reviewer: Seat,
        target: Seat,
        why: str,
        refused: bool,
        reply: Completion | None,
        unreadable: Callable[[str, str, str], ReviewT],
        counted: str,
        notes: list[str],
    ) -> ReviewT:
        """The review that stands for one no attempt made usable (``counted``: what it counts as), noted; where the
        budget refused its retry, :class:`ReviewRefused` carries it and its reply up with the stop."""
        review = unreadable(reviewer.member.id, target.member.id, why)
        said = f"review of {target.member.id} by {reviewer.member.id}: unusable ({why})"
        if refused:
            notes.append(f"{said}; the budget refused its retry")
            raise ReviewRefused(session.budget_stop or "budget spent", review, reply)
        notes.append(f"{said}; {counted}")
        return review


class VerdictReview(PeerReview):
    """B.4: verdicts and issues on every attempt, acceptance and convergence from them (math)."""

    @staticmethod
    def calls(n: int, rounds: int) -> int:
        """Every attempt reviewed by each other specialist, every round."""
        return n * (n - 1) * rounds

    def read_opinion(self, seat: Seat, r: int, notes: list[str]) -> None:
        if seat.answer is None:
            notes.append(f"{seat.member.id}: opinion states no final answer")

    async def review(
        self,
        session: ProblemSession,
        active: list[Seat],
        seats: list[Seat],
        r: int,
        transcript: Transcript,
        notes: list[str],
        reviews: Reviews,
        *,
        final: bool,
    ) -> None:
        """Every active attempt reviewed by every other specialist; then acceptance and convergence (under a budget
        stop, of the seats all of whose reviews came back)."""
        pairs = [(t, s) for t in active for s in seats if s is not t and t.spoke]
        try:
            await self.gather(
                active,
                pairs,
                lambda target, reviewer: self._review(session, reviewer, target, len(seats), notes),
                r,
                transcript,
                notes,
                reviews,
            )
        finally:
            self._judge(active, reviews, r)

    @staticmethod
    def _judge(active: list[Seat], reviews: Reviews, r: int) -> None:
        """Acceptance and convergence of each active seat whose reviews are in ``reviews``."""
        for seat in active:
            if seat.member.id not in reviews:
                continue
            if not seat.spoke:
                seat.accepted = seat.converged = False
                continue
            own = reviews[seat.member.id]
            seat.accepted = accepted(own)
            serious = any(i.severity in ("fatal", "major") for rv in own for i in rv.issues)
            kept = (
                r > 0
                and seat.answer is not None
                and normalize_answer(seat.answer) == normalize_answer(seat.previous_answer or "")
            )
            # "Unchanged under critique" needs a critique: a kept answer whose reviews all failed was read by no peer.
            heard = not own or any(rv.readable for rv in own)
            seat.converged = seat.accepted or (
                kept and heard and not serious and all(rv.verdict != "reject" for rv in own)
            )

    async def _review(
        self, session: ProblemSession, reviewer: Seat, target: Seat, team: int, notes: list[str]
    ) -> tuple[Review, Completion | None]:
        review, reply, why, refused = await self.ask(
            session,
            review_prompt(session.problem.question, reviewer.member, target.member, target.attempt),
            REVIEW_SAMPLE + target.index * team + reviewer.index,
            ReviewReply,
            lambda r: parse_review(r.content, reviewer.member.id, target.member.id, truncated=r.truncated),
            lambda rv: [("analysis", rv.analysis), *((f"issue {i.type}", f"{i.note} {i.fix}") for i in rv.issues)],
        )
        if review is not None:
            return review, reply
        counted = "counted as revise"
        return self.unusable(session, reviewer, target, why, refused, reply, unreadable_review, counted, notes), reply

    def meeting(
        self, seats: list[Seat], active: list[Seat], reviews: Reviews, r: int, transcript: Transcript, seen: list[str]
    ) -> None:
        """Each specialist's own feedback, and a bulletin of the round's new, distinct issues."""
        lines: list[str] = []
        for seat in active:
            if not seat.spoke:
                lines.append(f"{seat.member.id} ({seat.member.specialty}): {SILENT}, answer {seat.answer or 'none'}")
                continue
            own: list[Review] = reviews.get(seat.member.id, [])
            fresh = []
            for review in own:
                for issue in review.issues:
                    key = f"{issue.note} {issue.fix}"
                    if any(jaccard(key, old) >= _DUPLICATE_ISSUE for old in seen):
                        continue
                    seen.append(key)
                    fresh.append(issue)
            hints = sorted({rv.alt_hint.strip() for rv in own if rv.alt_hint and rv.alt_hint.strip()})
            # An unreadable review counts as revise for acceptance, but its author hears no verdict nobody gave.
            seat.feedback = json.dumps(
                {
                    "verdicts": {rv.reviewer: rv.verdict for rv in own if rv.readable},
                    "issues": [i.model_dump() for rv in own for i in rv.issues],
                    "alt_hints": hints,
                },
                ensure_ascii=False,
            )
            status = "accepted" if seat.accepted else ("converged" if seat.converged else "open")
            lines.append(f"{seat.member.id} ({seat.member.specialty}): {status}, answer {seat.answer or 'none'}")
            lines += [f"  - [{i.severity} {i.type}] {i.note}" + (f" Fix: {i.fix}" if i.fix else "") for i in fresh]
        transcript.utterances.append(Utterance(round=r, agent="coordinator", kind="meeting", text="\n".join(lines)))

    def score(self, reviews: Sequence[Any]) -> float | None:
        """The share of peers that accepted the attempt, so reports can rank attempts."""
        return sum(rv.verdict == "accept" for rv in reviews) / len(reviews) if reviews else None


class DifferentialCritique(PeerReview):
    """A.4: critiques of every differential (agreements, disagreements, changes); a specialist converges when its
    list no longer changes (medicine)."""

    @staticmethod
    def calls(n: int, rounds: int) -> int:
        """Every differential critiqued by each other specialist, in every round but the last."""
        return n * (n - 1) * max(rounds - 1, 0)

    def read_opinion(self, seat: Seat, r: int, notes: list[str]) -> None:
        # A differential cut at max_tokens ends in the diagnosis the cut went through ("Gaucher dis"): left out.
        seat.top10 = parse_differential(seat.attempt.rpartition("\n")[0] if seat.cut else seat.attempt)
        if len(seat.top10) < 10:
            notes.append(f"{seat.member.id}: differential has {len(seat.top10)} of 10 diagnoses")
        seat.converged = r > 0 and bool(seat.top10) and same_list(seat.top10, seat.previous_top10)

    async def review(
        self,
        session: ProblemSession,
        active: list[Seat],
        seats: list[Seat],
        r: int,
        transcript: Transcript,
        notes: list[str],
        reviews: Reviews,
        *,
        final: bool,
    ) -> None:
        """Every active differential critiqued by every other specialist; none in the last round, whose
        revisions they would feed."""
        if final or all(s.converged for s in seats):
            return
        pairs = [(t, s) for t in active for s in seats if s is not t and t.spoke]
        await self.gather(
            active,
            pairs,
            lambda target, reviewer: self._critique(session, reviewer, target, len(seats), notes),
            r,
            transcript,
            notes,
            reviews,
        )

    async def _critique(
        self, session: ProblemSession, reviewer: Seat, target: Seat, team: int, notes: list[str]
    ) -> tuple[DifferentialReview, Completion | None]:
        review, reply, why, refused = await self.ask(
            session,
            differential_review_prompt(session.problem.question, reviewer.member, target.member, target.attempt),
            REVIEW_SAMPLE + target.index * team + reviewer.index,
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
        unreadable = unreadable_differential_review
        return self.unusable(session, reviewer, target, why, refused, reply, unreadable, "nothing shared", notes), reply

    def meeting(
        self, seats: list[Seat], active: list[Seat], reviews: Reviews, r: int, transcript: Transcript, seen: list[str]
    ) -> None:
        """Eq. 6 for medicine: each specialist's change to its differential (Delta O_s) and the round's peer-review
        points not raised before, de-duplicated; each specialist's own reviews become its feedback."""
        lines: list[str] = []
        for seat in active:
            if not seat.spoke:
                lines.append(f"{seat.member.id} ({seat.member.specialty}): {SILENT}")
                continue
            own: list[DifferentialReview] = reviews.get(seat.member.id, [])
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
            lines.append(f"{seat.member.id} ({seat.member.specialty}): {differential_change(seat)}")
            for rv in own:
                for label, points in (("disagrees", rv.disagreements), ("asks to change", rv.changes)):
                    for point in points:
                        if any(jaccard(point, old) >= _DUPLICATE_ISSUE for old in seen):
                            continue
                        seen.append(point)
                        lines.append(f"  - {rv.reviewer} {label}: {point}")
        if self.params.pooled_differential:
            pooled = pooled_differential(seats)
            if pooled:
                lines.append("Team differential by Borda count (pooled_differential option): " + "; ".join(pooled))
        transcript.utterances.append(Utterance(round=r, agent="coordinator", kind="meeting", text="\n".join(lines)))


def _review_text(review: Review | DifferentialReview, reply: Completion | None) -> str:
    """A review's text in the transcript: its reply, or nothing when no reply gave a usable review (an error, a reply
    that does not parse, one that echoed its instructions): like an unusable opinion, it is no turn of the
    discussion that experience construction credits (the call record keeps the reply, the notes say why)."""
    return reply.content if reply is not None and review.readable else ""


def same_list(a: list[str], b: list[str]) -> bool:
    """Whether two differentials name the same diagnoses in the same order, letter case aside (as a list is read
    and pooled): a list written again with other capitals proposes no change (Eq. 5)."""
    return [n.lower() for n in a] == [n.lower() for n in b]


def differential_change(seat: Seat) -> str:
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
        return "unchanged" if same_list(seat.top10, seat.previous_top10) else "reordered its list"
    parts = [f"added {'; '.join(added)}"] if added else []
    parts += [f"dropped {'; '.join(dropped)}"] if dropped else []
    return ", ".join(parts)


def pooled_differential(seats: list[Seat]) -> list[str]:
    """The team's ten best diagnoses by Borda count (rank 1 earns 10 points, rank 10 earns 1); empty where no seat
    holds a differential."""
    points: Counter[str] = Counter()
    spelled: dict[str, str] = {}
    for seat in seats:
        for rank, name in enumerate(seat.top10[:10]):
            points[name.lower()] += 10 - rank
            spelled.setdefault(name.lower(), name)
    return [spelled[k] for k, _ in points.most_common(10)]
