"""The one way a model is made: provisioning, the HTTP client and store replay, composed as wrappers.

``async with open_model(settings, store) as llm`` gives a :class:`tmas.llm.model.ChatModel` built from the inside
out: the settings' default endpoint provisioned (with none configured, the embedded local model is started, and
stopped on leaving: :mod:`tmas.llm.provision`), the HTTP client over it (:class:`tmas.llm.client.LLMClient`, which
records in ``store`` what an endpoint refused), and, with a store, :class:`tmas.llm.replay.StoreReplay` around the
client, so a finished call is answered from the store and every other one is made durable there before it is used.
``llm.settings`` are the settings as provisioned (the local model's address and slots in place).

``open_model(settings, store, model=mine)`` runs on a :class:`tmas.llm.model.ChatModel` of the caller's own instead
(a backend that is not an OpenAI-compatible endpoint, an in-process model for tests): nothing is provisioned and no
HTTP client is made, and the same store replay goes around ``mine``, so its calls are replayed, recorded and counted
as an endpoint's are. Every opener (a run, a pool build, the judge grader) takes its model through here, so a run on
a model of one's own is the same run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from tmas.config import Settings
from tmas.llm.client import LLMClient
from tmas.llm.model import ChatModel, ClientStats
from tmas.llm.provision import provisioned
from tmas.llm.refusals import RunCallStore
from tmas.llm.replay import StoreReplay
from tmas.llm.types import CallKey


@asynccontextmanager
async def open_model(
    settings: Settings,
    store: RunCallStore | None = None,
    *,
    log_dir: Path | None = None,
    stats: ClientStats | None = None,
    on_send: Callable[[CallKey], None] | None = None,
    model: ChatModel | None = None,
) -> AsyncIterator[ChatModel]:
    """The model of ``settings`` (or ``model``, the caller's own), replayed from and recorded in ``store`` where one
    is given. ``log_dir`` keeps a started local server's log; ``stats`` counts the calls sent and replayed (for a
    progress display or summary); ``on_send`` hears of each call the store could not answer, before it is sent.

    ``model`` is used as it is: its ``settings`` are what its roles resolve against (build it on the run's settings,
    as ``ScriptedModel(script, settings)`` is), and it is neither started nor closed here. Without a store it is
    yielded unwrapped, and ``stats`` stays untouched."""
    stats = stats if stats is not None else ClientStats()
    if model is not None:
        yield model if store is None else _replaying(model, store, stats, on_send, count_sent=True)
        return
    async with (
        provisioned(settings, log_dir=log_dir) as live,
        LLMClient(live, downgrade_log=store, stats=stats) as client,
    ):
        yield client if store is None else _replaying(client, store, stats, on_send, count_sent=False)


def _replaying(
    inner: ChatModel,
    store: RunCallStore,
    stats: ClientStats,
    on_send: Callable[[CallKey], None] | None,
    *,
    count_sent: bool,
) -> StoreReplay:
    """``inner`` replayed from ``store``, the replays counted in ``stats``, and the calls sent too where ``inner``
    does not count them itself (the HTTP client does; a caller's own model does not)."""
    on_sent = stats.count if count_sent else None
    return StoreReplay(inner, store, on_replay=stats.count_replay, on_send=on_send, on_sent=on_sent)
