"""MATTRL Stage III, the decision (paper 003, A.4 and B.5): the coordinator's discussion report (``<analysis>``)
and final decision in strict tags, ``<final_answer>`` (math) or ``<top10>`` (medicine), with one rewrite pass when
the tags are missing.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from tmas.agents.mattrl_opinion import ranked_names
from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.answers import last_boxed
from tmas.llm.types import Message


class Decision(BaseModel):
    report: str = ""
    answer: str | None = None
    # Medicine: the ranked differential; math: empty.
    top10: list[str] = Field(default_factory=list)
    proof: str = ""


def _tag(text: str, name: str) -> str | None:
    found = re.findall(rf"<{name}>(.*?)</{name}>", text, re.S | re.I)
    return found[-1].strip() if found else None


def decision_prompt(question: str, domain: str, summary: str) -> list[Message]:
    # Math: the specialists' system text, so the decision shares their prefix up to the problem (prefix caches).
    system = MATH_SYSTEM if domain == "math" else None
    return prompt("mattrl_decision.j2", system_name=system, question=question, domain=domain, summary=summary)


def rewrite_prompt(reply: str, domain: str) -> list[Message]:
    return prompt("mattrl_rewrite.j2", reply=reply, domain=domain)


def _clean_answer(raw: str) -> str | None:
    text = raw.strip().lstrip("-").strip()
    text = last_boxed(text) or text.strip("$").strip()
    return None if not text or text.upper() in ("N/A", "NA", "UNKNOWN") else text


def parse_decision(content: str, domain: str) -> Decision | None:
    """The decision in its tags; None when the decision tag is missing (the caller then asks for a rewrite)."""
    report = _tag(content, "analysis") or ""
    if domain == "medicine":
        block = _tag(content, "top10")
        if block is None:
            return None
        ranked = ranked_names(block)
        if not ranked:
            return None
        return Decision(report=report, answer=ranked[0], top10=ranked)
    final = _tag(content, "final_answer")
    if final is None:
        return None
    first_line = next((line for line in final.splitlines() if line.strip()), "")
    return Decision(report=report, answer=_clean_answer(first_line), proof=_tag(content, "formal_proof") or "")
