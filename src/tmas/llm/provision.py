"""Resolve the settings' default endpoint: the configured one, or the embedded local model started for the run."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from tmas.config import Settings


def on_embedded_model(settings: Settings) -> bool:
    """Whether the run's model is one of the packaged embedded models, served by the embedded llama-server or run in
    process by name (``--hf-model qwen2.5-coder-0.5b``): the methods' small-model defaults apply to both."""
    from tmas.llm.weights import KNOWN_MODELS

    return settings.uses_local_model or (settings.uses_in_process_model and settings.hf.model in KNOWN_MODELS)


@asynccontextmanager
async def provisioned(settings: Settings, log_dir: Path | None = None) -> AsyncIterator[Settings]:
    """Yield settings whose default endpoint answers; with none configured, start and later stop the local model."""
    if not settings.uses_local_model:
        yield settings
        return
    from tmas.llm.local_server import LocalReplicas  # only needed without an endpoint
    from tmas.llm.weights import KNOWN_MODELS

    local = settings.local
    async with LocalReplicas(local, log_dir=log_dir) as servers:
        endpoint = settings.endpoint.model_copy(
            update={
                # The client spreads calls over the replicas, least loaded first.
                "base_url": servers.base_urls,
                "model": servers.model,
                "context_length": local.ctx_per_slot,
                # Per replica: more calls than slots would only queue inside a server.
                "max_in_flight": local.slots,
                # llama-server takes `id_slot`: one problem's calls share its slot's prompt cache (tmas.llm.lanes).
                "pin_slots": local.server == "llama-server",
            }
        )
        if local.model in KNOWN_MODELS and endpoint.reasoning == "auto":
            # The packaged models do not think: their replies may be constrained from the first call.
            endpoint = endpoint.model_copy(update={"reasoning": "none"})
        yield settings.model_copy(update={"endpoint": endpoint})
