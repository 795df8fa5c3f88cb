"""DeepConf's confidence measures (methods/confidence.py) and the Beta stopping criterion of Adaptive-Consistency
(methods/stopping.py), on values worked by hand."""

from __future__ import annotations

import math

import pytest

from tmas.llm.types import TokenLogprob, TopLogprob
from tmas.methods.confidence import SlidingGroups, token_confidence, trace_confidence
from tmas.methods.stopping import beta_stop_probability, beta_vote_stop, fewest_votes_to_stop


def position(*alternatives: float, token: str = "x") -> TokenLogprob:
    return TokenLogprob(
        token=token,
        logprob=alternatives[0] if alternatives else 0.0,
        top_logprobs=[TopLogprob(token=f"t{j}", logprob=lp) for j, lp in enumerate(alternatives)],
    )


def of_confidence(c: float) -> TokenLogprob:
    """A position whose token confidence is ``c``: alternatives -(c - 1) and -(c + 1) average to -c."""
    return position(-(c - 1.0), -(c + 1.0))


def test_token_confidence_is_minus_the_mean_of_the_top_logprobs() -> None:
    assert token_confidence(position(-1.0, -3.0)) == 2.0
    assert token_confidence(position(-1.0, -2.0, -6.0)) == 3.0
    # A peaked distribution (improbable alternatives) is more confident than a flat one.
    assert token_confidence(position(-0.01, -9.0)) > token_confidence(position(-0.69, -0.7))  # type: ignore[operator]
    # Non-finite values are dropped; fewer than two listed values say nothing of the distribution's shape.
    assert token_confidence(position(-math.inf, -1.0, -3.0)) == 2.0
    assert token_confidence(position(-0.2)) is None
    assert token_confidence(position()) is None


def test_trace_measures_worked_by_hand() -> None:
    # Token confidences 2, 1, 3, 3, 1 (mean 10 / 5 = 2).
    trace = [of_confidence(c) for c in (2.0, 1.0, 3.0, 3.0, 1.0)]
    # Windows of 2: 1.5, 2, 3, 2 -> lowest 1.5; the tail is the last two tokens: (3 + 1) / 2 = 2.
    two = trace_confidence(trace, window=2)
    assert two is not None
    assert (two.mean, two.lowest_group, two.tail, two.tokens, two.window) == (2.0, 1.5, 2.0, 5, 2)
    # Windows of 3: 2, 7/3, 7/3 -> lowest 2; tail (3 + 3 + 1) / 3 = 7/3.
    three = trace_confidence(trace, window=3)
    assert three is not None
    assert three.lowest_group == pytest.approx(2.0) and three.tail == pytest.approx(7 / 3)
    # A trace shorter than the window is one group: all three measures are its mean.
    whole = trace_confidence(trace, window=10)
    assert whole is not None and (whole.lowest_group, whole.tail, whole.mean) == (2.0, 2.0, 2.0)
    assert whole.value("tail") == 2.0 and three.value("lowest_group") == pytest.approx(2.0)


def test_positions_without_alternatives_are_left_out() -> None:
    trace = [of_confidence(2.0), position(-0.5), of_confidence(4.0)]
    measured = trace_confidence(trace, window=1)
    assert measured is not None and (measured.tokens, measured.mean, measured.lowest_group, measured.tail) == (
        2,
        3.0,
        2.0,
        4.0,
    )
    assert trace_confidence([position(-0.5)], window=4) is None
    assert trace_confidence(None, window=4) is None
    assert trace_confidence([], window=4) is None


def test_sliding_groups_report_each_full_window_as_tokens_arrive() -> None:
    groups = SlidingGroups(2)
    assert [groups.push(c) for c in (2.0, 1.0, 3.0)] == [None, 1.5, 2.0]
    assert groups.lowest == 1.5 and groups.tail() == 2.0
    with pytest.raises(ValueError, match="window"):
        SlidingGroups(0)


def test_beta_stop_probability_worked_by_hand() -> None:
    # P(p > 1/2), p ~ Beta(v1 + 1, v2 + 1) = sum_{j <= v1} C(v1 + v2 + 1, j) / 2^(v1 + v2 + 1).
    assert beta_stop_probability(0, 0) == 0.5
    assert beta_stop_probability(1, 0) == 0.75  # (1 + 2) / 4; the integral: (1/2 - 1/8) / (1/2)
    assert beta_stop_probability(2, 1) == 11 / 16  # (1 + 4 + 6) / 16; the integral: (11/192) / (1/12)
    assert beta_stop_probability(3, 1) == 26 / 32  # (1 + 5 + 10 + 10) / 32
    assert beta_stop_probability(3, 0) == 15 / 16 and beta_stop_probability(4, 0) == 31 / 32
    # Against a midpoint-rule integral of x^v1 (1 - x)^v2 over (1/2, 1) and (0, 1).
    for v1, v2 in ((5, 2), (7, 4), (2, 6)):
        steps = 20000
        xs = [(i + 0.5) / steps for i in range(steps)]
        f = [x**v1 * (1 - x) ** v2 for x in xs]
        assert beta_stop_probability(v1, v2) == pytest.approx(sum(f[steps // 2 :]) / sum(f), abs=1e-6)
    with pytest.raises(ValueError):
        beta_stop_probability(-1, 0)


def test_beta_vote_stop_reads_the_two_leading_counts() -> None:
    # Leader 4, runner-up 1 (the third answer does not count): 57/64 = 0.890625 < 0.95.
    reading = beta_vote_stop(["a", "a", "b", "a", "a", "c"])
    assert (reading.leading, reading.runner_up, reading.probability, reading.stop) == (4, 1, 57 / 64, False)
    assert beta_vote_stop(["a"] * 4).stop and not beta_vote_stop(["a"] * 3).stop
    assert beta_vote_stop(["a", "a", "a", "b"], threshold=0.8).stop  # 26/32 = 0.8125
    assert not beta_vote_stop([]).stop
    assert (fewest_votes_to_stop(0.95), fewest_votes_to_stop(0.5), fewest_votes_to_stop(0.99)) == (4, 1, 6)
