"""Pieces the baselines share: one solution call as a :class:`Candidate`, majority vote, and the end of a run (budget
stops included). Score-based selection is in selection.py.

A candidate's call that the budget refuses comes back as ``None``: the method records the candidates finished so far
and stops, so an equal-compute comparison keeps every token that was spent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from tmas.agents.baselines import solution_section
from tmas.agents.echo import EchoGuard
from tmas.answer_classes import class_of
from tmas.answers import extract_answer
from tmas.config import Sampling
from tmas.llm.types import Completion, Message
from tmas.llm.watch import TraceWatch
from tmas.methods.answer_reminder import ask_with_reminder
from tmas.methods.base import BUDGET_STOP, BudgetExhausted, Candidate, ProblemResult, ProblemSession
from tmas.methods.confidence import trace_confidence
from tmas.methods.echo_retry import chat_guarded


async def solve_call(
    session: ProblemSession,
    role: str,
    messages: list[Message],
    *,
    index: int,
    mode: str,
    sample: int | None = None,
    sampling: Sampling | None = None,
    meta: dict[str, Any] | None = None,
    remind: bool = False,
    confidence_window: int | None = None,
    watch: TraceWatch | None = None,
) -> Candidate | None:
    """One solution-writing call as candidate ``index``; None when the budget refused the call.

    ``confidence_window``: the reply's log-probabilities (asked for in ``sampling``) are reduced to the candidate's
    ``confidence`` with groups of that many tokens (methods/confidence.py).

    ``watch`` follows the streamed reply and may stop it (:mod:`tmas.llm.watch`): a stopped reply's candidate carries
    ``meta["stopped_early"]`` and an error, so its partial text gives no answer and no vote.

    Numeric mode: the answer is the last box, else an explicit final-answer statement; ``meta["extraction"]`` says
    which ("boxed" / "fallback" / "none"), and a reply with neither counts as unusable for ``role``.

    A reply whose answer or solution echoes the prompt's instructions is asked again once (:mod:`tmas.agents.echo`);
    when the retry echoes too, the candidate carries an error, so no answer, vote or later prompt uses it. With
    ``remind``, a reply without an answer (not cut at max_tokens) is sent back once with a reminder of the required
    output (``answer_reminder.j2``); the retry's reply is the candidate's where it succeeded and echoes nothing of its
    instructions (``meta["reminder"]["echo"]`` where it did), and ``meta["reminder"]`` keeps the first reply's call and
    text.
    """
    calls = sample if sample is not None else index
    guard = EchoGuard.of(messages)

    def echo_of(r: Completion) -> str | None:
        found = extract_answer(r.content).answer if mode == "numeric" else None
        return guard.solution_echo(solution_section(r.content), found)

    try:
        guarded = await chat_guarded(session, role, messages, echo_of, sample=calls, sampling=sampling, watch=watch)
    except BudgetExhausted:
        return None
    reply = guarded.reply
    info = dict(meta or {})
    if guarded.first_echo is not None:
        info["echo_retry"] = guarded.first_echo
    if reply.stopped_early is not None:
        info["stopped_early"] = reply.stopped_early
        return Candidate(
            index=index,
            text=reply.content,
            call_id=reply.call_id,
            usage=reply.usage,
            finish_reason=reply.finish_reason,
            error=f"stopped early: {reply.stopped_early}",
            confidence=None if confidence_window is None else trace_confidence(reply.logprobs, confidence_window),
            meta=info,
        )
    if guarded.echo is not None:
        info["echo"] = guarded.echo
        return Candidate(
            index=index,
            text=solution_section(reply.content),
            call_id=reply.call_id,
            usage=reply.usage,
            finish_reason=reply.finish_reason,
            error=f"the {guarded.echo} echoed the prompt's instructions (asked twice)",
            meta=info,
        )
    answer, source = _extracted(session, role, reply, mode)
    usage = reply.usage
    if remind and mode == "numeric" and reply.ok and answer is None and not reply.truncated:
        try:
            reminded = await ask_with_reminder(
                session, role, messages, reply, info, _section_and_answer, sample=calls, sampling=sampling
            )
        except BudgetExhausted:
            info["reminder"]["error"] = "budget spent"
        else:
            usage = usage + reminded.reply.usage
            if reminded.accepted:
                reply = reminded.reply
                answer, source = _extracted(session, role, reply, mode)
                info["reminder"]["answered"] = answer is not None
    if reply.ok and mode == "numeric":
        info["extraction"] = source
    if reply.truncated:
        info["truncated"] = True
    return Candidate(
        index=index,
        # The text later prompts see: the solution without any feedback section before it.
        text=solution_section(reply.content),
        answer=answer,
        call_id=reply.call_id,
        usage=usage,
        finish_reason=reply.finish_reason,
        error=reply.error,
        confidence=None if confidence_window is None else trace_confidence(reply.logprobs, confidence_window),
        meta=info,
    )


def _section_and_answer(content: str) -> tuple[str, str | None]:
    return solution_section(content), extract_answer(content).answer


def _extracted(session: ProblemSession, role: str, reply: Completion, mode: str) -> tuple[str | None, str]:
    """The reply's answer and where it came from (numeric mode), counted in ``role``'s reply tally."""
    if not reply.ok or mode != "numeric":
        return None, "none"
    answer, source = extract_answer(reply.content)
    session.tally(role).unusable += source == "none"
    session.tally(role).fallback += source == "fallback"
    return answer, source


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


async def pick_answered(
    session: ProblemSession, iterations: list[list[Candidate]], mode: str, *, fallback: bool
) -> tuple[Candidate | None, dict[str, Any] | None]:
    """:func:`pick` over the last of ``iterations``; when it has no answer (numeric mode) and ``fallback`` is on, the
    pick of the latest earlier iteration that has an answered candidate, with what the fallback took and why."""
    last = iterations[-1] if iterations else []
    chosen = pick(last, mode, await session.answer_classes(last))
    if not fallback or mode != "numeric" or (chosen is not None and chosen.answer is not None):
        return chosen, None
    for t in range(len(iterations) - 2, -1, -1):
        answered = [c for c in iterations[t] if c.answer is not None and c.error is None]
        if answered:
            backup = pick(answered, mode, await session.answer_classes(answered))
            if backup is not None:
                info = {
                    "iteration": t,
                    "candidate": backup.index,
                    "answer": backup.answer,
                    "reason": "no answered candidate in the last iteration",
                }
                return backup, info
    return chosen, None


def notes_for(candidates: list[Candidate], mode: str) -> list[str]:
    """The per-candidate anomalies worth a note in the iteration record."""
    notes = []
    for c in candidates:
        if c.meta.get("echo_retry"):
            notes.append(
                f"candidate {c.index}: its {c.meta['echo_retry']} echoed the prompt's instructions; asked again"
            )
        if c.meta.get("stopped_early"):
            notes.append(f"candidate {c.index}: {c.error}")
        elif c.error:
            notes.append(f"candidate {c.index}: {'unusable' if c.meta.get('echo') else 'call failed'}: {c.error}")
        elif mode == "numeric" and c.answer is None:
            notes.append(f"candidate {c.index}: no extractable answer")
        reminder = c.meta.get("reminder")
        if reminder is not None:
            outcome = "answered" if reminder.get("answered") else f"no answer ({reminder.get('error') or 'again'})"
            notes.append(f"candidate {c.index}: first reply had no answer; asked again with a reminder: {outcome}")
        if c.meta.get("truncated"):
            notes.append(f"candidate {c.index}: truncated at max_tokens")
    return notes


def vote(candidates: list[Candidate], classes: Mapping[str, str] | None = None) -> Candidate | None:
    """Majority vote (self-consistency): the first candidate holding the most frequent answer, answers counted by
    value (``classes``: answer -> class key, see tmas.answer_classes; without it, spelling and exact numbers)."""
    keys = [class_of(c.answer, classes) if c.answer and c.error is None else None for c in candidates]
    counts = Counter(k for k in keys if k)
    if not counts:
        return None
    top = max(counts.values())
    return next(c for c, k in zip(candidates, keys, strict=True) if k and counts[k] == top)


def pick(candidates: list[Candidate], mode: str, classes: Mapping[str, str] | None = None) -> Candidate | None:
    """Without scores: the majority answer in numeric mode, else the first candidate that succeeded."""
    if mode == "numeric":
        voted = vote(candidates, classes)
        if voted is not None:
            return voted
    return next((c for c in candidates if c.error is None), None)


def finish(session: ProblemSession, method: str, chosen: Candidate | None, *, stopped: bool) -> ProblemResult:
    """The problem's result from the chosen candidate; ``stopped``: the budget ended the run early."""
    result = session.result(
        method,
        answer=chosen.answer if chosen else None,
        text=chosen.text if chosen else "",
        stopped_reason=BUDGET_STOP if stopped else None,
    )
    if stopped:
        result.counters = {"budget_stops": 1}
    if chosen is None:
        last = session.records[-1].candidates if session.records else []
        errors = sorted({c.error for c in last if c.error})
        result.status = "failed"
        if not session.records and stopped:
            result.error = f"{session.budget_stop}, before any candidate finished"
        else:
            result.error = "no candidate of the last iteration succeeded" + (f": {errors[0]}" if errors else "")
    return result


def budget_note(session: ProblemSession, finished: int, planned: int) -> list[str]:
    """The note of an iteration the budget cut short."""
    return [f"stopped: {session.budget_stop}; {finished} of {planned} candidates finished"]
