"""The solution agent A_sol (paper eq. 1): generation (t = 0), exploit (refine) and explore prompts, and its parser.

The generation prompt is also every other method's first sample (cot, majority, self_refine, verify_refine, pacore,
rse), so methods differ only in what they do after it.

Numeric mode (the official ``--no_proof``): the final answer is the last ``\\boxed{}``; without one, an explicit
final-answer statement ("Final answer: X", "The answer is X"), and ``extraction`` says which it was. Proof mode: the
text under ``## Solution`` is the solution; when the heading is missing, the whole reply is used and ``has_section``
says so.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel

from tmas.agents.rollouts import RolloutView
from tmas.agents.style import Style
from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.answers import ExtractionSource, extract_answer
from tmas.llm.types import Message
from tmas.memory.experience_bank import ExperienceBank
from tmas.memory.guideline_bank import Strategy

SolutionPrompt = Literal["generate", "refine", "explore"]
_SECTION = re.compile(r"^#{1,6}\s*Solution\s*:?\s*$", re.I | re.M)


class SolutionOutput(BaseModel):
    # What later agents see: the reply's final content (the section under "## Solution" when there is one).
    text: str
    answer: str | None
    # Numeric mode: where the answer came from ("none" in proof mode, where there is no answer to extract).
    extraction: ExtractionSource = "none"
    has_section: bool


def generation_prompt(question: str, mode: str, style: Style = "paper") -> list[Message]:
    """The first sample of every method (TMAS's iteration 0, explore without a guideline bank): the problem alone."""
    return prompt("tmas_generate.j2", system_name=MATH_SYSTEM, question=question, mode=mode, style=style)


def refine_prompt(
    question: str,
    mode: str,
    rollouts: list[RolloutView],
    experience: ExperienceBank | None,
    style: Style = "paper",
) -> list[Message]:
    """Exploit, z = 0: A_sol(Q, R_{t-1}, E_{t-1}); ``experience`` None leaves the experience context out (ablation)."""
    return prompt(
        "tmas_refine.j2",
        system_name=MATH_SYSTEM,
        question=question,
        mode=mode,
        rollouts=rollouts,
        experience=experience,
        style=style,
    )


def explore_prompt(question: str, mode: str, strategies: list[Strategy], style: Style = "paper") -> list[Message]:
    """Explore, z = 1: A_sol(Q, G_{t-1}), the generation prompt with the guideline constraint appended."""
    return prompt(
        "tmas_explore.j2", system_name=MATH_SYSTEM, question=question, mode=mode, strategies=strategies, style=style
    )


def parse_solution(content: str, mode: str) -> SolutionOutput:
    matches = list(_SECTION.finditer(content))
    has_section = bool(matches)
    text = content.strip()
    if mode == "proof" and matches:
        text = content[matches[-1].end() :].strip() or text
    if mode != "numeric":
        return SolutionOutput(text=text, answer=None, has_section=has_section)
    answer, source = extract_answer(content)
    return SolutionOutput(text=text, answer=answer, extraction=source, has_section=has_section)
