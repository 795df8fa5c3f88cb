"""Default simulated replies for MATTRL's roles: ``coordinator`` (team JSON, decision, rewrite, teaching plan and
guidance), ``specialist`` (a worked attempt, a top-10 differential, or a teacher's turn), ``reviewer`` (the B.4
review JSON; medicine: the A.4 review of a differential) and ``student`` (education: answers "A" until guidance
points at another option).

They read the MATTRL prompts (``mattrl_*.j2``) by their tagged sections, like a model would, and are deterministic
given the request body. The ``judge`` role's diagnosis matching (``judge_diagnosis.j2``) is answered by
:func:`diagnosis_verdict`, which the pool build's judge responder hands that prompt to. The reviewer checks an
attempt's boxed answer against the problem's arithmetic: right means accept with no issue, wrong means revise with
one major issue, so convergence has something to converge on.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from tmas.agents.mattrl_opinion import parse_differential
from tmas.answers import last_boxed
from tmas.methods.mattrl_domains import DOMAINS, Domain
from tmas.testing.responders import SimRequest, register_responder, solution_responder
from tmas.testing.tmas_responders import expected_answer, tag

# A fixed differential the simulated medical team agrees on (the sim cannot diagnose; tests script real cases).
SIM_DIFFERENTIAL = (
    *("Fabry disease", "Gaucher disease", "Pompe disease", "Wilson disease", "Marfan syndrome"),
    *("Ehlers-Danlos syndrome", "Cystic fibrosis", "Huntington disease", "Myasthenia gravis", "Amyloidosis"),
)


def _recruiting_domain(text: str) -> Domain | None:
    """The domain whose catalog a recruiting prompt lists, as a model reads it from the prompt (None: a domain with
    no catalog, whose coordinator names its own specialists)."""
    return next((d for d in DOMAINS.values() if d.catalog and "; ".join(d.catalog) in text), None)


def _team(req: SimRequest) -> str:
    domain = _recruiting_domain(req.question)
    names = domain.catalog[:3] if domain else ("Arithmetic strategist", "Computation checker", "Edge-case auditor")
    # A teaching domain (C.4.2): its line-up's teaching roles, no leader; otherwise one leader.
    roles = (
        [r for _, r, _ in domain.line_up] if domain is not None and domain.teaching else ["leader", "analyst", "critic"]
    )
    return json.dumps(
        [
            {"specialty": n, "role": r, "description": f"Work on the case as the {n.lower()} and report clearly."}
            for n, r in zip(names, roles, strict=True)
        ]
    )


def _answer_from_summary(summary: str) -> str:
    answers = [line.split("answer: ", 1)[1].strip() for line in summary.splitlines() if "; answer: " in line]
    known = [a for a in answers if a != "none"]
    return max(set(known), key=known.count) if known else "N/A"


def _teacher(text: str) -> str | None:
    """A teacher's turn when the prompt is one (it shows the correct answer); the simulated teacher is no good at
    hiding it, so the guidance names the option and the student can learn."""
    gold = tag(text, "correct_answer")
    if not gold:
        return None
    if "closing guidance" in text:
        return f"Key idea: compare each option with the definition. Look again at option {gold}."
    if "<analyses>" in text:
        return f"ROUND {text.count('Teacher:') + 1}: Which assumption in your reasoning would you test first?"
    if "Your focus:" in text:
        return "The student matched a keyword instead of checking the definition."
    return "What definition did you use to rule out the other options?"


@register_responder("coordinator")
def coordinator_responder(req: SimRequest) -> str:
    text = req.question
    taught = _teacher(text)
    if taught is not None:
        return taught
    if "<team_summary>" in text:
        if "<top10>" in text:
            ranked = "\n".join(f"[{i}] {name}" for i, name in enumerate(SIM_DIFFERENTIAL, start=1))
            return f"<analysis>\n- The team converged.\n</analysis>\n<top10>\n{ranked}\n</top10>"
        answer = _answer_from_summary(tag(text, "team_summary"))
        return (
            "<analysis>\n- The specialists agree after review.\n</analysis>\n"
            f"<final_answer>\n{answer}\n</final_answer>\n"
            f"<formal_proof>\nCarrying out the computation gives \\boxed{{{answer}}}.\n</formal_proof>"
        )
    if "<reply>" in text:
        reply = tag(text, "reply")
        answer = last_boxed(reply) or "N/A"
        return f"<analysis>\n- Rewritten.\n</analysis>\n<final_answer>\n{answer}\n</final_answer>"
    return _team(req)


@register_responder("specialist")
def specialist_responder(req: SimRequest) -> str:
    """A worked solution of the ``<problem>`` section; a differential when the prompt asks for one."""
    problem = tag(req.question, "problem") or req.question
    taught = _teacher(req.question)
    if taught is not None:
        return taught
    if "<diagnosis>" in req.question:
        lines = "\n".join(f"{i}. {name}: fits part of the record." for i, name in enumerate(SIM_DIFFERENTIAL, 1))
        return f"1) Reflection: The record points to a storage disorder.\n2) <diagnosis>\n{lines}\n</diagnosis>"
    only_problem = replace(req, messages=[{"role": "user", "content": problem}])
    return solution_responder(only_problem)


def _differential_review(bundle: dict[str, object]) -> str:
    """Medicine (A.4): the simulated reviewer concurs with the author's top diagnosis and asks for no change."""
    ranked = parse_differential(str(bundle.get("differential", "")))
    top = ranked[0] if ranked else "the first diagnosis"
    return json.dumps(
        {
            "analysis": f"The differential is reasonable and {top} leads it for good reason.",
            "agreements": [f"{top} explains the main findings."],
            "disagreements": None,
            "changes": [],
        }
    )


@register_responder("reviewer")
def reviewer_responder(req: SimRequest) -> str:
    bundle = json.loads(tag(req.question, "bundle") or "{}")
    if "differential" in bundle:
        return _differential_review(bundle)
    answer = last_boxed(str(bundle.get("attempt", "")))
    expected = expected_answer(str(bundle.get("problem", "")))
    review: dict[str, object]
    if answer is not None and (expected is None or answer.replace(" ", "") == expected):
        review = {"analysis": f"The computation checks out: {answer}.", "verdict": "accept", "validated": ["result"]}
        review["issues"] = []
    else:
        review = {
            "analysis": "The final value does not match a recomputation.",
            "verdict": "revise",
            "validated": [],
            "issues": [
                {
                    "type": "computation_error",
                    "severity": "major",
                    "note": f"The stated result {answer or '(none)'} is not what the expression evaluates to.",
                    "fix": "Redo the last operation carefully and box the result.",
                }
            ],
        }
    review |= {"tests": {"random_checks": 1, "counterexample": {"found": False, "example": None}}, "confidence": 0.9}
    return json.dumps(review)


_RANKED = re.compile(r"^\[(\d+)\] (.+)$", re.M)
_NON_WORD = re.compile(r"[^a-z0-9]+")


def _words(name: str) -> frozenset[str]:
    return frozenset(_NON_WORD.sub(" ", name.lower()).split())


def diagnosis_verdict(text: str) -> str | None:
    """The diagnosis judge's verdict when ``text`` is its prompt (``<predicted>`` ranked names and a
    ``<reference>``), else None. A prediction names the reference when the words of one of the reference's names
    (`` | ``-separated) and the prediction's words, case and punctuation aside, are the same or one holds all of
    the other's (a wording with a qualifier, or a parent category): the best such rank, or No."""
    if "<predicted>" not in text or "<reference>" not in text:
        return None
    ranked = [(int(rank), name.strip()) for rank, name in _RANKED.findall(tag(text, "predicted"))]
    references = [w for w in (_words(n) for n in tag(text, "reference").split("|")) if w]
    matched = [
        (rank, name)
        for rank, name in ranked
        if _words(name) and any(w <= _words(name) or _words(name) <= w for w in references)
    ]
    if not matched:
        return "<think>No prediction names the reference condition.</think><answer>No</answer>"
    rank, name = min(matched)
    return f"<think>Prediction {rank}, {name}, names the reference condition.</think><answer>{rank}</answer>"


@register_responder("student")
def student_responder(req: SimRequest) -> str:
    text = req.question
    if "<conversation>" in text and "Answer: X" not in text:
        return "I picked it because the wording looked familiar, but I did not check the definition."
    pointed = re.findall(r"option ([A-J])\b", tag(text, "guidance"))
    letter = pointed[-1] if pointed else "A"
    return f"The option that fits the definition best is {letter}; I am unsure about the others.\nAnswer: {letter}"
