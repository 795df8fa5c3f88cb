"""An iteration's method state as the store keeps it (``IterationRecord.state``), typed: each method declares its
``State`` model beside its ``Params`` (``Method.State``), and readers validate a stored state through the model
they need instead of reading keys by name: the banks through :class:`BankState`, which every method that keeps
TMAS's banks extends (``tmas rl build-data`` reads runs of such methods only). Keys a model does not name are kept,
so runs stored before a field was added read as they were written."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tmas.agents.mattrl_decision import Decision
from tmas.memory.experience_bank import ExperienceBank
from tmas.memory.guideline_bank import GuidelineBank
from tmas.memory.transcript import Transcript
from tmas.store.records import Fallback


class MethodState(BaseModel):
    """A state with no fields of its own (a method that keeps none)."""

    model_config = ConfigDict(extra="allow")

    def stored(self) -> dict[str, Any]:
        """As the store keeps it (``IterationRecord.state``): the fields the iteration set (a field left unset is no
        key, as a stop or a fallback that did not happen), each whole."""
        return {k: v for k, v in self.model_dump(mode="json").items() if k in self.model_fields_set}


class FallbackState(MethodState):
    """The state of a method whose answer may fall back to an earlier iteration's (``answer_fallback``): the fallback
    this iteration took, where it took one (the closing step of ``tmas.methods.steps`` sets it)."""

    answer_fallback: Fallback | None = None


class BankState(MethodState):
    """The state of a method that keeps TMAS's banks: the experience bank E_t and guideline bank G_t after the
    iteration (read by the report's analyses, the viewer's bank changes and ``tmas rl build-data``)."""

    experience_bank: ExperienceBank = Field(default_factory=ExperienceBank)
    guideline_bank: GuidelineBank = Field(default_factory=GuidelineBank)


class EarlyStop(BaseModel):
    """Why TMAS stopped a settled problem after an iteration (``early_stop``): the iteration, the reason in words,
    and the readings that settled it."""

    iteration: int
    reason: str
    agreement: float
    lowest_verification: float | None = None
    mean_score: float = 0.0


class TMASState(BankState, FallbackState):
    """TMAS's state after iteration t (Algorithm 1)."""

    # Each candidate's mode: explore (a strategy asked for) or exploit.
    modes: list[str] = Field(default_factory=list)
    # Mean verification score of the iteration's candidates, and the share that gives the most common answer (proof
    # mode: the share that wrote a proof).
    mean_score: float = 0.0
    agreement: float = 0.0
    # What each memory agent's update did (or ``{"status": "skipped"}``).
    experience_update: dict[str, Any] = Field(default_factory=dict)
    guideline_update: dict[str, Any] = Field(default_factory=dict)
    # Handled bad agent outputs by kind.
    anomalies: dict[str, int] = Field(default_factory=dict)
    # Why the problem stopped here (``early_stop``); the earlier answer returned when this pool had none is
    # ``answer_fallback`` (FallbackState).
    early_stop: EarlyStop | None = None


class SeatRecord(BaseModel):
    """One MATTRL team member after a round: its answer, and whether it accepted the others' and converged."""

    id: str
    answer: str | None = None
    accepted: bool | None = None
    converged: bool | None = None
    # Whether it gave a usable opinion this round: False when its opinion call failed (it then neither converges nor
    # is reviewed); None when it had converged before the round and was not asked.
    spoke: bool | None = None


class MATTRLState(MethodState):
    """MATTRL's state after a round: the discussion so far (experience construction and the pool read it), the
    seats, and the decision of the last round (medicine: its ranked differential, which diagnosis grading reads).
    Education's teaching records the pre- and post-test instead of seats and decision."""

    round: int | None = None
    members: list[SeatRecord] = Field(default_factory=list)
    transcript: Transcript | None = None
    decision: Decision | None = None
    teaching: Literal["team", "single"] | None = None
    pre: str | None = None
    pre_correct: bool | None = None
    post: str | None = None
    post_correct: bool | None = None
    # The pre-test was right (or there was nothing to teach toward): no dialogue, the post-test is the pre-test.
    skipped: bool | None = None
