"""Thinking-model replies for the simulator: tens of thousands of tokens of reasoning, cheap to make and stream.

A paper-scale run is 164,000 calls whose reasoning runs to 2K-60K tokens each, so nothing here works per token in
Python: a corpus of generated reasoning-like text is built once per process (with its token offsets, counted as the
simulator counts tokens), and a reply's reasoning and answer padding are slices of it at random token offsets, cut
into streamed deltas of ``LongReplies.chunk_tokens`` at token boundaries, each delta's token count known in advance.

The answer keeps the role's own reply (the responder's text: a boxed answer, a score line, a JSON block) at its end,
after padding, so the run proceeds as TMAS does: verifiers, summaries and the memory agents parse what they always do.

How compressible the text is (``repeat_share``) is calibrated on real model replies: ``compression_ratio`` gives
zstd's ratio on slices of a given size, as the run store compresses a reply (docs/performance.md says the figures).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from array import array
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tmas.testing.personas import Persona
from tmas.testing.replies import Choice, certain_logprobs
from tmas.testing.responders import TOKEN_RE, SimRequest, content_text, count_tokens, cut_tokens, stable_hash
from tmas.testing.script import LongReplies, SimScript

# Words of mathematical reasoning, most frequent first (drawn Zipf-weighted). None of them, and no character the
# corpus uses, is markup a reply parser looks for (tags, boxes, score lines, code fences).
_VOCABULARY = (
    "the of a to is and we so that this then it by for with in not as be which let since at on are have case sum "
    "term value step check each gives one two its if but thus hence now both first next every must can prime "
    "integer divides modulo root degree bound equal greater less odd even square factor solution answer polynomial "
    "sequence function set number point line angle triangle circle area length coefficient exponent induction "
    "contradiction assume suppose consider note recall observe compute substitute simplify expand remaining "
    "verify again careful mistake recheck indeed therefore follows implies holds count pairs order residue "
    "parity symmetric maximum minimum limit interval digit base product quotient remainder graph vertex edge"
)
_WORDS = _VOCABULARY.split()
# Stock phrases a thinking model repeats through its reasoning.
_PHRASES = (
    "Wait, let me check that again.",
    "Hmm, that does not look right.",
    "Let me recompute this step carefully.",
    "So far so good.",
    "Actually, I think I made a mistake here.",
    "Let me try a different approach.",
    "Let me verify with a small case.",
    "That matches what we found before.",
    "So the answer should be consistent with this.",
    "Okay, so now we need to consider the remaining case.",
    "But wait, we should double check the boundary.",
    "Let me write this out more carefully.",
    "Alternatively, we can count the complement.",
    "This seems right, but let me make sure.",
    "Now, substituting back, we get the same expression.",
    "Let me think about whether this is always true.",
)
_VARIABLES = "xyznkmabc"


@dataclass(frozen=True)
class Corpus:
    """Generated reasoning text and the start and end offset of each of its tokens."""

    text: str
    starts: array[int]
    ends: array[int]

    @property
    def tokens(self) -> int:
        return len(self.starts)

    def slice(self, first: int, count: int, chunk: int) -> list[tuple[str, int]]:
        """Tokens ``first`` .. ``first + count - 1`` as deltas of ``chunk`` tokens: (text, its tokens) each. The
        deltas concatenate to one slice of the corpus, cut at token starts (a delta's spacing leads it)."""
        if count <= 0:
            return []
        last = first + count - 1
        out = []
        for at in range(first, last + 1, chunk):
            end = at + chunk
            stop = self.starts[end] if end <= last else self.ends[last]
            out.append((self.text[self.starts[at] : stop], min(chunk, last + 1 - at)))
        return out


def _sentence(rng: random.Random, weights: list[float]) -> str:
    words = rng.choices(_WORDS, weights, k=rng.randrange(6, 24))
    for i in range(0, len(words), 8):
        slot = rng.randrange(i, min(i + 8, len(words)))
        kind = rng.random()
        if kind < 0.5:
            words[slot] = str(rng.randrange(1000))
        elif kind < 0.8:
            words[slot] = f"{rng.choice(_VARIABLES)}^{rng.randrange(2, 9)} + {rng.randrange(100)}"
        else:
            words[slot] = f"= {rng.randrange(10**5)}"
    words[0] = words[0].capitalize()
    return " ".join(words) + "."


@lru_cache(maxsize=4)
def corpus(tokens: int, repeat_share: float, seed: int = 0) -> Corpus:
    """At least ``tokens`` tokens of reasoning-like prose: sentences of Zipf-weighted words, numbers and small
    formulas, a ``repeat_share`` of them stock phrases, in paragraphs. Built once per process and parameters."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(_WORDS))]
    paragraphs: list[str] = []
    count = 0
    while count < tokens:
        sentences = [
            rng.choice(_PHRASES) if rng.random() < repeat_share else _sentence(rng, weights)
            for _ in range(rng.randrange(2, 9))
        ]
        paragraph = " ".join(sentences)
        count += count_tokens(paragraph)
        paragraphs.append(paragraph)
    text = "\n\n".join(paragraphs)
    starts, ends = array("l"), array("l")
    for match in TOKEN_RE.finditer(text):
        starts.append(match.start())
        ends.append(match.end())
    return Corpus(text, starts, ends)


def compression_ratio(sample_chars: int, samples: int = 20, config: LongReplies | None = None) -> float:
    """zstd's mean ratio (level 3, as the run store) on ``samples`` corpus slices of about ``sample_chars``."""
    import zstandard

    config = config or LongReplies()
    text = corpus(config.corpus_tokens, config.repeat_share).text
    rng = random.Random(1)
    compressor = zstandard.ZstdCompressor(level=3)
    ratios = []
    for _ in range(samples):
        at = rng.randrange(0, max(1, len(text) - sample_chars))
        blob = text[at : at + sample_chars].encode()
        ratios.append(len(blob) / len(compressor.compress(blob)))
    return sum(ratios) / len(ratios)


def _draw_lengths(config: LongReplies, rng: random.Random) -> tuple[int, int]:
    """(reasoning tokens, answer tokens): log-normal reasoning, clipped; a uniform answer length."""
    drawn = rng.lognormvariate(math.log(config.reasoning_median_tokens), config.reasoning_sigma)
    reasoning = int(min(config.reasoning_max_tokens, max(config.reasoning_min_tokens, drawn)))
    return reasoning, rng.randint(config.answer_min_tokens, config.answer_max_tokens)


def long_choice(
    config: LongReplies, sim: SimRequest, reply: str, max_tokens: int | None, persona: Persona, script: SimScript
) -> Choice:
    """One choice of a thinking model: reasoning sliced from the corpus, then ``reply`` (the role's own answer) after
    padding to the drawn answer length, as pre-cut streaming deltas. ``max_tokens`` cuts the reasoning first, as a
    model's budget runs out in its thinking."""
    text = corpus(config.corpus_tokens, config.repeat_share)
    rng = random.Random(stable_hash(sim.sample_key, "long reply"))
    reasoning_tokens, answer_tokens = _draw_lengths(config, rng)
    if not sim.thinking:
        reasoning_tokens = 0  # the request turned thinking off: the answer alone
    reply_tokens = count_tokens(reply)
    padding = max(0, answer_tokens - reply_tokens)
    finish_reason = "stop"
    if max_tokens is not None and reasoning_tokens + padding + reply_tokens > max_tokens:
        finish_reason = "length"
        reasoning_tokens = min(reasoning_tokens, max_tokens)
        padding = min(padding, max_tokens - reasoning_tokens)
        reply = cut_tokens(reply, max_tokens - reasoning_tokens - padding)
        reply_tokens = count_tokens(reply)
    reasoning_pieces = text.slice(rng.randrange(text.tokens - reasoning_tokens), reasoning_tokens, config.chunk_tokens)
    content_pieces = text.slice(rng.randrange(text.tokens - padding), padding, config.chunk_tokens)
    if reply:
        content_pieces.append(("\n\n" + reply if content_pieces else reply, reply_tokens))
    if script.think_tags and sim.thinking:  # the reasoning goes in the content, between think tags
        opening = [] if script.think_in_prompt else [("<think>\n", 3)]
        # A reply cut inside its thinking never wrote the closing tag.
        closing = [] if max_tokens is not None and reasoning_tokens >= max_tokens else [("\n</think>\n\n", 4)]
        content_pieces = [*opening, *reasoning_pieces, *closing, *content_pieces]
        reasoning_tokens, reasoning_pieces = 0, []
    content = "".join(piece for piece, _ in content_pieces)
    reasoning = "".join(piece for piece, _ in reasoning_pieces) if reasoning_pieces else None
    completion_tokens = reasoning_tokens + sum(tokens for _, tokens in content_pieces)
    logprobs = None
    if sim.body.get("logprobs") and script.logprobs:
        top = sim.body.get("top_logprobs")
        top = persona.default_top_logprobs if top is None else top
        thought = certain_logprobs(reasoning, top, persona) if reasoning and persona.reasoning_logprobs else []
        logprobs = thought + certain_logprobs(content, top, persona)
    return Choice(
        content,
        reasoning,
        finish_reason,
        logprobs,
        reasoning_tokens,
        completion_tokens,
        (reasoning_pieces, content_pieces),
    )


def prompt_digest(messages: list[Any]) -> str:
    """A chat prompt's digest: its messages' roles and texts, as the run store keeps them (``call_messages``)."""
    pairs = [[m.get("role"), content_text(m.get("content"))] for m in messages if isinstance(m, dict)]
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()[:32]


def request_digest(body: dict[str, Any]) -> dict[str, Any]:
    """What the request log keeps of a chat request under ``SimScript.log_digests``: the prompt's digest, the seed
    and ``n``, enough to tell which calls a client sent again."""
    messages = body.get("messages")
    return {
        "prompt": prompt_digest(messages) if isinstance(messages, list) else None,
        "seed": body.get("seed"),
        "n": body.get("n") or 1,
    }
