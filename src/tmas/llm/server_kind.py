"""Which engine serves an endpoint, as its ``/v1/models`` reply says.

Each engine names itself in its model cards' ``owned_by``: vLLM ``"vllm"``, SGLang ``"sglang"``, llama.cpp's
llama-server ``"llamacpp"`` (their defaults, read in each one's source). OpenAI's API answers with an organisation
(``"openai"``, ``"system"``, the owner of a fine-tune), and proxies and other hosts copy those values, so it is left
unrecognised: nothing there tells OpenAI's own API from a look-alike.
"""

from __future__ import annotations

from typing import Any

from tmas.llm.types import ServerKind

_OWNERS: dict[str, ServerKind] = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama-server"}


def server_kind(models: Any) -> ServerKind | None:
    """The engine a ``/v1/models`` reply names in its first model card's ``owned_by``; None when it names none we
    know (or the reply is not a model list)."""
    cards = models.get("data") if isinstance(models, dict) else None
    for card in cards if isinstance(cards, list) else []:
        if isinstance(card, dict):
            owner = card.get("owned_by")
            return _OWNERS.get(owner.strip().lower()) if isinstance(owner, str) else None
    return None
