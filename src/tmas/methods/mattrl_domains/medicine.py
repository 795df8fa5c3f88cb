"""MATTRL's medicine domain (paper 003, section 4 and appendix A): a team of Table 7's departments with one leader,
strict top-10 differentials critiqued by peers (A.4), a decision in ``<top10>``; graded by the rank of the gold
diagnosis (Hit@k, MRR), which is also the pool's outcome (its reciprocal rank)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from tmas.agents.mattrl_decision import Decision, parse_top10
from tmas.agents.mattrl_opinion import top_diagnosis
from tmas.agents.mattrl_team import MEDICINE_CATALOG
from tmas.methods.mattrl_deliberation import DifferentialCritique, PeerReview
from tmas.methods.mattrl_domains.domain import Domain

# Cue words of the organ systems a finding may belong to (each roughly a department of Table 7).
_SYSTEMS = {
    "neuro": ("seizure", "neuro", "ataxia", "hypotonia", "intellectual", "developmental delay", "brain", "nerve"),
    "cardio": ("cardi", "heart", "arrhythm", "murmur", "aort", "vascular"),
    "renal": ("renal", "kidney", "protein", "hematuria", "nephr"),
    "skin": ("skin", "derma", "rash", "angiokeratoma", "hair", "nail"),
    "eye": ("eye", "ocular", "retina", "lens", "vision", "cornea", "optic"),
    "skeletal": ("skelet", "bone", "joint", "scoliosis", "stature", "vertebra", "limb", "arachnodactyly"),
    "digestive": ("liver", "hepat", "spleen", "gastro", "bowel", "diarrh", "vomit"),
    "blood": ("anemia", "anaemia", "platelet", "thrombocyt", "leuk", "bleeding", "hemat"),
    "lung": ("lung", "pulmon", "respirat", "cough", "dyspnea", "breath"),
    "endocrine": ("endocrin", "thyroid", "glucose", "diabet", "growth hormone", "puberty", "metabol"),
    "immune": ("immun", "infection", "fever", "autoimmun"),
    "ear": ("hearing", "deaf", "ear ", "otitis"),
}
_LABS = ("level", "elevated", "decreased", "serum", "urine", "gene", "mutation", "variant", "biopsy", "mri", "ct ")


class Medicine(Domain):
    name: ClassVar[str] = "medicine"
    catalog: ClassVar[tuple[str, ...]] = MEDICINE_CATALOG
    line_up: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("General Practice", "leader", "Weigh the whole record and keep the differential broad before narrowing."),
        ("Pathology", "consultant", "Tie each finding to the disease mechanisms that explain it."),
        ("Neurology", "consultant", "Check the neurological findings against the candidate diagnoses."),
    )
    review: ClassVar[type[PeerReview] | None] = DifferentialCritique
    # An opinion's answer is its top diagnosis, not a boxed value.
    answer_mode: ClassVar[str] = "medicine"
    grader: ClassVar[str | None] = "diagnosis"
    metrics: ClassVar[Mapping[str, str]] = {
        "hit@1": "Hit@1",
        "hit@3": "Hit@3",
        "hit@5": "Hit@5",
        "hit@10": "Hit@10",
        "mrr": "MRR",
    }
    metrics_note: ClassVar[str] = (
        "Hit@k: the share of cases whose gold disease is within the team's final top k; MRR: the mean of 1 / rank of"
        " the gold disease (0 where it is not in the top 10). Names match by spelling, then by the judge role (A.5"
        " rules) unless grading by rules alone."
    )
    # A near miss still earns part of the credit: 1 at rank 1, 1/3 at rank 3, 0 when absent.
    outcome: ClassVar[Literal["graded", "reciprocal_rank"]] = "reciprocal_rank"

    def opinion_answer(self, content: str) -> str | None:
        return top_diagnosis(content)

    def parse_decision(self, content: str) -> Decision | None:
        return parse_top10(content)

    def case_features(self, question: str, metadata: Mapping[str, Any]) -> dict[str, float]:
        """The paper's clinical cues: symptom complexity as the number of findings, the specialties involved as
        the organ systems the findings touch, the need for a team as findings in more than one system, and whether
        lab or genetic results are given."""
        text = f" {question.lower()} "
        findings = [f for f in re.split(r"[;,\n]", question) if f.strip()]
        systems = [name for name, cues in _SYSTEMS.items() if any(cue in text for cue in cues)]
        features = {
            "log_chars": math.log1p(len(question)),
            "findings": float(len(findings)),
            "systems": float(len(systems)),
            "multisystem": float(len(systems) > 1),
            "labs_or_genetics": float(sum(cue in text for cue in _LABS)),
        }
        for name in _SYSTEMS:
            features[f"system_{name}"] = float(name in systems)
        return features
