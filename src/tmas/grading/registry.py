"""The graders by name: what ``tmas eval --grade``, ``tmas report --grade`` and a pool's ``grade_mode`` accept;
``tmas cases grade`` uses ``diagnosis`` and ``teaching``, RL's rewards ``rules`` (:meth:`Grader.grade_one`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from tmas.errors import ConfigError
from tmas.grading.combined import CombinedGrader
from tmas.grading.diagnosis import DiagnosisGrader
from tmas.grading.grader import Grader
from tmas.grading.judge import JudgeGrader
from tmas.grading.rules import RULES, RulesGrader
from tmas.grading.teaching import TeachingGrader

GRADERS: dict[str, Grader] = {
    g.name: g for g in (CombinedGrader(), RulesGrader(), JudgeGrader(), DiagnosisGrader(), TeachingGrader())
}
# What a run's stored verdicts are read as when it holds none of the asked grader's own.
DEFAULT_GRADER = RULES


def grader_named(name: str) -> Grader:
    grader = GRADERS.get(name)
    if grader is None:
        raise ConfigError(f"unknown grader {name!r} (known: {', '.join(GRADERS)})")
    return grader


def _known(name: str) -> str:
    if name not in GRADERS:
        raise ValueError(f"unknown grader {name!r} (known: {', '.join(GRADERS)})")
    return name


# A grader's name in a pydantic model (a pool's ``grade_mode``), checked when the model is read.
GradeMode = Annotated[str, AfterValidator(_known)]
