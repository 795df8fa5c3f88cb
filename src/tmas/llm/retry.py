"""One retry policy for every kind of call (chat, batched samples, embeddings): what to do after a failed attempt.

A failure the request itself caused is final. One the server or the network caused is sent again after a backoff
(exponential, full jitter, at least the server's Retry-After), up to ``retry.max_attempts`` attempts; an engine
fault reported with a client status, and a reply SGLang aborted at its running-time limit (:data:`ONCE_PER_CALL`),
only once, since a second one is more likely the request's. A call that adapts to a refusal (a field left out, a
smaller max_tokens) goes again at once without costing an attempt, and so does one whose connection a replica refused
while another replica answers (it goes there: tmas.llm.client.LLMClient._moved_on). Every retry is counted by its cause.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tmas.config import Retry
from tmas.llm.failures import Failure

# Causes sent again at most once per call: a 4xx error event told to be the engine's fault, a reply SGLang aborted at
# its running-time limit (tmas.llm.failures).
ONCE_PER_CALL = frozenset({"engine_fault", "running_timeout"})


@dataclass
class Attempts:
    """The attempts of one call so far, and the causes of those that failed and were sent again."""

    policy: RetryPolicy
    count: int = 0
    causes: list[str] = field(default_factory=list)
    # Every failure was a refused connection: no replica could be reached.
    unreachable: bool = True
    last: Failure | None = None

    def begin(self) -> None:
        self.count += 1

    @property
    def left(self) -> bool:
        return self.count < self.policy.retry.max_attempts

    def after(self, failure: Failure) -> float | None:
        """Seconds to wait before sending again after ``failure``, or None to give up."""
        self.last = failure
        self.unreachable = self.unreachable and failure.connect
        if not failure.retry:
            return None
        if failure.cause in ONCE_PER_CALL and failure.cause in self.causes:
            failure.args = (f"{failure} (a second time in this call: not sent again)",)
            return None
        if not self.left:
            return None
        self.causes.append(failure.cause)
        return self.policy.backoff(self.count, failure)

    def unsent(self) -> None:
        """The attempt sent nothing (its replica turned out to be still loading its model): it costs none."""
        self.count -= 1

    def again_at_once(self, cause: str) -> None:
        """The call adapts (a refused field, a smaller max_tokens) and goes again at once, costing no attempt."""
        self.count -= 1
        self.causes.append(cause)


@dataclass
class RetryPolicy:
    retry: Retry
    rng: random.Random = field(default_factory=random.Random)

    def attempts(self) -> Attempts:
        return Attempts(self)

    def backoff(self, attempt: int, failure: Failure) -> float:
        """Exponential backoff with full jitter, at least what the server asked for in Retry-After (capped)."""
        retry = self.retry
        delay: float = min(retry.backoff_max_s, retry.backoff_base_s * 2 ** (attempt - 1)) * self.rng.random()
        if failure.retry_after is not None:
            delay = max(delay, min(failure.retry_after, retry.backoff_max_s))
        return delay
