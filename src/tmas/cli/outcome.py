"""How a command that solves problems ends: its exit code and its last line, which says how many problems failed
and why.

The codes (the README lists them): 0 every problem done; 1 an error stopped the command (an endpoint gone, ...);
2 bad input or configuration, or the cost gate not passed (its question answered no, or no terminal to ask on and
no --yes), nothing run; 3 the command finished but some problems failed; 4 every problem failed; 130 stopped by
Ctrl-C and 143 by SIGTERM, finished work kept.
"""

from __future__ import annotations

from collections.abc import Mapping

# Nothing was started: the cost gate's question was answered no (as bad input: nothing was run).
EXIT_NOT_STARTED = 2
EXIT_SOME_FAILED = 3
EXIT_ALL_FAILED = 4
# The shell's 128 + the signal's number.
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

# What a stop before the command began any work says (:func:`stop_line`).
NOTHING_STARTED = "nothing was started"


def stop_line(name: str, what: str) -> str:
    """The last line of a command a signal stopped: ``name`` the signal's (``Ctrl-C``), ``what`` what is kept and
    how to go on."""
    return f"tmas: stopped by {name}; {what}"


# Reasons the last line names; the rest are counted.
SHOWN_REASONS = 2


def exit_code(done: int, failed: int) -> int:
    """0 when nothing failed, else whether some or all problems failed."""
    if not failed:
        return 0
    return EXIT_ALL_FAILED if not done else EXIT_SOME_FAILED


def failed_calls_line(problems: int, again: str) -> str:
    """What a run whose finished problems hold failed calls can do about them: the command ``again`` asks them."""
    which = "1 finished problem holds" if problems == 1 else f"{problems} finished problems hold"
    return f"{which} calls that failed after their retries (solved without their replies): '{again}' asks them again"


def failed_line(done: int, failed: int, reasons: Mapping[str, int], where: str = "") -> str:
    """``tmas: 3 of 14 problems failed: 2 x REASON; 1 x REASON`` (the most common reasons first), or how many were
    done when none failed; ``where`` names what to read for every problem's error."""
    total = done + failed
    if not failed:
        return f"tmas: {total} of {total} problems done"
    ranked = sorted(reasons.items(), key=lambda item: -item[1])
    shown = "; ".join(f"{count} x {why}" for why, count in ranked[:SHOWN_REASONS])
    rest = failed - sum(count for _, count in ranked[:SHOWN_REASONS])
    more = f"; {rest} more" if rest > 0 else ""
    return f"tmas: {failed} of {total} problems failed: {shown}{more}{where}"
