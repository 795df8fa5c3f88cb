"""Per-request sampling inside transformers' continuous-batching engine: temperature, top-k, top-p, min-p and a seed
per request, each request drawing its tokens from its own seeded stream whatever else shares its batch.

transformers 5.17's engine samples every request of a batch with one random generator, and only temperature, top-k
and top-p can differ per request. Here the engine runs greedy (argmax) and these logits processors, run in this
order on each new token's scores, do the sampling:

1. :class:`Temperature` divides the scores by the request's temperature (1 for a greedy request);
2. :class:`TopK` keeps the k best (k = the vocabulary where unset);
3. :class:`TopP` keeps the smallest set of best tokens whose probability reaches p;
4. :class:`MinP` keeps the tokens whose probability is at least min_p times the best one's;
5. :class:`SeededGumbel` adds Gumbel noise drawn from the request's seed and its token's position, so the engine's
   argmax is a draw from the filtered distribution (the Gumbel-max trick: argmax_i(z_i + G_i) with G_i independent
   standard Gumbel is distributed as softmax(z)). A greedy request gets no noise.

The noise of a request's n-th token is a counter-based hash of (seed, n, token id), computed on the device, so two
requests with the same seed and prompt draw the same tokens in any batch (up to the floating-point differences of
different batch shapes), and a resumed run's sample draws what the first run's did.

The engine hands each processor one 32-bit value per request per step (``prepare_tensor_args``); the values come
from a :class:`RequestTable` the engine fills as it submits requests (a request the table does not hold, such as the
engine's own warm-up, is greedy).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_FILTERED = -math.inf


@dataclass(frozen=True)
class RequestSampling:
    """What one request samples with. ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 filter
    nothing; ``seed`` is the request's stream."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

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


def uniform_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """A [rows, vocab] float32 tensor of values in (0, 1), each a hash of its row's key and its column: every
    operation stays below 2**63 in int64, so it is exact on any device and inside a CUDA graph."""
    k = keys.to(torch.int64) & _MASK32
    column = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = (k.unsqueeze(-1) * 0x27D4EB2F + column * 0x165667B1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK32
    x = x ^ (x >> 15)
    # The top 24 bits, centred in their interval: never 0 nor 1.
    return ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise, -log(-log(U)), from :func:`uniform_noise`."""
    return -torch.log(-torch.log(uniform_noise(keys, vocab)))


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
    """A processor whose per-request value comes from the :class:`RequestTable`."""

    def __init__(self, table: RequestTable) -> None:
        self.table = table
        # Nothing comes through the engine's per-request keyword arguments.
        self.supported_kwargs = {}
        self.ignored_kwargs = ()


class _FloatParameter(_PerRequest):
    """One float per request, carried as the int32 of its float32 bits (as the engine's own processors carry
    theirs)."""

    default = 1.0

    def value(self, sampling: RequestSampling) -> float:
        raise NotImplementedError

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        default = torch.empty_like(int32_tensor, dtype=torch.float32).fill_(self.default)
        int32_tensor.copy_(default.view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        values = [self.value(self.table.get(rid)) for rid in _rows(requests_with_new_token)]
        return torch.tensor(values, dtype=torch.float32).view(dtype=torch.int32)

    @staticmethod
    def floats(tensor_arg: torch.Tensor, rows: int) -> torch.Tensor:
        return tensor_arg[:rows].view(dtype=torch.float32).unsqueeze(-1)


class Temperature(_FloatParameter):
    def value(self, sampling: RequestSampling) -> float:
        # A greedy request takes the argmax of its unscaled scores.
        return 1.0 if sampling.greedy else sampling.temperature

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        return _scores(scores / self.floats(tensor_arg, scores.size(0)))


class TopK(_PerRequest):
    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        values = [max(0, self.table.get(rid).top_k) for rid in _rows(requests_with_new_token)]
        return torch.tensor(values, dtype=torch.int32)

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        vocab = scores.size(-1)
        k = tensor_arg[: scores.size(0)].to(torch.int64)
        # 0 (unset) keeps every token; k is at most the vocabulary.
        k = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
        ordered = torch.sort(scores, dim=-1, descending=True).values
        threshold = ordered.gather(-1, (k - 1).unsqueeze(-1))
        return _scores(scores.masked_fill(scores < threshold, _FILTERED))


class TopP(_FloatParameter):
    def value(self, sampling: RequestSampling) -> float:
        return sampling.top_p

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        top_p = self.floats(tensor_arg, scores.size(0))
        ordered, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        # Drop the worst tokens while what they hold together is at most 1 - p; the best token always stays.
        drop = cumulative <= (1.0 - top_p)
        drop[..., -1] = False
        return _scores(scores.masked_fill(drop.scatter(-1, order, drop), _FILTERED))


class MinP(_FloatParameter):
    default = 0.0

    def value(self, sampling: RequestSampling) -> float:
        return sampling.min_p

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        min_p = self.floats(tensor_arg, scores.size(0))
        probs = scores.softmax(dim=-1)
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        return _scores(scores.masked_fill(probs < floor, _FILTERED))


class SeededGumbel(_PerRequest):
    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        # Called once per step for the requests that draw a token in it: each request's stream moves on by one.
        return torch.tensor([self.table.next_key(rid) for rid in _rows(requests_with_new_token)], dtype=torch.int32)

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        keys = tensor_arg[: scores.size(0)]
        noise = gumbel_noise(keys, scores.size(-1))
        return _scores(torch.where((keys != 0).unsqueeze(-1), scores + noise, scores))


def sampling_processors(table: RequestTable) -> list[ContinuousBatchingLogitsProcessor]:
    """The processors in the order the module's docstring gives."""
    return [Temperature(table), TopK(table), TopP(table), MinP(table), SeededGumbel(table)]
