"""Pieces the baselines share: one solution call as a :class:`Candidate`, majority vote, and the end of a run (budget
stops included). Score-based selection is in selection.py.

A candidate's call that the budget refuses comes back as ``None``: the method records the candidates finished so far
and stops, so an equal-compute comparison keeps every token that was spent.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tmas.agents.baselines import solution_section
from tmas.agents.echo import EchoGuard
from tmas.answers import extract_answer, normalize_answer
from tmas.config import Sampling
from tmas.llm.types import Completion, Message
from tmas.methods.base import BUDGET_STOP, BudgetExhausted, Candidate, ProblemResult, ProblemSession
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
) -> Candidate | None:
    """One solution-writing call as candidate ``index``; None when the budget refused the call.

    Numeric mode: the answer is the last box, else an explicit final-answer statement; ``meta["extraction"]`` says
    which ("boxed" / "fallback" / "none"), and a reply with neither counts as unusable for ``role``.

    A reply whose answer or solution echoes the prompt's instructions is asked again once (:mod:`tmas.agents.echo`);
    when the retry echoes too, the candidate carries an error, so no answer, vote or later prompt uses it.
    """
    guard = EchoGuard.of(messages)

    def echo_of(r: Completion) -> str | None:
        found = extract_answer(r.content).answer if mode == "numeric" else None
        return guard.solution_echo(solution_section(r.content), found)

    try:
        guarded = await chat_guarded(
            session, role, messages, echo_of, sample=index if sample is None else sample, sampling=sampling
        )
    except BudgetExhausted:
        return None
    reply = guarded.reply
    # The text later prompts see: the solution without any feedback section before it.
    text = solution_section(reply.content)
    answer = None
    info = dict(meta or {})
    if guarded.first_echo is not None:
        info["echo_retry"] = guarded.first_echo
    if guarded.echo is not None:
        info["echo"] = guarded.echo
        return Candidate(
            index=index,
            text=text,
            call_id=reply.call_id,
            usage=reply.usage,
            finish_reason=reply.finish_reason,
            error=f"the {guarded.echo} echoed the prompt's instructions (asked twice)",
            meta=info,
        )
    if reply.ok and mode == "numeric":
        answer, source = extract_answer(reply.content)
        info["extraction"] = source
        session.tally(role).unusable += source == "none"
        session.tally(role).fallback += source == "fallback"
    if reply.truncated:
        info["truncated"] = True
    return Candidate(
        index=index,
        text=text,
        answer=answer,
        call_id=reply.call_id,
        usage=reply.usage,
        finish_reason=reply.finish_reason,
        error=reply.error,
        meta=info,
    )


def notes_for(candidates: list[Candidate], mode: str) -> list[str]:
    """The per-candidate anomalies worth a note in the iteration record."""
    notes = []
    for c in candidates:
        if c.meta.get("echo_retry"):
            notes.append(
                f"candidate {c.index}: its {c.meta['echo_retry']} echoed the prompt's instructions; asked again"
            )
        if c.error:
            notes.append(f"candidate {c.index}: {'unusable' if c.meta.get('echo') else 'call failed'}: {c.error}")
        elif mode == "numeric" and c.answer is None:
            notes.append(f"candidate {c.index}: no extractable answer")
        if c.meta.get("truncated"):
            notes.append(f"candidate {c.index}: truncated at max_tokens")
    return notes


def vote(candidates: list[Candidate]) -> Candidate | None:
    """Majority vote (self-consistency): the first candidate holding the most frequent normalized answer."""
    keys = [normalize_answer(c.answer) if c.answer and c.error is None else None for c in candidates]
    counts = Counter(k for k in keys if k)
    if not counts:
        return None
    top = max(counts.values())
    return next(c for c, k in zip(candidates, keys, strict=True) if k and counts[k] == top)


def pick(candidates: list[Candidate], mode: str) -> Candidate | None:
    """Without scores: the majority answer in numeric mode, else the first candidate that succeeded."""
    if mode == "numeric":
        voted = vote(candidates)
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
