"""What a run or a grid will cost, before it starts: calls per problem from each method's structure, tokens per call
from a pilot (or a given average, or max_tokens as a ceiling), totals over problems and points, and hours at a
throughput.

Calls per problem, by role, when every call succeeds (a failed call only ever lowers the count: its candidate is not
verified or summarised, a memory agent with no rollout is skipped):

- cot: 1 solution call.
- majority: k x T solution calls (MV@k is k samples; each further iteration draws k more). With ``stop = "beta"``
  that is the most; the fewest is the first round end at which enough agreeing samples can decide the vote (4 at
  the 0.95 threshold, so one round of 4), the problem stopping there (with ``online_stop`` a round also ends where
  the warm-up does). ``online_stop`` leaves the calls as they are and makes their tokens a range: at the fewest,
  every sample after the ``warmup`` ones is stopped as soon as it can be, once ``confidence_window`` tokens arrived.
- self_refine: N solution calls in iteration 0, N refiner calls in each of the T - 1 later ones: N x T.
- verify_refine: N solution + N x (T - 1) corrector + N x m x T verifier calls: N x T x (1 + m).
- pacore: R x T solution calls (R responses per round), plus the synthesis round's S calls when ``synthesis``.
- rse: N x T solution calls and N x (T - 1) distiller calls (the last iteration is not distilled); its embedding
  requests are not chat calls and are not counted.
- tmas (Algorithm 1, every iteration including the first and the last): N solution, N x M verifier, N summary, one
  experience and one guideline call (none for an ablated bank): T x (N x (M + 2) + 2), 1,640 per problem for
  N = M = 8, T = 20, so 164,000 on 100 problems. With ``early_stop`` that is the most; the fewest is a problem
  settled after ``early_stop_patience`` iterations (the last of them without its memory update).

Where stopping makes the count uncertain, the estimate gives the range from the fewest calls (and tokens) to the most.
- mattrl (math): a recruit call, then per round an opinion per specialist and a review of each by each other
  specialist, then the decision: 2 + R x n^2 with n specialists and R rounds. Deliberation stops when everyone has
  converged, so this is an upper bound; unusable replies are retried (``retries``), raising the ceiling to
  (1 + retries) + R x (n + n(n - 1)(1 + retries)) + 2 (the decision's one rewrite pass included). Medicine has no
  reviews: 2 + R x n. Education: a right pre-test ends the case after 1 call; otherwise single teacher 2R + 3, team
  2 + R x (n + 2) + 2 (formation, per round n analyses, a plan and the student's reply, then guidance and post-test).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tmas.config import Settings
from tmas.llm.sampling import resolve_role
from tmas.methods.base import Method
from tmas.methods.majority import MajorityParams
from tmas.methods.stopping import fewest_votes_to_stop
from tmas.methods.tmas_params import TMASParams


@dataclass
class CallCount:
    """Chat calls per problem by role: ``expected`` when every call succeeds (and adaptive methods run to their
    limit), ``upper`` the most there can be (retries included). ``exact``: the structure fixes the count."""

    expected: dict[str, int]
    upper: dict[str, int]
    exact: bool = True
    note: str = ""
    # A call budget per problem (``--budget-calls``): no problem sends more, whatever the structure says.
    cap: int | None = None
    # The fewest calls by role, where a stopping rule may end a problem early (None: the count cannot go lower).
    fewest: dict[str, int] | None = None
    # Online stopping: calls by role (of the fewest) that may be stopped while they stream, and the fewest
    # completion tokens such a call spends before it can be (one confidence window).
    stoppable: dict[str, int] | None = None
    stoppable_tokens: int = 0

    @property
    def total(self) -> int:
        total = sum(self.expected.values())
        return total if self.cap is None else min(total, self.cap)

    @property
    def upper_total(self) -> int:
        total = sum(self.upper.values())
        return total if self.cap is None else min(total, self.cap)

    @property
    def fewest_total(self) -> int:
        total = sum((self.fewest if self.fewest is not None else self.expected).values())
        return total if self.cap is None else min(total, self.cap)

    def share(self) -> float:
        """The part of the structure's calls the cap leaves (1.0 without a cap)."""
        full = sum(self.expected.values())
        return self.total / full if full else 1.0


def _count(
    roles: Mapping[str, int],
    note: str = "",
    upper: Mapping[str, int] | None = None,
    fewest: Mapping[str, int] | None = None,
) -> CallCount:
    expected = {role: n for role, n in roles.items() if n}
    ceiling = {role: n for role, n in (upper or roles).items() if n}
    floor = {role: n for role, n in fewest.items() if n} if fewest is not None else None
    return CallCount(expected, ceiling, exact=upper is None and not note, note=note, fewest=floor)


def calls_per_problem(method: Method[Any]) -> CallCount:
    """Chat calls one problem costs under ``method`` (see the module docstring for each formula)."""
    p = method.params
    name = method.name
    t = p.iterations
    if name == "cot":
        return _count({"solution": 1})
    if name == "majority":
        return _majority(p)
    if name == "self_refine":
        return _count({"solution": p.n, "refiner": p.n * (t - 1)})
    if name == "verify_refine":
        return _count({"solution": p.n, "corrector": p.n * (t - 1), "verifier": p.n * p.m * t})
    if name == "pacore":
        return _count({"solution": p.responses_per_round * t, "synthesis": p.synthesis_responses * p.synthesis})
    if name == "rse":
        return _count({"solution": p.n * t, "distiller": p.n * (t - 1)})
    if name == "tmas":
        memory = t - 1 if p.skip_final_memory else t  # iterations whose summaries and banks are computed
        roles = {
            "solution": p.n * t,
            "verifier": p.n * p.m * t,
            "summary": p.n * memory,
            "experience": 0 if p.no_experience else memory,
            "guideline": 0 if p.no_guideline else memory,
        }
        settled = p.early_stop_patience  # the fewest iterations a problem can run: settled at once
        if not p.early_stop or settled >= t:
            return _count(roles)
        least = {
            "solution": p.n * settled,
            "verifier": p.n * p.m * settled,
            # The stopping iteration writes its summaries (inside each candidate's chain), not its memory update.
            "summary": p.n * settled,
            "experience": 0 if p.no_experience else settled - 1,
            "guideline": 0 if p.no_guideline else settled - 1,
        }
        note = f"early_stop: from a problem settled after {settled} iteration(s) to all {t}"
        return _count(roles, note, upper=roles, fewest=least)
    if name == "mattrl":
        return _mattrl(p.domain, p.teaching, p.team_size, t, p.retries)
    raise ValueError(f"no call-count formula for method {name!r}")


def _majority(p: MajorityParams) -> CallCount:
    most = p.k * p.iterations
    samples, count = most, _count({"solution": most})
    if p.stop == "beta":
        warmup = p.warmup if p.online_stop else 0
        samples = _majority_fewest(p.k, p.iterations, p.round_size, fewest_votes_to_stop(p.stop_threshold), warmup)
        if samples < most:
            note = f"stop=beta: from {samples} samples (a decided vote) to k x T (Adaptive-Consistency)"
            count = _count({"solution": most}, note, upper={"solution": most}, fewest={"solution": samples})
    if p.online_stop and samples > p.warmup:
        count.stoppable, count.stoppable_tokens = {"solution": samples - p.warmup}, p.confidence_window
        note = (
            f"online_stop: the samples after the first {p.warmup} may stop once {p.confidence_window} tokens"
            " arrived (DeepConf)"
        )
        count.note = "; ".join(filter(None, [count.note, note]))
    return count


def _majority_fewest(k: int, iterations: int, round_size: int, votes: int, warmup: int = 0) -> int:
    """The fewest samples after which the Beta stop can end a problem: the first round end (rounds of
    ``round_size`` within each iteration's k, a round also ending where the ``warmup`` samples do) with at least
    ``votes`` samples drawn; k x T when none."""
    drawn = 0
    for _ in range(iterations):
        asked = 0
        while asked < k:
            warming = max(0, warmup - drawn)
            end = min(asked + round_size, k, asked + (warming or k))
            drawn, asked = drawn + end - asked, end
            if drawn >= votes:
                return drawn
    return k * iterations


def _mattrl(domain: str, teaching: str, n: int, rounds: int, retries: int) -> CallCount:
    tries = 1 + retries
    if domain == "education":
        if teaching == "single":
            roles = {"student": rounds + 2, "specialist": rounds + 1}
            return _count(roles, "at most: a right pre-test ends the case after 1 call", upper=roles)
        roles = {"student": rounds + 2, "coordinator": 1 + rounds + 1, "specialist": n * rounds}
        upper = {**roles, "coordinator": tries + rounds + 1}
        return _count(roles, "at most: a right pre-test ends the case after 1 call; team formation may retry", upper)
    reviews = n * (n - 1) * rounds if domain == "math" else 0
    roles = {"coordinator": 2, "specialist": n * rounds, "reviewer": reviews}
    upper = {"coordinator": tries + 2, "specialist": n * rounds, "reviewer": reviews * tries}
    note = "at most, with the full team for every round: deliberation stops once every specialist has converged"
    return _count(roles, note, upper)


def role_max_tokens(settings: Settings, method: Method[Any], role: str) -> int | None:
    """The max_tokens a call of ``role`` sends, resolved as every call is (:func:`tmas.llm.sampling.resolve_role`):
    TMAS's preset fills only what no one set, its own per-role sampling goes over the settings."""
    preset, own = method.params.sampling_layers(role) if isinstance(method.params, TMASParams) else (None, None)
    return resolve_role(settings, role, preset=preset, method=own).sampling.max_tokens


@dataclass
class TokenRates:
    """Mean tokens per call, by role where a pilot measured them; ``default`` for roles it did not see."""

    completion: dict[str, float] = field(default_factory=dict)
    prompt: dict[str, float] = field(default_factory=dict)
    default_completion: float | None = None
    default_prompt: float = 0.0
    # "pilot" or "given".
    source: str = "given"
    # Completion tokens per second over the pilot (all its calls in flight together), when measured.
    throughput: float | None = None

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
            ok = c["calls"] - c.get("failed", 0)
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

    @property
    def total_calls(self) -> int:
        return self.calls.total * self.problems

    @property
    def upper_calls(self) -> int:
        return self.calls.upper_total * self.problems

    @property
    def fewest_calls(self) -> int:
        return self.calls.fewest_total * self.problems


def estimate_point(
    name: str, method: Method[Any], settings: Settings, problems: int, rates: TokenRates | None
) -> PointEstimate:
    count = calls_per_problem(method)
    budget = settings.budget
    if budget.calls is not None and count.upper_total > budget.calls:
        count.cap = budget.calls
        count.exact = False
        count.note = "; ".join(
            filter(None, [count.note, f"the call budget stops each problem at {budget.calls} calls"])
        )
    point = PointEstimate(name, method.name, problems, count)
    per_call: dict[str, float] | None = None
    counted = count.upper
    if rates is not None and rates.default_completion is not None:
        per_call = {role: rates.completion_of(role) or 0.0 for role in count.upper}
        counted = count.expected
        point.prompt_tokens = (
            problems * count.share() * sum(n * rates.prompt_of(role) for role, n in count.expected.items())
        )
        point.basis = rates.source
    else:
        ceilings = {role: role_max_tokens(settings, method, role) for role in count.upper}
        if all(v is not None for v in ceilings.values()):
            per_call = {role: float(v or 0) for role, v in ceilings.items()}
            point.basis = "max_tokens"
    if per_call is not None:
        per_problem = _completion(counted, per_call) * count.share()
        if budget.tokens is not None and budget.count == "completion" and per_problem > budget.tokens:
            # Calls in flight when the budget runs out still finish: a problem may pass it by that much.
            per_problem = float(budget.tokens)
            where = (
                f"the pooled token budget stops the run near {budget.tokens * problems}"
                if budget.pool
                else f"the token budget stops each problem near {budget.tokens}"
            )
            count.note = "; ".join(filter(None, [count.note, where]))
        point.completion_tokens = problems * per_problem
        if count.fewest is not None or count.stoppable:
            point.fewest_completion_tokens = problems * min(_fewest_completion(count, per_call), per_problem)
    return point


def _completion(calls: Mapping[str, int], per_call: Mapping[str, float]) -> float:
    """Completion tokens of ``calls`` (by role) at ``per_call`` tokens per call of each role."""
    return sum(n * per_call.get(role, 0.0) for role, n in calls.items())


def _fewest_completion(count: CallCount, per_call: Mapping[str, float]) -> float:
    """Completion tokens when the problem stops as early as it can: its fewest calls, the ones online stopping may
    cut at ``stoppable_tokens`` each."""
    tokens = _completion(count.fewest if count.fewest is not None else count.expected, per_call)
    for role, n in (count.stoppable or {}).items():
        tokens -= n * max(0.0, per_call.get(role, 0.0) - count.stoppable_tokens)
    return tokens


@dataclass
class Estimate:
    points: list[PointEstimate]
    rates: TokenRates | None = None
    # Completion tokens per second the hours are worked at: given, or measured by the pilot.
    throughput: float | None = None

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
        tokens = self.completion_tokens
        if tokens is None or not self.throughput:
            return None
        return tokens / self.throughput / 3600

    def over(self, max_calls: int | None, max_tokens: float | None) -> str | None:
        """Why this estimate needs a confirmation (None when it is under both thresholds)."""
        if max_calls is not None and self.upper_calls > max_calls:
            return f"{self.upper_calls:,} calls (threshold {max_calls:,})"
        tokens = self.completion_tokens
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
                    "exact": p.calls.exact,
                    "note": p.calls.note,
                    "calls": p.total_calls,
                    "upper_calls": p.upper_calls,
                    "fewest_calls": p.fewest_calls,
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
            "completion_tokens": self.completion_tokens,
            "fewest_completion_tokens": self.fewest_completion_tokens,
            "throughput_tokens_per_s": self.throughput,
            "hours": self.hours,
        }


def _tokens(value: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.{1 if value < 10 * size else 0}f}{unit}"
    return f"{value:.0f}"


def format_estimate(estimate: Estimate) -> str:
    """A plain-text table: one line per point, then the totals and the hours."""
    lines = ["cost estimate (before any call):"]
    width = max([len(p.name) for p in estimate.points] + [5])
    lines.append(f"  {'point':<{width}}  problems  calls/problem      calls  completion tokens")
    for p in estimate.points:
        per = f"{p.calls.total:,}" if p.calls.exact else f"<={p.calls.upper_total:,}"
        calls = f"{p.upper_calls:,}"
        tokens = "?" if p.completion_tokens is None else _tokens(p.completion_tokens)
        if p.calls.fewest is not None:
            # A stopping rule: from the fewest (every problem stopping as early as it can) to the most.
            per, calls = f"{p.calls.fewest_total:,}-{p.calls.upper_total:,}", f"{p.fewest_calls:,}-{calls}"
        fewest = p.fewest_completion_tokens
        if fewest is not None and p.completion_tokens is not None and fewest < p.completion_tokens:
            tokens = f"{_tokens(fewest)}-{tokens}"
        if p.basis == "max_tokens":
            tokens = f"<={tokens} (max_tokens)"
        lines.append(f"  {p.name:<{width}}  {p.problems:>8}  {per:>13}  {calls:>9}  {tokens}")
    for p in estimate.points:
        if p.calls.note:
            lines.append(f"  note: {p.name}: {p.calls.note}")
    total = estimate.completion_tokens
    basis = {p.basis for p in estimate.points if p.basis}
    if estimate.fewest_calls < estimate.upper_calls:
        lines.append(f"  total: {estimate.fewest_calls:,} to {estimate.upper_calls:,} calls (stopping rules)")
    else:
        lines.append(
            f"  total: {estimate.upper_calls:,} calls" + ("" if estimate.calls == estimate.upper_calls else " at most")
        )
    if total is None:
        lines.append("  tokens: unknown (give --tokens-per-call, --pilot N, or set max_tokens for a ceiling)")
    else:
        how = {
            "pilot": "mean per call measured by the pilot",
            "given": "the given tokens per call",
            "max_tokens": "every call at max_tokens: a ceiling",
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
    elif total is not None:
        lines.append("  time: give --throughput TOKENS_PER_S (or --pilot N to measure it) for hours")
    return "\n".join(lines)
