"""An answerless solution reply asked once more, with a reminder of the required output (``answer_reminder.j2``):
the follow-up call, and whether its reply may replace the first one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tmas.agents.answer_reminder import answer_reminder_prompt
from tmas.agents.echo import EchoGuard
from tmas.config import Sampling
from tmas.llm.types import Completion, Message
from tmas.methods.base import CandidateMeta, ProblemSession
from tmas.store.records import ReminderRecord

# The first, answerless reply kept in a reminded candidate's record is cut to this length.
REPLY_LIMIT = 4000


@dataclass
class Reminded:
    """The reply to the reminder, and whether it replaces the first reply: it succeeded and echoes nothing of its
    instructions (the echo guard reads the first reply as data)."""

    reply: Completion
    accepted: bool


async def ask_with_reminder(
    session: ProblemSession,
    role: str,
    messages: Sequence[Message],
    first: Completion,
    meta: CandidateMeta,
    read: Callable[[str], tuple[str, str | None]],
    *,
    sample: int,
    sampling: Sampling | None = None,
    chain: int | None = None,
) -> Reminded:
    """``first`` (a reply to ``messages`` with no answer) sent back with the reminder, under the same sample index
    and in the same ``chain``.

    ``meta.reminder`` keeps the first reply's call and text, then the retry's ``error`` or ``echo``; ``read`` gives a
    reply's solution text and answer, as the echo guard checks them. Both replies stay in the run store. A call the
    budget refuses raises :class:`tmas.methods.base.BudgetExhausted` with ``meta.reminder`` already written.
    """
    info = ReminderRecord(first_call_id=first.call_id, first_reply=first.content[:REPLY_LIMIT])
    meta.reminder = info
    reminded = answer_reminder_prompt(messages, first.content)
    retry = await session.chat(role, reminded, sample=sample, sampling=sampling, chain=chain)
    if not retry.ok:
        info.error = retry.error
        return Reminded(retry, accepted=False)
    echo = EchoGuard.of(reminded).solution_echo(*read(retry.content))
    if echo is not None:
        # Never an answer (as for the first reply's echo); the honest, answerless first reply stays.
        session.tally(role).echo += 1
        info.echo = echo
        return Reminded(retry, accepted=False)
    return Reminded(retry, accepted=True)
