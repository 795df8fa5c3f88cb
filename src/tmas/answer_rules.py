"""Rule-based answer equivalence with Math-Verify, run in worker processes.

Math-Verify enforces its timeouts with ``signal.alarm``, which only works in a process's main thread: each check
runs in the main thread of a worker process (``ProcessPoolExecutor``), driven from asyncio by ``run_in_executor``.
Workers are spawned, not forked, because the parent may hold an event loop and open sockets.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from tmas.answers import normalize_answer
from tmas.errors import TmasError


class MissingExtra(TmasError):
    exit_code = 2


@dataclass(frozen=True)
class RuleVerdict:
    """``correct`` is None when the rules cannot decide (unparseable, timed out, unequal non-numeric forms, or a
    reference in words)."""

    correct: bool | None
    detail: str


# A sentence's full stop after an answer ("29.", "$\\frac{1}{2}$."); not the dots of an ellipsis.
_FULL_STOP = re.compile(r"(?<!\.)\.\s*$")
# A thin space between digit groups (12\,345): Math-Verify reads it as a product.
_THIN_SPACE_GROUPS = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")
# A reference that is a sentence about formulas ("odd $n$", "$f(x)=cx$ for some $c$", "0 if ..., ... otherwise"):
# Math-Verify reads one formula of it at most, so its "equal" could accept a part of the answer or a wrong one.
_PROSE = re.compile(
    r"\$|\\\(|\\\[|\b(?:if|otherwise|for|where|which|and|or|all|some|of|is|are|the|with|when|excluding)\b", re.I
)


def _clean(answer: str) -> str:
    """``answer`` without a full stop, enclosing '$' or thin spaces between digit groups."""
    text = _FULL_STOP.sub("", answer.strip()).strip().strip("$").strip()
    return _THIN_SPACE_GROUPS.sub("", text)


def _wrap(answer: str) -> str:
    # Math-Verify extracts LaTeX from \boxed{} or $...$; boxing also copes with answers that contain '$'.
    return "\\boxed{" + _clean(answer) + "}"


def check_pair(gold: str, pred: str, timeout_s: int | None = 5) -> RuleVerdict:
    """Compare one pair (gold first: Math-Verify's ``verify`` is asymmetric). Runs in a worker process (or any main
    thread; ``timeout_s`` None runs without signal-based timeouts, for other threads)."""
    if normalize_answer(gold) == normalize_answer(pred):
        return RuleVerdict(True, "same answer")
    try:
        from math_verify import parse, verify
    except ImportError:  # pragma: no cover - surfaced by the pool's owner
        return RuleVerdict(None, "math-verify not installed")
    if _PROSE.search(_clean(gold)):
        return RuleVerdict(None, "reference in words: not checked by the rules")
    try:
        gold_parsed = parse(_wrap(gold), parsing_timeout=timeout_s)
        pred_parsed = parse(_wrap(pred), parsing_timeout=timeout_s)
    except Exception as exc:  # Math-Verify raises on odd input; that is "cannot decide", not a crash
        return RuleVerdict(None, f"parse error: {type(exc).__name__}")
    if not gold_parsed:
        return RuleVerdict(None, "reference not parseable")
    if not pred_parsed:
        return RuleVerdict(None, "answer not parseable")
    try:
        equal = bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))
    except Exception as exc:
        return RuleVerdict(None, f"verify error: {type(exc).__name__}")
    if equal:
        return RuleVerdict(True, "math-verify: equivalent")
    # A "no" is trusted only between plain numbers; symbolic or textual answers may be equal in ways the rules
    # miss (e.g. "all n >= 3" vs "n \ge 3"), so those go to the judge in combined mode.
    if _is_number(gold_parsed[0]) and _is_number(pred_parsed[0]):
        return RuleVerdict(False, "math-verify: different numbers")
    return RuleVerdict(None, "math-verify: not shown equivalent (non-numeric)")


def _is_number(value: Any) -> bool:
    return bool(getattr(value, "is_number", False)) and not getattr(value, "free_symbols", None)


def ensure_math_verify() -> None:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        raise MissingExtra("rule-based grading needs Math-Verify: pip install 'tmas[eval]' (or math-verify)") from None


class RuleChecker:
    """A pool of worker processes checking answer pairs; ``async with RuleChecker() as rc: await rc.check(g, p)``."""

    def __init__(self, workers: int = 2, timeout_s: int = 5) -> None:
        ensure_math_verify()
        self.timeout_s = timeout_s
        self._workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._cache: dict[tuple[str, str], RuleVerdict] = {}

    async def __aenter__(self) -> RuleChecker:
        self._pool = ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            # Waits for its workers to exit (seconds for one still starting: a run cancelled in its first check), on a
            # thread: the other runs on this event loop (tmas serve's requests) go on meanwhile.
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)

    async def check(self, gold: str, pred: str) -> RuleVerdict:
        key = (gold, pred)
        if key in self._cache:
            return self._cache[key]
        if self._pool is None:
            raise RuntimeError("RuleChecker used outside 'async with'")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, check_pair, gold, pred, self.timeout_s)
        try:
            # Math-Verify's own alarms bound parse and verify; this outer bound covers worker start-up and the rest.
            # Not wait_for: on Python 3.11 it returns a result that came in the turn its caller was cancelled.
            async with asyncio.timeout(4 * self.timeout_s + 60):
                verdict = await future
        except TimeoutError:
            verdict = RuleVerdict(None, "timed out")
        self._cache[key] = verdict
        return verdict


@functools.cache
def math_verify_installed() -> bool:
    """Whether Math-Verify can be imported (found, not imported: importing it loads SymPy, which takes a while);
    looked up once a process, not once a run (the proxy starts a run per request)."""
    return importlib.util.find_spec("math_verify") is not None


class RuleEquivalence:
    """The grading rules as the symmetric equivalence votes group answers by (tmas.answer_classes.EquivalenceCheck):
    two answers are equal when Math-Verify shows each equal to the other. Its worker pool starts on the first check
    (runs whose answers are all plain numbers never start it) and stops at :meth:`aclose`."""

    def __init__(self, workers: int = 1, timeout_s: int = 5) -> None:
        self._workers = workers
        self._timeout_s = timeout_s
        self._checker: RuleChecker | None = None
        self._start = asyncio.Lock()

    async def equivalent(self, first: str, second: str) -> bool:
        async with self._start:
            if self._checker is None:
                checker = RuleChecker(workers=self._workers, timeout_s=self._timeout_s)
                await checker.__aenter__()
                self._checker = checker
        checker = self._checker
        forward, backward = await asyncio.gather(checker.check(first, second), checker.check(second, first))
        return forward.correct is True and backward.correct is True

    async def aclose(self) -> None:
        if self._checker is not None:
            await self._checker.__aexit__(None, None, None)
            self._checker = None
