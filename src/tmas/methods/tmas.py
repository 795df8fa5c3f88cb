"""TMAS (paper section 3.2, Algorithm 1 in appendix A.1): five agents and two memory banks, iterated T times.

Per iteration t, from the fixed state (R_{t-1}, E_{t-1}, G_{t-1}) of the previous one:

- the N candidates are sampled in parallel; candidate i draws z ~ Bernoulli(epsilon) from an RNG seeded by
  (run seed, problem, t, i): z = 0 exploits (refine prompt with R_{t-1} and E_{t-1}; after an iteration that left no
  rollout, E_{t-1} alone, which its skipped update kept), z = 1 explores (generation prompt with the guideline
  constraint listing G_{t-1}); iteration 0 uses the plain generation prompt;
- each candidate, as soon as it is written, gets its M verifications in parallel, then its summary: r = (c, s);
- then the experience agent (E_t) and the guideline agent (G_t) run in parallel on R_t.

The critical path of an iteration is therefore solution + verification + summary + max(experience, guideline).
Nothing reads the last iteration's summaries and banks, so by default (``skip_final_memory``) it computes none: the
answer is the same, with N + 2 fewer calls; the ``paper`` preset runs them, as Algorithm 1 is written.
The answer is the argmax over R_T of the mean verifier score. Ties: among the tied candidates, the answer most of
them share (by value: methods/selection.py) wins, then the lowest candidate index; candidates without an answer
(numeric mode) are chosen only when no candidate has one. The ``select`` and ``select_from`` parameters choose other
rules.

Two documented deviations keep a run from losing an answer (``answer_reminder`` and ``answer_fallback``
turn them off): an exploit or explore reply with no extractable answer is asked once more, with a reminder of the
required output (``answer_reminder.j2``); and when R_T holds no answered candidate (proof mode: every call of the
last iteration failed), the answer is the best answered (usable) candidate of the earlier iterations, recorded in the
result's ``fallback`` and the iteration's state.

Beyond the paper, off by default and pinned off by the ``paper`` preset (the ``local`` preset turns the first on):
``early_stop`` ends a problem once its answer is settled, every candidate giving one answer that every verification
passes (or the agreement share and score it states), recorded in the iteration's ``state.early_stop``; and the
confidence rules of ``select`` (DeepConf) ask the solution calls for token log-probabilities and weigh or filter the
vote by each candidate's confidence (methods/confidence_params.py).

Bad agent output never crashes a problem: a failed or answerless solution scores 0 (one with no text at all, a
thinking model cut while it reasoned, has nothing to verify: no verification or summary is asked, and no later prompt
shows it), an unreadable verification
counts 0 (the summary agent reads the verifications that came back; with none, it is not asked), a missing
summary is replaced by one built from the scores, and an invalid experience or guideline update
leaves the previous bank in place. An output that echoes its prompt's instructions (:mod:`tmas.agents.echo`) is
asked again once; a solution that echoes twice gives no answer and no rollout, a summary is built from the scores
instead, and echoing bank items are dropped (from the first reply, when the retry failed or is unreadable). Each case
is noted (with the raw reply) in the iteration record and counted in ``ProblemResult.counters``. A solution prompt a
candidate index sends again (the plain prompt after an iteration that left no rollout) goes with a new seed where one is
configured (``tmas.methods.reasked``).

A budget stop (``BudgetExhausted``) ends the problem with what finished: the iteration it cut short is recorded with
the candidates whose solutions came back, each scored from the verifications that came back (kept unverified and
unscored where the stop refused them all), with no summary or memory update, and the answer is chosen among them as
after a last iteration; a stop that refused every solution call of an iteration leaves no record of it. An echoing
reply whose retry the stop refused was spent, and is recorded as after a second echo (a solution: an unusable candidate
saying the budget refused its retry, and an iteration whose every candidate is one answers as one the stop refused
whole, with the answer chosen after the iteration before; a summary: one built from the scores; a memory update: the
reply applied without its echoing items); a memory call the stop refused is recorded as refused, the other one's
update applied where it came back. Resume needs no state of its own: every call is replayed from the run store, and
every draw depends only on the run seed, so re-running reaches the same state.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel

from tmas.agents.echo import EchoFiltered, EchoGuard
from tmas.agents.experience import experience_prompt, experience_reply_model, parse_experience_update
from tmas.agents.guideline import GuidelineReply, guideline_prompt, parse_guideline_update
from tmas.agents.output import AgentOutputError
from tmas.agents.rollouts import CHARS_PER_TOKEN, Rollout, RolloutFit, RolloutView, fit_rollouts
from tmas.agents.score_first import parse_score_first, score_first_prompt
from tmas.agents.solution import (
    SolutionPrompt,
    explore_prompt,
    generation_prompt,
    parse_solution,
    refine_prompt,
)
from tmas.agents.summary import Summary, parse_summary, summary_from_scores, summary_prompt
from tmas.agents.verification import (
    Verification,
    parse_verification,
    verification_prompt,
    verification_reply_model,
)
from tmas.answer_classes import value_key
from tmas.config import Sampling, Settings
from tmas.llm.sampling import resolve_role
from tmas.llm.types import Completion, Message
from tmas.memory.experience_bank import ExperienceBank, apply_experience_ops
from tmas.memory.guideline_bank import GuidelineBank, apply_strategy_classifications
from tmas.methods.base import (
    BudgetExhausted,
    Candidate,
    CandidateMeta,
    IterationRecord,
    Method,
    MethodParams,
    ProblemResult,
    ProblemSession,
    gather_all,
    gather_finished,
    gather_pair,
)
from tmas.methods.call_count import CallCount, asked_again, count_calls
from tmas.methods.confidence_params import note_missing_confidence
from tmas.methods.echo_retry import GuardedReply, RetryRefused, chat_guarded, reply_to_read
from tmas.methods.reasked import Reasked
from tmas.methods.state import EarlyStop, MethodState, TMASState
from tmas.methods.steps import (
    Anomaly,
    Chosen,
    budget_note,
    fallback_note,
    held_answer_note,
    holds_answer,
    select_answer,
    solution_anomalies,
    solve_call,
)
from tmas.methods.tmas_params import TMAS_ROLES, TMASParams
from tmas.methods.training_prompts import IterationPrompts, Rendering
from tmas.methods.traits import Traits
from tmas.store.records import VerificationRecord

Update = TypeVar("Update", bound=EchoFiltered)

# Raw replies kept in the record for bad outputs are cut to this length.
RAW_LIMIT = 4000
# A problem's ``stopped_reason`` when ``early_stop`` ended it (the stopping iteration's ``state.early_stop`` says
# when and on what figures).
SETTLED = "settled (early_stop)"
# Room for the instructions, question and banks when a prompt's rollouts are fitted to the context window.
PROMPT_MARGIN_TOKENS = 256


def rollout_budget_chars(
    base: list[Message], *, context_tokens: int | None, window: int | None, reply_tokens: int | None
) -> int | None:
    """Characters left for R_{t-1} in a prompt whose other parts are ``base``: ``context_tokens`` when given, else
    the context window less the reply's max_tokens (a quarter of the window when unset) and a margin; None when
    neither is known."""
    tokens = context_tokens
    if tokens is None and window is not None:
        # A reply budget as large as the window (the paper preset's 128K) would leave the prompt nothing: keep half
        # the window for the prompt; the client lowers max_tokens to what the prompt leaves.
        reply = min(reply_tokens or window // 4, window // 2)
        tokens = window - reply - PROMPT_MARGIN_TOKENS
    if tokens is None:
        return None
    return max(int(tokens * CHARS_PER_TOKEN) - sum(len(m.content) for m in base), 0)


@dataclass
class MemoryState:
    """What iteration t hands to iteration t+1: R_t, E_t, G_t (all empty before iteration 0)."""

    rollouts: list[Rollout] = field(default_factory=list)
    experience: ExperienceBank = field(default_factory=ExperienceBank)
    guideline: GuidelineBank = field(default_factory=GuidelineBank)


@dataclass
class IterationLog:
    """Notes and anomaly counts of one iteration; shared by its concurrent tasks (one event loop, no locking)."""

    notes: list[str] = field(default_factory=list)
    anomalies: Counter[str] = field(default_factory=Counter)

    def bad(self, kind: str, note: str) -> None:
        self.anomalies[kind] += 1
        self.notes.append(note)

    def record(self, anomalies: list[Anomaly]) -> None:
        """A candidate's anomalies (methods/steps.py): each noted, and counted under its kind where it has one."""
        for kind, note in anomalies:
            if kind is None:
                self.notes.append(note)
            else:
                self.bad(kind, note)


@dataclass
class SolutionPlan:
    """The prompts of iteration t's N candidates, all built before any of them is sent."""

    modes: list[str]
    prompt_names: list[SolutionPrompt]
    messages: list[list[Message]]


@dataclass
class MemoryUpdate:
    """Lines 19-20's outcome: E_t and G_t, with what each agent's update did (or ``{"status": "skipped"}``)."""

    experience: ExperienceBank
    guideline: GuidelineBank
    experience_info: dict[str, Any]
    guideline_info: dict[str, Any]


@dataclass
class CandidateOutcome:
    candidate: Candidate
    rollout: Rollout | None


class TMAS(Method[TMASParams]):
    name: ClassVar[str] = "tmas"
    traits: ClassVar[Traits] = Traits(selects=True, roles=TMAS_ROLES)
    example_params: ClassVar[dict[str, Any] | None] = {"n": 1, "m": 1, "iterations": 2}
    # The setting of the TMAS paper (section 4.1).
    paper_settings: ClassVar[dict[str, Any]] = {"n": 8, "m": 8, "epsilon": 0.2}
    Params: ClassVar[type[MethodParams]] = TMASParams
    State: ClassVar[type[MethodState]] = TMASState
    embedded_defaults: ClassVar[dict[str, Any]] = {"preset": "local"}
    question_defaults: ClassVar[dict[str, Any]] = {"preset": "quick"}

    @classmethod
    def paper_names(cls, params: Mapping[str, Any]) -> list[str]:
        ablations = (("guideline", "no_guideline"), ("experience", "no_experience"))
        off = [name for name, flag in ablations if params.get(flag)]
        return ["TMAS w/o both" if len(off) == 2 else f"TMAS w/o {off[0]}" if off else "TMAS"]

    def calls_per_problem(self) -> CallCount:
        """Algorithm 1, every iteration including the first and the last: N solution, N x M verifier, N summary,
        one experience and one guideline call (none for an ablated bank): T x (N x (M + 2) + 2), 1,640 per problem
        for N = M = 8, T = 20. ``skip_final_memory`` leaves out the last iteration's summaries and memory update.
        With ``early_stop`` that is the most; the fewest is a problem settled after ``early_stop_patience``
        iterations (the last of them without its memory update)."""
        p, t = self.params, self.params.iterations
        memory = t - 1 if p.skip_final_memory else t  # iterations whose summaries and banks are computed
        roles = {
            "solution": p.n * t,
            "verifier": p.n * p.m * t,
            "summary": p.n * memory,
            "experience": 0 if p.no_experience else memory,
            "guideline": 0 if p.no_guideline else memory,
        }
        # Every call but the verifiers' is under the echo guard; a solution after the first iteration's may be
        # reminded of its answer too.
        guarded = {role: n for role, n in roles.items() if role != "verifier"}
        again = asked_again(guarded, {"solution": p.n * (t - 1)} if p.answer_reminder else None)
        settled = p.early_stop_patience  # the fewest iterations a problem can run: settled at once
        if not p.early_stop or settled >= t:
            return count_calls(roles, again=again)
        least = {
            "solution": p.n * settled,
            "verifier": p.n * p.m * settled,
            # The stopping iteration writes its summaries (inside each candidate's chain), not its memory update.
            "summary": p.n * settled,
            "experience": 0 if p.no_experience else settled - 1,
            "guideline": 0 if p.no_guideline else settled - 1,
        }
        note = f"early_stop: from a problem settled after {settled} iteration(s) to all {t}"
        return count_calls(roles, note, upper=roles, fewest=least, again=again)

    def call_max_tokens(self, role: str) -> int | None:
        """Logprob scoring asks every verification for a short score-first reply of ``score_max_tokens``."""
        p = self.params
        return p.score_max_tokens if role == "verifier" and p.verifier_score == "logprob" else None

    # ------------------------------------------------------------------------------------------ Algorithm 1
    async def solve(self, session: ProblemSession) -> ProblemResult:
        p = self.params
        state = MemoryState()  # line 2: E_0, G_0, R_0 = ∅
        # The solution prompts each candidate index sent: one sent again goes with a new seed where one is configured.
        asked = Reasked()
        totals: Counter[str] = Counter()
        streak = 0
        stopped: str | None = None
        # What a budget stop spent against what limit, once one came: the problem ends with what finished.
        budget: str | None = None
        # The answer chosen after the last iteration recorded.
        chosen = Chosen()
        for t in range(p.iterations):  # line 3
            session.begin_iteration(t)
            log = IterationLog()
            # Lines 5-12: every prompt of iteration t is built from the fixed state of t-1, before any call is sent.
            plan = self._plan(session, t, state, log)
            # Lines 6-17: candidates in parallel; each one's verifications start as soon as it is written.
            # Nothing reads the last iteration's summaries and banks (line 22 reads the candidates and scores alone).
            last = p.skip_final_memory and t == p.iterations - 1
            # Each candidate's calls are chain i (in their keys): on a pinned server slot they run back to back, so
            # each finds the previous one's prompt in the slot's cache; across replicas they keep to one
            # (tmas.llm.lanes). The chain ends when its rollout does, however it ends.
            finished = await gather_all(
                self._chained_rollout(session, i, plan, log, asked, summarize=not last) for i in range(p.n)
            )
            # A budget stop cuts the iteration short: it keeps the candidates that finished (finished work is never
            # lost), and the problem ends with it below; one that refused every solution call leaves no iteration.
            cut = session.budget_stop
            outcomes = [o for o in finished if o is not None]
            if cut is not None and not outcomes:
                if not session.records:
                    raise BudgetExhausted(cut)  # nothing finished: the runner records the problem as failed
                budget = cut
                break
            rollouts = [o.rollout for o in outcomes if o.rollout is not None]  # line 18: R_t
            candidates = [o.candidate for o in outcomes]
            if p.asks_confidence(p.select) and note_missing_confidence(session, candidates, log.notes):
                log.anomalies["confidence_missing"] += 1
            settled = None
            if cut is None:
                streak, settled = self._early_stop(t, candidates, streak)
            if settled is not None:
                stopped = SETTLED
                log.notes.append(f"early stop: {settled.reason}; memory update of this iteration skipped")
            elif last:
                log.notes.append("last iteration: summaries and memory update skipped (skip_final_memory)")
            elif cut is not None:
                log.notes.append("the budget stopped the iteration: summaries and memory update skipped")
            # Lines 19-20, unless nothing will read E_t or G_t (the saving early stopping is for).
            budget = cut
            skip = settled is not None or last or cut is not None
            memory = await self._update_memory(session, rollouts, state, log, skip=skip)
            if budget is None and session.budget_stop is not None:
                # The budget ran out in the memory update: the iteration's candidates stand, as the last iteration's
                # do without one, and the problem stops with them (below, once they are recorded). Each bank took
                # what came back of its update (a call refused: none; a retry refused: the first reply's).
                budget = session.budget_stop
                applied = "applied" in (memory.experience_info.get("status"), memory.guideline_info.get("status"))
                kept = "each bank took what came back of its update" if applied else "the banks stay as they were"
                log.notes.append(f"budget spent during the memory update: {kept}")
            state = MemoryState(rollouts=rollouts, experience=memory.experience, guideline=memory.guideline)
            if holds_answer(session, candidates):
                # Every reply that came back is unusable, its retry refused: the answer stays the one before, as where
                # the budget refused every call (the fallback would choose again among the earlier iterations).
                log.notes.append(held_answer_note(session))
            else:
                chosen = await self._select(session, candidates)
                if chosen.fallback is not None:
                    log.bad("answer_fallback", fallback_note(chosen.fallback))
            totals.update(log.anomalies)
            recorded = TMASState(
                modes=plan.modes,
                # Over the candidates scored (every one, unless a budget stop left some unscored).
                mean_score=_mean([c.score for c in candidates if c.score is not None]),
                agreement=_agreement(candidates, p.mode),
                experience_bank=memory.experience,
                guideline_bank=memory.guideline,
                experience_update=memory.experience_info,
                guideline_update=memory.guideline_info,
                anomalies=dict(log.anomalies),
            )
            # The fields a stop or a fallback did not set are no keys of the stored state.
            if settled is not None:
                recorded.early_stop = settled
            if chosen.fallback is not None:
                recorded.answer_fallback = chosen.fallback
            if cut is not None:
                log.notes += budget_note(session, len(candidates), p.n)
            session.end_iteration(
                candidates, chosen=chosen.candidate, fallback=chosen.fallback, state=recorded, notes=log.notes
            )
            if budget is not None or stopped is not None:
                break
        result = self._result(session, chosen, stopped)
        result.counters = dict(sorted(totals.items()))
        if budget is not None:
            # Ended by the budget as every method's stop is recorded, with the anomalies its finished iterations
            # counted.
            session.budget_stopped(result, budget)
        return result

    async def _update_memory(
        self, session: ProblemSession, rollouts: list[Rollout], prev: MemoryState, log: IterationLog, *, skip: bool
    ) -> MemoryUpdate:
        """Lines 19-20: the two memory agents in parallel on R_t; with ``skip``, E_{t-1} and G_{t-1} stand."""
        if skip:
            skipped = {"status": "skipped"}
            return MemoryUpdate(prev.experience, prev.guideline, dict(skipped), dict(skipped))
        (experience, exp_info), (guideline, guide_info) = await gather_pair(
            self._update_experience(session, rollouts, prev.experience, log),
            self._update_guideline(session, rollouts, prev.guideline, log),
        )
        return MemoryUpdate(experience, guideline, exp_info, guide_info)

    def _result(self, session: ProblemSession, best: Chosen, stopped: str | None) -> ProblemResult:
        """Line 22: argmax over R_T of Score(c) (with the defaults), or the earlier answer R_T lacks
        (answer_fallback): ``best``, as chosen after the last iteration recorded."""
        final = session.records[-1].candidates
        chosen = best.candidate
        result = session.result(
            self.name,
            answer=chosen.answer if chosen else None,
            text=chosen.text if chosen else "",
            stopped_reason=stopped,
        )
        result.fallback = best.fallback
        if chosen is None:
            errors = {c.error for c in final if c.error}
            result.status = "failed"
            result.error = "no candidate of the last iteration succeeded" + (f": {sorted(errors)[0]}" if errors else "")
        return result

    async def _select(self, session: ProblemSession, current: list[Candidate]) -> Chosen:
        """The answer from the iterations recorded so far, plus ``current`` (the iteration being finished), and the
        fallback it took, if any."""
        p = self.params
        return await select_answer(
            session,
            current,
            p.mode,
            p.select,
            select_from=p.select_from,
            fallback=p.answer_fallback,
            confidence=p.confidence_vote(),
        )

    # ------------------------------------------------------------------------------------------ solution agent
    def _plan(
        self,
        session: ProblemSession,
        t: int,
        prev: MemoryState,
        log: IterationLog,
    ) -> SolutionPlan:
        """z_{t,i} ~ Bernoulli(epsilon) per candidate (line 7) and the prompt each one gets (lines 8-12, eq. 1)."""
        p, q = self.params, session.problem.question
        if t == 0:
            first = self._generation_prompt(q)
            return SolutionPlan(["generate"] * p.n, ["generate"] * p.n, [first] * p.n)
        draws = [_bernoulli(session.seed, session.problem.problem_id, t, i, p.epsilon) for i in range(p.n)]
        cache: dict[str, list[Message]] = {}
        modes: list[str] = []
        names: list[SolutionPrompt] = []
        messages: list[list[Message]] = []
        # E_{t-1} outlives an iteration without rollouts (its update was skipped): exploits still see it.
        have_experience = not p.no_experience and len(prev.experience) > 0
        for z in draws:
            name = self._prompt_name(z, bool(prev.rollouts), have_experience)
            if name not in cache:
                if name == "explore":
                    cache[name] = self._explore_prompt(q, prev.guideline)
                elif name == "refine":
                    experience = None if p.no_experience else prev.experience
                    window, reply = self._window(session, "solution")
                    cache[name], fit = self._exploit_prompt(q, prev.rollouts, experience, window, reply)
                    if fit.changed:
                        log.notes.append(f"exploit prompt: {fit.describe()}")
                else:
                    cache[name] = self._generation_prompt(q)
            modes.append("explore" if z else "exploit")
            names.append(name)
            messages.append(cache[name])
        if not prev.rollouts and not all(draws):
            got = "the experience bank alone" if have_experience else "the plain prompt"
            log.notes.append(f"no usable rollout from the previous iteration: exploit candidates got {got}")
        return SolutionPlan(modes, names, messages)

    def _prompt_name(self, explore: bool, have_rollouts: bool, have_experience: bool) -> SolutionPrompt:
        if explore:  # A_sol(x, G_{t-1}); without a guideline bank (ablation) a fresh, memory-free sample
            return "generate" if self.params.no_guideline else "explore"
        # A_sol(x, R_{t-1}, E_{t-1}); with no usable rollout left, E_{t-1} alone; with neither, a fresh sample
        return "refine" if have_rollouts or have_experience else "generate"

    def _generation_prompt(self, question: str) -> list[Message]:
        """A_sol(x): the plain solution prompt (iteration 0, and a fresh sample)."""
        return generation_prompt(question, self.params.mode, self.params.style_of("solution"))

    def _explore_prompt(self, question: str, guideline: GuidelineBank) -> list[Message]:
        """A_sol(x, G_{t-1}) (line 12): the solution prompt with the guideline constraint listing G_{t-1}."""
        p = self.params
        return explore_prompt(question, p.mode, guideline.strategies, p.style_of("solution"))

    def _refine_prompt(
        self, question: str, views: list[RolloutView], experience: ExperienceBank | None
    ) -> list[Message]:
        p = self.params
        return refine_prompt(question, p.mode, views, experience, p.style_of("solution"))

    def _exploit_prompt(
        self,
        question: str,
        rollouts: list[Rollout],
        experience: ExperienceBank | None,
        window: int | None,
        reply_tokens: int | None,
    ) -> tuple[list[Message], RolloutFit]:
        """A_sol(x, R_{t-1}, E_{t-1}) (line 10): the refine prompt, R_{t-1} fitted to the prompt budget a context
        ``window`` and ``reply_tokens`` leave beside E_{t-1} (None: no bank in the prompt)."""
        fit = self._fit_to(rollouts, self._refine_prompt(question, [], experience), window, reply_tokens)
        return self._refine_prompt(question, fit.views, experience), fit

    def _window(self, session: ProblemSession, role: str) -> tuple[int | None, int | None]:
        """``role``'s context window and reply max_tokens, where they bound its prompts (not with context_tokens)."""
        window = session.context_window(role) if self.params.context_tokens is None else None
        return window, session.max_tokens(role) if window is not None else None

    def _fit(
        self,
        session: ProblemSession,
        role: str,
        rollouts: list[Rollout],
        base: list[Message],
    ) -> RolloutFit:
        """R_{t-1} as a prompt of ``role`` shows it: all of it, unless top_k / max_solution_chars / the window say
        otherwise."""
        return self._fit_to(rollouts, base, *self._window(session, role))

    def _fit_to(
        self, rollouts: list[Rollout], base: list[Message], window: int | None, reply_tokens: int | None
    ) -> RolloutFit:
        p = self.params
        budget = rollout_budget_chars(base, context_tokens=p.context_tokens, window=window, reply_tokens=reply_tokens)
        return fit_rollouts(
            rollouts,
            top_k=p.top_k,
            max_solution_chars=p.max_solution_chars,
            budget_chars=budget,
            scores=p.show_scores,
        )

    # ------------------------------------------------------------------------------------------ what RL trains on
    # tmas rl build-data (section 3.3) reads a stored run's solution prompts through these
    # (methods/training_prompts.py), built by the builders above, so training sees what inference sent.
    def rendering(self, settings: Settings | None, context_length: int | None) -> Rendering:
        """The solution agent's style and prompt budget of a run, from its parameters and settings. The window is
        the solution role's configured ``context_length`` (the embedded model's ``ctx_per_slot``); one the run only
        learnt from its server at run time is not stored, and ``context_length`` gives it."""
        p = self.params
        window = context_length
        reply = None
        if settings is not None:
            role = settings.roles.get("solution")
            if window is None:
                window = (role.context_length if role else None) or settings.endpoint.context_length
                if window is None and settings.uses_local_model:
                    window = settings.local.ctx_per_slot
            preset, own = p.sampling_layers("solution")
            reply = resolve_role(settings, "solution", preset=preset, method=own).sampling.max_tokens
        return Rendering(
            style=p.style_of("solution"),
            top_k=p.top_k,
            max_solution_chars=p.max_solution_chars,
            context_tokens=p.context_tokens,
            window=window,
            reply_tokens=reply,
        )

    def first_prompt(self, question: str, rendering: Rendering) -> list[Message]:
        return self._generation_prompt(question)

    def prompts_after(self, question: str, record: IterationRecord, rendering: Rendering) -> IterationPrompts:
        """Iteration t's exploit prompts (Base and Bank, R_{t-1} fitted as inference fits the exploit prompt, with
        the bank, and shown the same way in both halves) and explore prompt, from the stored record of t-1."""
        p = self.params
        banks = TMASState.model_validate(record.state)
        experience, guideline = banks.experience_bank, banks.guideline_bank
        rollouts = _stored_rollouts(record)
        exploit = None
        if rollouts and len(experience) and not p.no_experience:
            _, fit = self._exploit_prompt(question, rollouts, experience, rendering.window, rendering.reply_tokens)
            base, bank = (self._refine_prompt(question, fit.views, shown) for shown in (None, experience))
            exploit = (base, bank)
        explore = self._explore_prompt(question, guideline) if len(guideline) and not p.no_guideline else None
        return IterationPrompts(experience, guideline, exploit, explore)

    def leaves_next_state(self, record: IterationRecord) -> bool:
        """False where lines 19-20 were skipped (``skip_final_memory``'s last iteration, an early stop, a budget spent
        in the update): both agents then record ``skipped``, E_{t-1} and G_{t-1} stand and R_t has no summaries. Both
        record it too after an iteration with no rollout, whose next prompts would repeat this iteration's."""
        banks = TMASState.model_validate(record.state)
        updates = (banks.experience_update, banks.guideline_update)
        return not all(u.get("status") == "skipped" for u in updates)

    async def _chained_rollout(
        self,
        session: ProblemSession,
        i: int,
        plan: SolutionPlan,
        log: IterationLog,
        asked: Reasked,
        *,
        summarize: bool,
    ) -> CandidateOutcome | None:
        """Candidate i's rollout as chain i of the iteration: its calls carry ``chain=i``, and the chain ends with the
        rollout (also on an error or a cancel)."""
        with session.chain(i):
            return await self._rollout(session, i, plan, log, asked, summarize=summarize)

    # ------------------------------------------------------------------------------------------ one rollout
    async def _rollout(
        self,
        session: ProblemSession,
        i: int,
        plan: SolutionPlan,
        log: IterationLog,
        asked: Reasked,
        *,
        summarize: bool = True,
    ) -> CandidateOutcome | None:
        """Lines 9-16 for candidate i: c_{t,i}, then V_{t,i} (M passes in parallel), then s_{t,i} (unless not
        ``summarize``: the rollout then has no summary). Under a budget stop, what finished: None where the budget
        refused the solution call, else the candidate scored from the verifications that came back (unscored where
        none did), with no summary."""
        p = self.params
        # Lines 9-12: c_{t,i} = A_sol(x, ...) with the prompt z_{t,i} chose (the shared solution step, methods/steps.py:
        # echo guard, extraction, confidence; the answer reminder only after an exploit or explore prompt). A prompt
        # candidate i sent before (the plain prompt again after an iteration that left no rollout, the same bank
        # again) goes with a new seed where one is configured: the same one would draw the same reply again.
        candidate = await solve_call(
            session,
            "solution",
            plan.messages[i],
            index=i,
            mode=p.mode,
            parse=parse_solution,
            sampling=p.confidence_sampling(p.select),
            meta=CandidateMeta(mode=plan.modes[i], prompt=plan.prompt_names[i]),
            remind=p.answer_reminder and plan.prompt_names[i] != "generate",
            confidence_window=p.confidence_window if p.asks_confidence(p.select) else None,
            chain=i,
            asked=asked,
        )
        if candidate is None:
            # The budget refused the call: no candidate i this iteration, which ends with what finished (solve).
            return None
        candidate.score = 0.0
        log.record(solution_anomalies(candidate, p.mode))
        if candidate.error is not None:
            # A failed call or an echo never becomes a rollout: the candidate stays in the record, unusable.
            return CandidateOutcome(candidate, None)
        meta, text, answer = candidate.meta, candidate.text, candidate.answer
        if not text.strip():
            # Nothing to verify or summarise (a thinking model cut while it reasoned leaves no content): the candidate
            # stays in the record, scored 0, unverified, and no later prompt shows it.
            meta.unverified = True
            log.bad("solution_empty", f"candidate {i}: no solution text; not verified or summarised")
            return CandidateOutcome(candidate, None)

        # Line 14: M independent verification passes, in parallel.
        verifications, records = await self._verify(session, i, text, log)
        if not records:
            # The budget stopped every verification: a finished solution all the same, kept unverified and unscored
            # (the stop ends the problem with this iteration, so no later prompt would show it).
            meta.unverified = True
            candidate.score = None
            log.notes.append(f"candidate {i}: the budget stopped its verifications before any came back; unscored")
            return CandidateOutcome(candidate, None)
        if len(records) < p.m:
            log.notes.append(
                f"candidate {i}: {len(records)} of {p.m} verifications came back before the budget stop;"
                " scored from them"
            )
        meta.verifications = records
        score = _mean([v.effective_score for v in verifications])
        if p.mode == "numeric" and answer is None:
            score = 0.0
        candidate.score = score
        unsummarized = CandidateOutcome(
            candidate, Rollout(index=i, solution=text, summary="", score=score, answer=answer)
        )
        if not summarize or session.budget_stop is not None:
            # A budget stop (of this candidate's calls or another's) ends the problem with this iteration: nothing
            # reads a summary.
            return unsummarized

        # Line 15: s_{t,i} = A_sum(x, c_{t,i}, V_{t,i}): V_{t,i} is what the verifiers wrote; a call that failed wrote
        # nothing, so the summary agent is shown the replies alone (and, where none came back, not asked at all).
        replied = [v for v, record in zip(verifications, records, strict=True) if record.error is None]
        if replied:
            try:
                summary, call_id = await self._summarize(session, i, text, replied, log)
            except BudgetExhausted:
                return unsummarized
        else:
            log.notes.append(f"candidate {i}: no verification call came back; summary built from the scores")
            summary, call_id = summary_from_scores(verifications, "no verification call came back"), None
        meta.summary, meta.summary_call_id = summary.text, call_id
        rollout = Rollout(index=i, solution=text, summary=summary.text, score=score, answer=answer)
        return CandidateOutcome(candidate, rollout)

    async def _summarize(
        self, session: ProblemSession, i: int, solution: str, verifications: list[Verification], log: IterationLog
    ) -> tuple[Summary, int | None]:
        """s_{t,i} = A_sum(x, c_{t,i}, V_{t,i}) and its call; a summary built from the scores where the reply is
        unusable (failed, invalid, or echoing its instructions twice)."""
        q = session.problem.question
        s_messages = summary_prompt(q, solution, verifications, max_tokens=session.max_tokens("summary"))
        s_guard = EchoGuard.of(s_messages)
        try:
            s_guarded = await chat_guarded(
                session,
                "summary",
                s_messages,
                lambda r: "summary" if s_guard.echoes_text(r.content) else None,
                sample=i,
                chain=i,
            )
        except RetryRefused as refused:
            # The reply came back, echoing, and was spent: its call is the summary's; the stop ends the problem.
            s_guarded = refused.guarded
        s_reply = s_guarded.reply
        summary: Summary
        if s_guarded.refused is not None:
            log.bad(
                "summary_echo",
                f"candidate {i}: the summary echoed the prompt's instructions; the budget refused its retry"
                f" ({s_guarded.refused}); scores used",
            )
            return summary_from_scores(verifications, "the summary echoed its instructions"), s_reply.call_id
        if s_guarded.first_echo is not None:
            log.bad("summary_echo", f"candidate {i}: the summary echoed the prompt's instructions; asked again")
        if s_guarded.echo is not None:
            log.bad("summary_echo", f"candidate {i}: the retried summary echoed the instructions too; scores used")
            summary = summary_from_scores(verifications, "the summary echoed its instructions")
        elif not s_reply.ok:
            log.bad("summary_failed", f"candidate {i}: summary call failed: {s_reply.error}")
            summary = summary_from_scores(verifications, "the summary call failed")
        else:
            try:
                summary = parse_summary(s_reply.content, truncated=s_reply.truncated)
            except AgentOutputError as exc:
                session.tally("summary").unusable += 1
                log.bad("summary_invalid", f"candidate {i}: summary unusable ({exc}): {s_reply.content[:200]!r}")
                summary = summary_from_scores(verifications, str(exc))
        return summary, s_reply.call_id

    async def _verify(
        self,
        session: ProblemSession,
        i: int,
        solution: str,
        log: IterationLog,
    ) -> tuple[list[Verification], list[VerificationRecord]]:
        """V_{t,i}: M verifications of candidate i, with what each one's record keeps; where the budget stopped some,
        those that came back (none: it stopped them all).

        ``verifier_score = "text"`` (the paper): M analyses, each one's "Score:" line parsed. ``"logprob"`` (beyond
        the paper): M short score-first replies, each scored by the expected value of its score token's
        log-probabilities; a reply without them is scored from its text, counted as ``verifier_logprob_missing``.
        """
        p, q = self.params, session.problem.question
        logprob = p.verifier_score == "logprob"
        over: Sampling | None = None
        if logprob:
            check = score_first_prompt(q, solution, p.mode)
            asked = Sampling(
                max_tokens=p.score_max_tokens, extra_body={"logprobs": True, "top_logprobs": p.top_logprobs}
            )
            over = asked
        else:
            check = verification_prompt(q, solution, p.mode, p.style_of("verifier"))
        # Text scoring only: logprob scores are read from unconstrained tokens (see LLMClient._response_format).
        shape = None if logprob else verification_reply_model(session.max_tokens("verifier"))
        came_back = await gather_finished(
            session.chat("verifier", check, sample=i * p.m + j, sampling=over, reply_model=shape, chain=i)
            for j in range(p.m)
        )
        verifications: list[Verification] = []
        records: list[VerificationRecord] = []
        for j, v_reply in enumerate(came_back):
            if v_reply is None:
                continue  # refused by the budget: never asked, so no verification at all
            entry = VerificationRecord(call_id=v_reply.call_id)
            if not v_reply.ok:
                verification = Verification(feedback="(verification failed)", score=None)
                log.bad("verification_failed", f"candidate {i}, verifier {j}: call failed: {v_reply.error}")
                entry.error = v_reply.error
            elif logprob:
                scored = parse_score_first(v_reply.content, v_reply.logprobs, v_reply.reasoning)
                verification = Verification(feedback=scored.feedback, score=scored.score)
                entry.source = scored.source
                if scored.probabilities:
                    entry.probabilities = scored.probabilities
                if scored.source == "text":
                    log.bad(
                        "verifier_logprob_missing",
                        f"candidate {i}, verifier {j}: no log-probabilities at the score; the sampled score was used",
                    )
            else:
                verification = parse_verification(v_reply.content, truncated=v_reply.truncated)
                if verification.snapped:
                    entry.snapped = True
            if v_reply.ok and v_reply.truncated:
                entry.truncated = True
            if v_reply.ok and verification.score is None:
                session.tally("verifier").unusable += 1
                cut = " (cut at max_tokens, so not read)" if v_reply.truncated and not logprob else ""
                log.bad("verification_unparseable", f"candidate {i}, verifier {j}: no readable score{cut}; counted 0")
                entry.raw = v_reply.content[:RAW_LIMIT]
            verifications.append(verification)
            entry.score = verification.score
            records.append(entry)
        return verifications, records

    # ------------------------------------------------------------------------------------------ memory agents
    async def _update_experience(
        self,
        session: ProblemSession,
        rollouts: list[Rollout],
        bank: ExperienceBank,
        log: IterationLog,
    ) -> tuple[ExperienceBank, dict[str, Any]]:
        """Line 19, eq. 4: E_t = A_exp(x, R_t, E_{t-1}); any invalid update keeps E_{t-1}."""
        p, q = self.params, session.problem.question
        if p.no_experience:
            return bank, {"status": "disabled"}
        if not rollouts:
            log.notes.append("experience update skipped: no rollout this iteration")
            return bank, {"status": "skipped"}
        fit = self._fit(session, "experience", rollouts, experience_prompt(q, [], bank, p.experience_max_entries))
        if fit.changed:
            log.notes.append(f"experience prompt: {fit.describe()}")
        messages = experience_prompt(q, fit.views, bank, p.experience_max_entries)
        update, info = await self._ask_memory_agent(
            session,
            "experience",
            messages,
            parse_experience_update,
            log,
            experience_reply_model(session.max_tokens("experience")),
        )
        if update is None:
            return bank, info
        new_bank, report = apply_experience_ops(
            bank,
            update.operations,
            iteration=session.iteration,
            dedup_threshold=p.experience_dedup_threshold,
            max_entries=p.experience_max_entries,
        )
        rejected = update.malformed + report.rejected
        if rejected:
            log.anomalies["experience_ops_rejected"] += len(rejected)
            log.notes.append(f"experience update: {len(rejected)} operations refused: {'; '.join(rejected)[:500]}")
        return new_bank, {**info, "report": report.model_dump(), "malformed": update.malformed}

    async def _update_guideline(
        self,
        session: ProblemSession,
        rollouts: list[Rollout],
        bank: GuidelineBank,
        log: IterationLog,
    ) -> tuple[GuidelineBank, dict[str, Any]]:
        """Line 20, eq. 5: G_t = A_guide(x, R_t, G_{t-1}); any invalid update keeps G_{t-1}."""
        p, q = self.params, session.problem.question
        if p.no_guideline:
            return bank, {"status": "disabled"}
        if not rollouts:
            log.notes.append("guideline update skipped: no rollout this iteration")
            return bank, {"status": "skipped"}
        fit = self._fit(session, "guideline", rollouts, guideline_prompt(q, [], bank))
        if fit.changed:
            log.notes.append(f"guideline prompt: {fit.describe()}")
        update, info = await self._ask_memory_agent(
            session,
            "guideline",
            guideline_prompt(q, fit.views, bank),
            parse_guideline_update,
            log,
            GuidelineReply,
        )
        if update is None:
            return bank, info
        # The agent numbers rollouts as shown (candidate index + 1); map its verdicts back to those.
        shown = {view.number for view in fit.views}
        scores = {r.index + 1: r.score for r in rollouts}
        items = [item for item in update.items if item.rollout in shown]
        new_bank, report = apply_strategy_classifications(
            bank,
            items,
            iteration=session.iteration,
            n_rollouts=max(shown, default=0),
            scores=scores,
            dedup_threshold=p.guideline_dedup_threshold,
        )
        rejected = update.malformed + report.rejected
        rejected += [
            f"rollout {item.rollout}: not shown to the agent" for item in update.items if item.rollout not in shown
        ]
        if rejected:
            log.anomalies["guideline_items_rejected"] += len(rejected)
            log.notes.append(f"guideline update: {len(rejected)} verdicts refused: {'; '.join(rejected)[:500]}")
        return new_bank, {**info, "report": report.model_dump(), "malformed": update.malformed}

    async def _ask_memory_agent(
        self,
        session: ProblemSession,
        role: str,
        messages: list[Message],
        parse: Callable[..., Update],
        log: IterationLog,
        reply_model: type[BaseModel],
    ) -> tuple[Update | None, dict[str, Any]]:
        """One memory agent's call and parse. None with the reason when the update is unusable: the caller then
        keeps the previous bank, never a half-applied one. An update with an item that echoes the prompt's
        instructions is asked again once; echoing items of the reply used are dropped, so they never enter a bank.
        The reply used is the retry's, unless the retry failed, is unreadable or the budget refused it: then the first
        one's. A call the budget refused is no update (``{"status": "refused"}``); the stop stays in
        :attr:`ProblemSession.budget_stop`, which ends the problem once the iteration is recorded."""
        guard = EchoGuard.of(messages)

        def echo_of(r: Completion) -> str | None:
            try:
                dropped = parse(r.content, truncated=r.truncated).without_echoes(guard)[1]
            except AgentOutputError:
                return None
            return f"{len(dropped)} item(s) echoing the prompt's instructions" if dropped else None

        try:
            guarded = await chat_guarded(session, role, messages, echo_of, reply_model=reply_model)
        except RetryRefused as refused:
            # The first reply came back and was spent: read without its echoing items, as after an unusable retry.
            guarded = refused.guarded
        except BudgetExhausted as stop:
            log.notes.append(f"{role} update: the budget refused its call; previous bank kept")
            return None, {"status": "refused", "error": stop.detail}
        if guarded.refused is not None:
            log.bad(f"{role}_echo", f"{role} update held {guarded.first_echo}; the budget refused its retry")
        elif guarded.first_echo is not None:
            log.bad(f"{role}_echo", f"{role} update held {guarded.first_echo}; asked again")
        reply, retry = _reply_to_use(session, role, guarded, parse, log)
        if not reply.ok:
            log.bad(f"{role}_failed", f"{role} call failed: {reply.error}; previous bank kept")
            return None, {"status": "failed", "error": reply.error, "call_id": reply.call_id}
        try:
            update = parse(reply.content, truncated=reply.truncated)
        except AgentOutputError as exc:
            session.tally(role).unusable += 1
            log.bad(f"{role}_invalid", f"{role} update invalid ({exc}); previous bank kept")
            return None, {
                "status": "invalid",
                "error": str(exc),
                "raw": reply.content[:RAW_LIMIT],
                "call_id": reply.call_id,
            }
        info: dict[str, Any] = {"status": "applied", "call_id": reply.call_id}
        if retry is not None:
            info["retry"] = retry
        update, dropped = update.without_echoes(guard)
        if dropped:
            log.bad(f"{role}_echo", f"{role} update: {len(dropped)} items dropped: {'; '.join(dropped)[:500]}")
            info["echo_dropped"] = dropped
        return update, info

    # ------------------------------------------------------------------------------------------ early stopping
    def _early_stop(self, t: int, candidates: list[Candidate], streak: int) -> tuple[int, EarlyStop | None]:
        """Beyond the paper: stop once the answer is settled (the candidates agree and every verification of the
        agreeing ones passes) for `early_stop_patience` iterations in a row. Never after the last iteration, which
        has nothing left to save."""
        p = self.params
        agreement = _agreement(candidates, p.mode)
        weakest = _weakest_verification(candidates, p.mode)
        holds = agreement >= p.early_stop_agreement and weakest is not None and weakest >= p.early_stop_score
        streak = streak + 1 if holds else 0
        if not p.early_stop or streak < p.early_stop_patience or t == p.iterations - 1:
            return streak, None
        agreed = "agreement" if p.mode == "numeric" else "share of candidates with a proof"
        reason = (
            f"after iteration {t}: settled for {streak} consecutive iteration(s): {agreed} {agreement:.2f} >= "
            f"{p.early_stop_agreement:g} and every verification of the "
            f"{'agreeing candidates' if p.mode == 'numeric' else 'proofs'} scored >= "
            f"{p.early_stop_score:g} (lowest {weakest:.2f})"
        )
        return streak, EarlyStop(
            iteration=t,
            reason=reason,
            agreement=agreement,
            lowest_verification=weakest,
            mean_score=_mean([c.score or 0.0 for c in candidates]),
        )


# ---------------------------------------------------------------------------------------------- helpers
def _stored_rollouts(record: IterationRecord) -> list[Rollout]:
    """R_t of a stored iteration record: the candidates whose solution call succeeded and was verified (one with no
    solution text was not), with their summaries."""
    return [
        Rollout(index=c.index, solution=c.text, summary=c.meta.summary or "", score=c.score or 0.0, answer=c.answer)
        for c in record.candidates
        if not c.error and not c.meta.unverified
    ]


def _reply_to_use(
    session: ProblemSession,
    role: str,
    guarded: GuardedReply,
    parse: Callable[..., EchoFiltered],
    log: IterationLog,
) -> tuple[Completion, dict[str, Any] | None]:
    """The memory agent's reply to read: the retry's after an echo, unless the retry is no update at all (a failed
    call, an unreadable reply) while the first reply is one but for its echoing items; then the first (whose echoing
    items the caller drops), with what became of the retry for the update's record."""
    used, why = reply_to_read(guarded, lambda r: _unusable_update(r, parse))
    if why is None:
        return used, None
    if guarded.refused is not None:
        # No retry came back: the first reply is read, and the update's record says the budget refused the retry.
        return used, {"status": "refused", "error": guarded.refused}
    retry = guarded.reply
    if retry.ok:
        session.tally(role).unusable += 1
    log.notes.append(f"{role} retry unusable ({why}); the first reply applied without its echoing items")
    return used, {"status": "invalid" if retry.ok else "failed", "error": why, "call_id": retry.call_id}


def _unusable_update(reply: Completion, parse: Callable[..., EchoFiltered]) -> str | None:
    """Why a memory agent's ``reply`` is no update (its call failed, or ``parse`` refuses it); None when it is one."""
    if not reply.ok:
        return f"call failed: {reply.error}"
    try:
        parse(reply.content, truncated=reply.truncated)
    except AgentOutputError as exc:
        return str(exc)
    return None


def _bernoulli(seed: int, problem_id: str, t: int, i: int, epsilon: float) -> bool:
    """z_{t,i} ~ Bernoulli(epsilon), from an RNG fixed by (run seed, problem, iteration, candidate)."""
    return random.Random(f"{seed}\x1f{problem_id}\x1f{t}\x1f{i}").random() < epsilon


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _weakest_verification(candidates: list[Candidate], mode: str) -> float | None:
    """The lowest verification score of the candidates giving the most common answer (in proof mode, of those that
    wrote a proof: one with no text was not verified, and :func:`_agreement` counts it against settling); a failed or
    unreadable verification counts 0; None when no such candidate was verified."""
    usable = [c for c in candidates if c.error is None]
    if mode == "numeric":
        keys = [value_key(c.answer) for c in usable if c.answer is not None]
        if not keys:
            return None
        leading = Counter(keys).most_common(1)[0][0]
        usable = [c for c in usable if c.answer is not None and value_key(c.answer) == leading]
    scores = [v.score for c in usable for v in c.meta.verifications or []]
    return min((s if s is not None else 0.0 for s in scores), default=None)


def _agreement(candidates: list[Candidate], mode: str) -> float:
    """Share of candidates giving the most common answer (numeric, by spelling and exact number: no rule check for
    a progress figure); in proof mode, where no two answers are counted equal, the share that wrote a proof (a call
    that failed or left no text wrote none), so an iteration counts as settled on the same candidates in both modes."""
    if mode != "numeric":
        written = [c for c in candidates if c.error is None and c.text.strip()]
        return len(written) / len(candidates) if candidates else 0.0
    keys = [value_key(c.answer) for c in candidates if c.answer is not None]
    if not keys or not candidates:
        return 0.0
    return Counter(keys).most_common(1)[0][1] / len(candidates)
