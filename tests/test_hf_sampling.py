"""The in-process engine's per-request sampling (tmas.llm.hf_sampling): each processor on scores worked by hand, and
the seeded Gumbel draw against the distribution it samples."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tmas.llm.hf_sampling import (  # noqa: E402
    GREEDY,
    MinP,
    RequestSampling,
    RequestTable,
    SeededDraw,
    Temperature,
    TopK,
    TopP,
    draw,
    sampling_processors,
    stream_key,
    uniform_of,
)

INF = math.inf


def requests(*ids: str) -> list[Any]:
    """The engine's future request states as the processors read them (their request id only)."""
    return [SimpleNamespace(state=SimpleNamespace(request_id=rid)) for rid in ids]


def table(**rows: RequestSampling) -> RequestTable:
    t = RequestTable()
    for rid, sampling in rows.items():
        t.add(rid, sampling)
    return t


def apply(processor: Any, scores: list[list[float]], ids: list[str]) -> list[list[float]]:
    arg = processor.prepare_tensor_args(requests(*ids))
    out = processor(torch.tensor(scores, dtype=torch.float32), arg)
    return [[round(v, 6) for v in row] for row in out.tolist()]


def test_temperature_divides_each_rows_scores_by_its_own_and_greedy_by_one() -> None:
    t = table(a=RequestSampling(temperature=0.5), b=GREEDY)
    assert apply(Temperature(t), [[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]], ["a", "b"]) == [[4.0, 2.0, 0.0], [2.0, 1.0, 0.0]]


def test_top_k_keeps_the_k_best_and_zero_keeps_all() -> None:
    t = table(a=RequestSampling(top_k=2), b=RequestSampling(top_k=0), c=RequestSampling(top_k=99))
    scores = [[3.0, 1.0, 2.0, 0.0]] * 3
    assert apply(TopK(t), scores, ["a", "b", "c"]) == [[3.0, -INF, 2.0, -INF], scores[0], scores[0]]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05. Ascending, the cumulative sums are 0.05, 0.2, 0.5, 1.0: p = 0.75 drops those
    # at most 0.25 (0.05 and 0.15; the 0.8 left reaches 0.75), p = 0.9 those at most 0.1 (0.05 alone), p = 1 none.
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    t = table(a=RequestSampling(top_p=0.75), b=RequestSampling(top_p=0.9), c=RequestSampling(top_p=1.0))
    out = apply(TopP(t), [logits] * 3, ["a", "b", "c"])
    kept = [[v != -INF for v in row] for row in out]
    assert kept == [[True, True, False, False], [True, True, True, False], [True, True, True, True]]


def test_min_p_keeps_tokens_at_least_min_p_times_the_best() -> None:
    # min_p 0.4 of the best 0.5 is 0.2: 0.5 and 0.3 stay; min_p 0 keeps all.
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    t = table(a=RequestSampling(min_p=0.4), b=RequestSampling(min_p=0.0))
    out = apply(MinP(t), [logits] * 2, ["a", "b"])
    assert [[v != -INF for v in row] for row in out] == [[True, True, False, False], [True, True, True, True]]


def test_a_request_the_table_does_not_hold_is_greedy() -> None:
    t = RequestTable()
    assert t.get("warm-up") == GREEDY
    assert t.next_key("warm-up") == 0
    assert apply(SeededDraw(t), [[1.0, 2.0]], ["warm-up"]) == [[1.0, 2.0]]


def test_stream_keys_are_never_zero_and_follow_seed_and_position() -> None:
    keys = {stream_key(seed, position) for seed in range(50) for position in range(50)}
    assert 0 not in keys
    assert all(0 < k < 2**31 for k in keys)
    assert len(keys) == 2500  # no two (seed, position) pairs of these share a stream
    assert stream_key(7, 3) == stream_key(7, 3)


def test_each_request_moves_its_own_stream_on_by_one_token_per_step() -> None:
    t = table(a=RequestSampling(seed=5), b=RequestSampling(seed=5), g=GREEDY)
    first = [t.next_key("a"), t.next_key("a"), t.next_key("a")]
    assert first == [stream_key(5, 0), stream_key(5, 1), stream_key(5, 2)]
    # Another request with the same seed draws the same stream from its own start, whatever the first drew.
    assert t.next_key("b") == stream_key(5, 0)
    assert t.next_key("g") == 0
    t.remove("a")
    assert len(t) == 2


def test_the_uniform_numbers_are_in_the_open_unit_interval_and_repeat_for_a_key() -> None:
    keys = torch.tensor([stream_key(seed, 0) for seed in range(10_000)], dtype=torch.int32)
    u = uniform_of(keys)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert torch.equal(u, uniform_of(keys))
    # Uniform: the mean of 10,000 is within 0.01 of 1/2 (its standard error is 0.003), and a tenth fall below 0.1.
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float((u < 0.1).float().mean()) - 0.1) < 0.01


def test_inverse_transform_draws_worked_by_hand() -> None:
    # Cumulative 0.5, 0.8, 0.95, 1.0: u = 0.3 lands on token 0, 0.5 still on 0 (the first to reach it), 0.6 on 1,
    # 0.97 on 3; a token of probability 0 (token 1 of the second row) is never drawn.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4 + [[0.5, 0.0, 0.5, 0.0]])
    u = torch.tensor([0.3, 0.5, 0.6, 0.97, 0.5])
    assert draw(probs, u).squeeze(-1).tolist() == [0, 0, 1, 3, 0]
    # Scores filtered by earlier processors are -inf: their probability is 0 and the total is what is left.
    left = torch.tensor([[0.5, 0.3, 0.0, 0.0]])
    assert draw(left, torch.tensor([0.7])).item() == 1  # 0.7 x 0.8 = 0.56 is past 0.5


def test_the_seeded_draw_samples_the_softmax() -> None:
    # 40,000 requests, each a first token: every frequency within 0.01 of p (the largest standard error, at p = 0.5,
    # is 0.0025).
    p = [0.5, 0.3, 0.15, 0.05]
    t = table(**{f"r{i}": RequestSampling(temperature=1.0, seed=i) for i in range(40_000)})
    ids = [f"r{i}" for i in range(40_000)]
    out = torch.tensor(apply(SeededDraw(t), [[math.log(q) for q in p]] * len(ids), ids))
    tokens = out.argmax(dim=-1)
    # Only the drawn token stands.
    assert torch.equal((out != -INF).sum(dim=-1), torch.ones(len(ids), dtype=torch.int64))
    frequency = torch.bincount(tokens, minlength=4).float() / len(ids)
    assert torch.allclose(frequency, torch.tensor(p), atol=0.01), frequency.tolist()


def test_a_filter_no_request_uses_is_skipped_unless_it_must_always_run() -> None:
    t = table(a=RequestSampling(top_k=0), b=RequestSampling(top_k=0))
    top_k = TopK(t)
    scores = [[3.0, 1.0, 2.0]] * 2
    assert apply(top_k, scores, ["a", "b"]) == scores
    assert top_k._used is False
    t.add("c", RequestSampling(top_k=1))
    assert apply(top_k, [*scores, [3.0, 1.0, 2.0]], ["a", "b", "c"])[2] == [3.0, -INF, -INF]
    top_k.always = True
    assert apply(top_k, scores, ["a", "b"]) == scores


def test_the_processors_in_order_sample_within_the_filters() -> None:
    # top_k 2 leaves tokens 0 and 1 of four; greedy takes token 0; 200 sampled rows never leave the top two.
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    t = table(g=GREEDY, **{f"s{i}": RequestSampling(temperature=1.0, top_k=2, seed=i) for i in range(200)})
    ids = ["g", *(f"s{i}" for i in range(200))]
    scores = torch.tensor([logits] * len(ids), dtype=torch.float32)
    for processor in sampling_processors(t):
        scores = processor(scores, processor.prepare_tensor_args(requests(*ids)))
    tokens = scores.argmax(dim=-1).tolist()
    assert tokens[0] == 0
    assert set(tokens[1:]) == {0, 1}
