"""Online stopping of weak traces, for majority vote: DeepConf's online mode (Fu et al. 2025, "Deep Think with
Confidence", section 4, Algorithm 2), beyond the papers this project implements.

The first ``warmup`` samples of a problem (DeepConf: 16) run to their end and set a stopping threshold s from their
lowest group confidences C_least (methods/confidence.py). Every later sample streams under a
:class:`ConfidenceWatch` and is stopped as soon as its running group confidence, the mean token confidence of its last
n tokens (n = ``confidence_window``), falls below s: the client closes the connection and the server aborts the
request (:mod:`tmas.llm.watch`). A stopped sample does not vote: its candidate carries an error and
``meta["stopped_early"]`` (methods/steps.py).

The threshold is the (1 - ``online_keep``) quantile of the warm-up samples' C_least, interpolated linearly between
order statistics (numpy's default percentile, which DeepConf's own script calls), so that about ``online_keep`` of
traces like the warm-up ones run on: 0.9 is DeepConf-high (s at the 10th percentile), 0.1 DeepConf-low (the 90th).
Worked by hand: C_least of 1, 2, 3, 4, 5 and keep 0.9 put s at position 0.1 x 4 = 0.4 between 1 and 2, so s = 1.4;
keep 0.1 at 3.6, s = 4.6.

A group is read once n tokens have arrived, so a sample shorter than n tokens is never stopped (DeepConf's windows
are 2048 tokens of long thinking traces; the embedded model's short replies want a smaller ``confidence_window``,
and a run whose warm-up replies all fall short of it says so once: :data:`SHORT_WARMUP_NOTICE`).
The warm-up samples vote whatever their confidence (DeepConf's script also leaves warm-up traces below s out of its
vote: ``select = "filtered_vote"`` filters every sample by confidence instead).

Completion tokens saved by a stopped sample are estimated as the mean completion tokens of the problem's warm-up
samples (which ran to their end) less what the stopped sample spent, at least 0: the stopped trace itself might have
ended sooner or later. Without log-probabilities in the warm-up replies there is no threshold: no sample is watched,
and the run says so once (:data:`ONLINE_STOP_NOTICE`); a reply that came unstreamed could not be watched
(:data:`tmas.llm.watch.UNWATCHED_NOTICE`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from tmas.llm.types import TokenLogprob
from tmas.llm.watch import WatchStop
from tmas.methods.base import Candidate
from tmas.methods.confidence import SlidingGroups, token_confidence
from tmas.methods.confidence_params import ConfidenceParams

# The finish_reason of a sample stopped by its confidence.
CONFIDENCE_STOP = "confidence_stop"
ONLINE_STOP_NOTICE = (
    "online_stop: the warm-up samples came without token log-probabilities, so no stopping threshold was set and"
    " every sample ran to its end"
)
# Raised once a run when a problem's warm-up samples were all shorter than the window, formatted with both lengths.
SHORT_WARMUP_NOTICE = (
    "online_stop: every warm-up sample was shorter than confidence_window ({window} tokens; the longest had"
    " {longest}), so the threshold came from their whole-reply means and a later sample can be stopped only past"
    " {window} tokens; a smaller confidence_window suits replies this short"
)
# meta.online_stop of a sample: a warm-up one (run to its end) or a watched one.
WARMUP: Literal["warmup"] = "warmup"
WATCHED: Literal["watched"] = "watched"


class OnlineStopRecord(BaseModel):
    """What an iteration's record says of online stopping (``state.online_stop``): the rule, its threshold (None:
    none could be set), the share of groups it keeps and their window, and of the iteration's samples, the warm-up
    ones, the watched ones, those stopped, and the completion tokens that saved (estimated)."""

    rule: Literal["deepconf_online"] = "deepconf_online"
    threshold: float | None
    keep: float
    window: int
    warmup: int
    watched: int
    stopped: int
    tokens_saved: int


class OnlineStopParams(ConfidenceParams):
    online_stop: bool = Field(
        default=False,
        description="stop a streamed sample once its running group confidence falls below the threshold the"
        " problem's first samples set (DeepConf's online mode, Fu et al. 2025)",
    )
    warmup: int = Field(
        default=16,
        ge=1,
        description="online_stop: a problem's first samples, run to their end, that set the threshold (DeepConf: 16)",
    )
    online_keep: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="online_stop: the share of warm-up samples above the threshold, set at the (1 - keep) quantile"
        " of their lowest group confidence (DeepConf: 0.9 and 0.1)",
    )

    def asks_confidence(self, rule: str) -> bool:
        return self.online_stop or super().asks_confidence(rule)


def stopping_threshold(lowest_groups: Sequence[float], keep: float) -> float:
    """s: the (1 - ``keep``) quantile of the warm-up traces' C_least, linearly interpolated (see the module)."""
    if not lowest_groups:
        raise ValueError("a stopping threshold needs at least one warm-up trace with a confidence")
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"the share kept must be in (0, 1], not {keep}")
    ordered = sorted(lowest_groups)
    position = (len(ordered) - 1) * (1.0 - keep)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


class ConfidenceWatch:
    """A :class:`tmas.llm.watch.TraceWatch` that stops a reply once a group confidence of ``window`` tokens falls
    below ``threshold``."""

    def __init__(self, threshold: float, window: int) -> None:
        self.threshold = threshold
        self.window = window
        self.began = False
        self._groups = SlidingGroups(window)

    def begin(self) -> None:
        self.began = True
        self._groups = SlidingGroups(self.window)

    def observe(self, tokens: Sequence[TokenLogprob]) -> WatchStop | None:
        for position in tokens:
            c = token_confidence(position)
            group = None if c is None else self._groups.push(c)
            if group is not None and group < self.threshold:
                detail = (
                    f"group confidence {group:.3f} of the last {self.window} tokens fell below the threshold"
                    f" {self.threshold:.3f} after {self._groups.count} tokens"
                )
                return WatchStop(CONFIDENCE_STOP, detail)
        return None


@dataclass
class OnlineStop:
    """One problem's online stopping: its warm-up samples, the threshold they set, the watches of the later ones."""

    warmup: int
    keep: float
    window: int
    warm: list[Candidate] = field(default_factory=list)
    threshold: float | None = None
    # Set once every warm-up sample finished, with or without a threshold.
    ready: bool = False

    @classmethod
    def of(cls, params: OnlineStopParams) -> OnlineStop:
        return cls(params.warmup, params.online_keep, params.confidence_window)

    def warmup_left(self) -> int:
        """How many of the next samples are warm-up samples."""
        return 0 if self.ready else self.warmup - len(self.warm)

    def warmed(self, candidates: Sequence[Candidate]) -> bool:
        """Take finished warm-up samples; once all are in, set the threshold. True when the warm-up ended without
        one (no warm-up sample had a confidence): the caller raises :data:`ONLINE_STOP_NOTICE`."""
        self.warm += candidates
        if self.warmup_left() > 0:
            return False
        self.ready = True
        lows = [c.confidence.lowest_group for c in self.warm if c.confidence is not None]
        self.threshold = stopping_threshold(lows, self.keep) if lows else None
        return self.threshold is None

    def short_warmup(self) -> str | None:
        """:data:`SHORT_WARMUP_NOTICE` where the threshold was set from warm-up samples none of which filled a group
        (DeepConf's 2048-token windows against a small model's replies of a few hundred tokens), else None."""
        lengths = [c.confidence.tokens for c in self.warm if c.confidence is not None]
        if self.threshold is None or not lengths or max(lengths) >= self.window:
            return None
        return SHORT_WARMUP_NOTICE.format(window=self.window, longest=max(lengths))

    def watch(self) -> ConfidenceWatch | None:
        """A watch for the next sample; None before the threshold is set (or where none could be)."""
        return ConfidenceWatch(self.threshold, self.window) if self.threshold is not None else None

    def full_length(self) -> float | None:
        """The mean completion tokens of the warm-up samples that finished: what a sample not stopped is taken to
        spend."""
        spent = [c.usage.completion_tokens for c in self.warm if c.error is None]
        return statistics.fmean(spent) if spent else None

    def saved(self, candidate: Candidate) -> int:
        """The completion tokens ``candidate`` saved by being stopped (0 for one not stopped; see the module)."""
        full = self.full_length()
        if not candidate.meta.stopped_early or full is None:
            return 0
        return max(0, round(full - candidate.usage.completion_tokens))

    def record(self, candidates: Sequence[Candidate]) -> OnlineStopRecord:
        """What an iteration's record says of online stopping, over its ``candidates``."""
        stopped = [c for c in candidates if c.meta.stopped_early]
        return OnlineStopRecord(
            threshold=self.threshold,
            keep=self.keep,
            window=self.window,
            warmup=sum(c.meta.online_stop == WARMUP for c in candidates),
            watched=sum(c.meta.online_stop == WATCHED for c in candidates),
            stopped=len(stopped),
            tokens_saved=sum(self.saved(c) for c in stopped),
        )
