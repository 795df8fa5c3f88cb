"""benchmarks/adaptive_majority.py's rules, read on samples made by hand: the samples each rule draws, the tokens it
counts and the answer it returns, against values worked out here (Beta criterion of Adaptive-Consistency, Aggarwal
et al. 2023; DeepConf's online threshold, Fu et al. 2025, Algorithm 2)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark
from tmas.llm.types import TokenLogprob, TopLogprob, Usage
from tmas.methods.base import Candidate
from tmas.methods.confidence import Confidence


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("adaptive_majority", monkeypatch)


def _sample(index: int, answer: str, tokens: int, lowest: float | None = None) -> Candidate:
    confidence = (
        None if lowest is None else Confidence(mean=lowest, lowest_group=lowest, tail=lowest, tokens=tokens, window=2)
    )
    return Candidate(index=index, text="", answer=answer, usage=Usage(completion_tokens=tokens), confidence=confidence)


def _problem(bench: ModuleType, answers: list[str], tokens: int = 100, **kw: object) -> object:
    samples = [_sample(i, a, tokens) for i, a in enumerate(answers)]
    return bench.Problem("p", "5", samples, {a: a for a in answers}, [[] for _ in samples], **kw)


def _position(confidence: float) -> TokenLogprob:
    """A token whose two listed alternatives have mean log-probability -confidence (C_i = confidence)."""
    alternatives = [TopLogprob(token="a", logprob=-confidence + 0.5), TopLogprob(token="b", logprob=-confidence - 0.5)]
    return TokenLogprob(token="a", logprob=-confidence + 0.5, top_logprobs=alternatives)


def test_fixed_draws_the_first_k_samples_and_votes_their_plurality(bench: ModuleType) -> None:
    p = _problem(bench, ["7", "7", "7", "5", "5", "5", "5", "5"])
    assert bench.fixed(8)(p) == bench.Outcome("5", 800, 8)  # 5 five times against 7 three times
    assert bench.fixed(4)(p) == bench.Outcome("7", 400, 4)  # the first four: 7 three times against 5 once


def test_adaptive_stops_where_the_beta_criterion_passes_0_95(bench: ModuleType) -> None:
    # Unanimous: P(p > 1/2) for Beta(v + 1, 1) is 1 - 2^-(v + 1): 0.9375 after 3 votes, 0.96875 after 4.
    unanimous = _problem(bench, ["5"] * 8)
    for round_size in (1, 2, 4):
        assert bench.adaptive(round_size)(unanimous) == bench.Outcome("5", 400, 4)
    # One dissent among the first four: after v votes of which one differs, Beta(v, 2) gives
    # P = 1 - (v + 2) / 2^(v + 1): v = 4: 0.8125, 5: 0.890625, 6: 0.9375, 7: 0.96484375.
    # The dissent is the 2nd sample, so 7 votes (6 to 1) pass: rounds of 1 stop at 7 samples, rounds of 2 and 4 at 8.
    dissent = _problem(bench, ["5", "7", "5", "5", "5", "5", "5", "5"])
    assert bench.adaptive(1)(dissent) == bench.Outcome("5", 700, 7)
    assert bench.adaptive(2)(dissent) == bench.Outcome("5", 800, 8)
    assert bench.adaptive(4)(dissent) == bench.Outcome("5", 800, 8)
    # Never past k: an even split draws every sample.
    split = _problem(bench, ["5", "7"] * 4)
    assert bench.adaptive(1)(split).drawn == 8


def test_online_stop_counts_the_stopped_tokens_and_keeps_the_stopped_sample_out_of_the_vote(
    bench: ModuleType,
) -> None:
    # Warm-up of 2 with C_least 1.0 and 3.0: keep 0.9 puts the threshold at 1.0 + 0.1 x (3.0 - 1.0) = 1.2.
    warm = [_sample(0, "7", 10, lowest=1.0), _sample(1, "7", 10, lowest=3.0)]
    # Sample 2 runs confident (C_i = 2.0 throughout, groups of 2 at 2.0): it votes 5, all 10 tokens count.
    # Sample 3 falls to C_i = 0.5: its first full group (2.0, 0.5) is 1.25, the next (0.5, 0.5) is 0.5 < 1.2, so it
    # stops at its 3rd token: 3 tokens count and its answer (5) does not vote.
    later = [_sample(2, "5", 10, lowest=2.0), _sample(3, "5", 10, lowest=0.5)]
    positions = [[], [], [_position(2.0)] * 10, [_position(2.0), *[_position(0.5)] * 9]]
    p = bench.Problem("p", "5", [*warm, *later], {"5": "5", "7": "7"}, positions)
    outcome = bench.online(2, 0.9, 2)(p)
    assert outcome.tokens == 10 + 10 + 10 + 3
    assert outcome.answer == "7"  # 7 twice (the warm-up) against 5 once: the stopped 5 would have tied it
    # Keep 0.1 puts the threshold at 1.0 + 0.9 x 2.0 = 2.8: sample 2's groups of 2.0 stop it at its 2nd token too.
    assert bench.online(2, 0.1, 2)(p).tokens == 10 + 10 + 2 + 2


def test_grade_reports_accuracy_its_standard_error_and_the_tokens_saved(bench: ModuleType) -> None:
    right = _problem(bench, ["5"] * 8)
    wrong = bench.Problem("q", "5", [_sample(i, "7", 50) for i in range(8)], {"7": "7"}, [[]] * 8)
    rows = bench.grade([right, wrong], {"fixed": bench.fixed(8), "adaptive": bench.adaptive(1)})
    fixed_row, adaptive_row = rows
    # One right of two: p = 0.5, SE = sqrt(0.5 x 0.5 / 2) = 0.3536; tokens (800 + 400) / 2 = 600 a problem.
    assert (fixed_row["right"], fixed_row["accuracy"]) == (1, 0.5)
    assert fixed_row["standard_error"] == pytest.approx(0.35355, abs=1e-5)
    assert fixed_row["completion_tokens_per_problem"] == 600
    # Adaptive stops both at 4 samples: (400 + 200) / 2 = 300 a problem, half of fixed's.
    assert adaptive_row["completion_tokens_per_problem"] == 300
    assert adaptive_row["samples_per_problem"] == 4
    assert adaptive_row["tokens_saved_vs_fixed"] == pytest.approx(0.5)


def test_a_problem_opens_unanimous_when_its_first_four_samples_answer_alike(bench: ModuleType) -> None:
    assert bench.opens_unanimous(_problem(bench, ["5", "5", "5", "5", "7"]))
    assert not bench.opens_unanimous(_problem(bench, ["5", "5", "5", "7", "5"]))
    # An unanswered sample among the first four: the criterion has three votes there, too few at 0.95.
    unanswered = _problem(bench, ["5", "5", "5", "5"])
    unanswered.samples[2].answer = None
    assert not bench.opens_unanimous(unanswered)
    assert not bench.opens_unanimous(_problem(bench, ["5", "5", "5"]))


def test_reading_a_folder_that_holds_no_run_says_so_in_one_line(bench: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"adaptive_majority: no run in .*fixed8 to read \(run the command without"):
        bench.main(["--out", str(tmp_path / "out"), "--read-only"])
