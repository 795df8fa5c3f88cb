"""TMAS's memory banks: the experience bank (low-level, verifier-backed signals) and the guideline bank (the log of
high-level strategies tried). Each is a small typed value with pure functions that apply an agent's update to it."""

from tmas.memory.experience_bank import (
    ExperienceBank,
    ExperienceEntry,
    ExperienceOp,
    ExperienceReport,
    apply_experience_ops,
)
from tmas.memory.guideline_bank import (
    GuidelineBank,
    GuidelineReport,
    Strategy,
    StrategyClassification,
    apply_strategy_classifications,
)
from tmas.memory.similarity import jaccard, word_set

__all__ = [
    "ExperienceBank",
    "ExperienceEntry",
    "ExperienceOp",
    "ExperienceReport",
    "GuidelineBank",
    "GuidelineReport",
    "Strategy",
    "StrategyClassification",
    "apply_experience_ops",
    "apply_strategy_classifications",
    "jaccard",
    "word_set",
]
