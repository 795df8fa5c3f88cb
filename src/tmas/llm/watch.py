"""Watching a streamed reply as it arrives, to stop it early (DeepConf's online stopping is one such watch:
methods/online_stop.py).

A caller hands :meth:`tmas.llm.model.ChatModel.chat` a :class:`TraceWatch`. The HTTP client tells it of each streamed
reply's start (:meth:`TraceWatch.begin`, again for a retry after a failed attempt) and of each new batch of the
reply's token log-probabilities as the deltas arrive (:meth:`TraceWatch.observe`: those the server streams, the
content's, and the reasoning's where a server lists them too). When the watch answers with a :class:`WatchStop`, the
client closes the connection there (vLLM, SGLang and llama-server abort a request whose client has gone) and returns
the reply so far as a finished call: ``finish_reason`` is the stop's, ``stopped_early`` says why, the content is the
part that arrived, and the usage counts the tokens received (estimated: a server reports none for a stream cut by its
client; at least one per log-probability received). The run store keeps it as it keeps any finished call, and replays
it, still stopped, to a caller that watches again; a caller without a watch has the call sent afresh.

A reply that comes whole (``stream = "off"``, a server that cannot stream, an in-process model) cannot be watched:
the watch is never begun, and :meth:`tmas.methods.base.ProblemSession.chat` raises :data:`UNWATCHED_NOTICE` once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tmas.llm.types import TokenLogprob

UNWATCHED_NOTICE = (
    "a watched call's reply came unstreamed (stream = 'off', or the server could not stream): it ran to its end,"
    " so no trace could be stopped early (online_stop)"
)


@dataclass(frozen=True)
class WatchStop:
    """A watch's decision to stop a reply: the completion's ``finish_reason`` (a short word) and why (one line)."""

    finish_reason: str
    detail: str


class TraceWatch(Protocol):
    """Told of a streamed reply as it arrives; may stop it."""

    @property
    def began(self) -> bool:
        """Whether a streamed reply began (:meth:`begin` was called)."""
        ...

    def begin(self) -> None:
        """A streamed reply starts (again, after a failed attempt): what earlier attempts showed is forgotten."""
        ...

    def observe(self, tokens: Sequence[TokenLogprob]) -> WatchStop | None:
        """The reply's next tokens with their log-probabilities; a stop to cut the reply after them, or None."""
        ...
