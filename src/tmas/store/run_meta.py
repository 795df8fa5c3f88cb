"""The run's metadata (settings, method, dataset, versions: one JSON value per key) and what the run learnt of its
endpoints on the way: the downgrades a server forced, what each server said of itself, and one-line notices."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from tmas.llm.types import DOWNGRADES, DowngradeKind, ServerFindings
from tmas.store.database import meta_text, write_meta
from tmas.store.records import UnreadableRecord, stored_json


def downgrade_where(url: str, model: str | None) -> str:
    """Where a downgrade was made, in words: the endpoint URL and the model it refused (the URL alone where the record
    names none: an endpoint serving one model of its own, or a record of an earlier version)."""
    return f"{url} (model {model})" if model else url


# The stored values that are tables (JSON objects): the run's settings and its method with its parameters.
_TABLES = ("settings", "method")


class RunMeta:
    def __init__(self, db: sqlite3.Connection, origin: str = "") -> None:
        self._db = db
        # The run directory, for a value that cannot be read.
        self._origin = origin

    def set(self, key: str, value: Any) -> None:
        write_meta(self._db, key, value)

    def get(self, key: str) -> Any:
        text = meta_text(self._db, key)
        if text is None:
            return None
        value = stored_json(text, f"{self._origin}: a stored setting", f"{key!r}: ")
        # Edited by hand: every reader takes it for a table (null: not recorded, as a missing key).
        if key in _TABLES and value is not None and not isinstance(value, dict):
            held = json.dumps(value)
            held = held if len(held) <= 60 else f"{held[:57]}..."
            raise UnreadableRecord(f"{self._origin}: a stored setting is not a table ({key!r} holds {held})")
        return value

    def record_downgrade(
        self, kind: DowngradeKind, endpoint: str, role: str, message: str, model: str | None = None
    ) -> None:
        """Record, once per endpoint, model and kind, that its server refused what the client asked of that model and
        the run went on without it (:data:`DOWNGRADES` says what each kind is): one URL may serve several models,
        each refusing its own fields. ``model`` None: the endpoint serves one model of its own (the in-process one)."""
        recorded = self.downgrades(kind)
        models = recorded.setdefault(endpoint, {})
        if (model or "") not in models:
            models[model or ""] = {"role": role, "message": message, "at": time.time(), "model": model}
            self.set(f"{kind}_downgrades", recorded)

    def downgrades(self, kind: str) -> dict[str, dict[str, dict[str, Any]]]:
        """Endpoint URL -> model -> the first refusal of this kind for that model (role, server message, time, model),
        over the run. A run stored by an earlier version kept one refusal per URL (under ``KIND_fallbacks`` before
        that), saying no model: read under the model "" (the model the run asked at the time, not named), as
        :meth:`downgrade_messages` shows it, under the URL alone."""
        stored = self.get(f"{kind}_downgrades") or self.get(f"{kind}_fallbacks") or {}
        return {
            url: {"": dict(entry)} if isinstance(entry.get("message"), str) else {m: dict(f) for m, f in entry.items()}
            for url, entry in stored.items()
            if isinstance(entry, dict)
        }

    def downgrade_messages(self) -> dict[str, dict[str, str]]:
        """Kind -> where (:func:`downgrade_where`: the endpoint URL and the model refused) -> the server's message, for
        each kind of downgrade the run made."""
        found = {
            kind: {
                downgrade_where(url, model): str(f.get("message", ""))
                for url, models in self.downgrades(kind).items()
                for model, f in models.items()
            }
            for kind in DOWNGRADES
        }
        return {kind: where for kind, where in found.items() if where}

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
