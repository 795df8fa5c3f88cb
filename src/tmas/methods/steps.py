"""The toolkit every method's steps come from: one solution-writing call as a :class:`Candidate` (:func:`solve_call`,
used by TMAS, MATTRL and the baselines), the anomalies it reports (kinds for counters, notes for the iteration
record), the closing of an iteration of a baseline that selects an answer (:func:`close_iteration`) and the end of a
baseline's run (:func:`finish`, budget stops included). Which candidate a method returns, with the answer fallback,
is in selection.py.

A candidate's call that the budget refuses comes back as ``None`` from :func:`solve_call`: a baseline and TMAS record
the candidates finished so far (each scored from the verifications that came back:
:func:`tmas.methods.base.gather_finished`) and stop, so an equal-compute comparison keeps every token that was spent.
A reply that echoed, whose retry the budget refused, is a candidate of its own for TMAS, CoT, majority vote, PaCoRe,
RSE, Self-Refine, Verify-Refine and MATTRL's opinions: unusable, in the record with its call and
tokens; a refinement's trajectory holds its solution on, as where the call was refused (:func:`hold`), and an
iteration of TMAS, PaCoRe or RSE whose every candidate is such a reply keeps the answer chosen before it, as where
every call was refused (:func:`holds_answer`). MATTRL raises
the stop again: the method's own round ends the problem with what finished; the runner ends one whose method let the
stop through. Whichever ends it, the stop is recorded one way (:meth:`ProblemSession.budget_stopped`): the stop
reason, the ``budget_stops`` counter, and a ``stopped:`` note in the last iteration record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from tmas.agents.echo import EchoGuard
from tmas.agents.output import finished_lines
from tmas.agents.solution import SolutionOutput, parse_section
from tmas.config import Sampling
from tmas.llm.types import Completion, Message, Usage
from tmas.llm.watch import TraceWatch
from tmas.methods.answer_reminder import ask_with_reminder
from tmas.methods.base import (
    BudgetExhausted,
    Candidate,
    CandidateMeta,
    Fallback,
    ProblemResult,
    ProblemSession,
)
from tmas.methods.confidence import Confidence, reply_confidence
from tmas.methods.echo_retry import GuardedReply, RetryRefused, chat_guarded
from tmas.methods.reasked import Reasked
from tmas.methods.selection import ConfidenceRule, ConfidenceVote, FallbackFrom, SelectFrom, SelectRule, select_answered
from tmas.methods.state import FallbackState

# How a reply is read: (content, mode) -> its solution text, answer, extraction and heading (tmas.agents.solution).
SolutionParser = Callable[[str, str], SolutionOutput]
# One anomaly of a candidate: the counter kind it counts under (None: a note only) and its note.
Anomaly = tuple[str | None, str]


async def solve_call(
    session: ProblemSession,
    role: str,
    messages: list[Message],
    *,
    index: int,
    mode: str,
    parse: SolutionParser = parse_section,
    sample: int | None = None,
    sampling: Sampling | None = None,
    meta: CandidateMeta | None = None,
    remind: bool = False,
    confidence_window: int | None = None,
    watch: TraceWatch | None = None,
    chain: int | None = None,
    asked: Reasked | None = None,
    draw: int | None = None,
) -> Candidate | None:
    """One solution-writing call of ``role`` as candidate ``index`` (sample ``sample``, else ``index``); None when the
    budget refused the call. Its calls (echo retry and reminder included) belong to ``chain``
    (:meth:`ProblemSession.chat`); ``meta``: what the method records of the candidate beforehand (its prompt).
    What the steps below find is kept in the candidate's meta (``CandidateMeta``), and :func:`solution_anomalies`
    reads it back as counters and notes.

    ``parse`` reads a reply's solution text and answer (the baselines' :func:`parse_section` unless given; TMAS
    passes :func:`tmas.agents.solution.parse_solution`): in numeric mode the last box, else an explicit final-answer
    statement (``meta.extraction``; a reply with neither counts as unusable for ``role``); in proof mode a reply
    without a ``## Solution`` heading is taken whole. ``confidence_window``: the reply's log-probabilities (asked for
    in ``sampling``) are reduced to the candidate's ``confidence`` with groups of that many tokens. ``watch`` follows
    the streamed reply and may stop it (:mod:`tmas.llm.watch`): a stopped reply gives no answer and no vote.
    ``asked``: how many times each trajectory (here candidate ``index``) sent each prompt (:class:`Reasked`): the call
    is counted in it, and a prompt the trajectory sent before goes with a changed configured seed
    (:meth:`ProblemSession.chat`'s ``attempt``); None: ``messages`` is sent for the first time. ``draw``: which of its
    prompt's samples in the step the call is, where that is not its sample (the configured seed goes plus it).

    A reply that echoes the prompt's instructions is asked again once (:mod:`tmas.agents.echo`); when the retry
    echoes too, the candidate has an error, so no answer, vote or later prompt uses it. Where the budget refused that
    retry, the first reply was answered and spent: it is the candidate, unusable as one that echoed twice, its error
    and ``meta.retry_refused`` saying the budget refused the retry (the caller ends with the stop,
    :attr:`ProblemSession.budget_stop`). With ``remind``, a reply
    without an answer (not cut at max_tokens) is sent back once with a reminder of the required output
    (:func:`_remind`).
    """
    calls = sample if sample is not None else index
    guard = EchoGuard.of(messages)

    def echo_of(r: Completion) -> str | None:
        parsed = parse(r.content, mode)
        return guard.solution_echo(parsed.text, parsed.answer)

    guarded: GuardedReply | None
    try:
        guarded = await chat_guarded(
            session,
            role,
            messages,
            echo_of,
            sample=calls,
            sampling=sampling,
            watch=watch,
            chain=chain,
            attempt=asked.attempt(index, role, messages) if asked is not None else 0,
            draw=draw,
        )
    except RetryRefused as refused:
        guarded = refused.guarded
    except BudgetExhausted:
        guarded = None
    if asked is not None:
        # One send, two where the first reply echoed and was asked again (a retry the budget refused was not sent).
        asked.add(index, role, messages, 2 if guarded is not None and guarded.echoed is not None else 1)
    if guarded is None:
        return None
    reply = guarded.reply
    info = meta.model_copy(deep=True) if meta is not None else CandidateMeta()
    info.echo_retry = guarded.first_echo
    if guarded.refused is not None:
        info.echo, info.retry_refused = guarded.echo, guarded.refused
        error = f"the {guarded.echo} echoed the prompt's instructions; the budget refused its retry"
        return _unusable(index, reply, guarded.usage, parse(reply.content, mode).text, error, info)
    if reply.stopped_early is not None:
        info.stopped_early = reply.stopped_early
        error = f"stopped early: {reply.stopped_early}"
        return _unusable(index, reply, guarded.usage, reply.content, error, info, _confidence(reply, confidence_window))
    solution = parse(reply.content, mode)
    if reply.truncated and solution.extraction == "stated":
        # A statement on the line the cut went through is unfinished ("The answer is 39" of "... 391"): the answer
        # is stated on a finished line or not at all. A box is whole wherever it is.
        finished = parse(finished_lines(reply), mode)
        solution = solution.model_copy(update={"answer": finished.answer, "extraction": finished.extraction})
    if guarded.echo is not None:
        info.echo = guarded.echo
        error = f"the {guarded.echo} echoed the prompt's instructions (asked twice)"
        return _unusable(index, reply, guarded.usage, solution.text, error, info)
    _tally(session, role, reply, solution, mode)
    # Every call spent on the candidate: an echoing first reply's and a reminder's beside the reply it keeps.
    usage = guarded.usage
    if remind and mode == "numeric" and reply.ok and solution.answer is None and not reply.truncated:
        ask = _Asked(session, role, messages, parse, mode, calls, sampling, chain)
        reply, solution, usage = await _remind(ask, reply, solution, usage, info)
    return _candidate(index, reply, solution, usage, info, mode, _confidence(reply, confidence_window))


def _candidate(
    index: int,
    reply: Completion,
    solution: SolutionOutput,
    usage: Usage,
    info: CandidateMeta,
    mode: str,
    confidence: Confidence | None,
) -> Candidate:
    """The candidate of a read reply, with how its answer was read and whether it was cut in its meta."""
    if reply.ok and mode == "numeric":
        info.extraction = solution.extraction
    if reply.ok and mode == "proof" and not solution.has_section:
        info.no_solution_heading = True
    if reply.truncated:
        info.truncated = True
    return Candidate(
        index=index,
        # The text later prompts see (with parse_section: the solution without any feedback section before it).
        text=solution.text,
        answer=solution.answer if reply.ok else None,
        call_id=reply.call_id,
        usage=usage,
        finish_reason=reply.finish_reason,
        error=reply.error,
        confidence=confidence,
        meta=info,
    )


class _Asked(NamedTuple):
    """How a solution call was asked, for its reminder: the same role, prompt, reading, sample and chain."""

    session: ProblemSession
    role: str
    messages: list[Message]
    parse: SolutionParser
    mode: str
    sample: int
    sampling: Sampling | None
    chain: int | None


async def _remind(
    ask: _Asked, reply: Completion, solution: SolutionOutput, spent: Usage, info: CandidateMeta
) -> tuple[Completion, SolutionOutput, Usage]:
    """An answerless ``reply`` sent back once with a reminder of the required output (``answer_reminder.j2``): the
    retry's reply and reading where it succeeded and echoes nothing of its instructions, else the first's; the usage
    ``spent`` on the first (an echo's retry included) and the reminder's. ``info.reminder`` keeps the first reply's
    call and text, then the retry's ``error`` (a refused call: "budget spent"), ``echo`` or ``answered``."""
    session, mode = ask.session, ask.mode

    def read(content: str) -> tuple[str, str | None]:
        parsed = ask.parse(content, mode)
        return parsed.text, parsed.answer

    try:
        reminded = await ask_with_reminder(
            session,
            ask.role,
            ask.messages,
            reply,
            info,
            read,
            sample=ask.sample,
            sampling=ask.sampling,
            chain=ask.chain,
        )
    except BudgetExhausted:
        if info.reminder is not None:
            info.reminder.error = "budget spent"
        return reply, solution, spent
    usage = spent + reminded.reply.usage
    if not reminded.accepted:
        return reply, solution, usage
    solution = ask.parse(reminded.reply.content, mode)
    _tally(session, ask.role, reminded.reply, solution, mode)
    if info.reminder is not None:
        info.reminder.answered = solution.answer is not None
    return reminded.reply, solution, usage


def _unusable(
    index: int,
    reply: Completion,
    usage: Usage,
    text: str,
    error: str,
    info: CandidateMeta,
    confidence: Confidence | None = None,
) -> Candidate:
    """A candidate with no answer and an error (a reply stopped early, or echoing twice): no vote or prompt uses it.
    ``usage``: what its calls spent, an echo's retry included."""
    return Candidate(
        index=index,
        text=text,
        call_id=reply.call_id,
        usage=usage,
        finish_reason=reply.finish_reason,
        error=error,
        confidence=confidence,
        meta=info,
    )


def _confidence(reply: Completion, window: int | None) -> Confidence | None:
    return None if window is None else reply_confidence(reply, window)


def _tally(session: ProblemSession, role: str, reply: Completion, solution: SolutionOutput, mode: str) -> None:
    """A successful reply's extraction (numeric mode) in ``role``'s reply tally."""
    if reply.ok and mode == "numeric":
        session.tally(role).unusable += solution.extraction == "none"
        session.tally(role).stated += solution.extraction == "stated"


def solution_anomalies(c: Candidate, mode: str) -> list[Anomaly]:
    """What of candidate ``c`` (from :func:`solve_call`) is worth a note in the iteration record, each with the
    counter kind it counts under: TMAS counts them in ``ProblemResult.counters``; the baselines keep the notes."""
    found: list[Anomaly] = []
    at, meta = f"candidate {c.index}", c.meta
    if meta.retry_refused:
        # One reply, which echoed, and nothing asked after it (no retry, no reminder): one note, counted once.
        return [("solution_echo", f"{at}: unusable: {c.error} ({meta.retry_refused})")]
    if meta.echo_retry:
        found.append(("solution_echo", f"{at}: its {meta.echo_retry} echoed the prompt's instructions; asked again"))
    if meta.stopped_early:
        found.append(("solution_stopped_early", f"{at}: {c.error}"))
    elif meta.echo:
        found.append(("solution_echo", f"{at}: unusable: {c.error}"))
    elif c.error:
        found.append(("solution_failed", f"{at}: call failed: {c.error}"))
    reminder = meta.reminder
    if reminder is not None:
        asked = f"{at}: first reply had no answer; asked again with a reminder of the required output"
        if reminder.error:
            found.append(("solution_reminder_failed", f"{asked}: no answer ({reminder.error})"))
        elif reminder.echo:
            found.append(("solution_echo", f"{asked}: the reply echoed its instructions ({reminder.echo})"))
        else:
            found.append(("solution_reminded", f"{asked}: {'answered' if reminder.answered else 'no answer again'}"))
    if mode == "numeric" and c.error is None and c.answer is None:
        found.append(("solution_no_answer", f"{at}: no extractable answer"))
    if meta.no_solution_heading:
        found.append((None, f"{at}: no '## Solution' heading; the whole reply is taken as the solution"))
    if meta.truncated:
        found.append(("solution_truncated", f"{at}: truncated at max_tokens"))
    return found


def notes_for(candidates: list[Candidate], mode: str) -> list[str]:
    """The per-candidate anomalies worth a note in the iteration record."""
    return [note for c in candidates for _, note in solution_anomalies(c, mode)]


class Chosen(NamedTuple):
    """The candidate a method returns after an iteration (None: every call failed) and the answer fallback that took
    it, if one did."""

    candidate: Candidate | None = None
    fallback: Fallback | None = None


async def select_answer(
    session: ProblemSession,
    current: list[Candidate] | None,
    mode: str,
    rule: SelectRule | ConfidenceRule = "vote",
    *,
    select_from: SelectFrom = "last",
    fallback: bool = True,
    fallback_from: FallbackFrom = "all",
    confidence: ConfidenceVote | None = None,
    held_over: list[int] | None = None,
) -> Chosen:
    """The answer of the iterations recorded so far and ``current`` (the one being finished; None: the records
    alone) by :func:`tmas.methods.selection.select_answered`, answers grouped by value as the run groups them, and
    the answer fallback it took, if any (:func:`fallback_note` says it in a line). ``held_over``: the trajectories of
    ``current`` whose call a budget stop refused (:func:`tmas.methods.selection.held`)."""
    iterations = [record.candidates for record in session.records]
    refused = [record.held_over for record in session.records]
    if current is not None:
        iterations.append(current)
        refused.append(held_over)
    classes = await session.answer_classes(c for candidates in iterations for c in candidates)
    chosen, fell_back = select_answered(
        iterations,
        select_from,
        mode,
        rule,
        classes,
        fallback=fallback,
        fallback_from=fallback_from,
        confidence=confidence,
        held_over=refused,
    )
    return Chosen(chosen, fell_back)


def holds_answer(session: ProblemSession, candidates: list[Candidate]) -> bool:
    """Whether an iteration a budget stop cut answers as one whose every solution call it refused: each of its
    ``candidates`` (those that came back) is a reply that echoed, whose retry the budget refused (:func:`solve_call`),
    and an iteration was recorded before it. The answer stays the one chosen after that iteration, this iteration's
    record saying so (:func:`held_answer_note`) with the replies in it, unusable, as ever."""
    return bool(session.records and candidates) and all(c.meta.retry_refused is not None for c in candidates)


def held_answer_note(session: ProblemSession) -> str:
    """The note of an iteration that keeps the answer chosen before it (:func:`holds_answer`)."""
    return (
        "no usable candidate: every reply that came back echoed and the budget refused its retry; the answer stays"
        f" the one chosen after iteration {session.records[-1].iteration}"
    )


def fallback_note(fallback: Fallback) -> str:
    """The iteration record's note of an answer taken from an earlier iteration."""
    return f"answer from iteration {fallback.iteration}: {fallback.reason}"


async def close_iteration(
    session: ProblemSession,
    candidates: list[Candidate],
    state: FallbackState,
    notes: list[str],
    *,
    planned: int,
    mode: str,
    rule: SelectRule = "vote",
    select_from: SelectFrom = "last",
    fallback: bool = True,
    fallback_from: FallbackFrom = "all",
    held_over: list[int] | None = None,
    previous: Chosen | None = None,
) -> Chosen:
    """The end of an iteration of a baseline that selects its answer among its candidates (Self-Refine,
    Verify-Refine, PaCoRe, RSE): the answer by ``rule`` (:func:`select_answer`, with the answer fallback where on), the
    fallback's note and ``state.answer_fallback``, the note of a budget that cut the iteration short (``planned``
    candidates asked), and the iteration's record with the candidate chosen. The method's own ``notes`` come first.

    ``held_over`` (Self-Refine, Verify-Refine): the trajectories whose call the budget stop refused; each votes with
    the solution it held at the iteration before (:func:`tmas.methods.selection.held`), as the record keeps them.
    ``previous`` (PaCoRe, RSE): the answer chosen after the iteration before, which stays the answer where the budget
    refused the retry of every reply that came back (:func:`holds_answer`), as where it refused every call."""
    if previous is not None and holds_answer(session, candidates):
        chosen = previous
        notes.append(held_answer_note(session))
    else:
        chosen = await select_answer(
            session,
            candidates,
            mode,
            rule,
            select_from=select_from,
            fallback=fallback,
            fallback_from=fallback_from,
            held_over=held_over,
        )
        if chosen.fallback is not None:
            notes.append(fallback_note(chosen.fallback))
    if chosen.fallback is not None:
        state.answer_fallback = chosen.fallback
    if session.budget_stop:
        notes += budget_note(session, len(candidates), planned, held_over)
    session.end_iteration(
        candidates, chosen=chosen.candidate, fallback=chosen.fallback, state=state, notes=notes, held_over=held_over
    )
    return chosen


def keeps_previous(candidate: Candidate, previous: Candidate | None, mode: str) -> bool:
    """Whether a refinement without an answer must not replace ``previous``, an answered solution of the same
    trajectory (numeric mode): the trajectory goes on from ``previous``, and the new reply is only recorded."""
    return (
        mode == "numeric"
        and candidate.error is None
        and candidate.answer is None
        and previous is not None
        and previous.error is None
        and previous.answer is not None
    )


def carry(candidate: Candidate, previous: Candidate, written: int) -> str:
    """Mark ``candidate``, a refinement without an answer, as leaving its trajectory on ``previous`` (written in
    iteration ``written``), the solution the trajectory holds and votes with in its place (``meta.carried_from``,
    read by :func:`tmas.methods.selection.held`); its note for the iteration record."""
    candidate.meta.kept_previous = True
    candidate.meta.carried_from = written
    return (
        f"candidate {candidate.index}: no answer; the trajectory goes on from its solution of iteration {written}"
        f" (answer {previous.answer}), which counts in its place"
    )


def holds_previous(candidate: Candidate, previous: Candidate | None) -> bool:
    """Whether ``candidate``, a refinement of ``previous`` (Self-Refine, Verify-Refine), is a reply that echoed its
    prompt's instructions whose retry the budget refused: spent and recorded, but no solution, so its trajectory
    holds ``previous`` on (where that is a solution: a failed one is restarted from) as one whose call the budget
    refused outright does (``IterationRecord.held_over``)."""
    return candidate.meta.retry_refused is not None and previous is not None and previous.error is None


def hold(candidate: Candidate, previous: Candidate, written: int) -> str:
    """Mark ``candidate``, a refinement whose echo retry the budget refused (:func:`holds_previous`), as leaving its
    trajectory on ``previous`` (written in iteration ``written``), which votes in its place (``meta.carried_from``,
    as :func:`carry` marks an answerless one); its note for the iteration record."""
    candidate.meta.carried_from = written
    return (
        f"candidate {candidate.index}: the budget refused its retry; the trajectory goes on from its solution of"
        f" iteration {written} (answer {previous.answer}), which counts in its place"
    )


def finish(
    session: ProblemSession,
    method: str,
    chosen: Candidate | None,
    *,
    stopped: bool,
    fallback: Fallback | None = None,
) -> ProblemResult:
    """The problem's result from the chosen candidate (``fallback``: the answer fallback that took it); ``stopped``:
    the budget ended the run early, recorded as every method records it (:meth:`ProblemSession.budget_stopped`)."""
    result = session.result(method, answer=chosen.answer if chosen else None, text=chosen.text if chosen else "")
    result.fallback = fallback
    if stopped:
        session.budget_stopped(result)
    if chosen is None:
        last = session.records[-1].candidates if session.records else []
        errors = sorted({c.error for c in last if c.error})
        result.status = "failed"
        if not session.records and stopped:
            result.error = f"{session.budget_stop}, before any candidate finished"
        else:
            result.error = "no candidate of the last iteration succeeded" + (f": {errors[0]}" if errors else "")
    return result


def budget_note(session: ProblemSession, finished: int, planned: int, held_over: list[int] | None = None) -> list[str]:
    """The note of an iteration the budget cut short, for its own record (:func:`finish` then adds no other; a stop
    that refused a whole iteration is noted by :func:`finish` on the record before), after the note that the
    trajectories it refused (``held_over``) vote with the solutions they held at the iteration before."""
    stopped = f"stopped: {session.budget_stop}; {finished} of {planned} candidates finished"
    if not held_over:
        return [stopped]
    which = ", ".join(str(i) for i in held_over)
    who = (
        f"trajectory {which}: the budget refused its call; it holds"
        if len(held_over) == 1
        else f"trajectories {which}: the budget refused their calls; each holds"
    )
    held = f"{who} its solution of the iteration before, which counts here in its place"
    # The stop's note stays the record's last, as every method's is.
    return [held, stopped]
