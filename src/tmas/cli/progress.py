"""Progress of a run: a live Rich display on a terminal, plain log lines otherwise."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tmas.llm.types import cached_share_text
from tmas.methods.base import ProblemResult
from tmas.runner import RunState

err = Console(stderr=True, highlight=False)


# Active problems named one by one in the live display; beyond this many, a count of the rest.
SHOWN_ACTIVE = 6


def active_text(state: RunState) -> str:
    """Each active problem with the iteration it is in (``p3@1``: problem p3, iteration 1), oldest first."""
    items = list(state.active.items())
    shown = " ".join(f"{pid}@{t}" for pid, t in items[:SHOWN_ACTIVE])
    more = f" +{len(items) - SHOWN_ACTIVE} more" if len(items) > SHOWN_ACTIVE else ""
    slots = f"/{state.problem_slots}" if state.problem_slots else ""
    return f"{len(items)}{slots} active: {shown}{more}" if items else f"0{slots} active"


def _calls_text(state: RunState) -> str:
    s = state.stats
    if s is None:
        return "starting"
    where = active_text(state) + " · "
    return where + (
        f"{s.in_flight} in flight · {s.calls} calls · {s.replayed} replayed · {s.failed} failed · "
        f"{s.usage.prompt_tokens:,} prompt{cached_share_text(s.usage)}"
        f" + {s.usage.completion_tokens:,} completion tokens"
    )


class RunProgress:
    """Reports a run's progress; ``on_result`` is called by the runner as each problem finishes."""

    def __init__(self, state: RunState, *, live: bool | None = None) -> None:
        self.state = state
        self.live = sys.stderr.isatty() if live is None else live
        state.on_iteration = self.on_iteration

    def on_iteration(self, problem_id: str, iteration: int) -> None:
        """A log line as each problem starts an iteration (the live display shows the same in its status)."""
        if self.live:
            return
        print(f"{problem_id}: iteration {iteration} · {active_text(self.state)}", file=sys.stderr, flush=True)

    def on_result(self, result: ProblemResult) -> None:
        if self.live:
            return
        st = self.state
        n = st.done + st.failed
        line = (
            f"[{n + st.skipped}/{st.total}] {result.problem_id}: {result.status}"
            f" answer={result.answer!r} iterations={len(result.iterations)} calls={result.calls}"
            f" prompt_tokens={result.usage.prompt_tokens} completion_tokens={result.usage.completion_tokens}"
            f" reasoning_tokens={result.usage.reasoning_tokens}"
            f" cached_prompt_tokens={result.usage.cached_prompt_tokens}"
        )
        if result.error:
            line += f" error={result.error}"
        print(line, file=sys.stderr, flush=True)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[RunProgress]:
        if not self.live:
            yield self
            return
        progress = Progress(
            TextColumn("[bold]problems"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[calls]}"),
            console=err,
            transient=False,
        )
        task = progress.add_task("run", total=None, calls="starting")
        refresher = asyncio.create_task(self._refresh(progress, task))
        with progress:
            try:
                yield self
            finally:
                refresher.cancel()
                self._update(progress, task)

    def _update(self, progress: Progress, task: TaskID) -> None:
        st = self.state
        progress.update(
            task,
            total=st.total or None,
            completed=st.done + st.failed + st.skipped,
            calls=_calls_text(st),
        )

    async def _refresh(self, progress: Progress, task: TaskID) -> None:
        while True:
            self._update(progress, task)
            await asyncio.sleep(0.25)
