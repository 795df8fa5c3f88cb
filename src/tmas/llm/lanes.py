"""Problem lanes: which problem worker of a run a call comes from, so that an endpoint with ``pin_slots`` keeps one
problem's calls on one server slot.

llama-server keeps each slot's last prompt in that slot's KV cache (and older prompts in host memory): a call whose
prompt shares a prefix with what its slot holds skips that prefix. TMAS's calls about one problem share the system
text, the problem and often the rollouts, but sent in parallel they land on whichever slot is free and mostly find
another problem's prompt there. When a run has at least as many problems in flight as the endpoint has slots, each
problem worker is a lane: the client sends the calls of lane ``w`` to one slot (``id_slot``), one at a time, and that
slot's cache holds the lane's own previous prompt. With fewer problems than slots (one ``tmas solve``) nothing is
pinned: the parallel calls of one problem then use every slot.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Lane:
    index: int
    count: int


_current: ContextVar[Lane | None] = ContextVar("tmas_lane", default=None)


def enter_lane(index: int, count: int) -> None:
    """Mark the running task, and the tasks it starts from now on, as lane ``index`` of ``count``."""
    _current.set(Lane(index, count))


def current_lane() -> Lane | None:
    return _current.get()


def pinned_slot(lane: Lane | None, replicas: int, slots_per_replica: int) -> tuple[int, int] | None:
    """(replica index, slot index) for ``lane``, or None when calls are not pinned: no lane, no known slot count, or
    fewer lanes than slots (pinning would leave slots idle). Lanes fill the replicas' slot 0 first, then slot 1."""
    if lane is None or slots_per_replica < 1 or lane.count < replicas * slots_per_replica:
        return None
    return lane.index % replicas, (lane.index // replicas) % slots_per_replica
