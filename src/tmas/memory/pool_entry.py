"""An entry of MATTRL's test-time experience pool (paper 003, section 3.4): a distilled, high-credit utterance.

Experience construction (``tmas pool build``) produces these from scored transcripts; the pool
(:mod:`tmas.memory.pool`) stores them with their embeddings, retrieves them for a case and keeps their
lifecycle counters. Both sides use this one model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

EntryScope = Literal["general", "case"]


class PoolEntry(BaseModel):
    id: str
    # The ACTION the specialist took and the EXPERIENCE (why it helped), as the summarizer distilled them.
    action: str
    experience: str
    # General lessons apply to any case of the domain; case-specific ones to cases like their source.
    scope: EntryScope = "general"
    domain: str = "math"
    specialty: str = ""
    # Education (C.1.1, C.4.7): the teacher's role (Diagnostician, Pedagogy Strategist, Subject Matter Expert), the
    # question's subject and difficulty, which key retrieval, and the entry's class (GUIDANCE or STRATEGY). Empty in
    # other domains and in entries written before these fields existed (such pools load unchanged).
    role: str = ""
    subject: str = ""
    difficulty: str = ""
    category: str = ""
    # Where it came from: run directory, problem, round, agent; and the utterance's final reward r (Eq. 12).
    source_run: str = ""
    source_problem: str = ""
    source_round: int = 0
    source_agent: str = ""
    # The source problem's question as tmas.problems.question_hash writes it (case and whitespace aside): a run on
    # that same problem leaves the entry out of its retrieval, since the summarizer wrote it knowing the reference
    # answer. Empty in entries written before the field existed, which no run can tell apart.
    source_question: str = ""
    reward: float = 0.0
    # Pool version that added it (recency), and how its retrievals turned out later (lifecycle).
    added_version: int = 0
    retrieved: int = 0
    retrieved_wrong: int = 0
    tags: list[str] = Field(default_factory=list)

    @property
    def text(self) -> str:
        """What is embedded and injected: the action and the experience together."""
        return f"ACTION: {self.action}\nEXPERIENCE: {self.experience}"
