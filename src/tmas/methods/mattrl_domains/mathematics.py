"""MATTRL's math domain (paper 003, section 3 and appendix B): a freely recruited team with one leader, boxed
answers, B.4's peer reviews with verdicts, and a decision in ``<final_answer>``; graded by its answer."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from tmas.agents.mattrl_decision import Decision, parse_final_answer
from tmas.agents.templates import MATH_SYSTEM
from tmas.answers import extract_answer, final_boxed
from tmas.methods.mattrl_deliberation import PeerReview, VerdictReview
from tmas.methods.mattrl_domains.domain import Domain

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_LATEX = re.compile(r"\\[A-Za-z]+")
_OPERATORS = re.compile(r"[=+\-*/^<>≤≥]")
_TOPICS = {
    "proof": ("prove", "show that", "justify"),
    "counting": ("how many", "number of ways", "count"),
    "probability": ("probability", "expected", "random"),
    "geometry": ("triangle", "circle", "angle", "polygon", "area"),
    "number_theory": ("prime", "divisible", "remainder", "mod", "integer"),
}


class Mathematics(Domain):
    name: ClassVar[str] = "math"
    line_up: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("Problem analyst", "leader", "Restate the problem, fix the notation and drive the main line of attack."),
        ("Computation checker", "verifier", "Recompute every numeric and algebraic step independently."),
        ("Edge-case auditor", "critic", "Look for missed cases, boundary values and counterexamples."),
    )
    # The solvers' system text of every method, so every call about the problem shares one prefix (prefix caches).
    system_name: ClassVar[str | None] = MATH_SYSTEM
    review: ClassVar[type[PeerReview] | None] = VerdictReview

    def opinion_answer(self, content: str) -> str | None:
        """The boxed (or "final answer:") value, as every method's solutions state it."""
        return extract_answer(content).answer

    def parse_decision(self, content: str) -> Decision | None:
        return parse_final_answer(content)

    def decision_fallback(self, content: str) -> str | None:
        """The reply's final boxed answer (:func:`tmas.answers.final_boxed`: boxes joined by "or" give both, a hedge,
        not the last alone)."""
        return final_boxed(content)

    def case_features(self, question: str, metadata: Mapping[str, Any]) -> dict[str, float]:
        """Size, quantities, notation density, and topic flags."""
        text = question.lower()
        words = text.split()
        features = {
            "log_chars": math.log1p(len(question)),
            "log_words": math.log1p(len(words)),
            "numbers": float(len(_NUMBER.findall(question))),
            "latex_commands": float(len(_LATEX.findall(question))),
            "operators": float(len(_OPERATORS.findall(question))),
            "sentences": float(max(1, question.count(".") + question.count("?"))),
        }
        for topic, cues in _TOPICS.items():
            features[f"topic_{topic}"] = float(any(cue in text for cue in cues))
        return features
