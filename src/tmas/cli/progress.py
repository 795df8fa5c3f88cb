"""Progress of a run: a live display on a terminal, plain lines otherwise.

On a terminal, three lines that fit any width (80 columns included): the problems done of the total with a bar, the
ETA and the time so far first; then the problems being solved (how many, the cap on them, the oldest few with their
iteration); then the calls and tokens. Each line is cut at the terminal's edge, never wrapped. Without a terminal (a
log file, a batch job): one line per finished problem and, every few seconds, one line with the same figures.

Problems and calls are counted apart: "4 solving (up to 4 at once)" are problems, "12 calls in flight" are calls.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from tmas.llm.types import cached_share_text
from tmas.methods.base import ProblemResult
from tmas.runner import RunState

err = Console(stderr=True, highlight=False)

# Active problems named one by one; beyond this many, a count of the rest.
SHOWN_ACTIVE = 3
# Seconds between two plain progress lines (without a terminal).
PLAIN_EVERY_S = 5.0


def duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h07m``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def tokens(value: int) -> str:
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return str(value)


def eta(state: RunState, now: float | None = None) -> str:
    """Time left, from the share of the work done since this command started: finished problems, and each active
    problem's iterations begun of the planned ones; ``?`` until something is done."""
    todo = state.total - state.skipped
    if todo <= 0:
        return "0s"
    planned = max(1, state.iterations)
    done = state.done + state.failed + sum(min(t, planned) / planned for t in state.active.values())
    elapsed = (now if now is not None else time.monotonic()) - state.started_at
    if done <= 0 or elapsed <= 0:
        return "?"
    return duration(elapsed * (todo - done) / done)


def headline(state: RunState) -> str:
    """``5/14 problems (1 failed) · eta 2m10s · 1m20s so far``."""
    finished = state.done + state.failed + state.skipped
    failed = f" ({state.failed} failed)" if state.failed else ""
    spent = duration(time.monotonic() - state.started_at)
    return f"{finished}/{state.total or '?'} problems{failed} · eta {eta(state)} · {spent} so far"


def active_text(state: RunState) -> str:
    """``4 solving (up to 4 at once): p3@1 p4@0 +2 more`` (``p3@1``: problem p3, in iteration 1), oldest first."""
    items = list(state.active.items())
    cap = f" (up to {state.problem_slots} at once)" if state.problem_slots else ""
    if not items:
        return f"0 solving{cap}"
    shown = " ".join(f"{pid}@{t}" for pid, t in items[:SHOWN_ACTIVE])
    more = f" +{len(items) - SHOWN_ACTIVE} more" if len(items) > SHOWN_ACTIVE else ""
    return f"{len(items)} solving{cap}: {shown}{more}"


def calls_text(state: RunState) -> str:
    """``calls: 12 in flight, 340 sent, 20 replayed, 1 failed · tokens: 1.2M prompt + 45.0k completion`` (replayed
    and failed calls only where there are any)."""
    s = state.stats
    if s is None:
        return "calls: starting"
    counts = [f"{s.in_flight} in flight", f"{s.calls} sent"]
    counts += [f"{n} {what}" for n, what in ((s.replayed, "replayed"), (s.failed, "failed")) if n]
    return (
        f"calls: {', '.join(counts)} · tokens: {tokens(s.usage.prompt_tokens)} prompt{cached_share_text(s.usage)}"
        f" + {tokens(s.usage.completion_tokens)} completion"
    )


def plain_status(state: RunState) -> str:
    """The run's figures in one line: problems, ETA, problems being solved, calls and tokens."""
    return f"{headline(state)} · {active_text(state).split(':')[0]} · {calls_text(state)}"


def plain_line(state: RunState) -> str:
    """The line written every few seconds without a terminal."""
    return f"tmas: {plain_status(state)}"


def result_line(state: RunState, result: ProblemResult) -> str:
    """The line of a finished problem: ``[6/14] p3: done · answer '42' · 2 iterations · 12 calls``, and a failed
    one's error."""
    n = state.done + state.failed + state.skipped
    what = f"answer {result.answer!r}" if result.status == "done" else (result.error or "no answer")
    iterations, calls = len(result.iterations), result.calls
    cost = f"{iterations} iteration{'s' * (iterations != 1)} · {calls} call{'s' * (calls != 1)}"
    cost += f" · {result.usage.completion_tokens} completion tokens"
    return f"[{n}/{state.total}] {result.problem_id}: {result.status} · {what} · {cost}"


class _Board(Progress):
    """The live display: the progress bar's line, then status lines cut at the terminal's edge."""

    def __init__(self, status: Callable[[], Iterable[str]], *args: object, **kwargs: object) -> None:
        self.status = status  # before Progress starts rendering
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        for line in self.status():
            yield Text(line, no_wrap=True, overflow="ellipsis")


class RunProgress:
    """Reports a run's progress; ``on_result`` is called by the runner as each problem finishes. ``every_s``: the
    seconds between plain lines."""

    def __init__(self, state: RunState, *, live: bool | None = None, every_s: float = PLAIN_EVERY_S) -> None:
        self.state = state
        self.live = sys.stderr.isatty() if live is None else live
        self.every_s = every_s

    def on_result(self, result: ProblemResult) -> None:
        if not self.live:
            print(result_line(self.state, result), file=sys.stderr, flush=True)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[RunProgress]:
        if not self.live:
            ticker = asyncio.create_task(self._plain())
            try:
                yield self
            finally:
                ticker.cancel()
            return
        board, task = self.board(err)
        refresher = asyncio.create_task(self._refresh(board, task))
        with board:
            try:
                yield self
            finally:
                refresher.cancel()
                self._update(board, task)

    def board(self, console: Console, *, auto_refresh: bool = True) -> tuple[Progress, TaskID]:
        """The live display on ``console`` and its one task, the run."""
        board = _Board(
            lambda: (active_text(self.state), calls_text(self.state)),
            TextColumn("[bold]problems"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TaskProgressColumn(),
            TextColumn("eta {task.fields[eta]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            auto_refresh=auto_refresh,
        )
        task = board.add_task("run", total=None, eta="?")
        self._update(board, task)
        return board, task

    async def _plain(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            print(plain_line(self.state), file=sys.stderr, flush=True)

    def _update(self, board: Progress, task: TaskID) -> None:
        st = self.state
        board.update(task, total=st.total or None, completed=st.done + st.failed + st.skipped, eta=eta(st))

    async def _refresh(self, board: Progress, task: TaskID) -> None:
        while True:
            self._update(board, task)
            await asyncio.sleep(0.25)
