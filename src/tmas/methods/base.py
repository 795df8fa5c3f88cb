"""The interface every method shares, and the records it emits.

A method runs one problem for T iterations and emits one :class:`IterationRecord` per iteration with every candidate,
its extracted answer, its score and its token cost, so evaluation, budgets, reports and the viewer treat every
method the same way.
"""

from __future__ import annotations

import asyncio
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Annotated, Any, ClassVar, Generic, Self, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tmas.answer_classes import EquivalenceCheck, answer_classes
from tmas.config import Budget, Sampling
from tmas.llm.model import ChatModel, spent_before
from tmas.llm.replay import StoreReplay, store_replay
from tmas.llm.replica import MESSAGE_TEMPLATE_TOKENS
from tmas.llm.sampling import (
    DERIVED_SEED,
    ResolvedSampling,
    derived_base,
    earlier_configured_seeds,
    earlier_derived_seed,
    for_sample,
    retried,
)
from tmas.llm.types import CallKey, ChainKey, Completion, Lane, Message, Usage
from tmas.llm.watch import UNWATCHED_NOTICE, TraceWatch
from tmas.methods.call_count import CallCount
from tmas.methods.state import MethodState
from tmas.methods.traits import DEFAULT_TRAITS, Traits
from tmas.problems import Problem
from tmas.store.records import (
    BUDGET_STOP,
    Candidate,
    CandidateMeta,
    Fallback,
    IterationRecord,
    ProblemResult,
    ReplyTally,
    Selection,
)
from tmas.store.run_store import RunStore

# The records a method emits are the store's (tmas.store.records); methods import them from here.
__all__ = [
    "BUDGET_STOP",
    "STORED_RUN",
    "BudgetExhausted",
    "Candidate",
    "CandidateMeta",
    "Fallback",
    "IterationRecord",
    "Iterations",
    "Method",
    "MethodParams",
    "ProblemResult",
    "ProblemSession",
    "ReplyTally",
    "Selection",
    "TokenBank",
    "gather_all",
    "gather_finished",
    "gather_pair",
    "read_as_stored",
    "truncation_warnings",
]


# Above this share of a role's replies cut at max_tokens, the run warns: a cut solution has no answer and scores 0, a
# cut verifier or memory reply is unusable. Usually max_tokens is too small for the model (a thinking model needs
# tens of thousands of tokens; the `paper` preset asks for 128K).
TRUNCATION_WARN_SHARE = 0.10


def truncation_warnings(replies: Mapping[str, tuple[int, int]], threshold: float = TRUNCATION_WARN_SHARE) -> list[str]:
    """One line per role whose share of truncated replies passes ``threshold``; ``replies`` maps a role to
    (successful replies, of them cut at max_tokens)."""
    out = []
    for role, (n, cut) in sorted(replies.items()):
        if n and cut / n > threshold:
            out.append(
                f"{role}: {cut} of {n} replies ({100 * cut / n:.1f}%) were cut at max_tokens;"
                " raise max_tokens for this role (or the model's context window)"
            )
    return out


class BudgetExhausted(Exception):
    """Raised by :meth:`ProblemSession.chat` instead of sending a call once the problem's budget is spent.

    A method may catch it to keep what it finished (e.g. the candidates of the current iteration); otherwise the
    runner ends the problem with the iterations recorded so far and ``stopped_reason = "budget"``.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


# Characters a token at most in a prompt's guess for a budget that counts prompts (ProblemSession._prompt_guess).
BUDGET_CHARS_PER_TOKEN = 3.0


class TokenBank:
    """A pooled token budget (``budget.pool``): the tokens finished problems left unused, for problems still open.

    A problem that has spent its own ``budget.tokens`` draws up to that much again from the bank before its budget
    refuses a call (not where its call budget refuses it: no draw lets that call go), so the tokens a settled
    problem saved reach several open problems rather than the first one alone; when it finishes, what it did not
    spend of its share and its draws goes back. The run never spends more
    than its problems' shares together (and one call each, as for any token budget). With more than one problem
    in flight, which open problem gets them depends on the order they finish in.
    """

    def __init__(self, left: int = 0) -> None:
        self.left = left

    def deposit(self, tokens: int) -> None:
        """Return a finished problem's unused tokens (negative: what its calls in flight spent past its limit)."""
        self.left += tokens

    def draw(self, wanted: int) -> int:
        """Take up to ``wanted`` tokens; what was taken."""
        taken = max(0, min(wanted, self.left))
        self.left -= taken
        return taken


# T, the iterations (rounds) a problem runs. Declared here once; a method's parameters restate the field only to set
# its own default (``iterations: Iterations = 20``): pydantic takes a field's default from the class that declares it.
Iterations = Annotated[int, Field(ge=1)]


# The validation context key of a stored run's parameters read back (:meth:`MethodParams.as_stored`).
STORED_RUN = "stored_run"


def read_as_stored(info: ValidationInfo) -> bool:
    """Whether parameters are validated as a stored run's, read back as it ran (:meth:`MethodParams.as_stored`): a
    check of values given now that was added after runs were stored lets them through."""
    return isinstance(info.context, dict) and bool(info.context.get(STORED_RUN))


class MethodParams(BaseModel):
    """Base of each method's parameters; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")
    # Old name -> current name of each parameter the method renamed: the old name still works, and a run that uses
    # it raises a one-line notice (:meth:`notices`).
    renamed: ClassVar[dict[str, str]] = {}
    # Parameter -> the value runs stored before it existed ran with, where that is not its default (a behaviour added
    # later, on by default): readers of stored runs (:func:`tmas.methods.stored_params`) replay those runs as they ran.
    before_added: ClassVar[dict[str, Any]] = {}

    # Why the method cannot take mode=proof, where it cannot (None: it can).
    proof_refused: ClassVar[str | None] = None

    iterations: Iterations = 1
    mode: str = Field(default="numeric", pattern="^(numeric|proof)$")
    # The old names these parameters were given by.
    _old_names: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _current_names(cls, data: Any, handler: ModelWrapValidatorHandler[MethodParams]) -> MethodParams:
        old = [key for key in cls.renamed if isinstance(data, dict) and key in data]
        for key in old:
            if cls.renamed[key] in data:
                raise ValueError(f"{key!r} is the old name of {cls.renamed[key]!r}: give one of them")
        if old:
            data = {cls.renamed.get(key, key): value for key, value in data.items()}
        params = handler(data)
        params._old_names = old
        return params

    @classmethod
    def as_stored(cls, params: Mapping[str, Any]) -> Self:
        """The parameters a stored run ran with, read back for a reader of it (RL data): the checks added since runs
        were stored (mode=proof for a method that cannot take it, a selection rule of the other mode, a TMAS role's
        ``extra_body`` key that tmas sends) let its values through, as it ran; every other check holds. A run is
        resumed with its parameters validated as given now."""
        return cls.model_validate(params, context={STORED_RUN: True})

    @field_validator("mode")
    @classmethod
    def _mode_applies(cls, mode: str, info: ValidationInfo) -> str:
        if mode != "numeric" and cls.proof_refused is not None and not read_as_stored(info):
            raise ValueError(cls.proof_refused)
        return mode

    def notices(self) -> dict[str, str]:
        """Kind -> one-line notice the parameters raise in a run that uses them (an old parameter name)."""
        return {
            f"renamed_parameter_{old}": f"method parameter {old!r} is now called {self.renamed[old]!r};"
            " the old name still works"
            for old in self._old_names
        }

    def sampling_layers(self, role: str) -> tuple[Sampling | None, Sampling | None]:
        """``role``'s layers of the one sampling resolution (:mod:`tmas.llm.sampling`) that the method sets: its
        preset's sampling (fills only what no one set) and the user's own per-role method sampling (goes over every
        setting). None where the method sets none, as here."""
        return None, None


P = TypeVar("P", bound=MethodParams)


class ProblemSession:
    """What a method sees of the run while it solves one problem: calls (replayed or sent, and stored), iteration
    bookkeeping."""

    def __init__(
        self,
        problem: Problem,
        llm: ChatModel,
        store: RunStore | None,
        *,
        params: MethodParams,
        seed: int = 0,
        active: dict[str, int] | None = None,
        budget: Budget | None = None,
        equivalence: EquivalenceCheck | None = None,
        on_iteration: Callable[[str, int], None] | None = None,
        bank: TokenBank | None = None,
        lane: Lane | None = None,
    ) -> None:
        self.problem = problem
        self.llm = llm
        self.store = store
        # The run seed: methods derive their random draws and each call's sampling seed from it.
        self.seed = seed
        # Shared with the progress display: problem id -> iteration it is in; ``on_iteration`` hears of each start.
        self._active = active
        self._on_iteration = on_iteration
        # The grading rules' equivalence of two answers (None without Math-Verify): what votes group answers by.
        self.equivalence = equivalence
        self.iteration = 0
        self._iteration_calls = 0
        self._iteration_failed = 0
        self._iteration_usage = Usage()
        self._iteration_replies: dict[str, ReplyTally] = {}
        self.records: list[IterationRecord] = []
        self.budget = budget or Budget()
        # The problem's whole spend (all iterations, replayed calls included, so a resumed run stops where the
        # first one did): what budgets are checked against. Tokens as the budget counts them (``Budget.count``).
        self.spent_calls = 0
        self.spent_tokens = 0
        # Of ``spent_calls``, the calls of an earlier pass that failed and that a resume asks again: a call budget
        # counts each such call once, as its new call (:meth:`_spent_before`).
        self._asked_again = 0
        # Every call's usage and failures, the unfinished iteration's included: what the result reports.
        self.spent_usage = Usage()
        self.spent_failed = 0
        if store is not None:
            self._spent_before(store)
        # Under a budget, on a problem solved again from ``store`` (see :meth:`_take_stored`): its stored calls that
        # the pass replays before any new call could change what it asks (RunStore.sure_replay_calls) and that it
        # has not replayed yet, by id, each with its iteration and its tokens as the budget counts them; the
        # iterations the pass replayed a call of, and those it sent a call of.
        self._replay: StoreReplay | None = None
        self._unreplayed: dict[int, tuple[int, int]] = {}
        self._replayed_in: set[int] = set()
        self._sent_in: set[int] = set()
        if store is not None and (self.budget.calls is not None or self.budget.tokens is not None):
            replay = store_replay(llm)
            if replay is not None and replay.store is store:
                self._replay = replay
                for call_id, (iteration, usage) in store.sure_replay_calls(problem.problem_id).items():
                    self._unreplayed[call_id] = (iteration, self.budget.spent(usage))
        # Calls sent and not yet answered: a call budget counts them (so it is never exceeded). A token budget
        # counts each at what it may cost at most (``reserved_tokens``: its max_tokens, plus its prompt where the
        # budget counts prompts) and holds a call back while they could reach the limit (:meth:`_admit`).
        self.calls_in_flight = 0
        self.reserved_tokens = 0
        # Calls in flight with no max_tokens: nothing bounds what they spend, so no other call goes beside them.
        self._unbounded_in_flight = 0
        # Where the budget counts prompts: how many times a prompt's guess (:meth:`_prompt_guess`) its finished
        # calls cost at most; None until one has reported its prompt tokens (till then one call goes at a time).
        self._prompt_scale: float | None = None
        # Set (and replaced) each time a call of the problem ends: a call held back waits for it.
        self._call_ended = asyncio.Event()
        # Set when the budget refused a call; says what was spent against what limit.
        self.budget_stop: str | None = None
        # A pooled token budget's bank, and the tokens this problem drew from it past its own share.
        self.bank = bank
        self.drawn = 0
        # The parameters of the method solving the problem: their sampling layers (MethodParams.sampling_layers)
        # enter every call's sampling resolution. Required, so that no session leaves a method's sampling out
        # unseen (a session outside a method passes ``MethodParams()``, which sets none).
        self.params = params
        # Kind -> the one-line notice this problem raised (see :meth:`notice`).
        self.notices: dict[str, str] = {}
        # The run's problem worker solving the problem (tmas.llm.lanes), in every call's key: an endpoint with
        # ``pin_slots`` keeps its calls on one server slot. None outside a run's workers.
        self.lane = lane

    def _spent_before(self, store: RunStore) -> None:
        """A problem solved again on resume starts from what its calls that failed in an earlier pass spent: a resume
        asks each again and replays none, and what the server generated for them is spent all the same. Counted
        against a token budget (a pooled one's too) and in the result's calls and usage, as the run's summary and
        every token figure of the report count them (``tmas.reports.metrics.spent_through``); not as failures of the
        run, which asks them again. A call budget does not count them: it counts the calls the method asks, and the
        resume asks each of them again as a call of its own, which it counts; counting both would leave a resumed
        problem fewer calls than one whose calls never failed."""
        earlier = store.failed_spend(self.problem.problem_id)
        self.spent_calls = self._asked_again = earlier.calls
        self.spent_tokens = self.budget.spent(earlier.usage)
        self.spent_usage = earlier.usage

    def notice(self, kind: str, message: str) -> None:
        """Raise the run-level notice ``kind`` (one line): kept once in this problem's result and once in the run's
        store, however often the problem raises it."""
        if kind in self.notices:
            return
        self.notices[kind] = message
        if self.store is not None:
            self.store.record_notice(kind, message)

    async def chat(
        self,
        role: str,
        messages: Sequence[Message],
        *,
        sample: int = 0,
        sampling: Sampling | None = None,
        reply_model: type[BaseModel] | None = None,
        watch: TraceWatch | None = None,
        chain: int | None = None,
        attempt: int = 0,
        draw: int | None = None,
    ) -> Completion:
        """One call of this problem (see :meth:`ChatModel.chat`; ``reply_model``: the pydantic model of a JSON
        reply, sent as its schema where the endpoint allows; ``watch``: follows the streamed reply and may stop it,
        and a reply that came unstreamed raises the run's one-line notice :data:`UNWATCHED_NOTICE`; ``chain``: the
        chain of calls of this iteration it belongs to, in its key, ended by :meth:`chain`'s block; the key holds the
        session's ``lane`` too; ``attempt``: 0, or how many times the same prompt was asked before because its reply
        was unusable or what it is built from did not move (:mod:`tmas.methods.reasked`): the seed is then changed
        (:func:`tmas.llm.sampling.retried`); ``draw``: which of its prompt's samples in this step the call is,
        ``sample`` unless given (majority vote's later iterations continue their numbering): the seed, configured or
        derived for the role's prompt in this iteration, goes plus it (:func:`tmas.llm.sampling.for_sample`), so a
        prompt's samples differ, and draw the same alone, batched or resumed).

        Under a budget the call may wait for calls of the problem in flight (:meth:`_admit`), and raises
        :class:`BudgetExhausted` instead of going out once the budget is spent."""
        key = CallKey(
            problem_id=self.problem.problem_id,
            role=role,
            sample=sample,
            iteration=self.iteration,
            chain=chain,
            lane=self.lane,
        )
        resolved = self.resolve_sampling(role, sampling)
        derived = resolved.sampling.seed is None
        if derived:
            # A reproducible seed for the role's prompt in this step: a rerun with the same run seed asks the same
            # questions (servers that honour `seed`, e.g. vLLM, answer the same too).
            resolved = resolved.over(DERIVED_SEED, Sampling(seed=self.derived_base("call", role)))
        # The seed goes plus the sample's index (sample j: seed + j, as vLLM draws choice j of one request), so a
        # prompt's samples differ and draw alike alone, batched or resumed; it is changed for a prompt asked again:
        # the same seed would draw the same unusable reply.
        index = sample if draw is None else draw
        seed = resolved.sampling.seed
        resolved = retried(for_sample(resolved, index), attempt)
        if derived:
            # A run stored before seeds were derived per prompt and step replays its calls under their own seeds.
            earlier: tuple[int, ...] = (
                earlier_derived_seed(self.seed, self.problem.problem_id, self.iteration, "call", role, sample),
            )
        else:
            # A run stored before sample j went with the configured seed + j replays its calls under the seeds sent.
            earlier = earlier_configured_seeds(seed or 0, index, attempt)
        resolved = resolved.model_copy(update={"earlier_seeds": earlier})
        # A call the live run made is not held back, and holds its stored tokens while it replays.
        stored = self._take_stored(role, messages, key, resolved, watch)
        if stored is None:
            reserve = await self._admit(resolved, messages)
            if self._unreplayed:
                self._sent_in.add(self.iteration)
        else:
            self.check_budget(replaying=True)
            reserve = stored
        self.calls_in_flight += 1
        self._hold(reserve, +1)
        try:
            completion = await self.llm.chat(
                role, messages, key=key, sampling=resolved, reply_model=reply_model, watch=watch
            )
        except asyncio.CancelledError as cancel:
            # Its reply goes to no one, but what the server generated for it is spent: counted, not as a failure
            # (no reply is missing: its caller left).
            if (spent := spent_before(cancel)) is not None:
                self._spend(messages, spent.usage)
            raise
        finally:
            self.calls_in_flight -= 1
            self._hold(reserve, -1)
            # The calls held back look again once this task yields: after its spend is counted below.
            self._wake_held()
        if watch is not None and completion.ok and not completion.replayed and not watch.began:
            self.notice("unwatched", UNWATCHED_NOTICE)
        self._spend(messages, completion.usage)
        if completion.ok:  # the role's reply counts; what the reply held is the method's to add
            tally = self.tally(role)
            tally.replies += 1
            tally.truncated += completion.truncated
        if not completion.ok:
            self._iteration_failed += 1
            self.spent_failed += 1
        return completion

    def _take_stored(
        self,
        role: str,
        messages: Sequence[Message],
        key: CallKey,
        resolved: ResolvedSampling,
        watch: TraceWatch | None,
    ) -> int | None:
        """Where the store will answer this call from one of the problem's calls still to replay (``_unreplayed``)
        and the pass follows the live run through the current iteration: that call taken off them, and its tokens
        as the budget counts them; None otherwise (the call is admitted as any other).

        Replayed calls come back at once, so calls made side by side (a method's candidates, TMAS's two memory
        updates) replay one after another in the order they were started, not in the order the live run's replies
        came back in, and what a budget counted when it let a call go or refused it would differ. So while the pass
        follows the live run through an iteration (it replayed calls of it and sent none), that iteration's calls
        still to replay count as spent for a call the store does not answer (:meth:`_still_to_replay`): a call the
        live run's budget refused, with as much spent then as the iteration's stored calls hold, is refused again,
        whatever the order of the replays. A call the live run made is checked against what the pass replayed
        before it alone, and never held back: under the budget the live run had, that is less than the limit
        (always under a call budget; under a token budget, unless calls its live run sent after it, of a larger
        max_tokens, replay before it), and under a lower one the budget stops the replay. Once the pass sends a
        call of the iteration (one the live run never answered, or asked otherwise), the budget counts what the pass
        spent, as on any pass: a stored call it no longer asks is not counted."""
        if not self._unreplayed or self._replay is None or self.iteration in self._sent_in:
            return None
        found = self._replay.stored_reply(role, messages, key, resolved, watched=watch is not None)
        taken = None if found is None or found.call_id is None else self._unreplayed.pop(found.call_id, None)
        if taken is None:
            return None
        iteration, tokens = taken
        self._replayed_in.add(iteration)
        return tokens

    def _still_to_replay(self) -> tuple[int, int]:
        """The calls of the current iteration still to replay, and their tokens, while the pass follows the live run
        through it (it replayed calls of it and sent none); none otherwise (:meth:`_take_stored`)."""
        if self.iteration not in self._replayed_in or self.iteration in self._sent_in:
            return 0, 0
        left = [tokens for iteration, tokens in self._unreplayed.values() if iteration == self.iteration]
        return len(left), sum(left)

    def _spend(self, messages: Sequence[Message], usage: Usage) -> None:
        """A call of the problem ended, having cost ``usage``: counted against the budget and in the records."""
        self.spent_calls += 1
        self.spent_tokens += self.budget.spent(usage)
        self._learn_prompt_cost(messages, usage)
        self.spent_usage = self.spent_usage + usage
        self._iteration_calls += 1
        self._iteration_usage = self._iteration_usage + usage

    @contextmanager
    def chain(self, chain: int) -> Iterator[None]:
        """The block makes the calls of chain ``chain`` of the current iteration (each passes ``chain=chain`` to
        :meth:`chat`); on leaving it, however (an error, a cancel), the chain ends (:meth:`ChatModel.end_chain`),
        so a server slot it held goes on to the problem's other calls."""
        ended = ChainKey(problem_id=self.problem.problem_id, iteration=self.iteration, chain=chain)
        try:
            yield
        finally:
            self.llm.end_chain(ended)

    def tally(self, role: str) -> ReplyTally:
        """``role``'s reply counts in this iteration, for the method to add what it found in them."""
        return self._iteration_replies.setdefault(role, ReplyTally())

    def _hold(self, reserve: int | None, sign: int) -> None:
        """Count a call's hold on the token budget in (``sign`` +1) or out (-1); None: a call nothing bounds."""
        if reserve is None:
            self._unbounded_in_flight += sign
        else:
            self.reserved_tokens += sign * reserve

    def _wake_held(self) -> None:
        """A call ended: the calls held back by the budget look again."""
        self._call_ended.set()
        self._call_ended = asyncio.Event()

    def _most_tokens(self, resolved: ResolvedSampling, messages: Sequence[Message]) -> int | None:
        """What a call may spend of a token budget at most: its max_tokens, plus its prompt where the budget counts
        prompts (guessed from its characters, scaled by what the problem's finished calls reported); None where no
        max_tokens bounds it."""
        if self.budget.tokens is None:
            return 0
        most = resolved.sampling.max_tokens
        if most is None:
            return None
        if self.budget.count == "total":
            most += math.ceil(self._prompt_guess(messages) * (self._prompt_scale or 1.0))
        return most

    @staticmethod
    def _prompt_guess(messages: Sequence[Message]) -> float:
        """A prompt's tokens guessed from its text, on the high side (3 characters a token, a chat template's
        tokens around each message): LaTeX and code take more tokens a character than prose."""
        return sum(len(m.content) / BUDGET_CHARS_PER_TOKEN + MESSAGE_TEMPLATE_TOKENS for m in messages)

    def _learn_prompt_cost(self, messages: Sequence[Message], usage: Usage) -> None:
        """What a finished call's prompt cost against its guess: later calls are reserved at the largest ratio."""
        if self.budget.count != "total" or usage.prompt_tokens <= 0:
            return
        ratio = usage.prompt_tokens / max(1.0, self._prompt_guess(messages))
        self._prompt_scale = max(self._prompt_scale or 1.0, ratio)

    async def _admit(self, resolved: ResolvedSampling, messages: Sequence[Message]) -> int | None:
        """Wait until the call can go; what it holds while in flight (:meth:`_most_tokens`, priced anew each time it
        looks, as finished calls show what prompts cost; None: no bound).

        Under a token budget a call goes while the calls in flight, each counted at what it may spend, cannot reach
        the limit; otherwise it waits for one to end and looks again. The spend and what the calls in flight hold
        then stay under the limit plus one call: a problem passes its token budget by one call's tokens at most
        (a majority vote's k samples go as the budget allows, not all at once), and a resumed run holds its calls
        back in the same order. Raises :class:`BudgetExhausted` once the budget is spent."""
        while True:
            self.check_budget()
            if self.budget.tokens is None:
                return 0
            most = self._most_tokens(resolved, messages)
            limit = self.budget.tokens + self.drawn
            # Prompts counted and none priced yet: the first call goes alone, so the next ones are reserved at what
            # a prompt of this problem was seen to cost.
            unpriced = self.budget.count == "total" and self._prompt_scale is None and self.calls_in_flight > 0
            spent = self.spent_tokens + self._still_to_replay()[1]
            if not self._unbounded_in_flight and not unpriced and spent + self.reserved_tokens < limit:
                return most
            await self._call_ended.wait()

    def check_budget(self, *, replaying: bool = False) -> None:
        """Raise :class:`BudgetExhausted` when the problem has spent its token or call budget (``replaying``: for a
        call the live run made, see :meth:`_take_stored`)."""
        b = self.budget
        over: list[str] = []
        # A problem solved again from its store counts its calls still to replay as spent (:meth:`_take_stored`).
        left_calls, left_tokens = (0, 0) if replaying else self._still_to_replay()
        calls = self.spent_calls - self._asked_again + self.calls_in_flight + left_calls
        tokens = self.spent_tokens + left_tokens
        if b.calls is not None and calls >= b.calls:
            over.append(f"{calls} calls of a budget of {b.calls}")
        # A call the call budget refuses draws nothing: no draw lets it go, and the pool's tokens stay for the open
        # problems that can spend them.
        if not over and b.tokens is not None and tokens >= b.tokens + self.drawn and self.bank is not None:
            self.drawn += self.bank.draw(b.tokens)
        if b.tokens is not None and tokens >= b.tokens + self.drawn:
            pooled = f" and {self.drawn} drawn from the run's pool" if self.bank is not None else ""
            over.append(f"{tokens} {b.count} tokens of a budget of {b.tokens}{pooled}")
        if over:
            self.budget_stop = f"budget spent ({'; '.join(over)}) in iteration {self.iteration}"
            raise BudgetExhausted(self.budget_stop)

    async def answer_classes(self, candidates: Iterable[Candidate]) -> dict[str, str]:
        """Each answer of ``candidates`` (failed calls left out) -> the key of its class of equal values, for
        :func:`tmas.methods.selection.select` (see tmas.answer_classes)."""
        return await answer_classes((c.answer for c in candidates if c.error is None), self.equivalence)

    async def embed(self, texts: Sequence[str], *, role: str = "embedding") -> list[list[float]]:
        """Embedding vectors of ``texts`` (not stored, not counted against the chat budget: they are cheap and
        deterministic, so a resumed run asks again)."""
        return await self.llm.embed(texts, role=role)

    def context_window(self, role: str) -> int | None:
        """The context window (tokens) of ``role``'s endpoint where configured or reported, else None."""
        return self.llm.context_window(role)

    def resolve_sampling(self, role: str, call: Sampling | None = None) -> ResolvedSampling:
        """What a call of ``role`` with the per-call override ``call`` sends (the seed aside), and who set what."""
        preset, method = self.params.sampling_layers(role)
        return self.llm.resolve_sampling(role, preset=preset, method=method, call=call)

    def max_tokens(self, role: str, sampling: Sampling | None = None) -> int | None:
        """The max_tokens a call of ``role`` with the ``sampling`` override would send."""
        return self.resolve_sampling(role, sampling).sampling.max_tokens

    def derived_base(self, *parts: object) -> int:
        """The derived seed of sample 0 of a prompt (:func:`tmas.llm.sampling.derived_base`) fixed by the run seed,
        the problem, the current iteration and ``parts``."""
        return derived_base(self.seed, self.problem.problem_id, self.iteration, *parts)

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        if self._active is not None:
            self._active[self.problem.problem_id] = iteration
        if self._on_iteration is not None:
            self._on_iteration(self.problem.problem_id, iteration)
        self._iteration_calls = 0
        self._iteration_failed = 0
        self._iteration_usage = Usage()
        self._iteration_replies = {}

    def end_iteration(
        self,
        candidates: list[Candidate],
        *,
        chosen: Candidate | None = None,
        fallback: Fallback | None = None,
        selected: str | None = None,
        state: MethodState | None = None,
        notes: list[str] | None = None,
        held_over: list[int] | None = None,
    ) -> IterationRecord:
        """Record the iteration: its ``candidates``, the answer the method would return after it, the method's
        ``state`` (its declared ``State``; the fields it set) and ``notes``.

        ``chosen``: the candidate the method returns (this iteration's or an earlier one's; ``fallback``: taken by
        the answer fallback), kept as the record's ``selection`` with its answer as ``selected``, so no reader
        chooses again; ``selected`` alone: an answer that is no candidate's (MATTRL's decision). ``held_over``: the
        trajectories whose call a budget stop refused, each holding its solution of the iteration before
        (``IterationRecord.held_over``)."""
        selection = None
        if chosen is not None:
            selected = chosen.answer
            selection = Selection(iteration=self._iteration_of(chosen, candidates), candidate=chosen.index)
            selection.fallback = fallback is not None
        record = IterationRecord(
            problem_id=self.problem.problem_id,
            iteration=self.iteration,
            candidates=candidates,
            selected=selected,
            selection=selection,
            calls=self._iteration_calls,
            failed_calls=self._iteration_failed,
            usage=self._iteration_usage,
            state=state.stored() if state is not None else {},
            notes=notes or [],
            replies=dict(sorted(self._iteration_replies.items())),
            held_over=held_over or None,
        )
        self.records.append(record)
        if self.store is not None:
            self.store.save_iteration(record)
        return record

    def _iteration_of(self, chosen: Candidate, current: list[Candidate]) -> int:
        """The iteration ``chosen`` was written in: the current one's ``current`` candidates, or an earlier record's."""
        if any(c is chosen for c in current):
            return self.iteration
        found = (r.iteration for r in reversed(self.records) if any(c is chosen for c in r.candidates))
        return next(found, self.iteration)

    def budget_stopped(self, result: ProblemResult, detail: str | None = None) -> None:
        """Mark ``result`` as ended by the budget (``stopped_reason``, the ``budget_stops`` counter) and say where in
        the records: the last iteration record gets the note ``stopped: <detail>`` (``detail``: the stop the session
        recorded unless given), stored again with it.

        Every method's budget stop goes through here (:func:`tmas.methods.steps.finish`, the runner's result of a stop
        a method let through, TMAS, MATTRL), so the records read the same whichever method ran: a stop that refused a
        whole iteration leaves no record of that iteration, and the note on the one before is all that shows it. A
        record that already notes this stop (a method's note on the iteration the budget cut, saying how much of it
        finished) is left as it is."""
        detail = detail or self.budget_stop or "budget spent"
        result.stopped_reason = BUDGET_STOP
        result.counters["budget_stops"] = 1
        if not self.records:
            return
        last, note = self.records[-1], f"stopped: {detail}"
        if any(n.startswith(note) for n in last.notes):
            return
        last.notes.append(note)
        if self.store is not None:
            self.store.save_iteration(last)

    def result(self, method: str, *, answer: str | None, text: str, stopped_reason: str | None = None) -> ProblemResult:
        # Calls and tokens of every call, those of an iteration a budget or an error cut short included, so the
        # result shows what the problem cost (the iteration records show what each finished iteration cost).
        return ProblemResult(
            problem_id=self.problem.problem_id,
            method=method,
            answer=answer,
            text=text,
            stopped_reason=stopped_reason,
            iterations=self.records,
            calls=self.spent_calls,
            failed_calls=self.spent_failed,
            usage=self.spent_usage,
            notices=list(self.notices.values()),
            budget_drawn=self.drawn,
        )


_T = TypeVar("_T")
_U = TypeVar("_U")


async def gather_all(aws: Iterable[Awaitable[_T]]) -> list[_T]:
    """Run ``aws`` concurrently; if one raises, cancel the others and re-raise that exception itself (unlike a
    TaskGroup, which would wrap it), so errors such as an unreachable endpoint reach the runner as they are."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BudgetExhausted:
        # A spent budget is no error: calls already in flight finish and count (each sibling stops at its own
        # next call), then the stop goes on up, unless a sibling failed for a worse reason meanwhile.
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, BudgetExhausted):
                raise outcome from None
        raise
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def gather_finished(aws: Iterable[Awaitable[_T]]) -> list[_T | None]:
    """:func:`gather_all`, keeping what finished when the budget stops some of ``aws``: each one's result, in order,
    None for one the budget refused (:class:`BudgetExhausted`), so a step scores what came back rather than losing it
    (:attr:`ProblemSession.budget_stop` says a stop came). Any other error is raised as :func:`gather_all` raises it."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    # Every task has ended once gather_all returns or raises the stop (it waits for them); the refused ones hold it.
    with suppress(BudgetExhausted):
        await gather_all(tasks)
    return [None if task.exception() is not None else task.result() for task in tasks]


async def gather_pair(first: Awaitable[_T], second: Awaitable[_U]) -> tuple[_T, _U]:
    """:func:`gather_all` for two awaitables of different types."""
    a, b = asyncio.ensure_future(first), asyncio.ensure_future(second)
    await gather_all([a, b])
    return a.result(), b.result()


class Method(ABC, Generic[P]):
    """A test-time scaling method. Subclasses set ``name`` and ``Params`` (the class ``P`` stands for) and implement
    :meth:`solve`."""

    name: ClassVar[str]
    Params: ClassVar[type[MethodParams]] = MethodParams
    # The shape of its IterationRecord.state (methods/state.py): readers validate stored states through it.
    State: ClassVar[type[MethodState]] = MethodState
    # What the method is (its frontier, selection, roles...), for every reader that must not go by its name.
    traits: ClassVar[Traits] = DEFAULT_TRAITS
    # The parameters its paper ran it with, so that a report says where a run differs (empty: no paper setting).
    paper_settings: ClassVar[dict[str, Any]] = {}
    # Small parameters under which one problem runs quickly and reaches the roles of its default setting: the test
    # suite runs every registered method with them (None: the method gives none, and the suite says so).
    example_params: ClassVar[dict[str, Any] | None] = None
    # Params put under the user's own when the run uses the embedded local model (e.g. a small preset).
    embedded_defaults: ClassVar[dict[str, Any]] = {}
    # Params of one question asked of a user's endpoint with no parameters given (``tmas solve``, ``tmas.solve``, a
    # ``tmas serve`` request): a question asked interactively should not cost a benchmark run (tmas_params.py).
    question_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, params: MethodParams) -> None:
        if not isinstance(params, self.Params):
            raise TypeError(f"{type(self).__name__} takes {self.Params.__name__}, not {type(params).__name__}")
        self.params = cast(P, params)

    @abstractmethod
    async def solve(self, session: ProblemSession) -> ProblemResult:
        """Solve ``session.problem``; every LLM call goes through ``session.chat``."""

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        """The names the papers' tables give a run of this method with these (stored) parameters, to put the run
        beside its published numbers (reports/paper_numbers.py); none by default."""
        return []

    def check_setup(self) -> None:
        """An error, one line, where something the parameters name outside the run (a folder of the user's) cannot
        be read: checked before a run directory is made and before any call. Nothing by default."""

    def check_model(self, llm: ChatModel) -> None:
        """An error, one line, where what the parameters name outside the run does not go with the model the run
        opened (MATTRL's pool, built with another embedding model): checked once the model is open, before any
        problem is solved. Nothing by default."""

    async def check_served(self, llm: ChatModel) -> None:
        """:meth:`check_model` for what only a reply can say (MATTRL's pool where the embedding role names no model:
        the model that serves it): asked once a run has problems to solve, before their first chat call. Nothing by
        default."""

    def inputs(self) -> dict[str, str]:
        """What the parameters name outside the run that its requests are made from (MATTRL's experience pool), as
        a name a message shows (``pool=PATH``) -> an identity of its content. A run records them with its setup, and
        a resume that finds one changed is refused while a finished problem would keep a result of the old one
        (:meth:`tmas.runner.RunSetup.check_resume`). None by default."""
        return {}

    def calls_per_problem(self) -> CallCount:
        """The chat calls one problem costs, by role, as the method's structure fixes them (the cost estimate adds
        them up; see :mod:`tmas.methods.call_count`). A method that states none is estimated as unknown."""
        return CallCount.unknown(self.name)

    def call_max_tokens(self, role: str) -> int | None:
        """The max_tokens the method puts on every call of ``role`` itself (a per-call setting, over every other
        layer), which the cost estimate's ceiling takes for the role; None where it sets none, as here."""
        return None
