"""The one way a model is made: provisioning, the HTTP client and store replay, composed as wrappers.

``async with open_model(settings, store) as llm`` gives a :class:`tmas.llm.model.ChatModel` built from the inside
out: the settings' default endpoint provisioned (with none configured, the embedded local model is started, and
stopped on leaving: :mod:`tmas.llm.provision`), the HTTP client over it (:class:`tmas.llm.client.LLMClient`, which
records in ``store`` what an endpoint refused), and, with a store, :class:`tmas.llm.replay.StoreReplay` around the
client, so a finished call is answered from the store and every other one is made durable there before it is used.
``llm.settings`` are the settings as provisioned (the local model's address and slots in place).

With ``hf.model`` set and no endpoint, the model is a Hugging Face model run in this process
(:class:`tmas.llm.hf_model.HFChatModel`, started and stopped here), replayed and counted like a model of one's own.

``open_model(settings, store, model=mine)`` runs on a :class:`tmas.llm.model.ChatModel` of the caller's own instead (a
backend that is not an OpenAI-compatible endpoint, an in-process model for tests): nothing is provisioned and no HTTP
client is made, and the same store replay goes around ``mine``, so its calls are replayed, recorded and counted as an
endpoint's are, and what it adapts of what it is asked (the in-process model: a schema it cannot follow) is recorded
in ``store`` as an endpoint's refusals are. Every opener (a run, a pool build, the judge grader) takes its model
through here, so a run on a model of one's own is the same run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, nullcontext
from pathlib import Path

from tmas.config import Sampling, Settings
from tmas.llm.client import LLMClient
from tmas.llm.model import ChatModel, ClientStats, WrappedModel
from tmas.llm.provision import provisioned
from tmas.llm.refusals import RecordsDowngrades, RunCallStore
from tmas.llm.replay import StoreReplay
from tmas.llm.sampling import ResolvedSampling, resolve_role
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

    ``model`` is neither started nor closed here. Its calls' sampling is resolved from ``settings`` (the run's: its
    config, flags, preset and resume overrides), as an endpoint's is, even where the model was built on other
    settings, so what the user configured reaches the model's ``chat``. Without a store it is not wrapped for
    replay, and ``stats`` stays untouched."""
    stats = stats if stats is not None else ClientStats()
    if model is not None:
        own = model if model.settings is settings else UnderSettings(model, settings)
        if store is None:
            yield own
            return
        # A model that adapts what it is asked (the in-process model opened once for several runs) records it here.
        recording = model.downgrades_into(store) if isinstance(model, RecordsDowngrades) else nullcontext()
        with recording:
            yield _replaying(own, store, stats, on_send, count_sent=True)
        return
    if settings.uses_in_process_model:
        from tmas.llm.hf_model import open_hf_model  # torch and transformers only where a model runs in process

        async with open_hf_model(settings, downgrade_log=store) as in_process:
            yield in_process if store is None else _replaying(in_process, store, stats, on_send, count_sent=True)
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


class UnderSettings(WrappedModel):
    """A caller's own model run under the run's settings: every call's sampling is resolved from ``settings``
    (:func:`tmas.llm.sampling.resolve_role`), so the run's configured sampling reaches ``inner.chat`` as it reaches an
    endpoint (:class:`WrappedModel` resolves a call's own override the same way); the calls themselves, the chains,
    embeddings, context windows and model names are ``inner``'s."""

    def __init__(self, inner: ChatModel, settings: Settings) -> None:
        super().__init__(inner)
        self._settings = settings

    @property
    def settings(self) -> Settings:
        return self._settings

    def resolve_sampling(
        self,
        role: str,
        *,
        preset: Sampling | None = None,
        method: Sampling | None = None,
        call: Sampling | None = None,
    ) -> ResolvedSampling:
        return resolve_role(self._settings, role, preset=preset, method=method, call=call)
