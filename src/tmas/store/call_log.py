"""Every LLM call of the run, its texts kept as parts (see tmas.store.texts): committed before its result is used, and
found again by request hash, sample index and iteration (what replay answers from)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

from tmas.config import Sampling
from tmas.llm.types import CallKey, ChatRequest, Completion, TokenLogprob, Usage
from tmas.store.database import transaction
from tmas.store.records import stored_json
from tmas.store.texts import Part, TextBlobs, blob_ids, join

# The source stored for a seed the model drew where the call named none (Completion.drawn_seed).
DRAWN_SEED = "drawn by the model"

# The texts of a reply in text_parts (the call's messages are read only by CallLog.messages).
_REPLY_TEXTS = ("content", "reasoning", "logprobs")
_CALL_COLUMNS = (
    "id, request_hash, sample, problem_id, iteration, role, endpoint, model, content, reasoning, prompt_tokens,"
    " completion_tokens, reasoning_tokens, usage_estimated, finish_reason, max_tokens_sent, latency_s, attempts,"
    " error, error_cause, retry_causes, logprobs, cached_prompt_tokens, stopped_early, text_parts, queued_s,"
    " first_token_s"
)


class CallLog:
    def __init__(self, db: sqlite3.Connection, texts: TextBlobs, origin: str = "") -> None:
        self._db = db
        self._texts = texts
        # The run directory, for a call that cannot be read.
        self._origin = origin

    def record(self, completion: Completion, request: ChatRequest) -> int:
        """Commit a finished or failed call, its texts as parts (see tmas.store.texts); returns its row id."""
        c = completion
        with transaction(self._db):
            texts = {
                "messages": [[m.role, self._texts.put(m.content)] for m in request.messages],
                "content": self._texts.put(c.content),
                "reasoning": self._texts.put(c.reasoning, split=False),
                "logprobs": None
                if c.logprobs is None
                else self._texts.put(json.dumps([t.model_dump() for t in c.logprobs]), split=False),
            }
            return self._insert_call(c, request, json.dumps(texts, ensure_ascii=False))

    def _insert_call(self, c: Completion, request: ChatRequest, text_parts: str) -> int:
        u, k = c.usage, c.key
        cursor = self._db.execute(
            "INSERT INTO calls (request_hash, sample, problem_id, iteration, role, endpoint, model, messages,"
            " sampling, content, reasoning, prompt_tokens, completion_tokens, reasoning_tokens, usage_estimated,"
            " finish_reason, max_tokens_sent, latency_s, attempts, error, created_at, error_cause, retry_causes,"
            " logprobs, cached_prompt_tokens, sampling_sources, stopped_early, text_parts, queued_s, first_token_s)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                c.request_hash,
                k.sample,
                k.problem_id,
                k.iteration,
                k.role,
                c.endpoint,
                c.model,
                "",
                _stored_sampling(c, request).model_dump_json(),
                "",
                "",
                u.prompt_tokens,
                u.completion_tokens,
                u.reasoning_tokens,
                int(u.estimated),
                c.finish_reason,
                c.max_tokens_sent,
                c.latency_s,
                c.attempts,
                c.error,
                time.time(),
                c.error_cause,
                json.dumps(c.retry_causes),
                None,
                u.cached_prompt_tokens,
                json.dumps(_stored_sources(c, request), sort_keys=True),
                c.stopped_early,
                text_parts,
                c.queued_s,
                c.first_token_s,
            ),
        )
        return int(cursor.lastrowid or 0)

    def lookup(
        self, request_hash: str, sample: int, iteration: int | None, *, stopped_early: bool = False
    ) -> Completion | None:
        """The finished call for this request, sample index and iteration, if any. Failed calls are not replayed, nor
        are replies a watch stopped early unless ``stopped_early`` (the caller watches again: tmas.llm.watch). The
        iteration counts: a configured seed makes a later iteration's request equal to an earlier one's (majority
        vote's samples of one prompt), and that is a new sample to draw, not the earlier reply."""
        row = self._db.execute(
            f"SELECT {_CALL_COLUMNS} FROM calls WHERE request_hash = ? AND sample = ? AND iteration IS ?"
            " AND error IS NULL AND (? OR stopped_early IS NULL) ORDER BY id LIMIT 1",
            (request_hash, sample, iteration, stopped_early),
        ).fetchone()
        return None if row is None else self._completion(row)

    def iterate(self, problem_id: str | None = None, iteration: int | None = None) -> Iterator[Completion]:
        """The calls (of ``problem_id``, of its ``iteration``) in the order they were stored. Each is read with its
        texts, so a page that shows one iteration asks for that one: a problem of the paper's size holds 20."""
        kept = [
            (column, value)
            for column, value in (("problem_id", problem_id), ("iteration", iteration))
            if value is not None
        ]
        query = f"SELECT {_CALL_COLUMNS} FROM calls"
        if kept:
            query += " WHERE " + " AND ".join(f"{column} = ?" for column, _ in kept)
        for row in self._db.execute(query + " ORDER BY id", tuple(value for _, value in kept)):
            yield self._completion(row)

    def outside(self, problem_id: str, iterations: set[int]) -> Iterator[Completion]:
        """The problem's calls of no iteration among ``iterations`` (nor of any iteration), in the order they were
        stored: those of an iteration in progress, or of one that never finished (its problem failed)."""
        marks = ", ".join("?" * len(iterations))
        query = f"SELECT {_CALL_COLUMNS} FROM calls WHERE problem_id = ?"
        query += f" AND (iteration IS NULL OR iteration NOT IN ({marks}))" if iterations else ""
        for row in self._db.execute(query + " ORDER BY id", (problem_id, *sorted(iterations))):
            yield self._completion(row)

    def reply_model_endpoints(self, role: str) -> tuple[str | None, list[str]]:
        """The model ``role``'s first answered call reported, and the URLs its answered calls came from."""
        first = self._db.execute(
            "SELECT model FROM calls WHERE role = ? AND error IS NULL ORDER BY id LIMIT 1", (role,)
        ).fetchone()
        rows = self._db.execute(
            "SELECT DISTINCT endpoint FROM calls WHERE role = ? AND error IS NULL AND endpoint IS NOT NULL", (role,)
        )
        return (first[0] if first else None), sorted(row[0] for row in rows)

    def problem_ids(self) -> set[str]:
        """The problems with at least one finished call stored (what a resumed run replays)."""
        rows = self._db.execute("SELECT DISTINCT problem_id FROM calls WHERE error IS NULL")
        return {row[0] for row in rows}

    def get(self, call_id: int) -> Completion | None:
        row = self._db.execute(f"SELECT {_CALL_COLUMNS} FROM calls WHERE id = ?", (call_id,)).fetchone()
        return None if row is None else self._completion(row)

    def sampling(self, call_id: int) -> dict[str, Any]:
        row = self._db.execute("SELECT sampling FROM calls WHERE id = ?", (call_id,)).fetchone()
        return {} if row is None else dict(self._json(call_id, "sampling", row[0]))

    def sampling_sources(self, call_id: int) -> dict[str, str] | None:
        """Which source set each field of the call's sampling (see tmas.llm.sampling); None for calls stored
        before sources were kept."""
        row = self._db.execute("SELECT sampling_sources FROM calls WHERE id = ?", (call_id,)).fetchone()
        return None if row is None or row[0] is None else dict(self._json(call_id, "sampling_sources", row[0]))

    def messages(self, call_id: int) -> list[dict[str, str]]:
        row = self._db.execute("SELECT messages, text_parts FROM calls WHERE id = ?", (call_id,)).fetchone()
        if row is None:
            return []
        if row[1] is None:
            return list(self._json(call_id, "messages", row[0]))
        messages: list[tuple[str, list[Part]]] = self._json(call_id, "text_parts", row[1])["messages"]
        texts = self._texts.load(i for _, parts in messages for i in blob_ids(parts))
        return [{"role": role, "content": join(parts, texts)} for role, parts in messages]

    def _json(self, call_id: int, column: str, stored: str) -> Any:
        """A JSON column of a stored call, one edited into something that is not JSON named by the call and column."""
        return stored_json(stored, f"{self._origin}: call {call_id}: its stored {column}")

    def _completion(self, row: tuple[Any, ...]) -> Completion:
        content, reasoning, logprobs = row[8], row[9], row[21]
        if row[24] is not None:
            parts = self._json(row[0], "text_parts", row[24])
            texts = self._texts.load(i for key in _REPLY_TEXTS for i in blob_ids(parts[key] or ()))
            content, reasoning = join(parts["content"], texts), join(parts["reasoning"], texts)
            logprobs = None if parts["logprobs"] is None else join(parts["logprobs"], texts)
        return Completion(
            call_id=row[0],
            request_hash=row[1],
            key=CallKey(sample=row[2], problem_id=row[3], iteration=row[4], role=row[5]),
            endpoint=row[6],
            model=row[7],
            content=content,
            reasoning=reasoning,
            usage=Usage(
                prompt_tokens=row[10],
                completion_tokens=row[11],
                reasoning_tokens=row[12],
                cached_prompt_tokens=row[22] or 0,
                estimated=bool(row[13]),
            ),
            finish_reason=row[14],
            max_tokens_sent=row[15],
            latency_s=row[16],
            attempts=row[17],
            error=row[18],
            error_cause=row[19],
            retry_causes=self._json(row[0], "retry_causes", row[20]),
            logprobs=None
            if logprobs is None
            else [TokenLogprob.model_validate(t) for t in self._json(row[0], "logprobs", logprobs)],
            stopped_early=row[23],
            queued_s=row[25],
            first_token_s=row[26],
        )


def _stored_sampling(c: Completion, request: ChatRequest) -> Sampling:
    """The call's sampling as stored: the request's, with the seed the model drew where the request named none."""
    if request.sampling.seed is not None or c.drawn_seed is None:
        return request.sampling
    return request.sampling.model_copy(update={"seed": c.drawn_seed})


def _stored_sources(c: Completion, request: ChatRequest) -> dict[str, str]:
    if request.sampling.seed is not None or c.drawn_seed is None:
        return request.sampling_sources
    return {**request.sampling_sources, "seed": DRAWN_SEED}
