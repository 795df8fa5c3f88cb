"""One simulated chat reply, in a persona's shapes: the plain JSON body, or the server-sent events of a stream."""

from __future__ import annotations

import itertools
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from tmas.testing.personas import Persona, TokenCounts
from tmas.testing.responders import TOKEN_RE, count_tokens
from tmas.testing.script import SimScript

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def split_pieces(text: str, n: int = 4) -> list[str]:
    """``text`` in up to ``n`` streaming deltas, cut at spaces; the pieces concatenate back to ``text``."""
    if not text:
        return []
    cuts: list[int] = []
    for i in range(1, n):
        pos = text.find(" ", len(text) * i // n)
        if 0 < pos < len(text) and (not cuts or pos > cuts[-1]):
            cuts.append(pos)
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def token_pieces(text: str) -> list[str]:
    """``text`` as one streaming delta per simulator token (its spacing in front); they concatenate back to ``text``."""
    ends = [match.end() for match in TOKEN_RE.finditer(text)]
    if not ends:
        return [text] if text else []
    ends[-1] = len(text)
    return [text[a:b] for a, b in itertools.pairwise([0, *ends])]


def _logprob(persona: Persona, token: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"token": token, "logprob": 0.0}
    if persona.logprob_bytes:
        entry["bytes"] = list(token.encode())
    if persona.logprob_ids:
        entry["id"] = zlib.crc32(token.encode()) % 151936  # a stand-in token id, the same in every process
    return entry


def certain_logprobs(content: str, top: Any, persona: Persona) -> list[dict[str, Any]]:
    """A logprobs payload in which every content token (the simulator's tokens, spacing attached in front) had
    probability 1, with itself as the only alternative listed (none when ``top`` is 0 or absent)."""
    out: list[dict[str, Any]] = []
    start = 0
    for match in TOKEN_RE.finditer(content):
        token = content[start : match.end()]
        start = match.end()
        entry = _logprob(persona, token)
        entry["top_logprobs"] = [_logprob(persona, token)] if isinstance(top, int) and top > 0 else []
        out.append(entry)
    return out


@dataclass
class Choice:
    content: str
    reasoning: str | None
    finish_reason: str
    logprobs: list[dict[str, Any]] | None
    reasoning_tokens: int
    completion_tokens: int
    # The reasoning's and the content's streamed deltas, each with its token count, where they were cut in advance
    # (tmas.testing.long_replies: thousands of tokens a delta, never counted again); None: cut and counted here.
    pieces: tuple[list[tuple[str, int]], list[tuple[str, int]]] | None = None


class _Part(NamedTuple):
    """One streamed delta of a choice."""

    delta: dict[str, Any]
    logprobs: list[dict[str, Any]] | None  # its tokens' log-probabilities
    tokens: int  # the tokens it waits for (per-token latency)
    reasoning: bool


@dataclass
class Reply:
    persona: Persona
    script: SimScript
    id: str
    created: int
    model: str
    choices: list[Choice]
    prompt_tokens: int
    # Prompt tokens served from the replica's prefix cache (None: nothing to report).
    cached: int | None
    # A timings object scripted by a rule (ScriptedUsage.cached_in); llama-server's persona builds its own.
    timings: dict[str, Any] | None = None
    # stream_options.continuous_usage_stats: each delta carries the usage so far, where the persona does that.
    continuous_usage: bool = False

    # ---- usage ----------------------------------------------------------------------------------------------

    def counts(self, choices: list[Choice] | None = None) -> TokenCounts:
        """Usage counts over ``choices`` (all by default): the prompt once, the completions summed."""
        chosen = self.choices if choices is None else choices
        return TokenCounts(
            prompt=self.prompt_tokens,
            completion=sum(c.completion_tokens for c in chosen),
            reasoning=sum(c.reasoning_tokens for c in chosen),
            cached=self.cached,
            separate_reasoning=any(c.reasoning is not None for c in chosen),
            choices=len(chosen),
        )

    def usage(self, choice: int | None = None, streamed: bool = False) -> dict[str, Any] | None:
        """The reply's usage (``choice``: that choice's alone), or None where the server reports none."""
        if not self.script.usage:
            return None
        if choice is None and self.persona.usage_per_choice:
            choice = 0
        counts = self.counts(None if choice is None else [self.choices[choice]])
        return self.persona.usage(counts, self.script, streamed)

    def persona_timings(self, choice: int) -> dict[str, Any]:
        """llama-server's timings for ``choice`` (server-task.cpp result_timings). Its speeds are synthetic: 1000
        prompt tokens and 50 generated tokens a second."""
        cache_n = self.cached or 0
        prompt_n = self.prompt_tokens - cache_n
        predicted_n = self.choices[choice].completion_tokens
        prompt_ms, predicted_ms = prompt_n * 1.0, predicted_n * 20.0
        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms else 0.0,
        }

    # ---- the plain reply ------------------------------------------------------------------------------------

    def completion(self) -> dict[str, Any]:
        p = self.persona
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model}
        choices = []
        for i, c in enumerate(self.choices):
            null = p.null_content == "always" or (p.null_content == "parsed" and c.reasoning is not None)
            content = None if null and not c.content else c.content
            message: dict[str, Any] = {"role": "assistant", "content": content, **p.message_extra}
            if c.reasoning is not None and p.reasoning_key is not None:
                message[p.reasoning_key] = c.reasoning
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                **p.choice_extra,
                "finish_reason": c.finish_reason,
            }
            if c.logprobs is not None:
                choice["logprobs"] = {"content": c.logprobs, **p.logprobs_extra}
            choices.append(choice)
        out["choices"] = choices
        out.update(p.response_extra)
        usage = self.usage()
        if usage is not None:
            out["usage"] = usage
        if p.timings:
            out["timings"] = self.persona_timings(0)
        elif self.timings is not None:
            out["timings"] = self.timings
        return out

    # ---- the stream -----------------------------------------------------------------------------------------

    def events(self, include_usage: bool, *, per_token_deltas: bool = False) -> list[tuple[bytes, int]]:
        """The stream as (event, tokens it carries) pairs, the tokens pacing per-token latency: a first delta with
        the role per choice, then the choices' deltas interleaved (one per token with ``per_token_deltas``, as a
        server generating in real time sends them; else a few pieces), each choice's finish, the usage chunk (with
        ``include_usage``) and ``[DONE]``."""
        p = self.persona
        usage = self.usage(streamed=True) if include_usage else None
        base: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            **p.chunk_extra,
        }
        if usage is not None and p.usage_null_in_chunks:
            base["usage"] = None

        def chunk(choice: dict[str, Any], **top: Any) -> dict[str, Any]:
            return {**base, "choices": [choice], **top}

        def choice_of(i: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
            return {"index": i, "delta": delta, **p.stream_choice_extra, **extra, "finish_reason": finish}

        events: list[tuple[dict[str, Any], int]] = [
            (chunk(choice_of(i, dict(p.first_delta))), 0) for i in range(len(self.choices))
        ]
        split = token_pieces if per_token_deltas else split_pieces
        parts = [self._parts(c, split) for c in self.choices]
        finished = [False] * len(self.choices)
        so_far = [[0, 0] for _ in self.choices]  # completion, reasoning tokens streamed per choice
        for j in range(max((len(ps) for ps in parts), default=0)):
            for i, ps in enumerate(parts):
                if j >= len(ps):
                    continue
                part = ps[j]
                extra: dict[str, Any] = {}
                if part.logprobs is not None:
                    extra["logprobs"] = {"content": part.logprobs, **p.logprobs_extra}
                finish = None
                if p.finish_with_last_delta and j == len(ps) - 1:
                    finish, finished[i] = self.choices[i].finish_reason, True
                    extra.update(p.finish_choice_extra)
                top: dict[str, Any] = {}
                so_far[i][0] += part.tokens
                so_far[i][1] += part.tokens if part.reasoning else 0
                asked = usage is not None or (self.script.usage and not p.continuous_needs_include)
                if self.continuous_usage and asked and p.continuous_usage:
                    counts = TokenCounts(self.prompt_tokens, so_far[i][0], so_far[i][1], None, part.reasoning)
                    top["usage"] = p.usage(counts, self.script, True)
                events.append((chunk(choice_of(i, part.delta, finish, **extra), **top), part.tokens))
        for i, c in enumerate(self.choices):
            # Each choice's finish, and with llama-server its own usage chunk and the timings on the last of them.
            closing: list[dict[str, Any]] = []
            if not finished[i]:
                closing.append(chunk(choice_of(i, {}, c.finish_reason, **p.finish_choice_extra)))
            if p.usage_per_choice and include_usage and self.script.usage:
                closing.append({**base, "choices": [], "usage": self.usage(i, streamed=True)})
            if p.timings and closing:
                closing[-1]["timings"] = self.persona_timings(i)
            elif self.timings is not None and closing:
                closing[-1]["timings"] = self.timings  # a scripted llama-server shape, on the last chunk
            events.extend((e, 0) for e in closing)
        if usage is not None and not p.usage_per_choice:
            events.append(({**base, "choices": [], "usage": usage}, 0))
        return [(sse(e), tokens) for e, tokens in events] + [(DONE, 0)]

    def _parts(self, c: Choice, split: Callable[[str], list[str]]) -> list[_Part]:
        """One choice's deltas. A persona that hides reasoning streams none of it, but the first content delta still
        waits for the hidden tokens."""
        p = self.persona
        if c.pieces is not None:
            reasoning_pieces, content_pieces = c.pieces
        else:
            reasoning_pieces = [(piece, count_tokens(piece)) for piece in split(c.reasoning or "")]
            content_pieces = [(piece, count_tokens(piece)) for piece in split(c.content)]
        parts: list[_Part] = []
        hidden = 0
        # The reasoning's log-probabilities come first where the server gives them (Persona.reasoning_logprobs).
        start = 0
        for piece, tokens in reasoning_pieces:
            if p.reasoning_key is None:
                hidden += tokens
                continue
            logprobs = None
            if c.logprobs is not None and p.reasoning_logprobs:
                logprobs = c.logprobs[start : start + tokens]
                start += tokens
            parts.append(_Part({p.reasoning_key: piece}, logprobs, tokens, True))
        for piece, tokens in content_pieces:
            logprobs = c.logprobs[start : start + tokens] if c.logprobs is not None else None
            start += tokens
            parts.append(_Part({"content": piece}, logprobs, tokens + hidden, False))
            hidden = 0
        return parts
