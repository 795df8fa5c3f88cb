"""A trajectory's prompt asked again: how many times each trajectory of an iterating method sent each prompt, so that a
prompt sent again goes with a new seed where one is configured.

A trajectory sends a prompt it sent before when what its next prompt is built from did not move: a Self-Refine or
Verify-Refine trajectory whose call failed or wrote no text starts afresh from the generation prompt; one whose
refinement gave no answer holds its solution on and is asked to refine that same solution again; a PaCoRe round after
one with no successful response and a TMAS candidate after an iteration that left no rollout sample the plain prompt
again; an RSE iteration whose bank its distillations left as it was samples the prompt of the iteration before again,
and a solution distilled once more after an unreadable distillation is asked the same prompt; a MATTRL seat whose
opinions keep failing is sent the same opinion prompt again once the snapshot and bulletin stand still. Under a
configured seed the request would be the one sent before, and a server that honours the seed would give the same
unusable reply again. The count is the ``attempt`` of :meth:`tmas.methods.base.ProblemSession.chat`: 0 on the first send
(the seed, configured or derived, goes plus the sample's index, as every sample's does), then a seed derived from
that and the count (:func:`tmas.llm.sampling.retried`); a derived seed already differs by iteration, and the count
keeps a prompt asked again within one iteration (an echo's retry) off the seed it was sent with. A resumed run
replays the same replies, so it counts the same and sends the same seeds. A solution call
(:func:`tmas.methods.steps.solve_call`) given the method's :class:`Reasked` reads its attempt there and counts its sends
in it; another call does both itself (:meth:`Reasked.attempt`, :meth:`Reasked.add`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence

from tmas.llm.types import Message


class Reasked:
    """Per trajectory, role and prompt: the calls sent so far (an echo's retry of the same prompt included)."""

    def __init__(self) -> None:
        self._sent: Counter[tuple[int, str, str]] = Counter()

    def attempt(self, trajectory: int, role: str, messages: Sequence[Message]) -> int:
        """How many times ``trajectory`` sent ``messages`` as ``role`` before: the next call's ``attempt``."""
        return self._sent[_key(trajectory, role, messages)]

    def add(self, trajectory: int, role: str, messages: Sequence[Message], calls: int) -> None:
        """``trajectory`` sent ``messages`` as ``role`` ``calls`` more times."""
        self._sent[_key(trajectory, role, messages)] += calls


def _key(trajectory: int, role: str, messages: Sequence[Message]) -> tuple[int, str, str]:
    raw = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False).encode("utf-8")
    return trajectory, role, hashlib.sha256(raw).hexdigest()
