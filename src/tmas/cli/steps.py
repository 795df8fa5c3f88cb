"""Saying what a long command is doing: a line as each step begins, and every few seconds while one lasts, so that no
step of more than a moment passes in silence (a report's grading, a sweep's points)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import typer

from tmas.cli.progress import PLAIN_EVERY_S, duration

T = TypeVar("T")
# A step's own line covers its first seconds.
SAID_S = 2.0


class Steps:
    """The steps of ``command`` (``tmas report``, ``tmas sweep``); ``status`` adds the figures of the step under way
    to the lines repeated while it lasts."""

    def __init__(self, command: str, *, every_s: float = PLAIN_EVERY_S) -> None:
        self.command = command
        self.every_s = every_s
        self.current: str | None = None
        self.began = time.monotonic()
        self.status: Callable[[], str] | None = None

    def step(self, text: str, status: Callable[[], str] | None = None) -> None:
        """A step begins: say so now."""
        self.current, self.began, self.status = text, time.monotonic(), status
        typer.echo(f"tmas {self.command}: {text}", err=True)

    def still(self) -> str | None:
        """The line repeated while a step lasts: its figures, or how long it has taken (None before the first step
        and in a step's first seconds, which its own line has just said)."""
        took = time.monotonic() - self.began
        if self.current is None or took < SAID_S:
            return None
        figures = self.status() if self.status is not None else f"{duration(took)} so far"
        return f"tmas {self.command}: {self.current} · {figures}"

    async def during(self, work: Awaitable[T]) -> T:
        """``work``, with the step under way said again every ``every_s`` seconds."""
        ticker = asyncio.create_task(self._tick())
        try:
            return await work
        finally:
            ticker.cancel()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            line = self.still()
            if line is not None:
                typer.echo(line, err=True)
