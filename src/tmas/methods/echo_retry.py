"""One agent call under the echo guard (:mod:`tmas.agents.echo`): a reply that echoes its prompt's instructions is
counted for its role (``ReplyTally.echo``) and asked again once, under another sample index and another seed
(:meth:`ProblemSession.chat`'s ``attempt``). A caller that drops a reply's echoing items (a bank update, a
distillation) reads the first reply when the retry is no reply to read (:func:`reply_to_read`).

When the budget refuses the retry, the first reply was answered and spent all the same: :class:`RetryRefused`, a
:class:`BudgetExhausted`, carries it up with the stop (its ``guarded``: that reply, what echoed in it, and the stop in
``refused``), so a caller records it, and one that lets the stop through ends as before."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from tmas.agents.echo import ECHO_RETRY_SAMPLE
from tmas.config import Sampling
from tmas.llm.types import Completion, Message, Usage
from tmas.llm.watch import TraceWatch
from tmas.methods.base import BudgetExhausted, ProblemSession


@dataclass
class GuardedReply:
    reply: Completion
    # What echoed in the first reply (None: it was clean, and ``reply`` is that first reply).
    first_echo: str | None = None
    # What still echoes in ``reply`` after the retry: the caller must keep it out of answers, banks and pools.
    echo: str | None = None
    # The first reply, when it echoed and ``reply`` is the retry's (None otherwise): a caller that can use part of a
    # reply (a bank update without its echoing items) falls back to it when the retry is unusable.
    echoed: Completion | None = None
    # The budget stop that refused the retry (None: the retry was asked, or none was needed). ``reply`` is then the
    # first reply, which echoed (``echo`` says what, as ``first_echo`` does): no answer, bank or pool takes it whole.
    refused: str | None = None

    @property
    def usage(self) -> Usage:
        """What both calls spent: the retry's and, when it was asked, the echoing first reply's."""
        return self.reply.usage if self.echoed is None else self.echoed.usage + self.reply.usage


class RetryRefused(BudgetExhausted):
    """The budget refused an echo's retry (:func:`chat_guarded`): ``guarded`` holds the first reply, answered and
    spent, what echoed in it, and the stop (``refused``); the stop goes on up as any other where no caller keeps it."""

    def __init__(self, detail: str, guarded: GuardedReply) -> None:
        super().__init__(detail)
        self.guarded = guarded


async def chat_guarded(
    session: ProblemSession,
    role: str,
    messages: Sequence[Message],
    echo_of: Callable[[Completion], str | None],
    *,
    sample: int = 0,
    sampling: Sampling | None = None,
    reply_model: type[BaseModel] | None = None,
    watch: TraceWatch | None = None,
    chain: int | None = None,
    attempt: int = 0,
    draw: int | None = None,
) -> GuardedReply:
    """``session.chat``, then ``echo_of(reply)`` (what echoes, or None) on a successful reply; one retry on an echo.
    A reply ``watch`` stopped early is returned as it is: its partial text is no reply to check. Both calls belong to
    ``chain`` (:meth:`ProblemSession.chat`); ``attempt``: how many times the caller asked ``messages`` before (the
    first call's, the retry's the next one); ``draw``: the sample's index among its prompt's samples, where it is not
    ``sample`` (:meth:`ProblemSession.chat`). A first call the budget refuses raises :class:`BudgetExhausted` (nothing
    came back); a retry it refuses raises :class:`RetryRefused`, holding the first reply."""
    reply = await session.chat(
        role,
        messages,
        sample=sample,
        sampling=sampling,
        reply_model=reply_model,
        watch=watch,
        chain=chain,
        attempt=attempt,
        draw=draw,
    )
    first = echo_of(reply) if reply.ok and reply.stopped_early is None else None
    if first is None:
        return GuardedReply(reply)
    session.tally(role).echo += 1
    try:
        retry = await session.chat(
            role,
            messages,
            sample=sample + ECHO_RETRY_SAMPLE,
            sampling=sampling,
            reply_model=reply_model,
            watch=watch,
            chain=chain,
            attempt=attempt + 1,
            draw=draw,
        )
    except BudgetExhausted as stop:
        kept = GuardedReply(reply, first_echo=first, echo=first, refused=stop.detail)
        raise RetryRefused(stop.detail, kept) from None
    again = echo_of(retry) if retry.ok and retry.stopped_early is None else None
    if again is not None:
        session.tally(role).echo += 1
    return GuardedReply(retry, first_echo=first, echo=again, echoed=reply)


def reply_to_read(guarded: GuardedReply, unusable: Callable[[Completion], str | None]) -> tuple[Completion, str | None]:
    """The reply a caller that drops echoing items reads: ``guarded.reply``, unless that is the retry after an echo and
    ``unusable`` (why a reply is none to read: a failed call, a reply that does not parse; None when it is one) refuses
    it; then the first reply, which was one but for its echoing items, and why the retry was not. Where the budget
    refused the retry (``guarded.refused``), the first reply, and that the budget refused its retry."""
    if guarded.refused is not None:
        return guarded.reply, f"the budget refused it ({guarded.refused})"
    if guarded.echoed is None:
        return guarded.reply, None
    why = unusable(guarded.reply)
    return (guarded.reply, None) if why is None else (guarded.echoed, why)
