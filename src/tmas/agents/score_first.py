"""The verifier's score-first variant (``verifier_score = "logprob"``): one short reply that opens with
``Score: S`` on a one-digit scale (2 = fully correct, 1 = partially correct, 0 = fatal error), then a reason.

The score is read from the log-probabilities of the digit token: the expected score over the candidate digits, so
one short call gives a graded judgement where text sampling needs many essays. When the server sent no
log-probabilities (or none at a score position), the sampled digit itself is the score (``source = "text"``).
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel

from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.llm.reasoning import answer_logprobs
from tmas.llm.types import Message, TokenLogprob

# The one-token digits of the prompt's scale and the score each stands for on TMAS's 0 / 0.5 / 1 scale.
DIGIT_SCORES = {"0": 0.0, "1": 0.5, "2": 1.0}
# What precedes the score digit: "Score:", "**Score:** ", "score =", "Score (0-2):". Only spacing, emphasis, ':', '='
# or '$' stand between the label (with the scale it may restate in brackets) and the digit: the "0" of "Score (0-2)"
# and the "1" of "Score: -1" are no grade.
_LABEL = r"\bscore(?:\s*[(\[][^()\[\]\n]*[)\]])?[\s*_:=$`]*"
# The prefix of the reply so far ends with the label.
_BEFORE_DIGIT = re.compile(_LABEL + "$", re.I)
# The text form: "Score: S" with a lone digit of the scale (not "0.5", not "10").
_SCORE_TEXT = re.compile(_LABEL + r"([0-2])(?![\d.,/]*\d)", re.I)


class ScoredVerification(BaseModel):
    feedback: str
    # Expected score on the 0..1 scale; None when the reply holds no score at all.
    score: float | None
    source: Literal["logprob", "text", "none"]
    # Renormalised probability of each digit at the score position (logprob source only).
    probabilities: dict[str, float] = {}


def score_first_prompt(question: str, solution: str, mode: str) -> list[Message]:
    return prompt("tmas_verify_score.j2", system_name=MATH_SYSTEM, question=question, solution=solution, mode=mode)


def expected_score(tokens: list[TokenLogprob]) -> tuple[float, dict[str, float]] | None:
    """E[s] at the first score position: sum over the digits d listed there of p(d) * value(d) / sum of p(d)
    (an expected verifier score, beyond the paper, whose verifier score is the parsed text).

    The sampled token and its ``top_logprobs`` alternatives are pooled by token text (each counted once); tokens
    that differ only by spacing (" 2" and "2") add up. Returns the expected score with the renormalised digit
    probabilities, or None when no token after a "Score:" is a digit of the scale, or its probability mass is 0.
    """
    prefix = ""
    for position in tokens:
        digit = position.token.strip()
        if digit in DIGIT_SCORES and _BEFORE_DIGIT.search(prefix):
            listed = {alt.token: alt.logprob for alt in position.top_logprobs}
            listed.setdefault(position.token, position.logprob)
            mass: dict[str, float] = {}
            for token, logprob in listed.items():
                key = token.strip()
                if key in DIGIT_SCORES and math.isfinite(logprob):
                    mass[key] = mass.get(key, 0.0) + math.exp(logprob)
            total = sum(mass.values())
            if total <= 0.0:
                return None
            probabilities = {d: p / total for d, p in sorted(mass.items())}
            return sum(p * DIGIT_SCORES[d] for d, p in probabilities.items()), probabilities
        prefix += position.token
    return None


def parse_score_first(content: str, logprobs: list[TokenLogprob] | None, reasoning: str = "") -> ScoredVerification:
    """The verification of a score-first reply: its ``content`` (its thinking split off as ``reasoning``) and the
    log-probabilities of its tokens, of which only the answer's count: a grade the thinking weighed is not the
    reply's."""
    feedback = content.strip()
    if logprobs and reasoning:
        logprobs = answer_logprobs(logprobs, content)
    found = expected_score(logprobs) if logprobs else None
    if found is not None:
        return ScoredVerification(feedback=feedback, score=found[0], source="logprob", probabilities=found[1])
    match = _SCORE_TEXT.search(content)
    if match is None:
        return ScoredVerification(feedback=feedback, score=None, source="none")
    return ScoredVerification(feedback=feedback, score=DIGIT_SCORES[match.group(1)], source="text")
