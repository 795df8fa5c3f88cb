"""MATTRL's education domain (paper 003, C.1 and C.4): pre-test, a teaching dialogue, post-test.

Record 0 is the student's pre-test (role ``student``). A right pre-test ends the case there: the post-test reuses it
(C.1). Otherwise the teaching runs ``iterations`` dialogue rounds, one record each: a single teacher (role
``specialist``) asks a question, or a recruited team (catalog of Table 8) writes role-specific analyses, with
retrieved experience when a pool is configured, and the coordinator plans the round's question from them; the
student replies. The last round's record also holds the closing guidance and the post-test. A round the budget cuts
part way is recorded with the turns of it that came back, and a note of where the budget cut it. The teachers know the
reference answer (the paper's setting), so this domain reads ``problem.answer``; the student never sees it.

Retrieval (C.1.1) is keyed by the teacher's role and the question's subject and difficulty (the domain's
declaration: :meth:`tmas.methods.mattrl_domains.education.Education.retrieval_tier`).

``state``: ``pre``/``post`` letters and whether each is correct (Acc_pre, Acc_post and their delta come from them),
``teaching`` (``single`` or ``team``), and the transcript.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tmas.agents.echo import EchoGuard
from tmas.agents.mattrl_teaching import (
    Case,
    Turn,
    parse_letter,
    parse_plan,
    plan_labelled,
    plan_prompt,
    student_prompt,
    student_reply_prompt,
    teacher_prompt,
)
from tmas.llm.types import Completion
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import TeamMember, Transcript, Utterance
from tmas.methods.base import (
    BudgetExhausted,
    Candidate,
    CandidateMeta,
    ProblemResult,
    ProblemSession,
    gather_all,
)
from tmas.methods.echo_retry import RetryRefused, chat_guarded
from tmas.methods.state import MATTRLState

FormTeam = Callable[[ProblemSession, list[str]], Awaitable[list[TeamMember]]]
Retrieve = Callable[[TeamMember, str, list[str]], Awaitable[list[PoolEntry]]]


def _candidate(index: int, reply: Completion, answer: str | None, kind: str) -> Candidate:
    return Candidate(
        index=index,
        text=reply.content,
        answer=answer,
        call_id=reply.call_id,
        usage=reply.usage,
        finish_reason=reply.finish_reason,
        error=reply.error,
        meta=CandidateMeta(stage=kind),
    )


async def _post_test(
    session: ProblemSession, case: Case, rounds: int, team: bool, transcript: Transcript, notes: list[str]
) -> tuple[Completion, str | None]:
    """The last round's closing guidance (the coordinator's for a team, the teacher's alone), then the student's
    post-test: its reply and the letter it answers (None: no 'Answer: X' line, noted), both in the transcript."""
    guide_role, guide_agent = ("coordinator", "coordinator") if team else ("specialist", "S1")
    guidance = await session.chat(guide_role, teacher_prompt(case, task="guidance", round_=rounds, rounds=rounds))
    if not guidance.ok or not guidance.content.strip():
        notes.append(f"closing guidance failed ({guidance.error or 'empty reply'}); the post-test follows without it")
    transcript.utterances.append(
        Utterance(round=rounds, agent=guide_agent, kind="report", text=guidance.content, call_id=guidance.call_id)
    )
    post = await session.chat(
        "student", student_prompt(case.question, case.dialogue, guidance.content, pretest=case.pre_reasoning.strip())
    )
    letter = parse_letter(post.content, case.question) if post.ok else None
    if letter is None:
        notes.append(f"post-test: no 'Answer: X' line ({post.error or 'unreadable reply'})")
    transcript.utterances.append(
        Utterance(
            round=rounds, agent="student", kind="decision", text=post.content, answer=letter, call_id=post.call_id
        )
    )
    transcript.final_answer = letter
    return post, letter


def _same(letter: str | None, gold: str | None) -> bool:
    return letter is not None and gold is not None and letter.strip().upper() == gold.strip().upper()


async def teach(
    session: ProblemSession,
    *,
    rounds: int,
    team: bool,
    form_team: FormTeam,
    retrieve: Retrieve,
    name: str,
    domain: str,
    pool: str | None = None,
) -> ProblemResult:
    """The case of ``session`` taught over ``rounds`` rounds by a team (``form_team``) or one teacher; ``name`` is
    the method's, ``domain`` the teaching domain's (its transcript's), ``pool`` the experience pool ``retrieve``
    reads (a team's; the transcript's :attr:`Transcript.pool`)."""
    problem = session.problem
    gold = (problem.answer or "").strip()
    transcript = Transcript(problem_id=problem.problem_id, domain=domain, pool=pool if team else None)
    notes: list[str] = []
    session.begin_iteration(0)
    pre = await session.chat("student", student_prompt(problem.question))
    pre_letter = parse_letter(pre.content, problem.question) if pre.ok else None
    if pre_letter is None:
        notes.append(f"pre-test: no 'Answer: X' line ({pre.error or 'unreadable reply'})")
    transcript.utterances.append(
        Utterance(round=0, agent="student", kind="opinion", text=pre.content, answer=pre_letter, call_id=pre.call_id)
    )
    teaching = "team" if team else "single"
    state = MATTRLState(teaching=teaching, pre=pre_letter, pre_correct=_same(pre_letter, gold), transcript=transcript)
    candidates = [_candidate(0, pre, pre_letter, "pre-test")]
    if state.pre_correct or not gold:
        if not gold:
            notes.append("no reference answer: nothing to teach toward, the post-test reuses the pre-test")
        transcript.final_answer = pre_letter
        state.post, state.post_correct, state.skipped = pre_letter, state.pre_correct, True
        session.end_iteration(candidates, selected=pre_letter, state=state, notes=notes)
        return session.result(name, answer=pre_letter, text=pre.content)
    try:
        members = await form_team(session, notes) if team else []
    except BudgetExhausted:
        # The pre-test came back: it is the case's answer until a post-test gives another, as every round's record
        # says, so the case ends with it rather than failing.
        session.end_iteration(candidates, selected=pre_letter, state=state, notes=notes)
        result = session.result(name, answer=pre_letter, text=pre.content)
        session.budget_stopped(result)
        return result
    # The single teacher is seat S1 of a team of one, so experience construction reads both modes alike.
    transcript.team = members or [TeamMember(id="S1", specialty="Teacher", role="single teacher", leader=True)]
    session.end_iteration(candidates, selected=pre_letter, state=state, notes=notes)
    dialogue: tuple[Turn, ...] = ()
    post_letter: str | None = None
    post = pre
    for r in range(1, rounds + 1):
        session.begin_iteration(r)
        state.round = r
        notes = []
        candidates = []
        try:
            case = Case(problem.question, gold, pre_letter, pre.content, dialogue)
            asked = await _question(session, case, r, rounds, members, retrieve, transcript, notes)
            reply = await session.chat(
                "student", student_reply_prompt(problem.question, dialogue, asked, pretest=pre.content.strip())
            )
            if not reply.ok or not reply.content.strip():
                notes.append(f"round {r}: the student's reply failed ({reply.error or 'empty reply'})")
            transcript.utterances.append(
                Utterance(round=r, agent="student", kind="opinion", text=reply.content, call_id=reply.call_id)
            )
            dialogue = (*dialogue, Turn(teacher=asked, student=reply.content.strip()))
            candidates = [_candidate(0, reply, None, "dialogue")]
            if r == rounds:
                case = Case(problem.question, gold, pre_letter, pre.content, dialogue)
                post, post_letter = await _post_test(session, case, rounds, bool(members), transcript, notes)
                state.post, state.post_correct = post_letter, _same(post_letter, gold)
                candidates.append(_candidate(1, post, post_letter, "post-test"))
        except BudgetExhausted:
            # The pre-test's letter stands, as every record before the post-test says. The turns of the round that
            # came back were answered and spent: its record keeps them, unless none did (no method records an
            # iteration the stop refused whole; the record before says where the run stopped).
            if transcript.by_round(r):
                stop = session.budget_stop or "budget spent"
                notes.append(
                    f"stopped: {stop}; round {r} was cut by the budget ({_cut(r, members, transcript)}): its"
                    " finished turns are kept, and the pre-test's answer stands"
                )
                session.end_iteration(candidates, selected=pre_letter, state=state, notes=notes)
            result = session.result(name, answer=pre_letter, text=pre.content)
            session.budget_stopped(result)
            return result
        session.end_iteration(
            candidates,
            selected=post_letter if r == rounds else pre_letter,
            state=state,
            notes=notes,
        )
    return session.result(name, answer=post_letter, text=post.content)


def _cut(r: int, members: list[TeamMember], transcript: Transcript) -> str:
    """Where the budget cut round ``r``, read from the turns of it that came back (each is in ``transcript`` once its
    call has come back): the first turn of the round missing."""
    said = transcript.by_round(r)
    analyses = [u for u in said if u.kind == "opinion" and u.agent != "student"]
    if members and len(analyses) < len(members):
        return f"{len(analyses)} of {len(members)} analyses came back"
    if not members and not analyses:
        return "the teacher's question was refused"
    if members and not any(u.kind == "meeting" for u in said):
        return "the planned question was refused"
    if any(u.kind == "meeting" and u.call_id is not None and not u.text for u in said):
        # A plan that came back echoing its instructions, whose retry the budget refused (:func:`_question`).
        return "the planned question echoed the prompt's instructions; the budget refused its retry"
    if not any(u.agent == "student" for u in said):
        return "the student's reply was refused"
    if not any(u.kind == "report" for u in said):
        return "the closing guidance was refused"
    return "the post-test was refused"


async def _question(
    session: ProblemSession,
    case: Case,
    r: int,
    rounds: int,
    members: list[TeamMember],
    retrieve: Retrieve,
    transcript: Transcript,
    notes: list[str],
) -> str:
    """The teacher's question of round ``r``: a single teacher's own, or the coordinator's plan from the team."""
    if not members:
        reply = await session.chat("specialist", teacher_prompt(case, task="ask", round_=r, rounds=rounds))
        transcript.utterances.append(
            Utterance(round=r, agent="S1", kind="opinion", text=reply.content, call_id=reply.call_id)
        )
        if reply.ok and reply.content.strip():
            return reply.content.strip()
        return _fallback(
            r, SINGLE_FALLBACK, f"the teacher's question failed ({reply.error or 'empty reply'})", transcript, notes
        )

    async def analyse(index: int, member: TeamMember) -> tuple[TeamMember, Completion, list[PoolEntry]]:
        hints = await retrieve(member, f"{case.question}\n\n{case.pre_reasoning}", notes)
        messages = teacher_prompt(case, task="analyse", round_=r, rounds=rounds, member=member, hints=hints)
        return member, await session.chat("specialist", messages, sample=index), hints

    analyses = await _analyses(members, analyse, r, transcript, notes)
    shown = [
        (f"{m.role or 'teacher'} ({m.specialty})", reply.content.strip())
        for m, reply, _ in analyses
        if reply.ok and reply.content.strip()
    ]
    messages = plan_prompt(case, r, shown)
    guard = EchoGuard.of(messages)
    try:
        guarded = await chat_guarded(
            session,
            "coordinator",
            messages,
            lambda reply: "plan" if guard.echoes_text(parse_plan(reply.content, r)) else None,
        )
    except RetryRefused as stop:
        # The plan came back, echoing, and was spent: the round's meeting turn keeps its call, with no text (no
        # question was put to the student), and the stop cuts the round (``_cut`` reads where from that turn).
        notes.append(f"round {r}: the planned question echoed the prompt's instructions; the budget refused its retry")
        call_id = stop.guarded.reply.call_id
        transcript.utterances.append(Utterance(round=r, agent="coordinator", kind="meeting", text="", call_id=call_id))
        raise
    plan = guarded.reply
    if guarded.first_echo is not None:
        notes.append(f"round {r}: the planned question echoed the prompt's instructions; asked again")
    asked = parse_plan(plan.content, r) if plan.ok and guarded.echo is None else ""
    if not asked:
        why = "it echoed the instructions twice" if guarded.echo else plan.error or "empty reply"
        return _fallback(r, TEAM_FALLBACK, f"no planned question ({why})", transcript, notes)
    if not plan_labelled(plan.content):
        notes.append(f"round {r}: the plan has no 'ROUND {r}:' line; its whole reply is asked")
    transcript.utterances.append(
        Utterance(round=r, agent="coordinator", kind="meeting", text=plan.content, call_id=plan.call_id)
    )
    return asked


Analysis = tuple[TeamMember, Completion, list[PoolEntry]]


async def _analyses(
    members: list[TeamMember],
    analyse: Callable[[int, TeamMember], Awaitable[Analysis]],
    r: int,
    transcript: Transcript,
    notes: list[str],
) -> list[Analysis]:
    """Every member's analysis of round ``r``, all at once, each into the transcript in member order (its notes too).
    When the budget refuses some, those that came back are in the transcript all the same (their calls were answered
    and spent), and the stop goes on up."""
    done: dict[int, Analysis] = {}

    async def keep(i: int, member: TeamMember) -> None:
        done[i] = await analyse(i, member)

    try:
        await gather_all(keep(i, m) for i, m in enumerate(members))
    finally:
        for i in sorted(done):
            member, reply, hints = done[i]
            if not reply.ok or not reply.content.strip():
                notes.append(f"round {r}: {member.id}'s analysis failed ({reply.error or 'empty reply'}); not shown")
            transcript.utterances.append(
                Utterance(
                    round=r,
                    agent=member.id,
                    kind="opinion",
                    text=reply.content,
                    call_id=reply.call_id,
                    experience_ids=[h.id for h in hints],
                )
            )
    return [done[i] for i in sorted(done)]


# The questions asked when the teachers put none (their call failed, or the plan echoed the instructions).
SINGLE_FALLBACK = "What made you choose your answer?"
TEAM_FALLBACK = "Can you walk me through how you ruled out the other options?"


def _fallback(r: int, asked: str, why: str, transcript: Transcript, notes: list[str]) -> str:
    """Round ``r``'s generic question ``asked`` in place of the teachers' (``why``: what failed), recorded as the
    round's coordinator meeting, the question put to the student, as a planned one is: the judge and summarizer of
    experience construction read the dialogue from it. The failed call's reply is in its call record."""
    notes.append(f"round {r}: {why}; the generic question {asked!r} is asked")
    transcript.utterances.append(Utterance(round=r, agent="coordinator", kind="meeting", text=asked))
    return asked
