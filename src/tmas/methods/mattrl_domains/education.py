"""MATTRL's education domain (paper 003, appendix C): a teaching team of Table 8 with C.4.2's roles and no forced
leader teaches a student between a pre-test and a post-test (:mod:`tmas.methods.mattrl_teaching`); graded by the
student's answers (Acc_pre, Acc_post, their delta). Its pool entries are keyed by the teacher's role and the
question's subject and difficulty (C.1.1), its turns judged by C.4.6's rubric and credited earlier-first."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from tmas.agents.mattrl_teaching import difficulty_of, subject_of
from tmas.agents.mattrl_team import (
    DIAGNOSTICIAN,
    EDUCATION_CATALOG,
    LEAD_TEACHER,
    STRATEGIST,
    SUBJECT_EXPERT,
    catalog_name,
    line_up_team,
    read_recruits,
    teaching_role,
    teaching_team,
)
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import TeamMember
from tmas.methods.mattrl_domains.domain import Domain, Tier

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_NEGATION = (" not ", " except", " false", " incorrect", " least ")
_DIFFICULTY = {"easy": 0.0, "middle": 1.0, "medium": 1.0, "hard": 2.0}


class Education(Domain):
    name: ClassVar[str] = "education"
    catalog: ClassVar[tuple[str, ...]] = EDUCATION_CATALOG
    line_up: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("Educational Psychology", DIAGNOSTICIAN, "Work out why the student chose the wrong option."),
        ("Pedagogy", STRATEGIST, "Decide how to teach this student next, one targeted question at a time."),
        ("STEM", SUBJECT_EXPERT, "Explain the discipline's knowledge the student is missing."),
    )
    team_roles: ClassVar[tuple[str, ...]] = (DIAGNOSTICIAN, STRATEGIST, SUBJECT_EXPERT, LEAD_TEACHER)
    teaching: ClassVar[bool] = True
    grader: ClassVar[str | None] = "teaching"
    metrics: ClassVar[Mapping[str, str]] = {"acc_pre": "Acc_pre", "acc_post": "Acc_post", "delta": "ΔAcc"}
    metrics_note: ClassVar[str] = (
        "Acc_pre and Acc_post: the shares of cases the student answers right before and after teaching;"
        " ΔAcc = Acc_post - Acc_pre."
    )
    # C.1: "higher credit to earlier instructional turns".
    credit_decay: ClassVar[Literal["later", "earlier"]] = "earlier"
    # C.1: "From each scored teaching interaction, the top-ranked (25%) utterances are selected".
    quantile_within: ClassVar[Literal["all", "case"]] = "case"

    def parse_team(self, content: str, n: int) -> tuple[list[TeamMember], list[str]]:
        """C.4.2's team: every member a teaching role, the required roles present; no forced leader."""
        recruits, notes = read_recruits(content, self.catalog, self.name)
        return teaching_team(recruits, n, notes), notes

    def default_team(self, n: int, metadata: Mapping[str, Any]) -> list[TeamMember]:
        """No leader; the Subject Matter Expert from the question's subject when Table 8 has it."""
        line_up = list(self.line_up)
        if name := catalog_name(subject_of(dict(metadata)), self.catalog):
            line_up[2] = (name, *line_up[2][1:])
        return line_up_team(line_up, n, led=False)

    def member_role(self, role: str) -> str:
        """C.4.2's role the recruited role names (as recruited when it names none)."""
        return teaching_role(role) or role

    def retrieval_tier(self, member: TeamMember, metadata: Mapping[str, Any]) -> Tier | None:
        """C.1.1's keyed retrieval as a tier per pool entry (lower first, None never): only education entries of the
        teacher's role (entries without a role, written before roles were recorded, come after all others);
        subject-specific entries only for the same subject; entries of the same difficulty (or of none recorded)
        before those of another. Within a tier the pool ranks by cosine similarity."""
        role = self.member_role(member.role)
        subject, difficulty = subject_of(dict(metadata)), difficulty_of(dict(metadata))

        def same(a: str, b: str) -> bool:
            return not a or not b or a.strip().lower() == b.strip().lower()

        def tier(entry: PoolEntry) -> int | None:
            if entry.domain != self.name or (entry.role and entry.role != role):
                return None
            if entry.scope == "case" and not same(entry.subject, subject):
                return None
            return (0 if same(entry.difficulty, difficulty) else 1) + (0 if entry.role else 2)

        return tier

    def case_features(self, question: str, metadata: Mapping[str, Any]) -> dict[str, float]:
        """The question's size, its option count, negation cues and the stated difficulty."""
        text = f" {question.lower()} "
        difficulty = str(metadata.get("difficulty") or "").strip().lower()
        return {
            "log_chars": math.log1p(len(question)),
            "options": float(len(re.findall(r"^[A-J]\) ", question, re.M))),
            "numbers": float(len(_NUMBER.findall(question))),
            "negation": float(any(cue in text for cue in _NEGATION)),
            "difficulty": _DIFFICULTY.get(difficulty, 1.0),
        }
