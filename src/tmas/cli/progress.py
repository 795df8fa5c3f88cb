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


def _calls_text(state: RunState) -> str:
    llm = state.llm
    if llm is None:
        return "starting"
    s = llm.stats
    iterations = sorted(state.active.values())
    where = ""
    if iterations:
        span = str(iterations[0]) if iterations[0] == iterations[-1] else f"{iterations[0]}-{iterations[-1]}"
        where = f"{len(iterations)} active, iteration {span} · "
    return where + (
        f"{s.in_flight} in flight · {s.calls} calls · {s.cached} replayed · {s.failed} failed · "
        f"{s.usage.prompt_tokens:,} prompt{cached_share_text(s.usage)}"
        f" + {s.usage.completion_tokens:,} completion tokens"
    )


class RunProgress:
    """Reports a run's progress; ``on_result`` is called by the runner as each problem finishes."""

    def __init__(self, state: RunState, *, live: bool | None = None) -> None:
        self.state = state
        self.live = sys.stderr.isatty() if live is None else live

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
