"""The confidence parameters majority vote and TMAS share (beyond their papers: DeepConf, Fu et al. 2025): whether
solution calls ask for token log-probabilities, and how the confidence rules of ``select`` read them (measures:
methods/confidence.py; rules: methods/selection.py).

A confidence rule, or ``confidence = true`` alone (to record the measures, e.g. to compare rules afterwards), makes
every solution call ask for ``logprobs: true, top_logprobs: confidence_top_logprobs``. Against a server that sends
none, each candidate's confidence stays empty, the rules vote plainly, and the run says so once
(:data:`CONFIDENCE_NOTICE`).
"""

from __future__ import annotations

from pydantic import Field

from tmas.config import Sampling
from tmas.methods.base import Candidate, MethodParams, ProblemSession
from tmas.methods.confidence import ConfidenceMeasure
from tmas.methods.selection import CONFIDENCE_RULES, ConfidenceVote, lacks_confidence

CONFIDENCE_NOTICE = (
    "the server sent no token log-probabilities with the solution replies: no confidence recorded, and the"
    " confidence rules counted plain votes instead"
)
ANSWER_ONLY_NOTICE = (
    "the server sent token log-probabilities for the solution replies' answers but not their reasoning: the"
    " confidence is the answer's alone, not the whole trace's that DeepConf scores"
)


class ConfidenceParams(MethodParams):
    confidence: bool = Field(
        default=False,
        description="ask solution calls for log-probabilities and record each candidate's confidence (DeepConf,"
        " Fu et al. 2025); on with a confidence rule",
    )
    confidence_measure: ConfidenceMeasure = Field(
        default="tail",
        description="the DeepConf measure a confidence rule reads: lowest_group, tail (the last window's mean) or mean",
    )
    # DeepConf used 2048-token windows over thinking traces of tens of thousands of tokens; a shorter reply is one
    # window, where the three measures agree.
    confidence_window: int = Field(
        default=2048, ge=1, description="tokens per sliding group and in the tail, and online_stop's window (DeepConf)"
    )
    # k of DeepConf's token confidence. The paper read 20; 5 keeps each reply's payload (and its copy in the run
    # store) several times smaller, and the rules only compare a problem's traces, all measured with the same k.
    confidence_top_logprobs: int = Field(
        default=5, ge=2, le=20, description="top_logprobs asked per token: the k of DeepConf's token confidence"
    )
    confidence_share: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="filtered_vote: the most confident share eta that votes (DeepConf: 0.1 and 0.9)",
    )

    def asks_confidence(self, rule: str) -> bool:
        """Whether the solution calls ask for log-probabilities under the selection ``rule``."""
        return self.confidence or rule in CONFIDENCE_RULES

    def confidence_sampling(self, rule: str) -> Sampling | None:
        """The per-call request for log-probabilities (None when nothing asks for them: the request is unchanged)."""
        if not self.asks_confidence(rule):
            return None
        return Sampling(extra_body={"logprobs": True, "top_logprobs": self.confidence_top_logprobs})

    def confidence_vote(self) -> ConfidenceVote:
        return ConfidenceVote(measure=self.confidence_measure, share=self.confidence_share)


def note_missing_confidence(session: ProblemSession, candidates: list[Candidate], notes: list[str]) -> bool:
    """When answered candidates came back without log-probabilities, or with their answer's alone: a note for the
    iteration record and, the first time, the run's one-line notice. True when some were missing."""
    partial = sum(1 for c in candidates if c.confidence is not None and c.confidence.answer_only)
    if partial:
        notes.append(
            f"{partial} candidates' confidence covers their answer alone: no log-probabilities of the reasoning"
        )
        session.notice("confidence_answer_only", ANSWER_ONLY_NOTICE)
    if not lacks_confidence(candidates):
        return False
    missing = sum(1 for c in candidates if c.error is None and c.answer is not None and c.confidence is None)
    notes.append(f"{missing} answered candidates came without log-probabilities: confidence rules vote plainly")
    session.notice("confidence", CONFIDENCE_NOTICE)
    return True
