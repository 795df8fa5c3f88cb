"""The one way a model is made: provisioning, the HTTP client and store replay, composed as wrappers.

``async with open_model(settings, store) as llm`` gives a :class:`tmas.llm.model.ChatModel` built from the inside
out: the settings' default endpoint provisioned (with none configured, the embedded local model is started, and
stopped on leaving: :mod:`tmas.llm.provision`), the HTTP client over it (:class:`tmas.llm.client.LLMClient`, which
records in ``store`` what an endpoint refused), and, with a store, :class:`tmas.llm.replay.StoreReplay` around the
client, so a finished call is answered from the store and every other one is made durable there before it is used.
``llm.settings`` are the settings as provisioned (the local model's address and slots in place).
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
) -> AsyncIterator[ChatModel]:
    """The model of ``settings``, replayed from and recorded in ``store`` where one is given. ``log_dir`` keeps a
    started local server's log; ``stats`` counts the calls sent and replayed (for a progress display or summary);
    ``on_send`` hears of each call the store could not answer, before it is sent."""
    stats = stats if stats is not None else ClientStats()
    async with (
        provisioned(settings, log_dir=log_dir) as live,
        LLMClient(live, downgrade_log=store, stats=stats) as client,
    ):
        if store is None:
            yield client
        else:
            yield StoreReplay(client, store, on_replay=stats.count_replay, on_send=on_send)
