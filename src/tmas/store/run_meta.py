"""The run's metadata (settings, method, dataset, versions: one JSON value per key) and what the run learnt of its
endpoints on the way: the downgrades a server forced, what each server said of itself, and one-line notices."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from tmas.llm.types import DOWNGRADES, DowngradeKind, ServerFindings
from tmas.store.database import read_meta, write_meta


class RunMeta:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def set(self, key: str, value: Any) -> None:
        write_meta(self._db, key, value)

    def get(self, key: str) -> Any:
        return read_meta(self._db, key)

    def record_downgrade(self, kind: DowngradeKind, endpoint: str, role: str, message: str) -> None:
        """Record, once per endpoint and kind, that its server refused what the client asked and the run went on
        without it (:data:`DOWNGRADES` says what each kind is)."""
        recorded = self.downgrades(kind)
        if endpoint not in recorded:
            recorded[endpoint] = {"role": role, "message": message, "at": time.time()}
            self.set(f"{kind}_downgrades", recorded)

    def downgrades(self, kind: str) -> dict[str, dict[str, Any]]:
        """Endpoint URL -> the first refusal of this kind (role, server message, time), over the run (runs stored by
        earlier versions kept them under ``KIND_fallbacks``)."""
        stored = self.get(f"{kind}_downgrades") or self.get(f"{kind}_fallbacks")
        return dict(stored or {})

    def downgrade_messages(self) -> dict[str, dict[str, str]]:
        """Kind -> endpoint URL -> the server's message, for each kind of downgrade the run made."""
        found = {
            kind: {url: str(f.get("message", "")) for url, f in self.downgrades(kind).items()} for kind in DOWNGRADES
        }
        return {kind: urls for kind, urls in found.items() if urls}

    def record_server(self, findings: ServerFindings) -> None:
        """Record what a server said of itself when probed (its kind, context window, ``n``) and where its replies
        put reasoning, per URL and model: one URL may serve several models, each thinking its own way."""
        servers = self.servers()
        models = servers.setdefault(findings.url, {})
        models[findings.model or ""] = findings.model_dump(mode="json")
        self.set("servers", servers)

    def servers(self) -> dict[str, dict[str, dict[str, Any]]]:
        """URL -> model -> what its server said of itself serving that model when the run probed it. A run stored by
        an earlier version recorded one entry per URL, of whichever model was seen last: not read, since it may be
        another model's (a resumed run learns each model's again from its replies)."""
        stored = self.get("servers") or {}
        return {
            url: dict(models)
            for url, models in stored.items()
            if isinstance(models, dict) and all(isinstance(found, dict) for found in models.values())
        }

    def record_notice(self, kind: str, message: str) -> None:
        """Record the one-line notice ``kind`` once in the run (the first message of each kind is kept)."""
        notices = self.get("notices") or {}
        if kind not in notices:
            notices[kind] = {"message": message, "at": time.time()}
            self.set("notices", notices)

    def notices(self) -> dict[str, str]:
        """Kind -> the run's one-line notice of that kind, in the order they were first raised."""
        return {kind: str(entry["message"]) for kind, entry in (self.get("notices") or {}).items()}
