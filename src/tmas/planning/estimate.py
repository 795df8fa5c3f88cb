"""What a run or a grid will cost, before it starts: calls per problem from each method's structure, tokens per call
from a pilot (or a given average, or max_tokens as a ceiling), totals over problems and points, and hours at a
throughput.

Each method states its own calls per problem, by role (:meth:`tmas.methods.base.Method.calls_per_problem`, the
formula in each method's docstring); a method that states none is shown as unknown. Where stopping makes the count
uncertain, the estimate gives the range from the fewest calls (and tokens) to the most. The ceilings (the most calls,
and the tokens at max_tokens) hold the replies asked again too, each as often as it can be (``CallCount.most``).
The token ceiling is of the replies: an attempt cut part way and retried is charged to its call for what it had
generated (up to max_tokens more per attempt), and the ceiling says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tmas.config import Settings
from tmas.llm.sampling import resolve_role
from tmas.methods.base import Method
from tmas.methods.call_count import CallCount, calls_tokens

# The calls one question may cost before ``tmas solve`` asks (and a ``tmas serve`` request's cap, by default): a few
# hundred is what a baseline costs at its paper setting; the TMAS paper's 1,630 is a benchmark run's worth.
QUESTION_CALLS = 500
# The calls a run, an evaluation or a sweep may cost before the command asks (tmas.api's runs refuse above it).
RUN_CALLS = 20_000
# The completion tokens (where the estimate knows them) above which the same ask (or refuse).
CONFIRM_TOKENS = 50_000_000


def calls_per_problem(method: Method[Any]) -> CallCount:
    """Chat calls one problem costs under ``method``, as the method states them."""
    return method.calls_per_problem()


def role_max_tokens(settings: Settings, method: Method[Any], role: str) -> int | None:
    """The max_tokens a call of ``role`` sends, resolved as every call is (:func:`tmas.llm.sampling.resolve_role`):
    a method's preset fills only what no one set, its own per-role sampling goes over the settings, and what the
    method puts on each call of the role itself (:meth:`Method.call_max_tokens`) over everything."""
    fixed = method.call_max_tokens(role)
    if fixed is not None:
        return fixed
    preset, own = method.params.sampling_layers(role)
    return resolve_role(settings, role, preset=preset, method=own).sampling.max_tokens


@dataclass
class PilotSpend:
    """What one configuration's pilot spent per problem, every stored call counted (as a run's spend is:
    ``tmas.reports.metrics.spent_through``), and what it leaves out of a whole run: the calls its cut structure
    states per problem (:meth:`Method.calls_per_problem` at the pilot's iterations), and how many of its problems
    ran to its last iteration (the others stopped before it, and a whole run stops them there too)."""

    problems: int
    completion_tokens: float
    prompt_tokens: float
    calls: dict[str, int]
    at_cap: int

    def per_problem(
        self, whole: Mapping[str, int], per_call: Mapping[str, float], prompt: bool = False, cap: int | None = None
    ) -> float:
        """The tokens one problem of a whole run whose structure states ``whole`` calls spends: the pilot's mean,
        and for the share of problems that ran to the pilot's last iteration, the calls the pilot cut off at
        ``per_call`` each; under a call budget of ``cap`` calls a problem, the share of those it leaves (a problem
        stops there, pilot or whole run)."""
        spent = self.prompt_tokens if prompt else self.completion_tokens
        if not self.problems:
            return 0.0
        more = max(0.0, calls_tokens(whole, per_call) - calls_tokens(self.calls, per_call))
        beyond = sum(whole.values()) - sum(self.calls.values())
        if cap is not None and beyond > 0:
            left = max(0, min(sum(whole.values()), cap) - min(sum(self.calls.values()), cap))
            more *= min(1.0, left / beyond)
        return spent / self.problems + more * self.at_cap / self.problems


@dataclass
class TokenRates:
    """Mean tokens per call, by role where a pilot measured them; ``default`` for roles it did not see; ``pilots``:
    what each configuration's pilot spent per problem, by its name."""

    completion: dict[str, float] = field(default_factory=dict)
    prompt: dict[str, float] = field(default_factory=dict)
    default_completion: float | None = None
    default_prompt: float = 0.0
    # "pilot" or "given".
    source: str = "given"
    # Completion tokens per second over the pilot (all its calls in flight together), when measured.
    throughput: float | None = None
    pilots: dict[str, PilotSpend] = field(default_factory=dict)

    def completion_of(self, role: str) -> float | None:
        return self.completion.get(role, self.default_completion)

    def prompt_of(self, role: str) -> float:
        return self.prompt.get(role, self.default_prompt)


def rates_from_role_costs(costs: Iterable[Mapping[str, Mapping[str, int]]], wall_s: float | None = None) -> TokenRates:
    """Per-role means from pilot runs' ``RunStore.role_costs()``; roles the pilot never called get the overall mean."""
    calls: dict[str, int] = {}
    prompt: dict[str, int] = {}
    completion: dict[str, int] = {}
    for run in costs:
        for role, c in run.items():
            # Per answered call: the failed ones, asked again or not, are left out.
            ok = c["calls"] - c.get("failed", 0) - c.get("asked_again", 0)
            if ok <= 0:
                continue
            calls[role] = calls.get(role, 0) + ok
            prompt[role] = prompt.get(role, 0) + c["prompt_tokens"]
            completion[role] = completion.get(role, 0) + c["completion_tokens"]
    total = sum(calls.values())
    if total == 0:
        return TokenRates(source="pilot")
    rates = TokenRates(
        completion={r: completion[r] / calls[r] for r in calls},
        prompt={r: prompt[r] / calls[r] for r in calls},
        default_completion=sum(completion.values()) / total,
        default_prompt=sum(prompt.values()) / total,
        source="pilot",
    )
    if wall_s and wall_s > 0:
        rates.throughput = sum(completion.values()) / wall_s
    return rates


@dataclass
class PointEstimate:
    """One run (or one grid point) over its problems."""

    name: str
    method: str
    problems: int
    calls: CallCount
    # Completion and prompt tokens over all problems; None when neither a rate nor max_tokens is known.
    completion_tokens: float | None = None
    prompt_tokens: float | None = None
    # How the tokens were found: "pilot", "given" (an average per call) or "max_tokens" (a ceiling).
    basis: str = ""
    # Completion tokens over all problems when every problem stops as early as its stopping rule allows (None
    # without a stopping rule, or without tokens).
    fewest_completion_tokens: float | None = None
    # Each role's max_tokens where the completion tokens are their ceiling (basis "max_tokens", no token budget
    # cutting them): what a stored call of the role is taken off them at (:func:`stored_ceiling`).
    ceilings: dict[str, float] = field(default_factory=dict)
    # Where a completion-token budget cuts the max_tokens ceiling: the most one problem spends, replayed calls
    # included (its budget and the call that passes it; None under a pooled budget, whose problems draw on each
    # other's): a resume takes what its replayed calls spent off it (:func:`stored_ceiling`).
    problem_cap: float | None = None
    # Whether the cut is a pooled budget's: the point's tokens bound what its problems spend together.
    pooled: bool = False

    @property
    def total_calls(self) -> int:
        return self.calls.total * self.problems

    @property
    def upper_calls(self) -> int:
        return self.calls.upper_total * self.problems

    @property
    def fewest_calls(self) -> int:
        return self.calls.fewest_total * self.problems

    @property
    def most_calls(self) -> int:
        """The most calls the point can send: the upper count with every reply asked again as often as it can be."""
        return self.calls.most_total * self.problems


def estimate_point(
    name: str, method: Method[Any], settings: Settings, problems: int, rates: TokenRates | None, *, banked: int = 0
) -> PointEstimate:
    """The estimate of ``problems`` solved under ``method`` and ``settings``; ``banked``: what a pooled token budget's
    bank holds for them as they start (a resumed run's, from the problems it finished before:
    :meth:`tmas.runner.RunSetup.pooled_left`), which they may spend beside their own shares."""
    count = calls_per_problem(method)
    budget = settings.budget
    if budget.calls is not None and count.most_total > budget.calls:
        # The budget counts every call, replies asked again included: no problem sends more.
        structure = count.upper_total
        count.cap = budget.calls
        if structure > budget.calls:
            count.exact = False
            count.note = "; ".join(
                filter(None, [count.note, f"the call budget stops each problem at {calls_said(budget.calls)}"])
            )
    point = PointEstimate(name, method.name, problems, count)
    if not count.known:
        return point
    per_call: dict[str, float] | None = None
    # A ceiling counts the most calls, each at the dearer role where it may go out as another's, and under a call
    # budget no more than its number of the dearest (CallCount.ceiling); a mean counts the expected ones (a call
    # budget's cap cutting them by its share).
    ceiling = True
    if rates is not None and rates.default_completion is not None:
        per_call = {role: rates.completion_of(role) or 0.0 for role in count.most}
        ceiling = False
        point.prompt_tokens = (
            problems * count.share() * sum(n * rates.prompt_of(role) for role, n in count.expected.items())
        )
        point.basis = rates.source
    else:
        ceilings = {role: role_max_tokens(settings, method, role) for role in count.ceiling_roles}
        if all(v is not None for v in ceilings.values()):
            per_call = {role: float(v or 0) for role, v in ceilings.items()}
            point.basis = "max_tokens"
    pilot = rates.pilots.get(name) if rates is not None and not ceiling else None
    if pilot is not None and per_call is not None and rates is not None:
        # A method that stops early (MATTRL's converged deliberation, an early stop, a decided vote) sends fewer
        # calls than its structure states: the pilot's problems spent what they spent, and only those that ran to
        # its last iteration go on to the calls it cut off.
        prompt_rates = {role: rates.prompt_of(role) for role in count.most}
        point.prompt_tokens = problems * pilot.per_problem(count.expected, prompt_rates, prompt=True, cap=budget.calls)
    if per_call is not None:
        if ceiling:
            per_problem = count.ceiling(per_call)
        elif pilot is not None:
            per_problem = pilot.per_problem(count.expected, per_call, cap=budget.calls)
        else:
            per_problem = calls_tokens(count.expected, per_call) * count.share()
        # The structure's, whatever the budget.
        whole = problems * per_problem
        cut = False
        # What a problem spends as the budget counts it, and the dearest call as it counts it: a mean's prompts too
        # where it counts them (a ceiling knows no prompt, and its completion tokens alone bound what passes it).
        counted, over = per_problem, max(per_call.values(), default=0.0)
        if budget.count == "total" and rates is not None and not ceiling and problems:
            counted += (point.prompt_tokens or 0.0) / problems
            over = max((n + rates.prompt_of(role) for role, n in per_call.items()), default=0.0)
        if budget.tokens is not None and counted > budget.tokens:
            cut = True
            # A problem stops at the budget, passing it by one call at most (ProblemSession._admit): at the dearest
            # call's max_tokens in a ceiling, its mean in a mean (a pilot's problems stopped by the budget spent
            # that much). Where the budget counts prompts, the completion tokens are their share of it.
            per_problem = min(per_problem, (budget.tokens + over) * per_problem / counted)
            pooled = f" and the {banked} tokens its finished problems left" if banked > 0 else ""
            tokens = f"{budget.tokens} prompt + completion tokens" if budget.count == "total" else str(budget.tokens)
            where = (
                f"the pooled token budget stops the run near {budget.tokens * problems}{pooled}"
                if budget.pool
                else f"the token budget stops each problem near {tokens}"
            )
            count.note = "; ".join(filter(None, [count.note, where]))
        point.completion_tokens = problems * per_problem
        if cut and budget.pool and banked > 0:
            # The bank's tokens go to the problems still open, beside their own shares (TokenBank).
            point.completion_tokens = min(whole, point.completion_tokens + banked)
        if point.basis == "max_tokens" and not cut:
            point.ceilings = per_call
        elif point.basis == "max_tokens":
            point.problem_cap, point.pooled = per_problem, budget.pool
        if count.fewest is not None or count.stoppable:
            point.fewest_completion_tokens = problems * min(_fewest_completion(count, per_call, ceiling), per_problem)
    return point


def replay_credit(point: PointEstimate, stored: Mapping[str, int]) -> int:
    """The calls a resume of ``point`` counts as replayed, from its ``stored`` answered calls by problem
    (:meth:`tmas.store.run_store.RunStore.sure_replays`): each problem's, up to the most the point's count lets one
    problem send by its structure. A problem that stored more (under a larger k or T before, or with replies asked
    again) replays no more than that, and takes nothing off what another problem has still to send; what it stored
    of replies asked again is not taken off the most it may send, so the calls still to send stay a bound."""
    most = point.calls.upper_total if point.calls.known else 0
    return sum(min(n, most) for n in stored.values())


def stored_ceiling(
    point: PointEstimate, calls: int, answered: Mapping[str, int], spent: Mapping[str, int] | None = None
) -> float | None:
    """The fewest completion tokens ``calls`` stored calls of ``point`` come to at their roles' max_tokens, where
    ``answered`` holds the store's answered calls by role (a superset of those replayed): what a resume's ceiling
    takes them off at (``Estimate.stored_tokens``). Where a completion-token budget cuts the ceiling, what the
    replayed calls and its failed ones ``spent`` of it instead, by problem
    (:meth:`tmas.runner.RunSetup.replayed_tokens`): a problem spends no more than its cap, replays and failed calls
    included, so what is left of it bounds what it sends. None where the
    point's tokens are a mean (or ``spent`` is not given for a cut one): the calls' share is taken off then."""
    if point.ceilings:
        return fewest_tokens(calls, answered, point.ceilings)
    if point.problem_cap is None or spent is None:
        return None
    if point.pooled:
        return min(point.completion_tokens or 0.0, float(sum(spent.values())))
    return sum(min(point.problem_cap, float(n)) for n in spent.values())


def stored_over_points(
    held: Iterable[tuple[PointEstimate, int, Mapping[str, int], Mapping[str, int] | None]],
) -> float | None:
    """The completion tokens the stored calls of several points (a sweep's, a pilot's configurations) take off their
    estimate, point by point, from each point's replayed ``calls``, the answered calls of its store by role and what
    the replayed calls spent by problem: as :func:`stored_ceiling` takes them off, else their share of the point's
    own tokens by its most calls (``Estimate.stored_tokens``). None where a point with stored calls
    has unknown tokens. A share over all the points would take a point's cheap stored calls off the others' dearer
    ones, and a point stopped after its cheap calls would have its dear ones taken off by their share."""
    taken = 0.0
    for point, calls, answered, spent in held:
        # A problem's failed calls spend its token budget though none is replayed (:func:`stored_ceiling`).
        budgeted = point.problem_cap is not None and bool(spent)
        if not (calls or budgeted) or not point.most_calls:
            continue
        if point.completion_tokens is None:
            return None
        ceiling = stored_ceiling(point, calls, answered, spent)
        share = point.completion_tokens * min(calls, point.most_calls) / point.most_calls
        taken += min(point.completion_tokens, share if ceiling is None else ceiling)
    return taken


def fewest_tokens(calls: int, answered: Mapping[str, int], per_call: Mapping[str, float]) -> float:
    """The fewest completion tokens ``calls`` of the stored calls can come to at ``per_call`` tokens each (by role,
    its max_tokens; a role without one at none), where ``answered`` holds each role's answered calls in the store:
    which of them replay is known only by role, so the cheaper role's are taken first. Subtracted from a ceiling
    that counts every call at its max_tokens, what is left bounds the tokens still to send (their share by calls does
    not: a run stopped after its cheap calls has its dear ones left)."""
    tokens = 0.0
    for role in sorted(answered, key=lambda r: per_call.get(r, 0.0)):
        taken = min(calls, answered[role])
        tokens += taken * per_call.get(role, 0.0)
        calls -= taken
    return tokens


def _fewest_completion(count: CallCount, per_call: Mapping[str, float], ceiling: bool) -> float:
    """Completion tokens when the problem stops as early as it can: its fewest calls, the ones online stopping may
    cut at ``stoppable_tokens`` each; under a call budget below them, no more than its number of their dearest
    (``ceiling``: ``per_call`` is each role's max_tokens), else their share."""
    fewest = count.fewest if count.fewest is not None else count.expected
    tokens = calls_tokens(fewest, per_call)
    for role, n in (count.stoppable or {}).items():
        tokens -= n * max(0.0, per_call.get(role, 0.0) - count.stoppable_tokens)
    calls = sum(fewest.values())
    if count.cap is None or calls <= count.cap:
        return tokens
    if not ceiling:
        return tokens * count.cap / calls
    dearest = sorted((per_call.get(role, 0.0) for role, n in fewest.items() for _ in range(n)), reverse=True)
    return min(tokens, sum(dearest[: count.cap]))


@dataclass
class Estimate:
    points: list[PointEstimate]
    rates: TokenRates | None = None
    # Completion tokens per second the hours are worked at: given, or measured by the pilot.
    throughput: float | None = None
    # Calls a resumed run holds already (answered, so replayed rather than sent): what the gate need not ask about.
    stored_calls: int = 0
    # The fewest completion tokens the stored calls come to at their roles' max_tokens, where the estimate is a
    # ceiling by role (:func:`stored_ceiling`, :mod:`tmas.planning.pool_build`), or over several points each point's
    # own (:func:`stored_over_points`): the tokens still to send are then the estimate's less these. Without it they
    # are the estimate's share by calls, which is no ceiling where the stored calls are of a role (or a point) with a
    # smaller max_tokens than those still to send.
    stored_tokens: float | None = None
    # Calls the command sends beside the method's and counts in no figure (a report's judge), each said in words.
    left_out: list[str] = field(default_factory=list)
    # Whether the command takes --tokens-per-call, --pilot and --throughput (the lines on unknown tokens and hours
    # name them); where it does not, max_tokens is the one way to tokens.
    measurable: bool = True

    @property
    def calls_to_send(self) -> int:
        """The most calls still to be sent: the most the points can send (replies asked again included) less those
        stored."""
        return max(0, self.most_calls - self.stored_calls)

    @property
    def tokens_to_send(self) -> float | None:
        """Completion tokens of the calls still to send (the estimate's less ``stored_tokens`` where known, else their
        share of the whole estimate's), None where unknown."""
        tokens = self.completion_tokens
        if tokens is None:
            return None
        if self.stored_tokens is not None:
            # Under a token budget, a problem's failed calls have spent some of it with no call replayed.
            return max(0.0, tokens - self.stored_tokens)
        if not self.stored_calls or not self.most_calls:
            return tokens
        return tokens * self.calls_to_send / self.most_calls

    @property
    def calls(self) -> int:
        return sum(p.total_calls for p in self.points)

    @property
    def upper_calls(self) -> int:
        return sum(p.upper_calls for p in self.points)

    @property
    def fewest_calls(self) -> int:
        return sum(p.fewest_calls for p in self.points)

    @property
    def most_calls(self) -> int:
        return sum(p.most_calls for p in self.points)

    @property
    def completion_tokens(self) -> float | None:
        values = [p.completion_tokens for p in self.points]
        return None if any(v is None for v in values) else sum(v or 0.0 for v in values)

    @property
    def fewest_completion_tokens(self) -> float | None:
        """Completion tokens when every problem stops as early as its rule allows (None where unknown)."""
        total = self.completion_tokens
        if total is None:
            return None
        return sum(
            p.completion_tokens if p.fewest_completion_tokens is None else p.fewest_completion_tokens or 0.0
            for p in self.points
            if p.completion_tokens is not None
        )

    @property
    def hours(self) -> float | None:
        """The hours the completion tokens still to send take at ``throughput`` (a resume's stored calls are replayed,
        not generated)."""
        tokens = self.tokens_to_send
        if tokens is None or not self.throughput:
            return None
        return tokens / self.throughput / 3600

    def over(self, max_calls: int | None, max_tokens: float | None) -> str | None:
        """Why this estimate needs a confirmation (None when it is under both thresholds)."""
        if max_calls is not None and self.calls_to_send > max_calls:
            return f"{calls_said(self.calls_to_send)} (threshold {max_calls:,})"
        tokens = self.tokens_to_send
        if max_tokens is not None and tokens is not None and tokens > max_tokens:
            return f"{_tokens(tokens)} completion tokens (threshold {_tokens(max_tokens)})"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": [
                {
                    "name": p.name,
                    "method": p.method,
                    "problems": p.problems,
                    "calls_per_problem": p.calls.expected,
                    "calls_per_problem_upper": p.calls.upper,
                    "calls_per_problem_fewest": p.calls.fewest,
                    "calls_per_problem_most": p.calls.most,
                    "exact": p.calls.exact,
                    "note": p.calls.note,
                    "calls": p.total_calls,
                    "upper_calls": p.upper_calls,
                    "fewest_calls": p.fewest_calls,
                    "most_calls": p.most_calls,
                    "completion_tokens": p.completion_tokens,
                    "fewest_completion_tokens": p.fewest_completion_tokens,
                    "prompt_tokens": p.prompt_tokens,
                    "token_basis": p.basis,
                }
                for p in self.points
            ],
            "calls": self.calls,
            "upper_calls": self.upper_calls,
            "fewest_calls": self.fewest_calls,
            "most_calls": self.most_calls,
            "completion_tokens": self.completion_tokens,
            "fewest_completion_tokens": self.fewest_completion_tokens,
            "throughput_tokens_per_s": self.throughput,
            "hours": self.hours,
            "stored_calls": self.stored_calls,
        }


# What a token ceiling at max_tokens leaves out, said in the whole estimate and in its one line: a call is charged what
# its attempts cut part way had generated too (docs/sampling_and_budgets.md, "What a call costs"), up to max_tokens
# each, which no count of calls bounds.
RETRIED_ATTEMPTS = "an attempt cut part way and retried adds what it had generated"


def calls_said(count: int, noun: str = "call") -> str:
    """``count`` with ``noun``, in the plural but for one: "1 call", "2 calls", "1,000 answered calls"."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _tokens(value: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.{1 if value < 10 * size else 0}f}{unit}"
    return f"{value:.0f}"


def brief_estimate(estimate: Estimate) -> str:
    """The estimate in one line: the calls (still to send, on a resume), the most they come to with every reply asked
    again as often as it can be (methods/call_count.py), and the completion-token ceiling or mean."""
    if estimate.stored_calls:
        # A resume's calls to send are a bound: a stored call after a failed one is counted as to send, and every
        # reply asked again is in it.
        calls = estimate.calls_to_send
        shown = f"up to {calls:,} call{'' if calls == 1 else 's'} to send ({estimate.stored_calls:,} stored, replayed)"
    else:
        calls = estimate.upper_calls
        ranged = estimate.fewest_calls < calls
        up_to = not ranged and estimate.calls != calls
        low = f"{estimate.fewest_calls:,} to " if ranged else "up to " if up_to else ""
        shown = f"{low}{calls:,} call{'' if calls == 1 and not ranged else 's'}"
        if estimate.most_calls > calls:
            shown += f" ({estimate.most_calls:,} at most, with replies asked again)"
    if any(not p.calls.known for p in estimate.points):
        shown += " and calls of unknown count"
    tokens = estimate.tokens_to_send
    if tokens is not None:
        ceiling = any(p.basis == "max_tokens" for p in estimate.points)
        shown += f", {'<=' if ceiling else '~'}{_tokens(tokens)} completion tokens"
        if ceiling:
            shown += f" ({RETRIED_ATTEMPTS})"
    if _unstated_again(estimate):
        shown += ", plus any reply asked again the method does not count (one call more each)"
    for what in estimate.left_out:
        shown += f"; not counted: {what}"
    return shown


def _unstated_again(estimate: Estimate) -> bool:
    """Whether a point's method counts calls but states none of its replies asked again (a plugin's may not)."""
    return any(p.calls.known and p.calls.again is None for p in estimate.points)


def format_estimate(estimate: Estimate) -> str:
    """A plain-text table: one line per point, then the totals and the hours."""
    lines = ["cost estimate (before any call):"]
    width = max([len(p.name) for p in estimate.points] + [5])
    lines.append(f"  {'point':<{width}}  problems  calls/problem      calls  completion tokens")
    for p in estimate.points:
        per = f"{p.calls.total:,}" if p.calls.exact else f"<={p.calls.upper_total:,}"
        calls = f"{p.upper_calls:,}"
        tokens = "?" if p.completion_tokens is None else _tokens(p.completion_tokens)
        if p.calls.fewest is not None and p.calls.fewest_total < p.calls.upper_total:
            # A stopping rule: from the fewest (every problem stopping as early as it can) to the most (a call budget
            # below the fewest leaves one count).
            per, calls = f"{p.calls.fewest_total:,}-{p.calls.upper_total:,}", f"{p.fewest_calls:,}-{calls}"
        fewest = p.fewest_completion_tokens
        if fewest is not None and p.completion_tokens is not None and fewest < p.completion_tokens:
            tokens = f"{_tokens(fewest)}-{tokens}"
        if p.basis == "max_tokens":
            tokens = f"<={tokens} (max_tokens)"
        if not p.calls.known:
            per = calls = "?"
        lines.append(f"  {p.name:<{width}}  {p.problems:>8}  {per:>13}  {calls:>9}  {tokens}")
    for p in estimate.points:
        if p.calls.note:
            lines.append(f"  note: {p.name}: {p.calls.note}")
    total = estimate.completion_tokens
    basis = {p.basis for p in estimate.points if p.basis}
    unknown = " and the unknown calls of the points marked ?" if any(not p.calls.known for p in estimate.points) else ""
    if estimate.fewest_calls < estimate.upper_calls:
        # From every call usable to the most the structure allows: where no point has a stopping rule, the range is
        # that of replies asked again and the like, said in the points' notes.
        why = " (stopping rules)" if any(p.calls.fewest is not None for p in estimate.points) else ""
        lines.append(f"  total: {estimate.fewest_calls:,} to {estimate.upper_calls:,} calls{why}{unknown}")
    else:
        at_most = "" if estimate.calls == estimate.upper_calls else " at most"
        lines.append(f"  total: {calls_said(estimate.upper_calls)}{at_most}{unknown}")
    if _unstated_again(estimate):
        lines.append(
            "  calls of a method that does not count its replies asked again hold every reply as usable: a reply"
            " asked again (one that repeats its instructions, a solution with no answer) adds one"
        )
    if any(p.calls.known for p in estimate.points):
        # As each method states its count (tmas.methods.call_count): the most with every reply asked again.
        lines.append(
            f"  at most: {calls_said(estimate.most_calls)} with every reply asked again as often as it can be (one"
            " that repeats its instructions once, then an answerless solution reminded of its answer once);"
            " a transport retry adds an attempt, not a call"
        )
    if estimate.stored_calls:
        to_send = estimate.tokens_to_send
        ceiling = any(p.basis == "max_tokens" for p in estimate.points)
        tokens = "" if to_send is None else f", {'<=' if ceiling else '~'}{_tokens(to_send)} completion tokens"
        lines.append(
            f"  stored: {calls_said(estimate.stored_calls, 'answered call')}, replayed rather than sent; at most"
            f" {estimate.calls_to_send:,} still to send{tokens}"
        )
    for what in estimate.left_out:
        lines.append(f"  not counted: {what}")
    if total is None:
        give = "give --tokens-per-call, --pilot N, or " if estimate.measurable else ""
        lines.append(f"  tokens: unknown ({give}set max_tokens for a ceiling)")
    else:
        # A pilot's own runs (tmas.planning.pilot) measure what a problem spends, not only the tokens per call.
        spent = estimate.rates is not None and any(p.name in estimate.rates.pilots for p in estimate.points)
        measured = (
            "what its problems spent, and the calls it cut off at its mean per call," if spent else "mean per call"
        )
        how = {
            "pilot": f"{measured} measured by the pilot",
            "given": "the given tokens per call",
            "max_tokens": f"every call, replies asked again included, at max_tokens: a ceiling; {RETRIED_ATTEMPTS}",
        }
        fewest = estimate.fewest_completion_tokens
        shown = _tokens(total) if fewest is None or fewest >= total else f"{_tokens(fewest)} to {_tokens(total)}"
        lines.append(f"  completion tokens: {shown} ({'; '.join(how.get(b, b) for b in sorted(basis))})")
    hours = estimate.hours
    if hours is not None:
        src = (
            "measured by the pilot" if estimate.rates and estimate.rates.throughput == estimate.throughput else "given"
        )
        rate = estimate.throughput or 0.0
        shown = f"{rate:,.1f}" if rate < 100 else f"{rate:,.0f}"
        lines.append(f"  time: {hours:,.1f} hours at {shown} completion tokens/s ({src})")
    elif total is not None and estimate.measurable:
        lines.append("  time: give --throughput TOKENS_PER_S (or --pilot N to measure it) for hours")
    return "\n".join(lines)
