"""The verification agent A_ver (paper eq. 2): analytical feedback and a score on the scale
1 = fully correct, 0.5 = partially correct, 0 = fatal error.

Parsing: a reply that is a JSON object (the shape :class:`VerificationReply` asks a constraining server for, bare or
in a code fence) gives its ``score`` and its ``analysis`` as the feedback. Otherwise the last line-leading
``Score: S`` (any case, markdown emphasis, "Final score", ``=``, a boxed value, a fraction or a grade out of a total
such as 0.5/1 allowed, and a decimal comma: 0,5); failing that, a lone boxed number in the ``## Score`` section, or
a number that is all the section holds below its heading.
Where the reply has a ``## Score`` section, both are read from it alone: a ``Score:`` line above it is part of the
analysis (one restating the scale). A value inside [0, 1] off the scale is snapped to the nearest point (ties go
down) and flagged; anything else means no score.

A reply cut at max_tokens had not stopped: a ``Score:`` line before its end may restate the scale in the middle of the
analysis, and its last line is one the cut went through ("Score: 1" of "Score: 1/2" or of "Score: 1 when every
step holds"), or one that more was to follow. Its score is read only from a JSON object that parsed whole (a
constrained server may let blank space follow the object until the cut); otherwise it has no score.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

from pydantic import BaseModel, Field, create_model

from tmas.agents.output import loads_reply
from tmas.agents.style import Style
from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.answers import last_boxed
from tmas.llm.types import Message

SCALE = (0.0, 0.5, 1.0)
# A number, or a grade out of a total ("1/2", "0.5/1", "0.5 / 1.0").
_NUMBER = r"[0-9]*\.?[0-9]+(?:\s*/\s*[0-9]*\.?[0-9]+)?"
# The number is read whole, with a decimal comma ("0,5" is 0.5, not 0).
_SCORE_LINE = re.compile(
    rf"^[\s>*_#-]*(?:final\s+)?(?:score|grade)[\s*_]*[:=][\s*_`$]*(?:\\boxed\{{\s*)?({_NUMBER}(?:,[0-9]+)?)",
    re.I | re.M,
)
_SCORE_SECTION = re.compile(r"^#{1,6}\s*Score\b(.*)\Z", re.I | re.M | re.S)
# A "## Score" section that holds nothing but its grade, on the line below the heading ("0.5", "**1**", "$1/2$").
_LONE_SCORE = re.compile(rf"[^\n]*\n[\s*_`$]*({_NUMBER}(?:,[0-9]+)?)[\s*_`$.]*", re.S)
_WHOLE_FENCE = re.compile(r"\A```[ \t]*(?:json)?[ \t]*\n(.*?)\n?```\Z", re.S | re.I)


class VerificationReply(BaseModel):
    """The reply's shape when the server constrains it (``reply_model``, text scoring only): the analysis first, then
    the score on the paper's scale. :func:`parse_verification` reads it as well as the markdown layout."""

    analysis: str
    # The scale's three points (a typing Literal cannot hold 0.5, so the enum is stated for the schema).
    score: float = Field(json_schema_extra={"enum": list(SCALE)})


# Under a schema the server closes the JSON only if the analysis ends in time: an analysis still going at max_tokens
# leaves the reply without its score (61 of 386 verifications of TMAS's local preset cut at 400 tokens on the
# embedded 0.5B model). So the schema sent bounds the analysis to what max_tokens holds before the score: at most
# CHARS_PER_TOKEN characters a token (the embedded model's JSON replies ran at about 3; LaTeX runs denser), after
# SCORE_TOKENS for the keys, the score and the closing brace.
CHARS_PER_TOKEN = 2.5
SCORE_TOKENS = 24


@lru_cache(maxsize=32)
def verification_reply_model(max_tokens: int | None) -> type[VerificationReply]:
    """:class:`VerificationReply` with its analysis bounded to what ``max_tokens`` holds before the score (none
    without ``max_tokens``)."""
    if max_tokens is None:
        return VerificationReply
    chars = max(1, int((max_tokens - SCORE_TOKENS) * CHARS_PER_TOKEN))
    return create_model("VerificationReply", __base__=VerificationReply, analysis=(str, Field(max_length=chars)))


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
    """The score ``raw`` states: a number, or a quotient whose parts may be decimals (``Fraction`` alone refuses
    "0.5/1"); None for anything outside [0, 1] or unreadable."""
    try:
        # A decimal comma is a decimal point: the comma was read with the number only where a digit follows it.
        numerator, _, denominator = raw.replace(" ", "").replace(",", ".").partition("/")
        value = float(Fraction(numerator) / Fraction(denominator or "1"))
    except (ValueError, ZeroDivisionError):
        return None
    return value if 0.0 <= value <= 1.0 else None


def _json_reply(content: str) -> tuple[str, str | None] | None:
    """(analysis, score text) of a reply that is one JSON object with a ``score``; None for any other reply."""
    text = content.strip()
    fenced = _WHOLE_FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text.startswith("{"):
        return None
    try:
        data = loads_reply(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or "score" not in data:
        return None
    score = data["score"]
    raw = str(score).strip() if isinstance(score, int | float | str) and not isinstance(score, bool) else None
    return str(data.get("analysis") or "").strip(), raw


def parse_verification(content: str, *, truncated: bool = False) -> Verification:
    """The feedback and score of a verifier's reply; ``truncated``: the reply was cut at max_tokens, and only a
    whole JSON object can hold its verdict."""
    structured = _json_reply(content)
    if structured is not None:
        analysis, score = structured
        return _scored(analysis or content.strip(), score)
    if truncated:
        return Verification(feedback=content.strip(), score=None)
    raw: str | None = None
    # The verdict is in the "## Score" section where there is one: a score line above it is the analysis's.
    section = _SCORE_SECTION.search(content)
    matches = _SCORE_LINE.findall(content[section.start() :] if section else content)
    if matches:
        raw = matches[-1]
    elif section:
        boxed = last_boxed(section.group(1))
        lone = _LONE_SCORE.fullmatch(section.group(1))
        raw = boxed.strip() if boxed else lone.group(1) if lone else None
    return _scored(content.strip(), raw)


def _scored(feedback: str, raw: str | None) -> Verification:
    value = _value(raw) if raw is not None else None
    if value is None:
        return Verification(feedback=feedback, score=None)
    nearest = min(SCALE, key=lambda point: (abs(point - value), point))
    return Verification(feedback=feedback, score=nearest, snapped=nearest != value)
