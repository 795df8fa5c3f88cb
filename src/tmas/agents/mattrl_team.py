"""MATTRL Stage I, team formation (paper 003, section 3.1, A.4, B.2, C.4.2): the coordinator recruits at most n
specialists as a JSON array of ``{specialty, role, description}``, from a catalog (medicine: Table 7; education:
Table 8) or freely (math). Math and medicine teams have exactly one leader. An education team (C.4.2) has no forced
leader: every member is a Diagnostician, a Pedagogy Strategist, a Subject Matter Expert or (optionally, at most one)
a lead teacher, and the team must hold at least one Diagnostician, at least one Pedagogy Strategist and one or two
Subject Matter Experts (with n < 3: the Diagnostician, then the Strategist); a team that breaks this is unusable.

The parser repairs what it can (a fenced block, an object wrapping the array, trailing commas, specialties outside
the catalog, a missing or doubled leader, duplicates, too many members) and says what it repaired; a reply with no
usable member is an :class:`AgentOutputError`, after which the method retries once and then uses the domain's default
line-up (:func:`line_up_team`). Which catalog, rule and line-up a domain uses is its declaration's
(:mod:`tmas.methods.mattrl_domains`); the functions here take them as arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, Field, create_model, field_validator

from tmas.agents.output import AgentOutputError, latex_restored, literal_backslashes, without_trailing_commas
from tmas.agents.templates import prompt
from tmas.llm.types import Message
from tmas.memory.transcript import TeamMember

# Table 7: the 24 departments of the medical specialist pool.
MEDICINE_CATALOG = (
    *("Pediatrics", "Urology", "Hematology", "Rheumatology", "Psychiatry", "Pulmonology", "Dentistry"),
    *("Endocrinology", "Allergy and Immunology", "Cardiology", "Pathology", "Neurology"),
    *("Obstetrics and Gynecology", "Ophthalmology", "Dermatology", "Geriatrics", "Traditional Chinese Medicine"),
    *("Nephrology", "Oncology", "General Practice", "Gastroenterology", "Infectious Diseases"),
    *("Rehabilitation Medicine", "Otorhinolaryngology"),
)
# Table 8: domain experts, pedagogical specialists and cross-disciplinary specialists.
EDUCATION_CATALOG = (
    *("Mathematics", "Engineering", "Physics", "Chemistry", "Biology", "Computer Science", "Medicine"),
    *("Agriculture", "Economics", "Management", "Law", "Education", "Military Science", "History", "Literature"),
    *("Philosophy", "Sociology", "Language Arts", "Pedagogy", "Educational Psychology"),
    *("Assessment and Evaluation", "Curriculum Design", "STEM", "Humanities", "Social Sciences"),
)

# C.4.2's teaching roles, in the order a small team fills them, and the optional coordinator.
DIAGNOSTICIAN, STRATEGIST, SUBJECT_EXPERT, LEAD_TEACHER = (
    "Diagnostician",
    "Pedagogy Strategist",
    "Subject Matter Expert",
    "lead teacher",
)
TEACHING_ROLES = (DIAGNOSTICIAN, STRATEGIST, SUBJECT_EXPERT)

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n(.*?)```", re.S)


# A specialty is written into tag attributes of later prompts (``<contribution ... specialty="...">``): a quote, an
# angle bracket or a line break in it would end the attribute or the tag early, and the block it opens would no longer
# read as data. A freely created title keeps its words on one line, those characters replaced by look-alikes.
_ATTRIBUTE_SAFE = str.maketrans({'"': "'", "<": "\u2039", ">": "\u203a"})


class Recruit(BaseModel):
    specialty: str = Field(min_length=1)
    role: str = ""
    description: str = ""

    @field_validator("specialty", mode="before")
    @classmethod
    def _one_line(cls, value: Any) -> Any:
        return " ".join(value.split()).translate(_ATTRIBUTE_SAFE) if isinstance(value, str) else value


@lru_cache(maxsize=32)
def team_reply_model(n: int, catalog: tuple[str, ...] = (), roles: tuple[str, ...] = ()) -> type[BaseModel]:
    """The recruiting reply's shape for a team of at most ``n``, sent as the call's JSON schema (``reply_model``):
    one to ``n`` members, each specialty one of ``catalog`` and each role one of ``roles`` where the domain names
    them (empty: any text), every field required, so a constrained model names a role (and with it the leader)
    instead of leaving it out. JSON schemas of structured outputs are objects (OpenAI's strict mode takes nothing
    else), so the array comes wrapped; :func:`read_recruits` reads both, and reads an unconstrained reply as
    forgivingly as ever (spelling, wording, too many members)."""
    specialty = Field(json_schema_extra={"enum": list(catalog)}) if catalog else Field(min_length=1)
    role = Field(json_schema_extra={"enum": list(roles)}) if roles else Field()
    member = create_model("MemberReply", specialty=(str, specialty), role=(str, role), description=(str, Field()))
    return create_model("TeamReply", members=(list[member], Field(min_length=1, max_length=n)))


def teaching_role(role: str) -> str | None:
    """C.4.2's role named by ``role`` (case and wording forgiven), or None when it names none of them."""
    text = " ".join(role.lower().split())
    if "diagnos" in text:
        return DIAGNOSTICIAN
    if "strateg" in text or "pedagog" in text:
        return STRATEGIST
    if "subject" in text or "expert" in text:
        return SUBJECT_EXPERT
    if re.search(r"\blead", text):
        return LEAD_TEACHER
    return None


def _teaching_team(recruits: list[Recruit], n: int, notes: list[str]) -> list[Recruit]:
    """C.4.2's roles: unknown roles dropped, extra lead teachers and Subject Matter Experts dropped, then checked."""
    kept: list[Recruit] = []
    for recruit in recruits:
        role = teaching_role(recruit.role)
        if role is None:
            notes.append(f"team member {recruit.specialty!r}: role {recruit.role!r} is not a teaching role; dropped")
            continue
        limit = {LEAD_TEACHER: 1, SUBJECT_EXPERT: 2}.get(role)
        if limit is not None and sum(r.role == role for r in kept) >= limit:
            notes.append(f"team member {recruit.specialty!r}: more than {limit} {role}; dropped")
            continue
        recruit.role = role
        kept.append(recruit)
    if len(kept) > n:
        # Fill the required roles first, then the rest in reply order.
        order = sorted(range(len(kept)), key=lambda i: (_fill_rank(kept, i), i))[:n]
        notes.append(f"{len(kept)} members recruited, at most {n} allowed; kept {n}, the required roles first")
        kept = [kept[i] for i in sorted(order)]
    missing = [role for role in TEACHING_ROLES[: min(n, 3)] if not any(r.role == role for r in kept)]
    if missing:
        raise AgentOutputError(f"the teaching team has no {' and no '.join(missing)} (C.4.2)")
    return kept


def _fill_rank(recruits: list[Recruit], i: int) -> int:
    """0 for the first member of each required role, 1 for everyone else."""
    role = recruits[i].role
    first = next(j for j, r in enumerate(recruits) if r.role == role)
    return 0 if role in TEACHING_ROLES and first == i else 1


def recruit_prompt(
    question: str, domain: str, n: int, *, catalog: Sequence[str] = (), system_name: str | None = None
) -> list[Message]:
    """The coordinator's recruiting call for a team of at most ``n`` from ``catalog`` (empty: any specialty);
    ``system_name``: the domain's specialists' system text, so every call about the problem shares one prefix."""
    return prompt(
        "mattrl_recruit.j2", system_name=system_name, question=question, domain=domain, n=n, catalog=tuple(catalog)
    )


def _json_array(text: str) -> list[Any]:
    """The JSON array in a reply: fenced or bare, possibly inside an object, trailing commas repaired; read as
    :func:`tmas.agents.output.loads_reply` reads JSON (line breaks inside strings as written, a backslash that
    begins no escape taken literally where nothing parses without)."""
    decoder = json.JSONDecoder(strict=False)
    for source in [*reversed(_FENCE.findall(text)), text]:
        repaired = without_trailing_commas(source)
        for candidate in dict.fromkeys((source, repaired, literal_backslashes(source), literal_backslashes(repaired))):
            position = min((p for p in (candidate.find("["), candidate.find("{")) if p >= 0), default=-1)
            while position >= 0:
                try:
                    value, _ = decoder.raw_decode(candidate, position)
                except ValueError:
                    nxt = [p for p in (candidate.find("[", position + 1), candidate.find("{", position + 1)) if p >= 0]
                    position = min(nxt, default=-1)
                    continue
                if isinstance(value, dict):
                    value = next((v for v in value.values() if isinstance(v, list)), None)
                if isinstance(value, list) and value:
                    restored: list[Any] = latex_restored(value)
                    return restored
                break
    raise AgentOutputError("no JSON array of team members in the reply")


def catalog_name(specialty: str, catalog: Sequence[str]) -> str | None:
    """``specialty`` as ``catalog`` spells it (case and spacing forgiven), or None when the catalog lacks it."""
    wanted = " ".join(specialty.lower().split())
    return next((name for name in catalog if name.lower() == wanted), None)


def read_recruits(content: str, catalog: Sequence[str], domain: str) -> tuple[list[Recruit], list[str]]:
    """The recruits of a reply in reply order, those outside ``catalog`` (when it is not empty) and duplicates
    dropped, with notes on every repair; raises when no member is usable."""
    if not content.strip():
        raise AgentOutputError("empty reply")
    raw = _json_array(content)
    notes: list[str] = []
    recruits: list[Recruit] = []
    for position, item in enumerate(raw, start=1):
        try:
            recruit = Recruit.model_validate(item)
        except ValueError:
            notes.append(f"team member {position}: not an object with a specialty; dropped")
            continue
        if catalog:
            name = catalog_name(recruit.specialty, catalog)
            if name is None:
                notes.append(f"team member {position}: {recruit.specialty!r} is not in the {domain} catalog; dropped")
                continue
            recruit.specialty = name
        if any(r.specialty.lower() == recruit.specialty.lower() for r in recruits):
            notes.append(f"team member {position}: duplicate specialty {recruit.specialty!r}; dropped")
            continue
        recruits.append(recruit)
    if not recruits:
        raise AgentOutputError(f"none of the {len(raw)} team members is usable" + (f" ({notes[0]})" if notes else ""))
    return recruits, notes


def led_team(recruits: list[Recruit], n: int, notes: list[str]) -> list[TeamMember]:
    """A team of at most ``n`` with exactly one leader (math, medicine): the first ``n`` recruits, led by the
    first whose role says leader (else the first); each repair noted."""
    if len(recruits) > n:
        notes.append(f"{len(recruits)} members recruited, at most {n} allowed; kept the first {n}")
        recruits = recruits[:n]
    leaders = [i for i, r in enumerate(recruits) if "leader" in r.role.lower()]
    if not leaders:
        notes.append("no member has the leader role; the first one leads")
    elif len(leaders) > 1:
        notes.append(f"{len(leaders)} members have the leader role; the first of them leads")
    return _members(recruits, leaders[0] if leaders else 0)


def teaching_team(recruits: list[Recruit], n: int, notes: list[str]) -> list[TeamMember]:
    """An education team (C.4.2): the teaching roles checked and repaired, led by its lead teacher if it has one."""
    kept = _teaching_team(recruits, n, notes)
    lead = next((i for i, r in enumerate(kept) if r.role == LEAD_TEACHER), None)
    return _members(kept, lead)


def _members(recruits: list[Recruit], lead: int | None) -> list[TeamMember]:
    return [
        TeamMember(
            id=f"S{i + 1}",
            specialty=r.specialty,
            role=r.role.strip(),
            description=r.description.strip(),
            leader=i == lead,
        )
        for i, r in enumerate(recruits)
    ]


def line_up_team(line_up: Sequence[tuple[str, str, str]], n: int, *, led: bool) -> list[TeamMember]:
    """The first ``n`` of a fixed ``(specialty, role, description)`` line-up as a team, the first member leading
    when ``led``: the team used when the coordinator's replies give none."""
    return [
        TeamMember(id=f"S{i + 1}", specialty=specialty, role=role, description=description, leader=led and i == 0)
        for i, (specialty, role, description) in enumerate(line_up[:n])
    ]
