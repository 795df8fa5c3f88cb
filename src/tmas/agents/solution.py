"""The solution agent A_sol (paper eq. 1): generation (t = 0), exploit (refine) and explore prompts, and its parser.

The generation prompt is also every other method's first sample (cot, majority, self_refine, verify_refine, pacore,
rse), so methods differ only in what they do after it.

Numeric mode (the official ``--no_proof``): the final answer is the last ``\\boxed{}``, unless a final-answer statement
after it restates the answer ("Final answer: X" after a boxed intermediate value); without a box, an explicit
final-answer statement ("Final answer: X", "The answer is X"); ``extraction`` says which it was. Proof mode: the
text under ``## Solution`` is the solution; when the heading is missing, the whole reply is used and ``has_section``
says so. Two readers of a reply: :func:`parse_solution` (TMAS: in numeric mode the whole reply is the solution) and
:func:`parse_section` (the baselines: in every mode the text under the last heading, so a refinement's feedback
written before its solution is left out).
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
    """Exploit, z = 0: A_sol(Q, R_{t-1}, E_{t-1}); ``experience`` None leaves the experience context out (ablation).
    With no ``rollouts`` (every candidate of t-1 failed) it is the generation task with the experience context."""
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


def solution_section(text: str) -> str:
    """What follows the last ``## Solution`` heading (the whole text without one): a reply minus its feedback."""
    matches = list(_SECTION.finditer(text))
    if not matches:
        return text.strip()
    return text[matches[-1].end() :].strip() or text.strip()


def parse_solution(content: str, mode: str) -> SolutionOutput:
    """TMAS's reading: the solution under the heading in proof mode, the whole reply in numeric mode."""
    has_section = _SECTION.search(content) is not None
    text = solution_section(content) if mode == "proof" else content.strip()
    if mode != "numeric":
        return SolutionOutput(text=text, answer=None, has_section=has_section)
    answer, source = extract_answer(content)
    return SolutionOutput(text=text, answer=answer, extraction=source, has_section=has_section)


def parse_section(content: str, mode: str) -> SolutionOutput:
    """The baselines' reading: as :func:`parse_solution`, but the text under the last heading in every mode (their
    refinement replies put feedback before the solution)."""
    return parse_solution(content, mode).model_copy(update={"text": solution_section(content)})
