"""Problem lanes: which problem worker of a run a call comes from, so that an endpoint with ``pin_slots`` keeps one
problem's calls on one server slot.

llama-server keeps each slot's last prompt in that slot's KV cache (and older prompts in host memory): a call whose
prompt shares a prefix with what its slot holds skips that prefix. TMAS's calls about one problem share the system
text, the problem and often the rollouts, but sent in parallel they land on whichever slot is free and mostly find
another problem's prompt there. When a run has at least as many problems in flight as the endpoint has slots, each
problem worker is a lane: the client sends the calls of lane ``w`` to one slot (``id_slot``), one at a time, and that
slot's cache holds the lane's own previous prompt. The lane is data, as the chain is: the runner gives each worker's
problem session its :class:`Lane`, the session puts it in every call's key (``CallKey.lane``), and the client reads
it there (:func:`pinned_slot`). With fewer problems than slots (one ``tmas solve``) nothing is
pinned: the parallel calls of one problem then use every slot.

A lane's calls wait their turn in a :class:`SlotQueue`. A method names the calls that build on each other as one
chain in their keys (``CallKey.chain``: a TMAS candidate's index; the session puts it there) and ends the chain when
its last call is done (``ChatModel.end_chain``); a chain that got the slot keeps it until it ends, so its calls run
back to back.

Across replicas a chain's affinity key (and outside chains, the problem's) is the call's affinity
(:func:`call_affinity`, read from the call's key and the run seed): the client's router prefers the replica that
served the chain's last call (tmas.llm.routing), and a serving router in front of the replicas reads it from a session
header (``Endpoint.session_header``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tmas.llm.types import CallKey, ChainKey, Lane

__all__ = ["Lane", "SlotQueue", "affinity_key", "call_affinity", "pinned_slot"]


def pinned_slot(lane: Lane | None, replicas: int, slots_per_replica: int) -> tuple[int, int] | None:
    """(replica index, slot index) for ``lane``, or None when calls are not pinned: no lane, no known slot count, or
    fewer lanes than slots (pinning would leave slots idle). Lanes fill the replicas' slot 0 first, then slot 1."""
    if lane is None or slots_per_replica < 1 or lane.count < replicas * slots_per_replica:
        return None
    return lane.index % replicas, (lane.index // replicas) % slots_per_replica


def affinity_key(*parts: object) -> str:
    """A short key fixed by ``parts`` (run seed, problem id, ...), the same in every process: safe as a header value
    whatever the problem id holds."""
    return hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).hexdigest()


def call_affinity(key: CallKey, seed: int) -> str | None:
    """The affinity key of the call ``key`` in a run of ``seed``: its chain's (fixed by the run seed, the problem, the
    iteration and the chain index, so a resumed run sends the same), else its problem's; None for a call of
    neither."""
    if key.chain is not None:
        return affinity_key(seed, key.problem_id, key.iteration, key.chain)
    return affinity_key(seed, key.problem_id) if key.problem_id else None


class SlotQueue:
    """One server slot's calls, one at a time, first come first served, except that a chain (the ``chain_key`` of
    its calls' keys) holding the slot keeps it between its calls until it ends (its later calls go first; other calls
    wait). The chain that got the slot keeps it until :meth:`chain_ended`, so each of its calls finds the previous
    one's prompt in the slot's cache (a summary shares the problem and the candidate with its verification). Without
    chains the queue is first come, first served, and the candidates' calls interleave (solution 1, solution 2,
    verification 1, ...), each finding the other chain's prompt (llama-server's host-memory prompt cache then restores
    some of it: docs/performance.md measures both orders). A chain's calls must all come before its end: one after it
    would take the slot again, with no end to give it back."""

    def __init__(self) -> None:
        self._busy = False
        self._holder: ChainKey | None = None
        self._waiters: deque[tuple[ChainKey | None, asyncio.Future[None]]] = deque()

    @asynccontextmanager
    async def turn(self, chain: ChainKey | None = None) -> AsyncIterator[None]:
        """The slot, for one call of ``chain`` (None: a call of no chain)."""
        await self._acquire(chain)
        try:
            yield
        finally:
            self._busy = False
            self._wake()

    async def _acquire(self, chain: ChainKey | None) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (chain, future)
        self._waiters.append(entry)
        self._wake()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._busy = False  # granted, but its task was cancelled before it ran: pass the turn on
            else:
                self._waiters.remove(entry)
            self._wake()
            raise

    def _admits(self, chain: ChainKey | None) -> bool:
        return self._holder is None or self._holder == chain

    def _grant(self, chain: ChainKey | None) -> None:
        self._busy = True
        if chain is not None and self._holder is None:
            self._holder = chain

    def _wake(self) -> None:
        if self._busy:
            return
        for entry in self._waiters:
            waiter, future = entry
            # A cancelled waiter's future is done already; its task removes the entry when it runs.
            if not future.done() and self._admits(waiter):
                self._waiters.remove(entry)
                self._grant(waiter)
                future.set_result(None)
                return

    def chain_ended(self, chain: ChainKey) -> None:
        """``chain`` made its last call: if it holds the slot, the next call in line gets it."""
        if self._holder == chain:
            self._holder = None
            self._wake()
