"""The verification agent A_ver (paper eq. 2): analytical feedback and a score on the scale
1 = fully correct, 0.5 = partially correct, 0 = fatal error.

Parsing: the last line-leading ``Score: S`` (any case, markdown emphasis, "Final score", ``=``, a boxed or fraction
value allowed); failing that, a lone boxed number in the ``## Score`` section. A value inside [0, 1] off the scale is
snapped to the nearest point (ties go down) and flagged; anything else means no score.
"""

from __future__ import annotations

import re
from fractions import Fraction

from pydantic import BaseModel

from tmas.agents.style import Style
from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.answers import last_boxed
from tmas.llm.types import Message

SCALE = (0.0, 0.5, 1.0)
_NUMBER = r"[0-9]*\.?[0-9]+(?:\s*/\s*[0-9]+)?"
_SCORE_LINE = re.compile(
    rf"^[\s>*_#-]*(?:final\s+)?(?:score|grade)[\s*_]*[:=][\s*_`$]*(?:\\boxed\{{\s*)?({_NUMBER})", re.I | re.M
)
_SCORE_SECTION = re.compile(r"^#{1,6}\s*Score\b(.*)\Z", re.I | re.M | re.S)


class Verification(BaseModel):
    feedback: str
    # None when no score could be read; the candidate then gets 0 for this pass.
    score: float | None
    snapped: bool = False

    @property
    def effective_score(self) -> float:
        return 0.0 if self.score is None else self.score


def verification_prompt(question: str, solution: str, mode: str, style: Style = "paper") -> list[Message]:
    return prompt(
        "tmas_verify.j2", system_name=MATH_SYSTEM, question=question, solution=solution, mode=mode, style=style
    )


def _value(raw: str) -> float | None:
    try:
        value = float(Fraction(raw.replace(" ", "")))
    except (ValueError, ZeroDivisionError):
        return None
    return value if 0.0 <= value <= 1.0 else None


def parse_verification(content: str) -> Verification:
    raw: str | None = None
    matches = _SCORE_LINE.findall(content)
    if matches:
        raw = matches[-1]
    else:
        section = _SCORE_SECTION.search(content)
        boxed = last_boxed(section.group(1)) if section else None
        raw = boxed.strip() if boxed else None
    value = _value(raw) if raw is not None else None
    if value is None:
        return Verification(feedback=content.strip(), score=None)
    nearest = min(SCALE, key=lambda point: (abs(point - value), point))
    return Verification(feedback=content.strip(), score=nearest, snapped=nearest != value)
