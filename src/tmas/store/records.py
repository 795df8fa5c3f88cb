"""The records a run keeps of what its method did, typed: each problem's result (:class:`ProblemResult`) with a
record per iteration (:class:`IterationRecord`), their candidates (:class:`Candidate`, with what a candidate's call
and steps said of it: :class:`CandidateMeta`), and the reply counts per role (:class:`ReplyTally`).

Methods write them (through ``tmas.methods.base``, which re-exports them), the store keeps them as JSON, and
everything that reads a run (the report, the viewer, grading, the pool, RL data, a resumed TMAS) gets them back as
these same models from the store's reader (:func:`read_result`, :func:`read_iteration`): validated in that one place,
never read by key. Runs stored by earlier versions read through the same models: a field added later takes its
default, a renamed one is read under its old name too (a reply tally's ``fallback`` count and an extraction called
``fallback`` are ``stated`` now), and keys no model names are kept (``extra = "allow"``) where a reader may show them
(a candidate's meta).

An iteration's method state (``IterationRecord.state``) stays the method's own: each method declares its shape
(``Method.State``, ``tmas.methods.state``) and readers validate a stored state through it.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar, get_args

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
)

from tmas.answers import ExtractionSource
from tmas.errors import TmasError
from tmas.llm.types import Usage

ConfidenceMeasure = Literal["lowest_group", "tail", "mean"]
CONFIDENCE_MEASURES: tuple[ConfidenceMeasure, ...] = get_args(ConfidenceMeasure)


class Confidence(BaseModel):
    """One candidate's confidence measures (DeepConf's: ``tmas.methods.confidence``), over the ``tokens``
    positions that listed log-probabilities, with groups of ``window`` tokens."""

    mean: float
    lowest_group: float
    tail: float
    tokens: int
    window: int
    # The reply reasoned but the server listed log-probabilities for its answer's tokens alone: the measures are the
    # answer's, not the whole trace's that DeepConf scores (tmas.methods.confidence.reply_confidence).
    answer_only: bool = False

    def value(self, measure: ConfidenceMeasure | str) -> float:
        return float(getattr(self, measure))


class _Sparse(BaseModel):
    """A record whose fields are mostly unset: stored without the fields that are None, so a candidate's record
    keeps only what happened to it (as when it was a plain dict), and read back with None for each."""

    model_config = ConfigDict(extra="allow")

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class VerificationRecord(_Sparse):
    """One verification of a candidate: its score (None: the call failed or no score could be read) and call, and
    how the score was read (TMAS's ``verifier_score = "logprob"``: its source and the digits' probabilities; a
    score snapped to the scale; a reply cut at max_tokens, which text scoring does not score; the start of a reply
    whose score was unreadable)."""

    score: float | None = None
    call_id: int | None = None
    error: str | None = None
    source: str | None = None
    probabilities: dict[str, float] | None = None
    snapped: bool | None = None
    truncated: bool | None = None
    raw: str | None = None


class ReminderRecord(_Sparse):
    """A reply without an answer sent back once with a reminder of the required output
    (``tmas.methods.answer_reminder``): the first reply's call and text, then what the retry gave (its error, the
    instructions it echoed, or whether it answered)."""

    first_call_id: int | None = None
    first_reply: str | None = None
    error: str | None = None
    echo: str | None = None
    answered: bool | None = None


class CandidateMeta(_Sparse):
    """What a candidate's steps said of it (``tmas.methods.steps.solve_call`` and the method's own steps)."""

    # The prompt that wrote it (a method's own names: generate, refine, correct, round, synthesis, explore, ...) and,
    # for TMAS, its mode (explore / exploit / generate); MATTRL's teaching: the stage (pre / post).
    prompt: str | None = None
    mode: str | None = None
    stage: str | None = None
    # Numeric mode: where its answer came from (a box, a final-answer statement, or none).
    extraction: ExtractionSource | None = None
    # Proof mode: no "## Solution" heading, the whole reply taken; the reply was cut at max_tokens.
    no_solution_heading: bool | None = None
    truncated: bool | None = None
    # What of the reply echoed the prompt's instructions: on the first try (asked again), on both (unusable).
    echo_retry: str | None = None
    echo: str | None = None
    # The budget stop that refused the echo's retry: the candidate is the first reply, which echoed (``echo``).
    retry_refused: str | None = None
    # Why a watched reply was stopped while it streamed (online stopping), and how the sample was watched.
    stopped_early: str | None = None
    online_stop: Literal["warmup", "watched"] | None = None
    reminder: ReminderRecord | None = None
    # A refinement without an answer: its trajectory went on from its previous solution, the one written in iteration
    # ``carried_from`` (same index), which is the trajectory's solution at this iteration: it, not this reply, votes
    # (and counts in Pass@1) here; a refinement whose echo retry the budget refused (``retry_refused``) is carried
    # the same way. Runs stored before ``carried_from`` have ``kept_previous`` alone. A trajectory
    # whose call a budget stop refused has no candidate here: its record's ``held_over`` names it.
    kept_previous: bool | None = None
    carried_from: int | None = None
    # No verification ran: the budget stopped them before any did, or (TMAS) the reply held no solution text.
    unverified: bool | None = None
    verifications: list[VerificationRecord] | None = None
    # TMAS: the summary agent's summary of it, and that call.
    summary: str | None = None
    summary_call_id: int | None = None
    # MATTRL: the seat that said it, where the seat stands after the round, the pool entries its opinion used, and
    # (medicine) its ranked differential.
    member: str | None = None
    specialty: str | None = None
    round: int | None = None
    accepted: bool | None = None
    converged: bool | None = None
    experience_ids: list[str] | None = None
    top10: list[str] | None = None

    @field_validator("extraction", mode="before")
    @classmethod
    def _stated(cls, value: Any) -> Any:
        # Earlier versions called an answer read from a final-answer statement a fallback.
        return "stated" if value == "fallback" else value


class Candidate(BaseModel):
    index: int
    # Empty in a result's summary (tmas.store.summaries), which keeps no texts.
    text: str = ""
    answer: str | None = None
    # Method's own score of the candidate (TMAS: mean verifier score); None when the method has none.
    score: float | None = None
    call_id: int | None = None
    usage: Usage = Field(default_factory=Usage)
    finish_reason: str | None = None
    error: str | None = None
    # How sure the model was of the reply, from its token log-probabilities (DeepConf's measures: see
    # methods/confidence.py); None unless the method asked for them and the server sent them.
    confidence: Confidence | None = None
    meta: CandidateMeta = Field(default_factory=CandidateMeta)

    @field_validator("meta", mode="before")
    @classmethod
    def _no_meta(cls, value: Any) -> Any:
        return CandidateMeta() if value is None else value


class ReplyTally(BaseModel):
    """One role's replies in one iteration: how many arrived, were cut at max_tokens, held nothing usable (no
    extractable answer, no readable score, an invalid update), gave their answer only in a final-answer statement
    (no box), or echoed their prompt's instructions (:mod:`tmas.agents.echo`; each echo is asked again once)."""

    replies: int = 0
    truncated: int = 0
    unusable: int = 0
    # Stored as ``fallback`` by earlier versions.
    stated: int = Field(default=0, validation_alias=AliasChoices("stated", "fallback"))
    echo: int = 0

    def __add__(self, other: ReplyTally) -> ReplyTally:
        return ReplyTally(
            replies=self.replies + other.replies,
            truncated=self.truncated + other.truncated,
            unusable=self.unusable + other.unusable,
            stated=self.stated + other.stated,
            echo=self.echo + other.echo,
        )


class Fallback(BaseModel):
    """An answer taken from an earlier iteration because the candidates the rule chose from held no answered one
    (numeric mode), or no usable one (proof mode) (``tmas.methods.selection.select_answered``): the iteration and
    candidate it came from, and why."""

    iteration: int
    candidate: int
    answer: str | None = None
    reason: str


class Selection(BaseModel):
    """The candidate a method returned after an iteration, as the method chose it: where it is (this iteration's, or
    an earlier one's), and whether the answer fallback took it. Readers (the report's table of selection rules) read
    it here and never choose again; records stored before it existed have none (their ``selected`` answer stands)."""

    iteration: int
    candidate: int
    fallback: bool = False


class IterationRecord(BaseModel):
    problem_id: str
    iteration: int
    candidates: list[Candidate]
    # The answer the method would return if it stopped after this iteration.
    selected: str | None = None
    # The candidate that answer is (None: a method whose answer is no candidate's, e.g. MATTRL's decision).
    selection: Selection | None = None
    # Every call of the iteration, all roles.
    calls: int = 0
    failed_calls: int = 0
    usage: Usage = Field(default_factory=Usage)
    # Method state after the iteration, as the method's ``State`` model stores it (e.g. TMAS's banks).
    state: dict[str, Any] = Field(default_factory=dict)
    # Bad agent outputs that were handled, truncations, and other things worth knowing.
    notes: list[str] = Field(default_factory=list)
    # Successful replies per role, with how many were truncated or unusable.
    replies: dict[str, ReplyTally] = Field(default_factory=dict)
    # An iteration a budget stop cut short in Self-Refine or Verify-Refine: the trajectories whose call the stop
    # refused (no candidate of theirs here). Each holds on the solution it held at the iteration before, which votes
    # here in its place (``tmas.methods.selection.held``); Pass@1 (``tmas.reports.metrics.held_at``) counts the calls
    # that came back alone, a held-over solution being no rollout of this iteration. None: no trajectory was refused,
    # or the method's candidates are no trajectories (TMAS and the others), or a record stored before this existed.
    held_over: list[int] | None = None


# A result's ``stopped_reason`` when its budget ended it (``ProblemSession.budget_stopped``).
BUDGET_STOP = "budget"
# Status of a stand-in result: a problem with iterations in the store but no result (stopped or still going).
RUNNING = "running"


class ProblemResult(BaseModel):
    problem_id: str
    method: str
    answer: str | None = None
    text: str = ""
    status: str = "done"
    error: str | None = None
    stopped_reason: str | None = None
    iterations: list[IterationRecord] = Field(default_factory=list)
    calls: int = 0
    failed_calls: int = 0
    usage: Usage = Field(default_factory=Usage)
    # Handled anomalies by kind (e.g. TMAS's bad agent outputs), summed over iterations for the run summary.
    counters: dict[str, int] = Field(default_factory=dict)
    # Set when the answer is not from the last iteration's pool, which held no answered candidate (numeric mode).
    fallback: Fallback | None = None
    # One-line notices about the run this problem raised (e.g. confidence rules without log-probabilities), each once;
    # the run store keeps each kind once for the whole run (``RunStore.notices``).
    notices: list[str] = Field(default_factory=list)
    # Under a pooled token budget: the tokens this problem drew past its own share (see ``TokenBank``).
    budget_drawn: int = 0
    # Samples stopped while they streamed (online stopping: methods/online_stop.py), and the completion tokens that
    # saved, estimated from the problem's samples that ran to their end.
    stopped_traces: int = 0
    stopped_tokens_saved: int = 0
    # The method and parameters (and budget) it was solved with, as a resumed run compares them (runner.py).
    fingerprint: str | None = None

    @property
    def in_progress(self) -> bool:
        """A stand-in for a problem with finished iterations and no result yet (:func:`running_result`)."""
        return self.status == RUNNING

    @property
    def last(self) -> IterationRecord | None:
        """The last finished iteration's record."""
        return self.iterations[-1] if self.iterations else None


def running_result(problem_id: str, method: str, iterations: list[IterationRecord]) -> ProblemResult:
    """The stand-in result of a problem stopped or still going: its finished iterations, with their calls and
    tokens as its own (``status = "running"``)."""
    usage = Usage()
    for record in iterations:
        usage = usage + record.usage
    return ProblemResult(
        problem_id=problem_id,
        method=method,
        status=RUNNING,
        answer=iterations[-1].selected if iterations else None,
        iterations=iterations,
        calls=sum(r.calls for r in iterations),
        failed_calls=sum(r.failed_calls for r in iterations),
        usage=usage,
    )


class UnreadableRecord(TmasError, ValueError):
    """A stored record that no layout reads (not JSON, or not a record): one line saying where and what, as every
    command that reads the run says it (not a :class:`tmas.store.database.StoreError`, which readers such as the
    viewer take for a run still being created)."""

    exit_code = 2


_Record = TypeVar("_Record", ProblemResult, IterationRecord)


def stored_json(stored: str | bytes, where: str, what: str = "") -> Any:
    """A stored JSON value that is no record (a setting, a problem's metadata, a call's texts), as ``json.loads``
    reads it; one edited into something that is not JSON is an :class:`UnreadableRecord`: ``where`` "is not JSON",
    then ``what`` and JSON's own words."""
    try:
        return json.loads(stored)
    except json.JSONDecodeError as exc:
        raise UnreadableRecord(f"{where} is not JSON ({what}{exc.msg} at character {exc.pos})") from None


def _read(model: type[_Record], stored: str | bytes, where: str) -> _Record:
    try:
        return model.model_validate(json.loads(stored))
    except json.JSONDecodeError as exc:
        raise UnreadableRecord(f"{where}: not JSON ({exc.msg} at character {exc.pos})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        at = ".".join(map(str, first["loc"])) or "the record"
        raise UnreadableRecord(f"{where}: unreadable at {at}: {first['msg']}") from None


def read_result(stored: str | bytes, where: str = "a stored result") -> ProblemResult:
    """A stored result, of this version's layout or an earlier one's: the one place a result is validated (a record
    no layout reads is an :class:`UnreadableRecord` naming ``where``)."""
    return _read(ProblemResult, stored, where)


def read_iteration(stored: str | bytes, where: str = "a stored iteration record") -> IterationRecord:
    """A stored iteration record, of this version's layout or an earlier one's."""
    return _read(IterationRecord, stored, where)
