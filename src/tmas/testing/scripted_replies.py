"""What a script answers, shared by the simulated server (over HTTP) and the scripted model (in process).

One request meets the script's rules here (first matching rule not used up), gets its reply text (the rule's
replies in turn, else the role's default responder), and that text is shaped as a model would shape it: a garbage
or truncate fault, stop strings, a chain of thought that spends the token budget first, a scripted finish reason
and token counts, with the content's log-probabilities where asked. Embeddings are a hashed bag of words.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from dataclasses import dataclass, replace
from typing import Any

from tmas.testing.personas import Persona
from tmas.testing.replies import Choice, certain_logprobs
from tmas.testing.responders import SimRequest, count_tokens, cut_tokens, fake_reasoning, garbage_text, get_responder
from tmas.testing.script import FaultKind, Rule, SimScript

_WORD_RE = re.compile(r"\w+")


def embed_text(text: str, dim: int) -> list[float]:
    """Hashed bag of words, L2-normalised: texts that share words point in similar directions."""
    vec = [0.0] * dim
    for word in _WORD_RE.findall(text.lower()):
        # crc32, not hash(): the same vector in every process. The top bit picks a sign so unrelated words
        # colliding in one bucket tend to cancel rather than add up.
        h = zlib.crc32(word.encode())
        vec[h % dim] += 1.0 if h & 0x80000000 else -1.0
    norm = math.sqrt(sum(x * x for x in vec))
    if norm == 0.0:
        vec[0] = 1.0  # empty text: a fixed unit vector, so cosine maths never divides by zero
        return vec
    return [x / norm for x in vec]


class RuleBook:
    """A script's rules with how often each applied; a new script (or a reset) starts a new book.

    Only one thread answers requests (the server's loop, or the test's), so the counts need no lock.
    """

    def __init__(self, script: SimScript) -> None:
        self.rules = script.rules
        self.counts = [0] * len(script.rules)

    def pick(self, role: str, texts: list[str], uses: int = 1) -> tuple[Rule | None, int]:
        """The first matching rule with ``times`` not used up, and how many times it applied before; it counts
        ``uses`` applications (one per choice of the request)."""
        joined: str | None = None
        for i, rule in enumerate(self.rules):
            used = self.counts[i]
            if rule.times is not None and used >= rule.times:
                continue
            if rule.role is not None and rule.role != role:
                continue
            if rule.regex is not None:
                if joined is None:
                    joined = "\n".join(texts)
                if rule.regex.search(joined) is None:
                    continue
            self.counts[i] = used + uses
            return rule, used
        return None, 0


@dataclass(frozen=True)
class ScriptedText:
    """One choice's text as the script makes it, with its token counts."""

    content: str
    reasoning: str | None
    finish_reason: str
    reasoning_tokens: int
    completion_tokens: int


def scripted_text(
    sim: SimRequest,
    rule: Rule | None,
    used: int,
    *,
    index: int = 0,
    fault: FaultKind | None = None,
    max_tokens: int | None = None,
) -> ScriptedText:
    """Choice ``index`` of the request ``sim`` (whose body gives the stop strings), ``rule`` having applied ``used``
    times before it."""
    script = sim.script
    if rule is not None and rule.replies:
        content = rule.replies[(used + index) % len(rule.replies)]
    else:
        content = get_responder(sim.role)(sim)
    reasoning: str | None = None
    if not sim.thinking:
        pass  # the request turned thinking off: the model answers at once
    elif rule is not None and rule.reasoning is not None:
        reasoning = rule.reasoning
    elif (script.reasoning or script.think_tags) and sim.body.get("model") not in script.also_serves:
        reasoning = fake_reasoning(sim)  # the script's own model thinks; a chat model it also serves does not

    finish_reason = "stop"
    if fault == "garbage":
        content = garbage_text(random.Random(sim.sample_key))
    elif fault == "truncate":
        content = cut_tokens(content, max(1, count_tokens(content) // 2))
        finish_reason = "length"
    elif fault == "abort":
        # vLLM's FinishReason.ABORT ("abort"), SGLang's abort finish reason without a status (its "type"): the reply
        # so far, ended as aborted.
        content = cut_tokens(content, max(1, count_tokens(content) // 2))
        finish_reason = "abort"
    stop = sim.body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    for s in stops:
        if isinstance(s, str) and s and s in content:
            content = content[: content.index(s)]
    if reasoning is not None and script.think_tags:
        opening = "" if script.think_in_prompt else "<think>\n"
        content = f"{opening}{reasoning}\n</think>\n\n{content}"
        reasoning = None

    # max_tokens covers the whole completion: the chain of thought spends the budget first, as in a model.
    reasoning_tokens = count_tokens(reasoning) if reasoning is not None else 0
    content_tokens = count_tokens(content)
    if max_tokens is not None and reasoning_tokens + content_tokens > max_tokens:
        if reasoning is not None and reasoning_tokens >= max_tokens:
            reasoning, reasoning_tokens = cut_tokens(reasoning, max_tokens), max_tokens
        content = cut_tokens(content, max_tokens - reasoning_tokens)
        content_tokens = count_tokens(content)
        finish_reason = "length"
    if rule is not None and rule.finish_reason is not None:
        finish_reason = rule.finish_reason
    completion_tokens = reasoning_tokens + content_tokens
    if rule is not None and rule.usage is not None:
        completion_tokens, reasoning_tokens = rule.usage.completion_tokens, rule.usage.reasoning_tokens
    return ScriptedText(content, reasoning, finish_reason, reasoning_tokens, completion_tokens)


def aborted_choices(choices: list[Choice]) -> list[Choice]:
    """The choices of a request of several the server aborts part way (fault "abort"), each asked whole: the abort
    comes when the longest is half way through its content, and ends every choice still generating there with
    finish_reason "abort", as a lone choice is (scripted_text); a choice that had finished by then keeps its end. (An
    engine aborts what still runs at one moment; that moment is the simulator's, not read from a source.)"""
    moment = max(1, max(count_tokens(c.content) for c in choices) // 2)
    out = []
    for choice in choices:
        tokens = count_tokens(choice.content)
        if tokens <= moment:
            out.append(choice)
            continue
        logprobs = choice.logprobs[: len(choice.logprobs) - (tokens - moment)] if choice.logprobs else choice.logprobs
        out.append(
            replace(
                choice,
                content=cut_tokens(choice.content, moment),
                finish_reason="abort",
                logprobs=logprobs,
                completion_tokens=choice.completion_tokens - (tokens - moment),
                pieces=None,
            )
        )
    return out


def scripted_logprobs(
    script: SimScript,
    body: dict[str, Any],
    rule: Rule | None,
    content: str,
    persona: Persona,
    reasoning: str | None = None,
) -> list[dict[str, Any]] | None:
    """The reply's log-probabilities (OpenAI's ``choices[0].logprobs.content``) where the request ``body`` asks for
    them and the script's server sends them: the rule's payload, else every token certain, of the content and, where
    the persona's server gives them for every generated token, of the ``reasoning`` before it. A rule's payload that
    covers the reasoning and the content (an entry a token of each) leaves the reasoning's out where the persona's
    server gives the content's alone."""
    if not body.get("logprobs") or not script.logprobs:
        return None
    if rule is not None and rule.logprobs is not None:
        hidden = 0 if persona.reasoning_logprobs else count_tokens(reasoning or "")
        whole = hidden > 0 and len(rule.logprobs) == hidden + count_tokens(content)
        return rule.logprobs[hidden:] if whole else rule.logprobs
    top = body.get("top_logprobs")
    top = persona.default_top_logprobs if top is None else top
    thought = certain_logprobs(reasoning, top, persona) if reasoning and persona.reasoning_logprobs else []
    return thought + certain_logprobs(content, top, persona)
