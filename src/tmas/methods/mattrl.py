"""MATTRL, multi-agent deliberation with a test-time experience pool (paper 003, sections 3.1-3.3, appendices A-B).

:meth:`MATTRL.solve` runs the paper's three stages:

- Stage I (:meth:`MATTRL._form_team`): the coordinator recruits at most ``team_size`` specialists, one of them the
  leader (education: C.4.2's roles, checked, no forced leader); unusable JSON is retried once, then the domain's
  default team is used; the record says which.
- Stage II (:meth:`MATTRL._round`, rounds r = 0 .. R_max - 1, one iteration record each): every specialist not yet
  converged retrieves its top-K pool entries for the case and its current context and gives its opinion
  (:meth:`MATTRL._opinion`); the domain's peer review reviews the opinions and says who has converged, and the
  meeting step turns the round's updates into a bulletin and each specialist's own feedback for the next round
  (:mod:`tmas.methods.mattrl_deliberation`: math's verdicts, B.4; medicine's critiques of differentials, A.4).
  Deliberation halts when all have converged or at R_max.
- Stage III (:meth:`MATTRL._decide`, in the last round's record): the coordinator reads every round's opinions
  (Eq. 7, fitted to its context window) and writes the discussion report and the decision in tags, with one
  rewrite pass when the tags are missing; failing that, what the domain reads from the reply, the team's pooled
  differential or its majority answer.

What differs between domains is each domain's declaration (:mod:`tmas.methods.mattrl_domains`); a teaching domain
(education) runs C.1's pre-test, teaching dialogue and post-test instead (:mod:`tmas.methods.mattrl_teaching`).
Every record's state is a :class:`MATTRLState` whose transcript is the discussion so far (experience construction
reads it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field

from tmas.agents.echo import EchoGuard
from tmas.agents.mattrl_decision import Decision, discussion_record
from tmas.agents.output import AgentOutputError, finished_lines
from tmas.agents.solution import SolutionOutput, parse_solution
from tmas.answers import normalize_answer
from tmas.errors import InputError, LLMError
from tmas.llm.model import ChatModel, EndpointUnreachable
from tmas.llm.tokens import CHARS_PER_TOKEN
from tmas.llm.types import Completion
from tmas.memory.embedders import LOCAL, UNNAMED, Embedder, LocalEmbedder, embedder_for
from tmas.memory.pool_entry import PoolEntry
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
from tmas.methods.call_count import CallCount, asked_again, count_calls
from tmas.methods.echo_retry import RetryRefused, chat_guarded
from tmas.methods.mattrl_deliberation import PeerReview, Reviews, Seat, pooled_differential
from tmas.methods.mattrl_domains import DEFAULT_DOMAIN, DOMAINS, Domain, DomainName, domain_named, domain_names
from tmas.methods.mattrl_domains.domain import Tier
from tmas.methods.mattrl_teaching import teach
from tmas.methods.param_flags import cli_flag
from tmas.methods.reasked import Reasked
from tmas.methods.state import MATTRLState, MethodState, SeatRecord
from tmas.methods.steps import solve_call
from tmas.methods.traits import Traits
from tmas.problems import question_hash

if TYPE_CHECKING:  # the pool needs numpy and faiss (the `pool` extra): imported only when a pool is configured
    from tmas.memory.pool import Pool

# Call sample numbers: distinct per call of one iteration, so each gets its own cache slot and sampling seed. The
# coordinator's decision (and its rewrite) count from _DECISION_SAMPLE, clear of its team formation's attempts (0 to
# ``retries``), which share its role and, when the decision comes in round 0, its iteration. Runs stored before it
# had the decision at samples 0 and 1: replayed now, their decision calls are not found and are sent again. (The
# reviews' numbers are the peer review's: mattrl_deliberation.REVIEW_SAMPLE.)
_DECISION_SAMPLE = 3000
# Tokens kept free beside the decision prompt and its reply, as TMAS keeps beside its rollouts.
_PROMPT_MARGIN_TOKENS = 256


class MATTRLParams(MethodParams):
    # R_max, the most deliberation rounds (paper: 3).
    iterations: Annotated[Iterations, Field(le=20)] = 3
    domain: DomainName = Field(
        default=DEFAULT_DOMAIN, json_schema_extra=cli_flag("--domain", f"MATTRL's domain: {domain_names()}.")
    )
    # Education: one teacher, or a recruited team (with experience when a pool is given).
    teaching: Literal["single", "team"] = "team"
    # n, the most specialists the coordinator may recruit.
    team_size: int = Field(default=3, ge=1, le=9)
    # The experience pool folder (None: no experience), its embedder, and K entries per retrieval (paper: 8).
    pool: str | None = None
    embedder: Literal["endpoint", "local"] = "endpoint"
    top_k: int = Field(default=8, ge=1, le=64)
    # Retrieve the entries distilled from the problem being solved too. Off: a pool built from runs on the same
    # problems (a test split that overlaps the build split) cannot hand a problem its own reference answer.
    pool_same_problem: bool = False
    # Extra attempts at an unusable team or review reply before the default team / an unreadable review.
    retries: int = Field(default=1, ge=0, le=3)
    # Medicine: also put the team's Borda-pooled top-10 into the meeting bulletin. This project's option, not the
    # paper's (A.4 shares each member's changes and the peer reviews); off by default, since a pooled list
    # invites every member to converge on it (herding).
    pooled_differential: bool = False

    proof_refused: ClassVar[str | None] = (
        "MATTRL's domain sets what its answer is (math: a final answer, education: a letter, medicine: a"
        " ranked differential); mode=proof does not apply to it"
    )

    def notices(self) -> dict[str, str]:
        """The base's, and a ``pool`` a single teacher does not read (C.4.3's teacher works without experience)."""
        out = super().notices()
        domain = DOMAINS.get(self.domain)
        if self.pool is not None and domain is not None and domain.teaching and self.teaching == "single":
            out["mattrl_pool_unused"] = (
                f"pool={self.pool} is not used with teaching=single: the single teacher teaches without experience"
                " (the paper's Single Agent); teaching=team teaches with it"
            )
        return out


@dataclass
class Retriever:
    """A problem's access to the pool. ``own``: the digest of the problem's question, whose entries are left out
    (None: ``pool_same_problem``); ``left_out``: how many entries that is, said once in the problem's record."""

    pool: Pool
    embed: Embedder
    k: int
    own: str | None = None
    left_out: int = 0
    said: bool = False


def _without_own(tier: Tier | None, own: str | None) -> Tier | None:
    """``tier`` (None: every entry in one tier), with the entries whose source question is ``own`` never returned."""
    if own is None:
        return tier

    def keyed(entry: PoolEntry) -> int | None:
        if entry.source_question == own:
            return None
        return tier(entry) if tier is not None else 0

    return keyed


def _pool_name(retriever: Retriever | None) -> str | None:
    """The pool a transcript's experience ids are entries of (:attr:`Transcript.pool`): its folder, resolved."""
    return str(retriever.pool.path.resolve()) if retriever is not None else None


@dataclass
class Deliberation:
    """The discussion of one case so far: its transcript, the seats, the domain's peer review, the points the
    bulletins already shared, the decision, and whether the budget ended it."""

    transcript: Transcript
    review: PeerReview
    retriever: Retriever | None
    seats: list[Seat] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    decision: Decision | None = None
    stopped: bool = False
    # The opinion prompts each seat sent: a seat whose opinions keep failing sends the same prompt again once the
    # snapshot and bulletin stand still, and a configured seed must then change.
    asked: Reasked = field(default_factory=Reasked)

    def bulletin(self) -> str:
        """The last meeting's bulletin (empty before the first meeting)."""
        return next((u.text for u in reversed(self.transcript.utterances) if u.kind == "meeting"), "")

    def snapshot(self) -> str:
        """The attempts the team has accepted so far."""
        return "\n\n".join(
            f"{s.member.id} ({s.member.specialty}), accepted:\n{s.attempt}" for s in self.seats if s.accepted
        )


class MATTRL(Method[MATTRLParams]):
    name: ClassVar[str] = "mattrl"
    traits: ClassVar[Traits] = Traits(roles=("coordinator", "specialist", "reviewer", "student", "embedding"))
    example_params: ClassVar[dict[str, Any] | None] = {"team_size": 2, "iterations": 2}
    # The setting of the MATTRL paper: 3 experts, at most 3 rounds (4.1), K = 8 entries a retrieval (A.7).
    paper_settings: ClassVar[dict[str, Any]] = {"team_size": 3, "iterations": 3, "top_k": 8}
    Params: ClassVar[type[MethodParams]] = MATTRLParams
    State: ClassVar[type[MethodState]] = MATTRLState
    embedded_defaults: ClassVar[dict[str, Any]] = {"iterations": 2, "team_size": 2}

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        domain = DOMAINS.get(str(params.get("domain", DEFAULT_DOMAIN)))
        if domain is not None and domain.teaching and params.get("teaching") == "single":
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
        reviews every round but the last: 2 + R x n + (R - 1) x n(n - 1). Education: a right pre-test ends the case
        after 1 call; otherwise single teacher 2R + 3, team 2 + R x (n + 2) + 2 (formation, per round n analyses, a
        plan and the student's reply, then guidance and post-test). The fewest: a right pre-test's one call; a
        recruited team of one that has converged after its first opinion, 3."""
        p = self.params
        n, rounds, tries = p.team_size, p.iterations, 1 + p.retries
        if self.domain.teaching:
            if p.teaching == "single":
                roles = {"student": rounds + 2, "specialist": rounds + 1}
                note = "at most: a right pre-test ends the case after 1 call"
                # No call of a single teacher's is asked again.
                return count_calls(roles, note, upper=roles, fewest={"student": 1}, again={})
            roles = {"student": rounds + 2, "coordinator": 1 + rounds + 1, "specialist": n * rounds}
            upper = {**roles, "coordinator": tries + rounds + 1}
            note = "at most: a right pre-test ends the case after 1 call; team formation may retry"
            # Each round's planned question is under the echo guard.
            again = asked_again({"coordinator": rounds})
            return count_calls(roles, note, upper, fewest={"student": 1}, again=again)
        review = self.domain.review
        reviews = review.calls(n, rounds) if review is not None else 0
        roles = {"coordinator": 2, "specialist": n * rounds, "reviewer": reviews}
        upper = {"coordinator": tries + 2, "specialist": n * rounds, "reviewer": reviews * tries}
        note = "at most, with the full team for every round: deliberation stops once every specialist has converged"
        # Opinions and the decision are under the echo guard (a review's own retries are in ``upper``).
        again = asked_again({"specialist": n * rounds, "coordinator": 1})
        return count_calls(roles, note, upper, fewest={"coordinator": 2, "specialist": 1}, again=again)

    def __init__(self, params: MethodParams) -> None:
        super().__init__(params)
        self._pool: Pool | None = None
        self._local: LocalEmbedder | None = None

    def check_setup(self) -> None:
        """The experience pool named: a wrong folder, or the ``pool`` extra missing, is one line before the run
        starts, not an error of every problem it solves."""
        if self.params.pool is None:
            return
        try:
            from tmas.memory.pool import Pool
        except ImportError:
            raise InputError(
                f"pool={self.params.pool}: MATTRL's experience pool needs numpy and faiss: pip install 'tmas[pool]'"
            ) from None
        Pool.check_folder(self.params.pool)

    def inputs(self) -> dict[str, str]:
        """The experience pool the specialists retrieve from, by its content (:meth:`Pool.content_digest`): a pool
        rebuilt, added to or pruned since the run finished some problems would give the rest other hints. None
        without a pool, or where a single teacher teaches without it. The pool is read here once and kept: every
        retrieval of this method reads what this digest is of, whatever a build saves meanwhile."""
        if not self._reads_pool():
            return {}
        return {f"pool={self.params.pool}": self._loaded_pool().content_digest()}

    def check_model(self, llm: ChatModel) -> None:
        """The pool's embedding model is the one configured (the endpoint's ``embedding`` model, or the local one):
        a pool another model built is refused before the first problem, not in each."""
        if self._reads_pool():
            self._loaded_pool().check_embedder(self._embedder(llm).name)

    async def check_served(self, llm: ChatModel) -> None:
        """Where the embedding role names no model, one embedding request (:meth:`Pool.check_served`) says which
        model serves it: a pool another model built is refused before the coordinator's first call, not at each
        problem's first retrieval. A pool the run would retrieve nothing from (no entry of its domain) is not asked
        about, as the run would not ask; an embedding the server refuses is left to the retrievals, which go
        without hints and say so."""
        if not self._reads_pool():
            return
        embed = self._embedder(llm)
        pool = self._loaded_pool()
        if embed.name == UNNAMED and any(entry.domain == self.domain.name for entry in pool.entries):
            try:
                await pool.check_served(embed)
            except EndpointUnreachable:
                raise  # it ends a run, as a chat call's does
            except LLMError:
                pass

    def _reads_pool(self) -> bool:
        """A pool is named and read: a single teacher teaches without it."""
        p = self.params
        return p.pool is not None and not (self.domain.teaching and p.teaching == "single")

    def _embedder(self, llm: ChatModel) -> Embedder:
        """The embedder of the queries: the endpoint's ``embedding`` model, or one all-MiniLM-L6-v2 for the run's
        problems (its weights are read once, not once a problem)."""
        if self.params.embedder == LOCAL:
            self._local = self._local or LocalEmbedder()
            return self._local
        return embedder_for(self.params.embedder, llm)

    def _loaded_pool(self) -> Pool:
        """The experience pool, read at the first need and kept for the method's life."""
        if self._pool is None:
            from tmas.memory.pool import Pool

            assert self.params.pool is not None
            self._pool = Pool.open(Path(self.params.pool))
        return self._pool

    @property
    def domain(self) -> Domain:
        """The declaration of the run's domain."""
        return domain_named(self.params.domain)

    async def solve(self, session: ProblemSession) -> ProblemResult:
        if self.domain.teaching:
            return await self._teach(session)
        review = self.domain.review
        assert review is not None, f"domain {self.domain.name!r} neither deliberates nor teaches"
        session.begin_iteration(0)
        notes: list[str] = []
        retriever = self._retriever(session)
        transcript = Transcript(
            problem_id=session.problem.problem_id, domain=self.domain.name, pool=_pool_name(retriever)
        )
        talk = Deliberation(transcript, review(self.params), retriever)
        # Stage I: the coordinator recruits the team.
        try:
            transcript.team = await self._form_team(session, notes)
        except BudgetExhausted:
            if not notes:
                raise  # nothing came back: no record, as no method records an iteration the stop refused whole
            # An unusable reply came back before the budget refused its retry: it was answered and spent, and round
            # 0's record keeps it (its call, its notes); no one speaks, and the problem ends stopped by the budget.
            talk.stopped = True
            session.end_iteration([], state=self._state(0, talk), notes=notes)
            return self._result(session, talk)
        talk.seats = [Seat(i, m) for i, m in enumerate(transcript.team)]
        # Stage II, round by round until every specialist has converged or R_max; Stage III ends the last round.
        for r in range(self.params.iterations):
            if r:
                session.begin_iteration(r)
            last = await self._round(session, talk, r, notes)
            notes = []
            if last:
                break
        return self._result(session, talk)

    async def _teach(self, session: ProblemSession) -> ProblemResult:
        """C.1: the student's pre-test, the team's (or a single teacher's) dialogue, the post-test."""
        p, metadata = self.params, session.problem.metadata
        # A single teacher teaches without experience: its pool is not read (nor checked against the embedder).
        retriever = self._retriever(session) if p.teaching == "team" else None

        async def retrieve(member: TeamMember, context: str, notes: list[str]) -> list[PoolEntry]:
            return await self._hints(retriever, member, [context], notes, metadata)

        return await teach(
            session,
            rounds=p.iterations,
            team=p.teaching == "team",
            form_team=self._form_team,
            retrieve=retrieve,
            name=self.name,
            domain=self.domain.name,
            pool=_pool_name(retriever),
        )

    # ---- Stage I --------------------------------------------------------------------------------

    async def _form_team(self, session: ProblemSession, notes: list[str]) -> list[TeamMember]:
        p, domain = self.params, self.domain
        messages, schema = domain.recruit_prompt(session.problem.question, p.team_size), domain.team_reply(p.team_size)
        for attempt in range(1 + p.retries):
            try:
                reply = await session.chat("coordinator", messages, sample=attempt, reply_model=schema, attempt=attempt)
            except BudgetExhausted:
                if attempt:
                    notes.append(f"team formation attempt {attempt + 1}: refused by the budget")
                raise
            why = reply.error or ("reply truncated at max_tokens" if reply.truncated else None)
            if why is None:
                try:
                    team, repairs = domain.parse_team(reply.content, p.team_size)
                except AgentOutputError as exc:
                    session.tally("coordinator").unusable += 1
                    why = str(exc)
                else:
                    notes.extend(f"team formation: {note}" for note in repairs)
                    return team
            notes.append(f"team formation attempt {attempt + 1}: unusable reply: {why}")
        notes.append("team formation: no usable team from the coordinator; the default team is used")
        return domain.default_team(p.team_size, session.problem.metadata)

    # ---- Stage II -------------------------------------------------------------------------------

    async def _round(self, session: ProblemSession, talk: Deliberation, r: int, notes: list[str]) -> bool:
        """Round ``r``: the opinions of the specialists not yet converged, the domain's peer review, then the
        meeting step, or in the last round Stage III's decision; the round's record. True when it was the last."""
        final = r == self.params.iterations - 1
        active = [s for s in talk.seats if not s.converged]
        for seat in talk.seats:
            seat.spoke = False if seat in active else None
        # Built once per round, before anyone speaks, so every prompt of the round sees the same team state.
        bulletin, snapshot = talk.bulletin(), talk.snapshot()
        spoke: dict[str, tuple[Candidate, Utterance]] = {}
        reviews: Reviews = {}
        try:
            await self._opinions(session, talk, active, r, snapshot, bulletin, spoke, notes)
            await talk.review.review(session, active, talk.seats, r, talk.transcript, notes, reviews, final=final)
            last = final or all(s.converged for s in talk.seats)
            if last:
                talk.decision = await self._decide(session, talk, r, notes)
                talk.transcript.final_answer = talk.decision.answer
            else:
                talk.review.meeting(talk.seats, active, reviews, r, talk.transcript, talk.seen)
        except BudgetExhausted:
            # Keep what the round finished; the team's majority stands in for the decision it could not make.
            talk.stopped = last = True
            if r > 0 and not spoke:
                # Nothing of the round finished: no record of it, as no method records an iteration the stop refused
                # whole (the record before says where the run stopped: _result).
                return last
            notes.append(f"stopped: {session.budget_stop}; the team's majority answer is used")
        candidates = [
            self._candidate(s, *spoke[s.member.id], talk.review.score(reviews.get(s.member.id, [])), r)
            for s in active
            if s.member.id in spoke
        ]
        session.end_iteration(
            candidates,
            selected=talk.decision.answer if talk.decision else self._majority(talk.seats),
            state=self._state(r, talk),
            notes=notes,
        )
        return last

    async def _opinions(
        self,
        session: ProblemSession,
        talk: Deliberation,
        active: list[Seat],
        r: int,
        snapshot: str,
        bulletin: str,
        spoke: dict[str, tuple[Candidate, Utterance]],
        notes: list[str],
    ) -> None:
        """Every active specialist's opinion of round ``r``, into ``spoke`` and the transcript (what finished is
        kept when the budget stops the round)."""
        start = len(notes)
        try:
            await gather_all(self._opinion(session, talk, s, r, snapshot, bulletin, spoke, notes) for s in active)
        finally:
            # Replies arrive in any order; the transcript and the notes list them in seat order, so a resumed run
            # (replayed calls return at once) records exactly what the first run did.
            talk.transcript.utterances += [spoke[s.member.id][1] for s in active if s.member.id in spoke]
            notes[start:] = sorted(notes[start:])

    def _retriever(self, session: ProblemSession) -> Retriever | None:
        p = self.params
        if p.pool is None:
            return None
        embed = self._embedder(session.llm)
        pool = self._loaded_pool()
        pool.check_embedder(embed.name)
        domain = self.domain.name
        if not any(entry.domain == domain for entry in pool.entries):
            # An empty pool (a build that kept no turn) or one of other domains' runs: no specialist can get a hint,
            # so nothing is embedded, and the run says it is the team without experience.
            others = len(pool.entries)
            holds = f"no {domain} entries ({others} of other domains)" if others else "no entries"
            session.notice(
                "mattrl_no_experience",
                f"pool={p.pool} holds {holds}: the specialists get no experience hints, so this run is the team"
                " without experience",
            )
            return None
        own = None if p.pool_same_problem else question_hash(session.problem.question)
        left_out = sum(1 for entry in pool.entries if own is not None and entry.source_question == own)
        if left_out:
            session.notice(
                "mattrl_same_problem_entries",
                f"pool={p.pool} holds entries distilled from problems of this run: each problem's own are left out"
                " of its retrieval (pool_same_problem=true retrieves them)",
            )
        return Retriever(pool, embed, p.top_k, own, left_out)

    async def _hints(
        self,
        retriever: Retriever | None,
        member: TeamMember,
        context: list[str],
        notes: list[str],
        metadata: Mapping[str, Any],
    ) -> list[PoolEntry]:
        """The top-K entries for the case, the specialist and its current context (B.9), ranked first by the
        domain's retrieval keys where it declares them (education: role, subject, difficulty). Entries distilled
        from this very problem are left out (unless ``pool_same_problem``): they were written knowing its answer."""
        if retriever is None:
            return []
        parts = [context[0], f"Specialist: {member.specialty}. {member.description}", *context[1:]]
        tier = _without_own(self.domain.retrieval_tier(member, metadata), retriever.own)
        if retriever.left_out and not retriever.said:
            retriever.said = True
            notes.append(
                f"experience retrieval: {retriever.left_out} pool entries distilled from this problem left out"
            )
        try:
            hits = await retriever.pool.search("\n\n".join(c for c in parts if c), retriever.k, retriever.embed, tier)
        except LLMError as exc:
            notes.append(f"{member.id}: experience retrieval failed, no hints this round: {exc}")
            return []
        return [entry for entry, _ in hits]

    async def _opinion(
        self,
        session: ProblemSession,
        talk: Deliberation,
        seat: Seat,
        r: int,
        snapshot: str,
        bulletin: str,
        spoke: dict[str, tuple[Candidate, Utterance]],
        notes: list[str],
    ) -> None:
        """The specialist's opinion of round ``r``, into ``spoke`` with its utterance (kept if the round stops)."""
        question, domain = session.problem.question, self.domain
        context = [question, seat.attempt, seat.feedback] if seat.attempt else [question]
        hints = await self._hints(talk.retriever, seat.member, context, notes, session.problem.metadata)
        messages = domain.opinion_prompt(
            question,
            seat.member,
            round_=r,
            previous=seat.attempt,
            feedback=seat.feedback,
            snapshot=snapshot,
            bulletin=bulletin,
            hints=hints,
        )
        # A solution-like call (methods/steps.py): the echo guard, extraction and tally of every solution writer; an
        # opinion's answer is the one the domain reads from it.
        # A prompt the seat sent before (its opinions failed and nothing it is built from moved) goes with a new seed
        # where one is configured: the same one would draw the same unusable reply.
        said = await solve_call(
            session,
            "specialist",
            messages,
            index=seat.index,
            mode=domain.answer_mode,
            parse=self._read_opinion,
            asked=talk.asked,
            # A reply that echoed, whose retry the budget refused, is the seat's candidate; the stop goes on below.
        )
        if said is None:
            # The budget refused the call: the round keeps what finished (see _round), and says why this seat is
            # silent (not a failed call).
            notes.append(f"{seat.member.id}: the budget refused its opinion call; it did not speak this round")
            raise BudgetExhausted(session.budget_stop or "budget spent")
        if said.meta.echo_retry and not said.meta.retry_refused:
            notes.append(f"{seat.member.id}: the opinion's {said.meta.echo_retry} echoed the instructions; asked again")
        if said.meta.retry_refused:
            notes.append(
                f"{seat.member.id}: the opinion's {said.meta.echo} echoed the instructions; the budget refused its"
                " retry; keeps its attempt"
            )
        elif said.meta.echo:
            notes.append(f"{seat.member.id}: the retried opinion echoed the instructions too; keeps its attempt")
        elif said.error or not said.text.strip():
            notes.append(f"{seat.member.id}: opinion call failed ({said.error or 'empty reply'}); keeps its attempt")
        else:
            if said.meta.truncated:
                notes.append(f"{seat.member.id}: opinion truncated at max_tokens")
            seat.previous_answer, seat.previous_top10 = seat.answer, seat.top10
            seat.attempt = said.text.strip()
            seat.cut = bool(said.meta.truncated) and not said.text.endswith("\n")
            seat.answer = said.answer
            seat.spoke = True
            talk.review.read_opinion(seat, r, notes)
        spoke[seat.member.id] = (
            said,
            Utterance(
                round=r,
                agent=seat.member.id,
                kind="opinion",
                # An unusable reply (one that echoed the instructions twice, a broken stream) is no opinion: the
                # discussion the chair and experience construction read holds none of it (the candidate keeps it).
                text=said.text if seat.spoke else "",
                answer=seat.answer if seat.spoke else None,
                call_id=said.call_id,
                experience_ids=[h.id for h in hints],
            ),
        )
        if said.meta.retry_refused:
            # Recorded, as the replies that came back are: the round then ends at the stop (see _round).
            raise BudgetExhausted(said.meta.retry_refused)

    def _read_opinion(self, content: str, mode: str) -> SolutionOutput:
        """An opinion as a solution: the whole reply, and the answer the domain reads from it; in math, where it
        came from (boxed or a final-answer statement)."""
        parsed = parse_solution(content, mode)
        return parsed.model_copy(update={"text": content, "answer": self.domain.opinion_answer(content)})

    # ---- Stage III ------------------------------------------------------------------------------

    async def _decide(self, session: ProblemSession, talk: Deliberation, r: int, notes: list[str]) -> Decision:
        domain, seats = self.domain, talk.seats
        messages = domain.decision_prompt(session.problem.question, self._summary(session, talk))
        guard = EchoGuard.of(messages)

        def echo_of(reply: Completion) -> str | None:
            found = domain.parse_decision(finished_lines(reply))
            return "final answer" if found is not None and guard.echoes_answer(found.answer) else None

        try:
            guarded = await chat_guarded(session, "coordinator", messages, echo_of, sample=_DECISION_SAMPLE)
        except RetryRefused as stop:
            # The reply came back, echoing, and is read as one that echoed twice; the stop ends the problem with it.
            guarded, talk.stopped = stop.guarded, True
        reply = guarded.reply
        if guarded.refused is not None:
            notes.append("decision: the final answer echoed the prompt's instructions; the budget refused its retry")
        elif guarded.first_echo is not None:
            notes.append("decision: the final answer echoed the prompt's instructions; asked again")
        # A reply cut at max_tokens is read (and shown to the rewrite) without the line the cut went through.
        said = finished_lines(reply)
        decision = domain.parse_decision(said) if reply.ok and guarded.echo is None else None
        final = reply
        rewrite_echoed = refused = False
        if decision is None and reply.ok and said.strip() and guarded.echo is None:
            notes.append("decision: the required tags are missing; asked for one rewrite")
            rewrite = domain.rewrite_prompt(said)
            try:
                final = await session.chat("coordinator", rewrite, sample=_DECISION_SAMPLE + 1)
            except BudgetExhausted:
                # The reply came back and is read as after a failed rewrite; the stop ends the problem with it.
                refused = talk.stopped = True
            decision = domain.parse_decision(finished_lines(final)) if final.ok and not refused else None
            # The rewrite's answer is under the echo guard as the reply's was (against its own prompt, where the
            # reply is data); one that echoes is no decision, and is not asked again: the rewrite is the one pass.
            if decision is not None and EchoGuard.of(rewrite).echoes_answer(decision.answer):
                session.tally("coordinator").echo += 1
                decision, rewrite_echoed = None, True
            # The rewrite keeps the reply's conclusion (B.5: it "preserves mathematical content"): another answer in
            # its tags is one it solved anew, and the answer the reply states stands.
            own = domain.decision_fallback(said)
            rewritten = decision.answer if decision is not None else None
            if decision is not None and rewritten and own and normalize_answer(own) != normalize_answer(rewritten):
                notes.append(
                    f"decision: the rewrite's answer ({rewritten}) is not the one its reply states ({own}):"
                    " the reply's is used"
                )
                decision.answer = own
        if decision is None or decision.answer is None:
            why = reply.error or (
                "its answer echoed the instructions; the budget refused its retry"
                if guarded.refused
                else "its answer echoed the instructions twice"
                if guarded.echo
                else ("empty reply" if not reply.content.strip() else "cut at max_tokens in its first line")
                if not said.strip()
                else "the budget stopped its rewrite"
                if refused
                else f"the rewrite failed: {final.error}"
                if final.error
                else "the rewrite's answer echoed the instructions"
                if rewrite_echoed
                else "no tags after the rewrite"
                if decision is None
                else "its tags hold no answer"
            )
            read = domain.decision_fallback(said) if reply.ok and guarded.echo is None else None
            pooled = pooled_differential(seats)
            decision = Decision(report=reply.content if reply.ok else "", answer=read or self._majority(seats))
            if pooled:
                decision.top10, decision.answer = pooled, pooled[0]
            source = (
                "the answer read from its reply"
                if read
                else "the team's pooled differential"
                if pooled
                else "the team's majority answer"
            )
            notes.append(f"decision: unreadable ({why}); {source} is used")
        talk.transcript.utterances.append(
            Utterance(round=r, agent="coordinator", kind="report", text=decision.report, call_id=reply.call_id)
        )
        talk.transcript.utterances.append(
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

    def _summary(self, session: ProblemSession, talk: Deliberation) -> str:
        """What the chair reads (Eq. 7: the union of every specialist's opinions over every round, B.5): each
        specialist's final status and answer, then every round's opinions, fitted to the coordinator's context
        window (older rounds shortened first) when the window is known."""
        status = [
            f"{s.member.id} {s.member.specialty} ({s.member.role or 'member'}): "
            f"{'accepted' if s.accepted else 'converged' if s.converged else 'unresolved'}; "
            f"answer: {s.answer or 'none'}"
            for s in talk.seats
        ]
        names = {s.member.id: f"{s.member.id} {s.member.specialty}" for s in talk.seats}
        rounds: dict[int, list[tuple[str, str]]] = {}
        for u in talk.transcript.utterances:
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
        frame = self.domain.decision_prompt(session.problem.question, "")
        tokens = window - reply - _PROMPT_MARGIN_TOKENS
        return max(0, int(tokens * CHARS_PER_TOKEN) - sum(len(m.content) for m in frame))

    # ---- records --------------------------------------------------------------------------------

    def _result(self, session: ProblemSession, talk: Deliberation) -> ProblemResult:
        """The decision's answer (the team's majority where the budget stopped the deliberation first)."""
        decision = talk.decision
        chosen = decision.answer if decision else self._majority(talk.seats) if talk.stopped else None
        text = (decision.proof or decision.report) if decision else ""
        if decision and decision.top10:
            text = "\n".join(f"[{i}] {name}" for i, name in enumerate(decision.top10, start=1))
        result = session.result(self.name, answer=chosen, text=text)
        if talk.stopped:
            session.budget_stopped(result)
        if chosen is None:
            result.status = "failed"
            result.error = "the team reached no answer"
        return result

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
    def _candidate(seat: Seat, said: Candidate, opinion: Utterance, score: float | None, r: int) -> Candidate:
        """The seat's candidate of round ``r``: its opinion (from the solution step) with where the seat stands, and
        the score its reviews give (math: the share of peers that accepted it, so reports can rank attempts)."""
        meta = said.meta.model_copy(
            update={
                "member": seat.member.id,
                "specialty": seat.member.specialty,
                "round": r,
                "accepted": seat.accepted,
                "converged": seat.converged,
                "experience_ids": opinion.experience_ids,
                "top10": seat.top10 or None,
            }
        )
        return said.model_copy(update={"answer": opinion.answer, "score": score, "meta": meta})

    @staticmethod
    def _state(r: int, talk: Deliberation) -> MATTRLState:
        members = [
            SeatRecord(id=s.member.id, answer=s.answer, accepted=s.accepted, converged=s.converged, spoke=s.spoke)
            for s in talk.seats
        ]
        state = MATTRLState(round=r, members=members, transcript=talk.transcript)
        if talk.decision is not None:
            state.decision = talk.decision
        return state
