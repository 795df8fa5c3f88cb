"""Labelled transcripts of MATTRL runs, read back from run directories: each finished problem's transcript (read
through MATTRL's declared state, :class:`tmas.methods.state.MATTRLState`), its gold answer and the terminal outcome
G of Eq. 12 (what the pool is built and pruned from; "cases" alone means the medicine and education cases of
``tmas cases``). Which G a domain has is its declaration's (``Domain.outcome``): the final answer graded against
gold by the evaluation harness (1 or 0: math, education), or the reciprocal rank of the gold answer in the team's
ranked decision (medicine's top-10: 1 at rank 1, 1/3 at rank 3, 0 when absent), so a near miss still earns part of
the credit. Names are matched by spelling first; a differential with no spelled match goes to the diagnosis judge
(the ``judge`` role with the A.5 rules, as ``tmas cases grade --judge``), whose calls are stored in the run's own
store, so build, prune and grading share one verdict per case.

Only team members' turns are credited: in education the student's pre-test and replies are context, not turns."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from tmas.agents.mattrl_teaching import difficulty_of, parse_plan, subject_of
from tmas.agents.utterance_judge import TeachingView
from tmas.config import Settings
from tmas.errors import InputError
from tmas.grading.diagnosis import judge_rank, name_rank, top10
from tmas.grading.grades import SELECTED, GradeConfig
from tmas.grading.registry import GradeMode
from tmas.grading.runs import grade_run
from tmas.llm.factory import open_model
from tmas.llm.model import ChatModel
from tmas.memory.transcript import Transcript, Utterance
from tmas.methods.mattrl_domains import Domain, domain_named
from tmas.methods.state import MATTRLState
from tmas.problems import Problem
from tmas.store.records import IterationRecord, ProblemResult
from tmas.store.run_store import RunStore, StoreError, resolved_once

# Utterance kinds a specialist speaks; the coordinator's meeting, report and decision are context, not team turns.
SPECIALIST_KINDS = ("opinion", "review")
# The education transcript's student (pre-test, replies, post-test): context, never a credited turn.
STUDENT = "student"
# How a medicine outcome's names are matched: spelling only, or spelling then the diagnosis judge.
DiagnosisMatch = Literal["judge", "spelling"]


@dataclass
class AgentTurn:
    """u_{i,t} of the paper: everything specialist ``agent`` said in turn ``turn`` (1-based), joined."""

    turn: int
    agent: str
    specialty: str
    text: str
    experience_ids: list[str] = field(default_factory=list)
    # The member's role (education: its C.4.2 teaching role) and the transcript round the turn was spoken in.
    role: str = ""
    round: int = 0


@dataclass
class LabelledTranscript:
    run: str
    problem: Problem
    transcript: Transcript
    # G of Eq. 12 in [0, 1] (see the module's docstring).
    outcome: float
    # The team's final ranked list where G is read from one (medicine's top-10); empty elsewhere.
    ranked: list[str] = field(default_factory=list)

    @property
    def gold(self) -> str:
        return self.problem.answer or ""

    @property
    def domain(self) -> Domain:
        """The declaration of the transcript's domain."""
        return domain_named(self.transcript.domain)

    def turns(self) -> list[AgentTurn]:
        """The team members' turns, in round then agent order; an agent's several utterances in a round are one turn.

        Only members of the transcript's team speak turns: the coordinator and, in education, the student (whose
        pre-test and replies are the outcome being taught, not a contribution to credit) are context. Turns are
        numbered 1..R over the rounds in which a member spoke (education's round 0 is the student's pre-test alone).

        An utterance with no text is no contribution: a specialist whose opinion call failed (or whose reply echoed
        the instructions) is recorded with an empty opinion, so it has no turn that round unless it also reviewed a
        peer, and Eq. 11's sum over the turn's team leaves it out.
        """
        specialties = {m.id: m.specialty for m in self.transcript.team}
        # The role each member's turns are credited and keyed under (education: its C.4.2 teaching role).
        roles = {m.id: self.domain.member_role(m.role) for m in self.transcript.team}
        grouped: dict[tuple[int, str], list[Utterance]] = {}
        for u in self.transcript.utterances:
            if u.kind in SPECIALIST_KINDS and u.agent in specialties and u.text.strip():
                grouped.setdefault((u.round, u.agent), []).append(u)
        number = {r: i for i, r in enumerate(sorted({r for r, _ in grouped}), start=1)}
        out = []
        for (round_, agent), utterances in sorted(grouped.items()):
            text = "\n\n".join(_utterance_text(u) for u in utterances)
            ids = list(dict.fromkeys(i for u in utterances for i in u.experience_ids))
            out.append(AgentTurn(number[round_], agent, specialties[agent], text, ids, roles[agent], round_))
        return out

    def teaching_view(self, turn: AgentTurn) -> TeachingView:
        """Education: the student's pre-test, the dialogue before ``turn``'s round (the question put to the student,
        from the coordinator's meeting (its plan, or the generic question asked when the teachers put none) or the
        single teacher's turn, and the student's reply), subject and difficulty."""
        utterances = self.transcript.utterances
        pre = next((u for u in utterances if u.agent == STUDENT and u.round == 0), None)
        asked: dict[int, str] = {}
        for u in utterances:
            if u.kind == "meeting" and u.agent == "coordinator":
                asked[u.round] = parse_plan(u.text, u.round)
            elif u.kind == "opinion" and u.round not in asked and len(self.transcript.team) == 1 and u.agent != STUDENT:
                asked[u.round] = u.text.strip()
        replies = {
            u.round: u.text.strip() for u in utterances if u.agent == STUDENT and u.kind == "opinion" and u.round
        }
        dialogue = [(asked[r], replies[r]) for r in sorted(asked) if r < turn.round and r in replies]
        metadata = self.problem.metadata
        return TeachingView(
            subject=subject_of(metadata),
            difficulty=difficulty_of(metadata),
            pre_answer=pre.answer if pre else None,
            pre_reasoning=pre.text if pre else "",
            dialogue=dialogue,
            role=turn.role,
        )

    @property
    def rounds(self) -> int:
        """R of Eq. 10: the turns the deliberation actually took."""
        return max((t.turn for t in self.turns()), default=0)


def _utterance_text(u: Utterance) -> str:
    if u.kind == "review" and u.target:
        return f"[review of {u.target}]\n{u.text}"
    return u.text


def mattrl_state(record: IterationRecord, where: str) -> MATTRLState:
    """An iteration record's state read as MATTRL's; a state that is not one is a one-line InputError."""
    try:
        return MATTRLState.model_validate(record.state)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(map(str, first["loc"]))
        raise InputError(f"{where}: iteration {record.iteration}: bad MATTRL state at {loc}: {first['msg']}") from None


def transcript_of(records: list[IterationRecord], where: str) -> Transcript | None:
    """The problem's transcript from its iteration records (one per round; the last holds the decision).

    Each record's transcript may hold the whole discussion so far or only its round: utterances are merged across
    records without repeats, the team and final answer taken from the latest record that has them.
    """
    merged: Transcript | None = None
    seen: set[tuple[int, str, str, str | None, str]] = set()
    for record in records:
        part = mattrl_state(record, where).transcript
        if part is None:
            continue
        if merged is None:
            merged = part.model_copy(update={"utterances": []})
        if part.team:
            merged.team = part.team
        if part.final_answer is not None:
            merged.final_answer = part.final_answer
        for u in part.utterances:
            key = (u.round, u.agent, u.kind, u.target, u.text)
            if key not in seen:
                seen.add(key)
                merged.utterances.append(u)
    return merged


@dataclass
class GradedResult:
    """A finished, labelled problem of a run, its result record and whether its final answer was graded correct
    (undecided counts as wrong, as everywhere in the harness)."""

    problem: Problem
    result: ProblemResult
    correct: bool

    @property
    def records(self) -> list[IterationRecord]:
        return self.result.iterations


async def graded_results(
    run_dir: Path,
    settings: Settings | None,
    grade_mode: GradeMode,
    notes: list[str],
    *,
    model: ChatModel | None = None,
) -> list[GradedResult]:
    """The run's finished, labelled problems, graded by the evaluation harness (grades stored in the run and
    reused; a judge on ``model`` where one is given); what is skipped and why goes to ``notes``."""
    try:
        store = RunStore(run_dir, create=False)
    except StoreError as exc:
        raise InputError(str(exc)) from None
    out: list[GradedResult] = []
    with store:
        grades = await grade_run(store, GradeConfig(mode=grade_mode, judge_runs=1), settings, model=model)
        problems = {p.problem_id: p for p in store.problems()}
        for result in store.results():
            pid, last = result.problem_id, result.last
            problem = problems.get(pid)
            if problem is None or problem.answer is None:
                notes.append(f"{run_dir}: problem {pid}: no gold answer, skipped")
            elif result.status != "done" or last is None:
                notes.append(f"{run_dir}: problem {pid}: not finished, skipped")
            else:
                correct = grades.correct((pid, last.iteration, SELECTED), 0)
                out.append(GradedResult(problem, result, correct))
    return out


def ungraded_transcripts(run_dirs: list[Path]) -> list[LabelledTranscript]:
    """The finished, labelled MATTRL problems of ``run_dirs`` as :func:`load_transcripts` finds them, read without
    grading (no call is sent; every outcome G is 0): what a build's cost estimate counts its turns from."""
    resolved_once(run_dirs)
    cases: list[LabelledTranscript] = []
    for run_dir in run_dirs:
        try:
            store = RunStore(run_dir, create=False)
        except StoreError as exc:
            raise InputError(str(exc)) from None
        with store:
            problems = {p.problem_id: p for p in store.problems()}
            for result in store.results():
                problem, last = problems.get(result.problem_id), result.last
                if problem is None or problem.answer is None or result.status != "done" or last is None:
                    continue
                transcript = transcript_of(result.iterations, f"{run_dir}: problem {problem.problem_id}")
                if transcript is not None:
                    cases.append(LabelledTranscript(str(run_dir), problem, transcript, 0.0))
    return cases


async def load_transcripts(
    run_dirs: list[Path],
    settings: Settings | None,
    *,
    grade_mode: GradeMode = "combined",
    notes: list[str],
    match: DiagnosisMatch = "judge",
    model: ChatModel | None = None,
) -> list[LabelledTranscript]:
    """The labelled, finished MATTRL problems of ``run_dirs``; what is skipped and why goes to ``notes``. The judges
    (grading, diagnosis matching) ask the endpoint of ``settings``, or ``model``, the caller's own."""
    resolved_once(run_dirs)
    cases: list[LabelledTranscript] = []
    for run_dir in run_dirs:
        # The cases whose G is the reciprocal rank of the gold answer in their decision's ranked list.
        ranked: list[tuple[LabelledTranscript, list[str]]] = []
        for graded in await graded_results(run_dir, settings, grade_mode, notes, model=model):
            problem, records = graded.problem, graded.records
            where = f"{run_dir}: problem {problem.problem_id}"
            transcript = transcript_of(records, where)
            if transcript is None:
                notes.append(f"{where}: no MATTRL transcript in its records, skipped")
                continue
            case = LabelledTranscript(str(run_dir), problem, transcript, 1.0 if graded.correct else 0.0)
            if case.domain.outcome == "reciprocal_rank":
                ranked.append((case, top10(records[-1].state)))
            cases.append(case)
        ranks = await diagnosis_ranks(
            run_dir, settings, [(c.problem.problem_id, t, c.gold) for c, t in ranked], match, notes, model=model
        )
        for case, names in ranked:
            case.ranked = names
            rank = ranks[case.problem.problem_id]
            case.outcome = 1.0 / rank if rank else 0.0
    return cases


async def diagnosis_ranks(
    run_dir: Path,
    settings: Settings | None,
    cases: list[tuple[str, list[str], str]],
    match: DiagnosisMatch,
    notes: list[str],
    *,
    model: ChatModel | None = None,
) -> dict[str, int | None]:
    """The gold diagnosis's rank in each ``(problem_id, top10, gold)``: by spelling, then (``match="judge"``) by
    the diagnosis judge for the differentials spelling did not match. The judge's calls go through the run's
    store, so they are asked once per case and replayed afterwards; an unreadable judgement ranks nothing."""
    ranks = {pid: name_rank(top, gold) for pid, top, gold in cases}
    todo = [(pid, top, gold) for pid, top, gold in cases if ranks[pid] is None and top]
    if not todo or match == "spelling":
        return ranks
    if settings is None and model is not None:
        settings = model.settings
    if settings is None:
        notes.append(f"{run_dir}: no endpoint configured: {len(todo)} differentials matched by spelling only")
        return ranks
    try:
        store = RunStore(run_dir, create=False)
    except StoreError as exc:
        raise InputError(str(exc)) from None
    with store:
        async with open_model(settings, store, log_dir=run_dir, model=model) as llm:
            judged = await asyncio.gather(*(judge_rank(llm, pid, top, gold) for pid, top, gold in todo))
    for (pid, _, _), (rank, why) in zip(todo, judged, strict=True):
        ranks[pid] = rank
        if why:
            notes.append(f"{run_dir}: problem {pid}: diagnosis judge: {why}; the gold diagnosis counts as unranked")
    return ranks
