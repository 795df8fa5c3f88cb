"""The chat calls one problem costs under a method, by role: what each method states of its own structure
(:meth:`tmas.methods.base.Method.calls_per_problem`) and the cost estimate adds up over problems and grid points.

Counts assume every call succeeds and every reply is usable: a failed call only ever lowers them (its candidate is
not verified or summarised, nor is a TMAS solution with no text; a memory agent with no rollout is skipped). The calls
a reply may be asked again in come on top, each a known number of times at most: a reply that echoes its prompt's
instructions (tmas.methods.echo_retry) is asked once more, and an answerless solution reminded of the required output
(tmas.methods.answer_reminder) once more after that. Each method states those calls too (``again``, by role), so
``most`` is the most a problem can send whatever its replies; a transport retry adds attempts of one call, not calls.
A call budget (``cap``) holds every call. Embedding requests are not chat calls and are not counted.

A count holds each call under the role it is sent as, but for calls that may go out as another role's instead (a
refinement whose trajectory starts afresh sends a solution call in its place, with the solution role's max_tokens):
each method states those places too (``instead``), and the token ceiling takes each at the dearer of the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Instead:
    """Up to ``times`` places where the calls a count holds as ``counted`` (by role, replies asked again included)
    may go out as ``sent`` (by role) instead: no more calls, but each of another role's max_tokens."""

    times: int
    counted: dict[str, int]
    sent: dict[str, int]

    def __post_init__(self) -> None:
        if sum(self.sent.values()) > sum(self.counted.values()):
            raise ValueError(f"calls sent instead ({self.sent}) outnumber those they stand for ({self.counted})")


@dataclass
class CallCount:
    """Chat calls per problem by role: ``expected`` when every call succeeds (and adaptive methods run to their
    limit), ``upper`` the most the method's structure allows, its own retries included (MATTRL's retries of unusable
    replies), ``again`` the most calls replies asked again add beside it (echo retries and answer reminders, see the
    module docstring): ``most``, their sum, no problem exceeds. ``exact``: the structure fixes the count."""

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
    # False for a method that states no count of its own: the estimate shows it as unknown, not as zero.
    known: bool = True
    # The most calls by role that replies asked again add to ``upper`` (an echo's retry, an answer reminder); None
    # where the method does not state them (a plugin's count may leave them out): ``most`` is then no ceiling.
    again: dict[str, int] | None = None
    # The places where ``most``'s calls of one role may go out as another's instead (see :class:`Instead`).
    instead: list[Instead] = field(default_factory=list)

    @classmethod
    def unknown(cls, method: str) -> CallCount:
        """The count of a method that states none."""
        return cls({}, {}, exact=False, note=f"method {method!r} states no calls per problem", known=False)

    @property
    def total(self) -> int:
        total = sum(self.expected.values())
        return total if self.cap is None else min(total, self.cap)

    @property
    def upper_total(self) -> int:
        total = sum(self.upper.values())
        return total if self.cap is None else min(total, self.cap)

    @property
    def most(self) -> dict[str, int]:
        """The most calls by role a problem sends: ``upper`` and every reply asked again as often as it can be."""
        again = self.again or {}
        return {role: self.upper.get(role, 0) + again.get(role, 0) for role in {**self.upper, **again}}

    @property
    def ceiling_roles(self) -> set[str]:
        """The roles whose per-call tokens :meth:`ceiling` reads: ``most``'s and those sent in their place."""
        return set(self.most).union(*(place.sent for place in self.instead))

    def ceiling(self, per_call: Mapping[str, float]) -> float:
        """The most completion tokens a problem's calls come to at ``per_call`` tokens each (by role, the most a
        call of it can spend): ``most``'s calls, each place that may go out as other calls taken at the dearer; under
        a call budget (``cap``), no more than its number of the dearest calls."""
        tokens = calls_tokens(self.most, per_call)
        for place in self.instead:
            tokens += place.times * max(0.0, calls_tokens(place.sent, per_call) - calls_tokens(place.counted, per_call))
        if self.cap is None:
            return tokens
        # Each call at the dearest role it may go out as (a place sends no more calls than it stands for).
        dearest = {role: per_call.get(role, 0.0) for role in self.most}
        for place in self.instead:
            top = max((per_call.get(role, 0.0) for role in place.sent), default=0.0)
            for role in place.counted:
                dearest[role] = max(dearest[role], top)
        calls = sorted((dearest[role] for role, n in self.most.items() for _ in range(n)), reverse=True)
        return min(tokens, sum(calls[: self.cap]))

    @property
    def most_total(self) -> int:
        total = sum(self.most.values())
        return total if self.cap is None else min(total, self.cap)

    @property
    def fewest_total(self) -> int:
        total = sum((self.fewest if self.fewest is not None else self.expected).values())
        return total if self.cap is None else min(total, self.cap)

    def share(self) -> float:
        """The part of the structure's calls the cap leaves (1.0 without a cap)."""
        full = sum(self.expected.values())
        return self.total / full if full else 1.0


def calls_tokens(calls: Mapping[str, int], per_call: Mapping[str, float]) -> float:
    """Completion tokens of ``calls`` (by role) at ``per_call`` tokens per call of each role."""
    return sum(n * per_call.get(role, 0.0) for role, n in calls.items())


def count_calls(
    roles: Mapping[str, int],
    note: str = "",
    upper: Mapping[str, int] | None = None,
    fewest: Mapping[str, int] | None = None,
    again: Mapping[str, int] | None = None,
    instead: list[Instead] | None = None,
) -> CallCount:
    """A :class:`CallCount` of ``roles`` (roles with no call left out): exact unless it has a ``note`` or an
    ``upper`` bound of its own; ``fewest``: where a stopping rule may end a problem sooner; ``again``: the most calls
    by role that replies asked again add (:func:`asked_again`; ``{}`` for none, None where the method does not say);
    ``instead``: the places whose calls may go out as another role's (those with none left out)."""
    expected = {role: n for role, n in roles.items() if n}
    ceiling = {role: n for role, n in (upper or roles).items() if n}
    floor = {role: n for role, n in fewest.items() if n} if fewest is not None else None
    more = {role: n for role, n in again.items() if n} if again is not None else None
    places = [place for place in instead or [] if place.times and place.sent]
    return CallCount(
        expected, ceiling, exact=upper is None and not note, note=note, fewest=floor, again=more, instead=places
    )


def asked_again(guarded: Mapping[str, int], reminded: Mapping[str, int] | None = None) -> dict[str, int]:
    """The most calls by role that replies asked again add: one for each of ``guarded``'s calls (under the echo
    guard, :func:`tmas.methods.echo_retry.chat_guarded`, a solution call's included) and one more for each of
    ``reminded``'s (solution calls that may be reminded of the required output, :mod:`tmas.methods.answer_reminder`;
    each is guarded too)."""
    more = reminded or {}
    return {role: guarded.get(role, 0) + more.get(role, 0) for role in {**guarded, **more}}
