"""How previous rollouts R_{t-1} are shown to an agent, fitted to its context window.

All N rollouts are shown by default, in candidate order (Algorithm 1 line 9). When they do not fit, the lowest-scoring
ones are left out (top-k by mean verifier score) and each remaining solution is cut in the middle, keeping its start
and its end (where the final answer is); :class:`RolloutFit` says what was done so the iteration record can tell.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

# A solution is never cut below this many characters: below that, fewer rollouts serve better than stumps.
MIN_SOLUTION_CHARS = 600
# Rough characters per token for mathematical text; errs towards more tokens (leaving room).
CHARS_PER_TOKEN = 3.0


class Rollout(BaseModel):
    """r_{t,i} = (c_{t,i}, s_{t,i}): a candidate's solution text with its verification summary and mean score."""

    index: int
    solution: str
    summary: str
    score: float
    answer: str | None = None


class RolloutView(BaseModel):
    """A rollout as rendered into a prompt (``_tmas_rollouts.j2``); ``score_text`` None: shown without its score."""

    number: int
    solution: str
    summary: str
    score_text: str | None


class RolloutFit(BaseModel):
    views: list[RolloutView]
    shown: list[int] = Field(default_factory=list)
    left_out: list[int] = Field(default_factory=list)
    # Candidate index -> characters cut from its solution.
    cut_chars: dict[int, int] = Field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.left_out or self.cut_chars)

    def describe(self) -> str:
        parts = []
        if self.left_out:
            parts.append(f"left out rollouts {self.left_out} (lowest scores)")
        if self.cut_chars:
            parts.append(f"cut {sum(self.cut_chars.values())} characters from {len(self.cut_chars)} solutions")
        return "; ".join(parts) or "all rollouts shown whole"


def score_text(score: float) -> str:
    return f"{score:.2f}".rstrip("0").rstrip(".") if score % 1 else str(int(score))


def cut_middle(text: str, limit: int) -> str:
    """``text`` shortened to about ``limit`` characters: its first 40 % and last 60 %, with a marker between."""
    if len(text) <= limit:
        return text
    head = int(limit * 0.4)
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[-tail:]}"


def fit_rollouts(
    rollouts: list[Rollout],
    *,
    top_k: int | None = None,
    max_solution_chars: int | None = None,
    budget_chars: int | None = None,
    scores: bool = True,
) -> RolloutFit:
    """The views of ``rollouts`` to render: at most ``top_k`` (by score, ties to the lower index), each solution at
    most ``max_solution_chars`` long, all together within ``budget_chars`` where given; ``scores``: each with its mean
    verifier score (else its solution and summary alone, as Algorithm 1's r = (c, s))."""
    ranked = sorted(rollouts, key=lambda r: (-r.score, r.index))
    chosen = ranked[:top_k] if top_k is not None else ranked
    cap = max_solution_chars
    if budget_chars is not None:
        while chosen:
            fixed = sum(len(r.summary) + 120 for r in chosen)
            room = (budget_chars - fixed) // len(chosen)
            longest = max(len(r.solution) for r in chosen)
            if room >= longest:
                break
            if room >= MIN_SOLUTION_CHARS or len(chosen) == 1:
                cap = max(1, room) if cap is None else min(cap, max(1, room))
                break
            chosen = chosen[:-1]
    chosen_ids = {r.index for r in chosen}
    views: list[RolloutView] = []
    cut: dict[int, int] = {}
    for r in sorted(chosen, key=lambda r: r.index):
        text = r.solution
        if cap is not None and len(text) > cap:
            text = cut_middle(text, cap)
            cut[r.index] = len(r.solution) - cap
        shown = score_text(r.score) if scores else None
        views.append(RolloutView(number=r.index + 1, solution=text, summary=r.summary, score_text=shown))
    return RolloutFit(
        views=views,
        shown=[r.index for r in sorted(chosen, key=lambda r: r.index)],
        left_out=sorted(r.index for r in rollouts if r.index not in chosen_ids),
        cut_chars=cut,
    )
