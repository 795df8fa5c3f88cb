"""MATTRL's deliberation transcript (paper 003, sections 3.1-3.3): who said what, in which round, about what.

The MATTRL method writes one :class:`Transcript` per problem into its iteration records (``state["transcript"]``,
one record per deliberation round, the decision in the last); experience construction (section 3.4) reads it back
from the run store to score each utterance and assign credit. Both sides use these models, so the format is one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

UtteranceKind = Literal["opinion", "review", "meeting", "report", "decision"]


class TeamMember(BaseModel):
    """A recruited specialist (Stage I): ``id`` is stable across rounds (``"S1"``, ``"S2"``, ...)."""

    id: str
    specialty: str
    role: str = ""
    description: str = ""
    leader: bool = False


class Utterance(BaseModel):
    """One turn of the deliberation.

    ``agent`` is a team member's id, or ``"coordinator"`` for the meeting bulletin, the report and the decision.
    ``target`` names the member whose attempt a review is about. ``answer`` is the answer the turn states, where
    it states one (an opinion's final answer, a decision's answer; medicine: the top-1 diagnosis).
    ``experience_ids`` are the pool entries injected into the prompt that produced it (for the pool's lifecycle).
    """

    round: int
    agent: str
    kind: UtteranceKind
    text: str
    target: str | None = None
    answer: str | None = None
    call_id: int | None = None
    experience_ids: list[str] = Field(default_factory=list)


class Transcript(BaseModel):
    """A problem's deliberation. ``pool`` is the experience pool folder (resolved) the utterances'
    ``experience_ids`` name entries of: ids are unique only within a pool (pools built from the same runs share
    them), so a pool's lifecycle counts a retrieval only where it is its own. None where no pool gave hints (and in
    runs recorded before the field existed; their run's ``pool`` parameter stands for it)."""

    problem_id: str
    domain: str = "math"
    pool: str | None = None
    team: list[TeamMember] = Field(default_factory=list)
    utterances: list[Utterance] = Field(default_factory=list)
    final_answer: str | None = None

    def by_round(self, round_: int) -> list[Utterance]:
        return [u for u in self.utterances if u.round == round_]

    @property
    def rounds(self) -> int:
        return 1 + max((u.round for u in self.utterances), default=-1)
