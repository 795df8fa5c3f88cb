"""Is a rollout correct? The evaluation harness's rules, applied in-process to one completion at a time.

The final answer is the last ``\\boxed{}`` (numeric mode, as the solution agent's parser reads it). Equal normalised
spellings are correct at once; otherwise Math-Verify decides (:func:`tmas.answer_rules.check_pair`, gold first). An
answer the rules cannot confirm counts as wrong, as in the harness: a reward is never given for an undecided answer.
"""

from __future__ import annotations

import threading

from tmas.answer_rules import check_pair
from tmas.answers import last_boxed, normalize_answer

RULE_TIMEOUT_S = 5


def final_answer(solution: str) -> str | None:
    return last_boxed(solution) or None


def is_correct(solution: str, ground_truth: str) -> bool:
    answer = final_answer(solution)
    if answer is None:
        return False
    if normalize_answer(answer) == normalize_answer(ground_truth):
        return True
    # Math-Verify's timeouts use signal.alarm, which works only in the main thread; elsewhere (a trainer's worker
    # thread) it runs without one.
    timeout = RULE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    return check_pair(ground_truth, answer, timeout).correct is True
