"""Per-request sampling inside transformers' continuous-batching engine: temperature, top-k, top-p, min-p and a seed
per request, each request drawing its tokens from its own seeded stream whatever else shares its batch.

transformers 5.17's engine samples every request of a batch with one random generator, and only temperature, top-k
and top-p can differ per request. Here the engine runs greedy (argmax) and these logits processors, run in this
order on each new token's scores (after :class:`tmas.llm.hf_grammar.SchemaMask` where replies are constrained to
schemas), do the sampling:

1. :class:`Temperature` divides the scores by the request's temperature (1 for a greedy request);
2. :class:`TopK` keeps the k best (all where unset);
3. :class:`TopP` keeps the smallest set of best tokens whose probability reaches p;
4. :class:`MinP` keeps the tokens whose probability is at least min_p times the best one's;
5. :class:`SeededDraw` draws the token from what is left by inverting its cumulative distribution at a uniform
   number made from the request's seed and the token's position, and leaves only that token standing, so the
   engine's argmax takes it. A greedy request's scores pass unchanged (its argmax is the greedy token).

The uniform number of a request's n-th token is a hash of (seed, n), so two requests with the same seed and prompt
draw the same tokens in any batch (up to the floating-point differences of different batch shapes), and a resumed
run's sample draws what the first run's did.

The engine hands each processor one 32-bit value per request per step (``prepare_tensor_args``); the values come
from a :class:`RequestTable` the engine fills as it submits requests (a request the table does not hold, such as the
engine's own warm-up, is greedy). Where no request of a step uses a filter, the filter is skipped (its sort is the
costly part), unless the engine replays captured CUDA graphs, where every step must run the same operations
(:attr:`Filter.always`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

from tmas.llm.hf_grammar import Grammars, SchemaMask

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_FILTERED = -math.inf


@dataclass(frozen=True)
class RequestSampling:
    """What one request samples with. ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 filter
    nothing; ``seed`` is the request's stream; ``schema``, a JSON schema's text, constrains what it draws
    (:mod:`tmas.llm.hf_grammar`)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    schema: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = RequestSampling(temperature=0.0)


def splitmix64(value: int) -> int:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014): a 64-bit mix of ``value``."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, position: int) -> int:
    """The noise key of a request's token at ``position`` (0 for its first): a positive 31-bit value, never 0 (0
    means no noise)."""
    mixed = splitmix64(splitmix64(seed & _MASK64) ^ position)
    return (mixed >> 33) | 1


def uniform_of(keys: torch.Tensor) -> torch.Tensor:
    """One float32 value in (0, 1) per 31-bit key, a hash of it: exact on any device and inside a CUDA graph (every
    product stays below 2**63 in int64)."""
    x = (keys.to(torch.int64) & _MASK32) * 0x27D4EB2F & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK32
    x = x ^ (x >> 15)
    # The top 24 bits, centred in their interval: never 0 nor 1.
    return ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs`` whose cumulative probability first reaches ``uniform`` times the row's
    total: a draw from the row's distribution (inverse transform sampling); a token of probability 0 is never drawn."""
    cumulative = probs.cumsum(dim=-1)
    target = (uniform * cumulative[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cumulative, target).clamp(max=probs.size(-1) - 1)


class RequestTable:
    """The sampling of each request in the engine by its id, and how many tokens each has drawn; written by the
    event loop's thread (:meth:`add`, :meth:`remove`) and read by the engine's (the processors)."""

    def __init__(self) -> None:
        self._sampling: dict[str, RequestSampling] = {}
        self._drawn: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, sampling: RequestSampling) -> None:
        with self._lock:
            self._sampling[request_id] = sampling
            self._drawn[request_id] = 0

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._sampling.pop(request_id, None)
            self._drawn.pop(request_id, None)

    def get(self, request_id: str) -> RequestSampling:
        return self._sampling.get(request_id, GREEDY)

    def next_key(self, request_id: str) -> int:
        """The noise key of the request's next token (0, no noise, for a greedy or unknown request); each call moves
        its stream on by one token."""
        with self._lock:
            sampling = self._sampling.get(request_id)
            if sampling is None or sampling.greedy:
                return 0
            position = self._drawn[request_id]
            self._drawn[request_id] = position + 1
        return stream_key(sampling.seed, position)

    def __len__(self) -> int:
        return len(self._sampling)


def _scores(tensor: torch.Tensor) -> torch.FloatTensor:
    # The engine's processors are typed as returning float tensors; every tensor here is float32.
    return cast(torch.FloatTensor, tensor)


def _rows(requests: list[Any]) -> list[str]:
    return [request.state.request_id for request in requests]


class _PerRequest(ContinuousBatchingLogitsProcessor):
    """A processor whose per-request value comes from the :class:`RequestTable`: ``value`` of each request's
    sampling, carried as an int32 (a float as the int32 of its float32 bits, as the engine's own processors carry
    theirs)."""

    dtype = torch.int32
    # The value that leaves a request's scores as they are.
    neutral: float = 0

    def __init__(self, table: RequestTable) -> None:
        self.table = table
        # Nothing comes through the engine's per-request keyword arguments.
        self.supported_kwargs = {}
        self.ignored_kwargs = ()

    def value(self, sampling: RequestSampling) -> float:
        raise NotImplementedError

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        default = torch.empty_like(int32_tensor, dtype=self.dtype).fill_(self.neutral)
        int32_tensor.copy_(default.view(dtype=torch.int32))

    def values(self, requests_with_new_token: list[Any]) -> list[float]:
        return [self.value(self.table.get(rid)) for rid in _rows(requests_with_new_token)]

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return torch.tensor(self.values(requests_with_new_token), dtype=self.dtype).view(dtype=torch.int32)

    def rows(self, tensor_arg: torch.Tensor, rows: int) -> torch.Tensor:
        """This step's values, one row each."""
        return tensor_arg[:rows].view(dtype=self.dtype).unsqueeze(-1)


class Filter(_PerRequest):
    """A processor that removes tokens, skipped in a step where every request's value is neutral. ``always`` makes
    every step run it (captured CUDA graphs replay the same operations whatever the values)."""

    always = False

    def __init__(self, table: RequestTable) -> None:
        super().__init__(table)
        self._used = True

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        values = self.values(requests_with_new_token)
        self._used = any(v != self.neutral for v in values)
        return torch.tensor(values, dtype=self.dtype).view(dtype=torch.int32)

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        if not (self.always or self._used):
            return scores
        return _scores(self.filtered(scores, self.rows(tensor_arg, scores.size(0))))

    def filtered(self, scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Temperature(_PerRequest):
    dtype = torch.float32
    neutral = 1.0

    def value(self, sampling: RequestSampling) -> float:
        # A greedy request takes the argmax of its unscaled scores.
        return 1.0 if sampling.greedy else sampling.temperature

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        return _scores(scores / self.rows(tensor_arg, scores.size(0)))


class TopK(Filter):
    def value(self, sampling: RequestSampling) -> float:
        return max(0, sampling.top_k)

    def filtered(self, scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        vocab = scores.size(-1)
        k = values.to(torch.int64)
        # 0 (unset) keeps every token; k is at most the vocabulary.
        k = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
        ordered = torch.sort(scores, dim=-1, descending=True).values
        return scores.masked_fill(scores < ordered.gather(-1, k - 1), _FILTERED)


class TopP(Filter):
    dtype = torch.float32
    neutral = 1.0

    def value(self, sampling: RequestSampling) -> float:
        return sampling.top_p

    def filtered(self, scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        ordered, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        # Drop the worst tokens while what they hold together is at most 1 - p; the best token always stays.
        drop = cumulative <= (1.0 - values)
        drop[..., -1] = False
        return scores.masked_fill(drop.scatter(-1, order, drop), _FILTERED)


class MinP(Filter):
    dtype = torch.float32
    neutral = 0.0

    def value(self, sampling: RequestSampling) -> float:
        return sampling.min_p

    def filtered(self, scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        probs = scores.softmax(dim=-1)
        floor = values * probs.max(dim=-1, keepdim=True).values
        return scores.masked_fill(probs < floor, _FILTERED)


class SeededDraw(_PerRequest):
    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        # Called once per step for the requests that draw a token in it: each request's stream moves on by one.
        return torch.tensor([self.table.next_key(rid) for rid in _rows(requests_with_new_token)], dtype=torch.int32)

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        keys = tensor_arg[: scores.size(0)]
        token = draw(scores.softmax(dim=-1), uniform_of(keys))
        drawn = torch.full_like(scores, _FILTERED).scatter(-1, token, 0.0)
        return _scores(torch.where((keys != 0).unsqueeze(-1), drawn, scores))


def sampling_processors(
    table: RequestTable, grammars: Grammars | None = None
) -> list[ContinuousBatchingLogitsProcessor]:
    """The processors in the order the module's docstring gives, after the schema mask where ``grammars`` is given
    (the draw is from the tokens a request's schema allows)."""
    processors: list[ContinuousBatchingLogitsProcessor] = []
    if grammars is not None:
        processors.append(SchemaMask(grammars, lambda request_id: table.get(request_id).schema))
    return [*processors, Temperature(table), TopK(table), TopP(table), MinP(table), SeededDraw(table)]
