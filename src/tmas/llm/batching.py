"""Several samples of one prompt as one request (``n``), so the server computes their shared prompt once.

Majority vote's k samples, TMAS's first-iteration solutions (identical prompts) and a candidate's M verifications are
started together (``gather``) and differ only in their sample index and their seed, seed + ``j`` for sample ``j``
(:meth:`tmas.methods.base.ProblemSession.chat`). Where the endpoint's ``batch_samples`` allows it
(:class:`tmas.config.Endpoint`), the client hands its calls to a :class:`SampleBatcher`: the calls that arrive in one
turn of the event loop and are alike (:func:`batch_group`) go as one request with ``n`` = their count, at most
:data:`MAX_SAMPLES_PER_REQUEST` (more go as several requests of near-equal size), and the reply's choices are handed
out one per call in sample order. Each call still returns its own :class:`Completion`, and the store, which wraps the
wire (:class:`tmas.llm.replay.StoreReplay`), keeps one row per sample under the sample's own request: a resumed run
asks only for the samples it lacks, in one request with ``n`` = their count.

The seed sent is the request's lowest sample's: vLLM samples choice ``i`` with that seed + ``i``. Each sample's seed,
set by a source or derived for its prompt's step, is already its own, seed + ``j`` for sample ``j``
(:func:`tmas.llm.sampling.for_sample`), as is a retry's: calls go together only where their seeds follow one another
(:func:`seed_runs`), so each choice is drawn with the seed its sample would have been sent alone, and batching changes
no sample's seed: a run draws the same samples batched or not, and a resumed run's remainder the ones it lacks.

Usage: a server reports one usage per reply: the prompt once, the completion tokens summed over the choices.
:func:`share_usage` splits it so that the samples' figures add up to it exactly: the first sample carries the prompt
and its cached tokens, the others none (the server computed the prompt once); completion and reasoning tokens are
split in proportion to each choice's own text as the endpoint's token counter counts it (largest remainder). Where
the server reported no usage, each choice keeps its own counted tokens and only the first counts the prompt; where it
reported the first choice's usage alone (llama-server), the first keeps it and the others' tokens are counted. Budgets
(``Budget.count``) then charge a batched group what the server computed. A caller that leaves while its request
runs (cancelled) takes no completion, so what its choice cost (the prompt, where it is the first) goes on the first
completion handed to a caller that waited: the figures still add up to what the server computed. Where every caller
left, the request is closed, and the first caller to find them all gone carries what it had the server generate on
its cancel, as a call sent alone does (:func:`tmas.llm.model.leave_spent`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from tmas.llm.model import CANCELLED, leave_spent, spent_before
from tmas.llm.replies import reported_reasoning
from tmas.llm.tokens import TokenCounter
from tmas.llm.types import CallKey, ChatRequest, Completion, ServerKind, Usage

# Choices asked of one request; a bigger group goes as several requests (a server runs a request's choices as that
# many sequences at once).
MAX_SAMPLES_PER_REQUEST = 64
# The engines whose /v1/models reply makes batch_samples = "auto" send `n` (both share one prefill among the choices).
BATCHING_SERVERS: frozenset[ServerKind] = frozenset({"vllm", "sglang"})
# The engines whose reply to n > 1 reports its first choice's usage alone (llama-server); the others sum the choices.
FIRST_CHOICE_USAGE: frozenset[ServerKind] = frozenset({"llama-server"})
# How a server says it does not serve this n: older llama-server builds "Only one completion choice is allowed" (a 400,
# or a 500, read only after its retries), newer ones "n_cmpl cannot be greater than the number of slots"; others name
# the field `n`.
_N_REFUSAL = re.compile(r"\bn\b|\bn_cmpl\b|completion choice", re.I)
_N_REFUSAL_CAUSES = frozenset({"http_400", "http_422", "http_500", "http_501"})

T = TypeVar("T")


def batch_group(request: ChatRequest, key: CallKey) -> str:
    """What calls must share to go in one request: role, problem, model, messages, ``response_format`` and sampling
    but the seed, and whether they carry one (seeds go together only where they follow one another:
    :func:`seed_runs`)."""
    seeded = request.sampling.seed is not None
    sampling = request.sampling.model_dump(mode="json", exclude={"seed"})
    messages = [[m.role, m.content] for m in request.messages]
    group = [key.role, key.problem_id, request.model, messages, request.response_format, sampling, seeded]
    return json.dumps(group, sort_keys=True, ensure_ascii=False)


def serves_samples(kinds: Iterable[ServerKind | None]) -> bool:
    """batch_samples = "auto": whether an endpoint whose replicas are of ``kinds`` (None: not recognised) gets `n`."""
    known = [kind for kind in kinds if kind is not None]
    return bool(known) and all(kind in BATCHING_SERVERS for kind in known)


@dataclass
class Sample:
    """One call waiting in its group: the request the client built for it, and where its completion goes."""

    request: ChatRequest
    key: CallKey
    request_hash: str
    # None: no alike call came with it, and its caller sends it alone.
    future: asyncio.Future[Completion | None]
    # The request it went in, once its group closed.
    part: Part | None = None


@dataclass
class Part:
    """One request's samples (in sample order) and its task, with what the request had the server generate that no
    caller took (every caller left): the first caller to find them all gone carries it (:func:`_carry_unclaimed`)."""

    samples: list[Sample]
    task: asyncio.Task[None] | None = None
    # A failed completion of cause "cancelled" (tmas.llm.model.leave_spent); None while nothing is left over.
    unclaimed: Completion | None = None
    carried: bool = False


# Sends one group (in sample order) and answers each sample with its completion, or None where its caller is to send
# it alone; what it raises, every caller of the group raises.
SendGroup = Callable[[list[Sample]], Awaitable[Sequence[Completion | None]]]


class SampleBatcher:
    """Collects the calls that arrive in one turn of the event loop and gives each group of two or more alike calls,
    in sample order and in parts of at most :data:`MAX_SAMPLES_PER_REQUEST`, to ``send`` (in a task of its own);
    a call that came alone goes back to its caller."""

    def __init__(self, send: SendGroup) -> None:
        self._send = send
        self._open: dict[str, list[Sample]] = {}
        self._running: set[asyncio.Task[None]] = set()

    async def submit(self, request: ChatRequest, key: CallKey, request_hash: str) -> Completion | None:
        """The completion of this call, sent together with the alike calls submitted in the same turn; None when
        none came with it (the caller then sends it as it is)."""
        loop = asyncio.get_running_loop()
        group = batch_group(request, key)
        samples = self._open.get(group)
        if samples is None:
            # Closed on the next turn: by then every call that `gather` started in this one has joined.
            samples = self._open[group] = []
            loop.call_soon(self._close, group)
        future: asyncio.Future[Completion | None] = loop.create_future()
        sample = Sample(request, key, request_hash, future)
        samples.append(sample)
        try:
            return await future
        except asyncio.CancelledError as cancel:
            await _carry_unclaimed(sample, cancel)
            raise

    def _close(self, group: str) -> None:
        # A call cancelled while its group was open asks for nothing.
        samples = sorted((s for s in self._open.pop(group) if not s.future.done()), key=lambda s: s.key.sample)
        if not samples:
            return
        parts = [p for run in seed_runs(samples) for p in near_equal_parts(run, MAX_SAMPLES_PER_REQUEST)]
        for alone in (p[0] for p in parts if len(p) == 1):
            alone.future.set_result(None)
        for samples_of_part in (p for p in parts if len(p) > 1):
            part = Part(samples_of_part)
            task = part.task = asyncio.ensure_future(self._answer(part))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            for sample in part.samples:
                sample.part = part
                sample.future.add_done_callback(partial(_abandon, task, part))

    async def _answer(self, part: Part) -> None:
        try:
            outcomes = await self._send(part.samples)
        except asyncio.CancelledError as cancel:
            part.unclaimed = spent_before(cancel)
            for sample in part.samples:
                sample.future.cancel()
            raise
        except Exception as exc:  # e.g. EndpointUnreachable: every caller of the part raises it
            for sample in part.samples:
                if not sample.future.done():
                    sample.future.set_exception(exc)
            return
        part.unclaimed = _charge_the_left(part.samples, outcomes)
        for sample, outcome in zip(part.samples, outcomes, strict=True):
            if not sample.future.done():  # else its caller was cancelled
                sample.future.set_result(outcome)


def _charge_the_left(part: Sequence[Sample], outcomes: Sequence[Completion | None]) -> Completion | None:
    """What the server spent on the choices of callers that left while the request ran (their completions go to no
    one), put on the first completion handed to a caller that waited: the prompt, prefilled once for the whole
    request, rides on the first choice's usage, so a first sample cancelled (the others settled the vote, a budget
    stop) would take it out of the run's count. Where every caller left, it is returned, as a cancelled call's
    spend (tmas.llm.model.leave_spent), for one of them to carry."""
    left = [o for s, o in zip(part, outcomes, strict=True) if s.future.cancelled() and o is not None]
    heir = next((o for s, o in zip(part, outcomes, strict=True) if not s.future.cancelled() and o is not None), None)
    spent = sum((o.usage for o in left), Usage())
    if heir is not None:
        heir.usage = heir.usage + spent
        return None
    if not left:
        return None
    first = left[0]
    return Completion(
        key=first.key, request_hash=first.request_hash, endpoint=first.endpoint, model=first.model,
        latency_s=first.latency_s, attempts=first.attempts, error=CANCELLED, error_cause="cancelled",
        retry_causes=first.retry_causes, usage=spent,
    )  # fmt: skip


def _abandon(task: asyncio.Task[None], part: Part, _: asyncio.Future[Completion | None]) -> None:
    """Stop a part's request once every one of its callers was cancelled: no one is left to read the reply."""
    if all(sample.future.cancelled() for sample in part.samples):
        task.cancel()


async def _carry_unclaimed(sample: Sample, cancel: asyncio.CancelledError) -> None:
    """``sample``'s caller leaves (``cancel``): the first caller to find every caller of its request gone waits for
    the request to stop (at once: its connection is closed) and carries on its cancel, under its own key, what the
    request had the server generate (tmas.llm.model.leave_spent), which no caller took."""
    part = sample.part
    if part is None or part.task is None or part.carried:
        return
    if not all(s.future.cancelled() for s in part.samples):
        return
    part.carried = True
    # Cancelled again meanwhile (gather_all cancels the calls still running once a sibling has ended cancelled), it
    # still waits: the request is already stopping, and what it spent has no one else to carry it.
    while not part.task.done():
        with suppress(asyncio.CancelledError):
            await asyncio.wait({part.task})
    if part.unclaimed is not None:
        leave_spent(cancel, part.unclaimed.model_copy(update={"key": sample.key, "request_hash": sample.request_hash}))


def near_equal_parts(items: list[T], most: int) -> list[list[T]]:
    """``items`` in order, in as few parts of at most ``most`` as possible, their sizes differing by at most one."""
    count = -(-len(items) // most)
    size, extra = divmod(len(items), count) if count else (0, 0)
    out: list[list[T]] = []
    start = 0
    for i in range(count):
        end = start + size + (i < extra)
        out.append(items[start:end])
        start = end
    return out


def one_per_choice(data: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """A reply to a request for ``n`` choices as one reply per choice, in ``index`` order (at most ``n``), each
    shaped as a reply of its own (its usage is still the whole reply's: see :func:`share_usage`); for ``n`` = 1 the
    reply as it is."""
    choices = data.get("choices")
    if n == 1 or not isinstance(choices, list):
        return [data]
    ordered = sorted(enumerate(choices), key=lambda item: _index(item[1], item[0]))
    return [{**data, "choices": [choice]} for _, choice in ordered[:n]]


def without_aborted(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The choices the server aborted (finish_reason "abort") of a reply of several where others finished, taken out
    of ``data``: the finished ones are kept and the others asked again, as a stream's unfinished ones are
    (:data:`tmas.llm.stream.PARTIAL`). None are taken where every choice was aborted: the reply fails whole."""
    choices = data.get("choices")
    if not isinstance(choices, list):
        return []
    aborted = [c for c in choices if isinstance(c, dict) and c.get("finish_reason") == "abort"]
    if aborted and len(aborted) < len(choices):
        data["choices"] = [c for c in choices if not (isinstance(c, dict) and c.get("finish_reason") == "abort")]
        return aborted
    return []


def choice_indices(replies: Sequence[dict[str, Any]]) -> list[int]:
    """The choice index of each reply of :func:`one_per_choice`."""
    return [_index(r["choices"][0], position) for position, r in enumerate(replies)]


def _index(choice: Any, position: int) -> int:
    index = choice.get("index") if isinstance(choice, dict) else None
    return index if isinstance(index, int) else position


def share_usage(
    completions: list[Completion], data: dict[str, Any], counter: TokenCounter, kind: ServerKind | None = None
) -> list[Completion]:
    """``completions``, read from the choices of the one reply ``data`` of a server of ``kind``, with the reply's
    usage split among them (see the module's docstring); a single completion as it is."""
    if len(completions) < 2:
        return completions
    if not _reports_usage(data):
        # Each completion was counted alone, its prompt included: the prompt counts once.
        for completion in completions[1:]:
            completion.usage = completion.usage.model_copy(update={"prompt_tokens": 0})
        return completions
    if kind in FIRST_CHOICE_USAGE:
        # The usage is the first choice's, its prompt included: the others' completion tokens are counted.
        for completion in completions[1:]:
            reasoning = counter.count(completion.reasoning)
            completion.usage = Usage(
                completion_tokens=counter.count(completion.content) + reasoning,
                reasoning_tokens=reasoning,
                estimated=not counter.exact,
            )
        return completions
    # Each completion was read with the whole reply's usage; its own text says how much of it is its own. Reasoning
    # the server did not count was counted from each completion's own text: that count stays its own.
    own = None if reported_reasoning(data.get("usage")) else [c.usage for c in completions]
    weights = [counter.count(c.content) + counter.count(c.reasoning) for c in completions]
    reasoning_weights = [counter.count(c.reasoning) for c in completions]
    for i, (completion, usage) in enumerate(
        zip(completions, split_usage(completions[0].usage, weights, reasoning_weights), strict=True)
    ):
        if own is not None:
            usage.reasoning_tokens = min(own[i].reasoning_tokens, usage.completion_tokens)
            usage.estimated = usage.estimated or own[i].estimated
        completion.usage = usage
    return completions


def _reports_usage(data: dict[str, Any]) -> bool:
    # The test the client's own usage reading applies (tmas.llm.client._usage).
    usage = data.get("usage")
    return isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int)


def split_usage(reply: Usage, completion_weights: Sequence[int], reasoning_weights: Sequence[int]) -> list[Usage]:
    """One reply's usage as one usage per choice: the prompt (and its cached tokens) on the first, completion and
    reasoning tokens in proportion to the weights; the parts sum to the reply's figures."""
    completion = apportion(reply.completion_tokens, completion_weights)
    reasoning = apportion(reply.reasoning_tokens, reasoning_weights)
    return [
        Usage(
            prompt_tokens=reply.prompt_tokens if i == 0 else 0,
            completion_tokens=completion[i],
            reasoning_tokens=reasoning[i],
            cached_prompt_tokens=reply.cached_prompt_tokens if i == 0 else 0,
            estimated=reply.estimated,
        )
        for i in range(len(completion_weights))
    ]


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` in whole parts proportional to ``weights`` that sum to it (largest remainder, ties to the earlier
    part); equal parts where every weight is 0."""
    if not any(weights):
        weights = [1] * len(weights)
    whole = sum(weights)
    parts = [total * w // whole for w in weights]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return parts


def refuses_n(completion: Completion) -> bool:
    """Whether a failed request for several choices failed because its server does not serve ``n`` > 1."""
    return completion.error_cause in _N_REFUSAL_CAUSES and bool(_N_REFUSAL.search(completion.error or ""))


def seed_runs(samples: list[Sample]) -> list[list[Sample]]:
    """One group's samples (in sample order) in the runs that can each go as one request: all of them where none
    carries a seed; else, ordered by seed, runs of seeds that follow one another, so that choice ``i`` of a run
    (drawn with the lead's seed + ``i``) draws with the seed its sample carries."""
    if samples[0].request.sampling.seed is None:
        return [samples]
    runs: list[list[Sample]] = []
    for sample in sorted(samples, key=lambda s: (s.request.sampling.seed or 0, s.key.sample)):
        seed = sample.request.sampling.seed or 0
        if runs and seed == (runs[-1][-1].request.sampling.seed or 0) + 1:
            runs[-1].append(sample)
        else:
            runs.append([sample])
    return runs


def handed_out(
    completions: Sequence[Completion], samples: Sequence[Sample], indices: Sequence[int] | None = None
) -> list[Completion | None]:
    """The completions of one request given to its samples, each under the sample's own key and request hash: choice
    ``i`` to sample ``i`` (``indices``: the choices' indices, where some did not come: a cut or aborted choice; vLLM
    samples choice ``i`` with the lowest sample's seed + ``i``, the seed sample ``i`` goes alone with), else in order;
    a failed request (one failed completion) fails every sample alike; samples without a choice get None (their
    callers send them alone)."""
    if len(completions) == 1 and not completions[0].ok:
        # What the failed request's attempts had the server generate is counted once, on the first sample.
        spent = completions[0]
        completions = [spent] + [spent.model_copy(update={"usage": Usage()})] * (len(samples) - 1)
        indices = None
    if indices is None or len(indices) != len(completions):
        indices = range(len(completions))
    given: list[Completion | None] = [None] * len(samples)
    for c, i in zip(completions, indices, strict=True):
        if 0 <= i < len(samples):
            s = samples[i]
            given[i] = c.model_copy(
                update={"key": s.key, "request_hash": s.request_hash, "retry_causes": list(c.retry_causes)}
            )
    return given
