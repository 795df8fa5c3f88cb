"""What methods remember, below the methods that use it:

- TMAS's memory banks: the experience bank (low-level, verifier-backed signals) and the guideline bank (the log of
  high-level strategies tried), each a small typed value with pure functions that apply an agent's update to it;
- MATTRL's cross-problem experience pool (``pool``: entries, embeddings, index; ``pool_entry``) and its
  deliberation transcripts (``transcript``), which the pool is built from (building it is :mod:`tmas.pool`);
- the embedders the pool retrieves with (an endpoint, or all-MiniLM-L6-v2 offline in numpy), and the word-set
  similarity that drops near-duplicate entries."""

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
