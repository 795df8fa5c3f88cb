"""How sure the model was of a trace, from its token log-probabilities: the confidence measures of DeepConf (Fu et
al. 2025, "Deep Think with Confidence", section 3), by the paper's names and symbols:

- token confidence, C_i = -(1/k) sum_{j=1..k} log P_i(j): minus the mean log-probability of the k most likely
  tokens at position i (the ``top_logprobs`` the server listed there; k is what the request asked for). It is high
  where the distribution is peaked, since the alternatives to the chosen token are then improbable;
- average trace confidence, C_avg = (1/N) sum_i C_i over the trace's N tokens;
- group confidence, C_{G_i} = (1/|G_i|) sum_{t in G_i} C_t over a group G_i of n consecutive tokens, the window
  sliding one token at a time;
- lowest group confidence, C_least = min_i C_{G_i}: the trace's weakest stretch;
- tail confidence, C_tail: the mean of C_t over the last n tokens, where the final answer is written.

A trace shorter than n tokens is one group, the whole trace (so C_least = C_tail = C_avg), as DeepConf's own code
does. A position where fewer than two finite log-probabilities are listed is left out: one value alone is the chosen
token's surprisal, which falls as the model grows surer, the opposite of what C_i measures.

:class:`SlidingGroups` takes the token confidences one at a time, so a streamed reply can be followed as it arrives
(DeepConf's online variant stops a trace whose running group confidence falls below a threshold set by the first
traces); :func:`trace_confidence` reduces a finished reply's log-probabilities with it.

DeepConf scores the whole trace, thinking included, and the servers list the reasoning's tokens first:
vLLM (vllm-project/vllm ``vllm/entrypoints/openai/chat_completion/serving.py``, once ``serving_chat.py``) builds them
with ``_create_chat_logprobs`` from each output's token ids, apart from the reasoning parser's split, so a reasoning
delta carries its tokens'; SGLang (sgl-project/sglang ``python/sglang/srt/entrypoints/openai/serving_chat.py``) takes
the meta_info's ``output_token_logprobs`` of every generated token and, streamed, puts each step's on its first chunk,
a ``reasoning_content`` one included; llama-server keeps every sampled token's. A server that lists the answer's
alone (SGLang's streams before that change) makes the measures the answer's: :func:`reply_confidence` marks them
``answer_only``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from tmas.llm.types import Completion, TokenLogprob

# A candidate's measures are part of its stored record (tmas.store.records); computed here.
from tmas.store.records import CONFIDENCE_MEASURES, Confidence, ConfidenceMeasure

__all__ = [
    "CONFIDENCE_MEASURES",
    "Confidence",
    "ConfidenceMeasure",
    "SlidingGroups",
    "reply_confidence",
    "token_confidence",
    "trace_confidence",
]


def token_confidence(position: TokenLogprob) -> float | None:
    """C_i at one position: minus the mean of the listed top log-probabilities; None with fewer than two of them."""
    listed = [alt.logprob for alt in position.top_logprobs if math.isfinite(alt.logprob)]
    if len(listed) < 2:
        return None
    return -sum(listed) / len(listed)


class SlidingGroups:
    """Group confidences C_{G_i} over a window of ``window`` token confidences, fed one at a time."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"confidence window must be at least 1 token, not {window}")
        self.window = window
        self._recent: deque[float] = deque()
        self._window_sum = 0.0
        self.count = 0
        self.total = 0.0
        # The lowest full group seen so far (None until ``window`` tokens have arrived).
        self.lowest: float | None = None

    def push(self, confidence: float) -> float | None:
        """Add the next token's C_i; the group confidence of the last ``window`` tokens once there are that many."""
        self._recent.append(confidence)
        self._window_sum += confidence
        if len(self._recent) > self.window:
            # A running sum: a thinking trace has tens of thousands of tokens and windows of thousands.
            self._window_sum -= self._recent.popleft()
        self.count += 1
        self.total += confidence
        if len(self._recent) < self.window:
            return None
        group = self._window_sum / self.window
        self.lowest = group if self.lowest is None else min(self.lowest, group)
        return group

    def tail(self) -> float | None:
        """The mean of the last ``window`` token confidences (all of them in a shorter trace)."""
        return self._window_sum / len(self._recent) if self._recent else None


def trace_confidence(logprobs: Iterable[TokenLogprob] | None, window: int) -> Confidence | None:
    """The measures of a reply's content tokens; None when no position listed log-probabilities to read."""
    groups = SlidingGroups(window)
    for position in logprobs or ():
        c = token_confidence(position)
        if c is not None:
            groups.push(c)
    tail = groups.tail()
    if tail is None:
        return None
    mean = groups.total / groups.count
    lowest = groups.lowest if groups.lowest is not None else mean
    return Confidence(mean=mean, lowest_group=lowest, tail=tail, tokens=groups.count, window=window)


def reply_confidence(reply: Completion, window: int) -> Confidence | None:
    """The measures of a reply's listed tokens, marked ``answer_only`` where it reasoned but the listed tokens' text
    does not reach into its reasoning (no longer than the answer and half the reasoning)."""
    measured = trace_confidence(reply.logprobs, window)
    if measured is None or not reply.reasoning:
        return measured
    listed = sum(len(position.token) for position in reply.logprobs or ())
    if listed < len(reply.content) + len(reply.reasoning) / 2:
        return measured.model_copy(update={"answer_only": True})
    return measured
