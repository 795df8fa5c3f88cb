"""The guideline bank G_t (paper section 3.2, eq. 5): a log of the distinct high-level strategies tried so far.

Explorers are shown it and told to go somewhere fundamentally different (eq. 1, second branch). The guideline agent
classifies each rollout's strategy against the log: 1 = new, 0 = the same as a logged one, -1 = cannot tell;
:func:`apply_strategy_classifications` turns those verdicts into G_t, purely. A "new" strategy whose wording is a
near-duplicate (word-set Jaccard, the same values stated) of a logged one, or of one a rollout of the same iteration
logged, is counted as another attempt of that one instead; and a rollout whose verdict names another rollout of its
iteration ("R2") counts as another attempt of that rollout's strategy. Each distinct strategy of an iteration's
rollouts enters the bank once.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tmas.memory.entry_ids import entry_id
from tmas.memory.similarity import jaccard, numbers

DEFAULT_DEDUP_THRESHOLD = 0.7
# The longest description a new strategy may enter the bank with: a strategy is a sentence or two, and one of
# thousands of characters (a runaway repetition) would ride in every later explore prompt.
MAX_DESCRIPTION_CHARS = 1000
# A ``same_as`` naming a rollout of the same iteration, as entry_id leaves it (upper case): "R2", "ROLLOUT 2".
_ROLLOUT_REF = re.compile(r"(?:R|ROLLOUT)\s*#?(\d+)")


class Strategy(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    description: str
    first_iteration: int
    last_iteration: int
    # How many rollouts followed it, and the best mean verifier score any of them got.
    attempts: int = 1
    best_score: float | None = None


class GuidelineBank(BaseModel):
    strategies: list[Strategy] = Field(default_factory=list)
    next_id: int = 1

    def get(self, strategy_id: str) -> Strategy | None:
        return next((s for s in self.strategies if s.id == strategy_id), None)

    def __len__(self) -> int:
        return len(self.strategies)


class StrategyNovelty(BaseModel):
    """A strategy judged against the bank: 1 new, 0 already attempted (``same_as`` names which), -1 cannot tell.

    Shared by the guideline agent's classifications and the RL guideline judge, which read the same verdict."""

    model_config = ConfigDict(extra="ignore")

    novelty: Literal[1, 0, -1]
    same_as: str | None = None

    @field_validator("novelty", mode="before")
    @classmethod
    def _novelty(cls, value: Any) -> Any:
        # Models write the verdict as "1", 1.0 or "+1" as often as 1.
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value.strip())
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @field_validator("same_as", mode="before")
    @classmethod
    def _same_as(cls, value: Any) -> Any:
        return entry_id(value) or None if isinstance(value, str | int) else value


class StrategyClassification(StrategyNovelty):
    """The agent's verdict on one rollout (see ``guideline.j2``)."""

    rollout: int = Field(ge=1)
    strategy: str = ""

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy(cls, value: Any) -> Any:
        # Null where the agent cannot make the strategy out (novelty -1): no description, as an empty string says.
        if value is None:
            return ""
        return value.strip() if isinstance(value, str) else value


class GuidelineReport(BaseModel):
    added: list[str] = Field(default_factory=list)
    # Strategy id -> rollouts (1-based) that followed it again.
    repeated: dict[str, list[int]] = Field(default_factory=dict)
    undetermined: list[int] = Field(default_factory=list)
    deduplicated: list[str] = Field(default_factory=list)
    rejected: list[str] = Field(default_factory=list)


def apply_strategy_classifications(
    bank: GuidelineBank,
    items: list[StrategyClassification],
    *,
    iteration: int,
    n_rollouts: int,
    scores: dict[int, float] | None = None,
    dedup_threshold: float = DEFAULT_DEDUP_THRESHOLD,
    max_description_chars: int = MAX_DESCRIPTION_CHARS,
) -> tuple[GuidelineBank, GuidelineReport]:
    """G_t from G_{t-1} and one verdict per rollout; ``scores`` maps rollout number (1-based) to its mean score.

    A rollout of this iteration can share its strategy with another one of the same iteration: its verdict is 0 with
    ``same_as`` naming that rollout ("R2"), and it counts as another attempt of whatever strategy that rollout's
    verdict logged or named, so a strategy the rollouts of one iteration share enters the bank once. Such verdicts are
    read after all the others, whatever their order in the reply. A new strategy described in more than
    ``max_description_chars`` characters is refused, unless its wording matches a logged one."""
    report = GuidelineReport()
    scores = scores or {}
    strategies = list(bank.strategies)
    next_id = bank.next_id
    seen: set[int] = set()
    # Rollout number -> position in ``strategies`` of the strategy its verdict logged or named.
    followed: dict[int, int] = {}

    def credit(position: int, rollout: int) -> None:
        old = strategies[position]
        score = scores.get(rollout)
        best = old.best_score if score is None else max(score, old.best_score or 0.0)
        strategies[position] = old.model_copy(
            update={"attempts": old.attempts + 1, "last_iteration": iteration, "best_score": best}
        )
        report.repeated.setdefault(old.id, []).append(rollout)
        followed[rollout] = position

    valid: list[StrategyClassification] = []
    for item in items:
        if item.rollout > n_rollouts:
            report.rejected.append(f"rollout {item.rollout}: there are only {n_rollouts}")
        elif item.rollout in seen:
            report.rejected.append(f"rollout {item.rollout}: classified twice")
        else:
            seen.add(item.rollout)
            valid.append(item)
    # Verdicts naming a rollout wait for that rollout's own (a chain R4 -> R2 -> R1 resolves in any order).
    pending = [i for i in valid if _rollout_named(i) is not None]
    ordered = [i for i in valid if _rollout_named(i) is None]
    while pending:
        ready = [i for i in pending if _rollout_named(i) not in {p.rollout for p in pending}]
        ready = ready or pending  # a cycle: read in reply order, so its first verdict is refused
        ordered += ready
        pending = [i for i in pending if i not in ready]

    for item in ordered:
        if item.novelty == -1:
            report.undetermined.append(item.rollout)
            continue
        if item.novelty == 0:
            named = _rollout_named(item)
            if named is not None:
                position = followed.get(named) if named != item.rollout else None
            else:
                position = next((i for i, s in enumerate(strategies) if s.id == item.same_as), None)
            if position is None and item.strategy:
                # The id is missing or wrong: match on the wording instead, if it is close enough to one entry.
                position = _closest(strategies, item.strategy, dedup_threshold)
            if position is None:
                names = "no strategy logged or named by that rollout" if named is not None else "no logged strategy"
                report.rejected.append(f"rollout {item.rollout}: 'same_as' {item.same_as!r} names {names}")
                continue
            credit(position, item.rollout)
            continue
        if not item.strategy:
            report.rejected.append(f"rollout {item.rollout}: a new strategy needs a description")
            continue
        position = _closest(strategies, item.strategy, dedup_threshold, same_values=True)
        if position is not None:
            report.deduplicated.append(f"rollout {item.rollout} (near-duplicate of {strategies[position].id})")
            credit(position, item.rollout)
            continue
        if len(item.strategy) > max_description_chars:
            report.rejected.append(
                f"rollout {item.rollout}: a strategy of {len(item.strategy)} characters, over the"
                f" {max_description_chars} a description may hold"
            )
            continue
        strategy_id = f"G{next_id}"
        next_id += 1
        strategies.append(
            Strategy(
                id=strategy_id,
                description=item.strategy,
                first_iteration=iteration,
                last_iteration=iteration,
                best_score=scores.get(item.rollout),
            )
        )
        followed[item.rollout] = len(strategies) - 1
        report.added.append(strategy_id)
    return GuidelineBank(strategies=strategies, next_id=next_id), report


def _rollout_named(item: StrategyClassification) -> int | None:
    """The rollout of the same iteration a 0 verdict's ``same_as`` names ("R2", "rollout 2"), or None."""
    match = _ROLLOUT_REF.fullmatch(item.same_as or "") if item.novelty == 0 else None
    return int(match.group(1)) if match else None


def _closest(strategies: list[Strategy], text: str, threshold: float, *, same_values: bool = False) -> int | None:
    """The position of the logged strategy worded most like ``text`` (Jaccard at least ``threshold``); with
    ``same_values``, only one stating the same values (a new strategy "modulo 4" is not the logged "modulo 3")."""
    best, position = threshold, None
    for i, strategy in enumerate(strategies):
        if same_values and numbers(strategy.description) != numbers(text):
            continue
        similarity = jaccard(strategy.description, text)
        if similarity >= best:
            best, position = similarity, i
    return position
