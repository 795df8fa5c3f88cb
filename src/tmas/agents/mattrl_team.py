"""MATTRL Stage I, team formation (paper 003, section 3.1, A.4, B.2, C.4.2): the coordinator recruits at most n
specialists as a JSON array of ``{specialty, role, description}`` with exactly one leader, from a catalog (medicine:
Table 7; education: Table 8) or freely (math).

The parser repairs what it can (a fenced block, an object wrapping the array, trailing commas, specialties outside
the catalog, a missing or doubled leader, duplicates, too many members) and says what it repaired; a reply with no
usable member is an :class:`AgentOutputError`, after which the method retries once and then uses :func:`default_team`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, Field

from tmas.agents.output import AgentOutputError
from tmas.agents.templates import MATH_SYSTEM, prompt
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
CATALOGS: dict[str, tuple[str, ...]] = {"medicine": MEDICINE_CATALOG, "education": EDUCATION_CATALOG}

_DEFAULTS: dict[str, list[tuple[str, str, str]]] = {
    "math": [
        ("Problem analyst", "leader", "Restate the problem, fix the notation and drive the main line of attack."),
        ("Computation checker", "verifier", "Recompute every numeric and algebraic step independently."),
        ("Edge-case auditor", "critic", "Look for missed cases, boundary values and counterexamples."),
    ],
    "medicine": [
        ("General Practice", "leader", "Weigh the whole record and keep the differential broad before narrowing."),
        ("Pathology", "consultant", "Tie each finding to the disease mechanisms that explain it."),
        ("Neurology", "consultant", "Check the neurological findings against the candidate diagnoses."),
    ],
    "education": [
        ("Pedagogy", "leader", "Coordinate the team and keep the dialogue aimed at the student's error."),
        ("Educational Psychology", "Diagnostician", "Work out why the student chose the wrong option."),
        ("STEM", "Subject Matter Expert", "Explain the discipline's knowledge the student is missing."),
    ],
}

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n(.*?)```", re.S)
_TRAILING_COMMA = re.compile(r",\s*([\]}])")


class Recruit(BaseModel):
    specialty: str = Field(min_length=1)
    role: str = ""
    description: str = ""


def recruit_prompt(question: str, domain: str, n: int) -> list[Message]:
    return prompt(
        "mattrl_recruit.j2",
        # Math: the specialists' system text, so every call about the problem shares one prefix (prefix caches).
        system_name=MATH_SYSTEM if domain == "math" else None,
        question=question,
        domain=domain,
        n=n,
        catalog=CATALOGS.get(domain, ()),
    )


def _json_array(text: str) -> list[Any]:
    """The JSON array in a reply: fenced or bare, possibly inside an object, trailing commas repaired."""
    for source in [*reversed(_FENCE.findall(text)), text]:
        for candidate in (source, _TRAILING_COMMA.sub(r"\1", source)):
            decoder = json.JSONDecoder()
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
                    return value
                break
    raise AgentOutputError("no JSON array of team members in the reply")


def _catalog_name(specialty: str, catalog: tuple[str, ...]) -> str | None:
    wanted = " ".join(specialty.lower().split())
    return next((name for name in catalog if name.lower() == wanted), None)


def parse_team(content: str, domain: str, n: int) -> tuple[list[TeamMember], list[str]]:
    """The team (ids S1, S2, ... in reply order) and notes on every repair; raises when no member is usable."""
    if not content.strip():
        raise AgentOutputError("empty reply")
    raw = _json_array(content)
    catalog = CATALOGS.get(domain, ())
    notes: list[str] = []
    recruits: list[Recruit] = []
    for position, item in enumerate(raw, start=1):
        try:
            recruit = Recruit.model_validate(item)
        except ValueError:
            notes.append(f"team member {position}: not an object with a specialty; dropped")
            continue
        if catalog:
            name = _catalog_name(recruit.specialty, catalog)
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
    if len(recruits) > n:
        notes.append(f"{len(recruits)} members recruited, at most {n} allowed; kept the first {n}")
        recruits = recruits[:n]
    leaders = [i for i, r in enumerate(recruits) if "leader" in r.role.lower()]
    if not leaders:
        notes.append("no member has the leader role; the first one leads")
    elif len(leaders) > 1:
        notes.append(f"{len(leaders)} members have the leader role; the first of them leads")
    lead = leaders[0] if leaders else 0
    team = [
        TeamMember(
            id=f"S{i + 1}",
            specialty=r.specialty,
            role=r.role.strip(),
            description=r.description.strip(),
            leader=i == lead,
        )
        for i, r in enumerate(recruits)
    ]
    return team, notes


def default_team(domain: str, n: int) -> list[TeamMember]:
    """The team used when the coordinator's replies give none: a fixed, sensible line-up for the domain."""
    return [
        TeamMember(id=f"S{i + 1}", specialty=specialty, role=role, description=description, leader=i == 0)
        for i, (specialty, role, description) in enumerate(_DEFAULTS.get(domain, _DEFAULTS["math"])[:n])
    ]
