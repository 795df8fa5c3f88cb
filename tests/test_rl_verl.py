"""verl as the paper trains: the batch reward gives a prompt's Base and Bank rollouts one GRPO
group, so the experience bonus moves the advantages (eq. 6-8, worked by hand below and in docs/rl.md), and no batch
boundary over a ``--layout verl`` file from a real TMAS run on the simulated server makes it raise."""

from __future__ import annotations

import os
import random
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from conftest import settings_for
from tmas.problems import Problem
from tmas.rl import verl_reward
from tmas.rl.data import build_dataset
from tmas.rl.rewards import group_advantages
from tmas.runner import prepare_run, run_problems
from tmas.testing import SimScript, SimServer
from tmas.testing.script import Rule

Q = "What is 17*23?"
ROOT = Path(__file__).resolve().parents[1]


def info(variant: str) -> dict[str, Any]:
    return {
        "task": "experience",
        "group": "run/p1/1/experience",
        "variant": variant,
        "copy": 0,
        "problem_id": "p1",
        "question": Q,
        "experience_bank": [],
        "guideline_bank": [],
    }


def advantages_by_uid(scores: list[dict[str, Any]], key: str = "uid") -> list[float]:
    """What verl's GRPO does with the returned scores: eq. 6 within each group of equal ``key``."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(scores):
        groups[str(s[key])].append(i)
    out = [0.0] * len(scores)
    for members in groups.values():
        for i, a in zip(members, group_advantages([scores[i]["score"] for i in members]), strict=True):
            out[i] = a
    return out


# The worked example of docs/rl.md: 8 Base rollouts, 2 correct (p_base = 2/8 = 0.25); 8 Bank rollouts, 5 correct.
BASE = ["\\boxed{391}"] * 2 + ["\\boxed{390}"] * 6
BANK = ["\\boxed{391}"] * 5 + ["no answer"] * 3


def score(beta: float) -> list[dict[str, Any]]:
    return verl_reward.compute_score_batch(
        data_sources=["tmas/experience"] * 16,
        solution_strs=BASE + BANK,
        ground_truths=["391"] * 16,
        extra_infos=[info("base")] * 8 + [info("bank")] * 8,
        beta=beta,
    )


@pytest.mark.parametrize(
    # Eq. 8: a correct Bank rollout gets 1 + beta * (1 - 0.25). Eq. 6 over all 16 (population sigma):
    #   beta 0:   7 x +1, 9 x -1; mu = -2/16 = -0.125, sigma = sqrt(1 - 0.015625) = 0.99216
    #             -> A = 1.125/0.99216 = 1.1339 (every correct), -0.875/0.99216 = -0.8819 (wrong)
    #   beta 0.3: Bank correct 1.225; mu = (2 + 6.125 - 9)/16 = -0.0546875; E[r^2] = (2 + 5*1.500625 + 9)/16
    #             = 1.1564453, sigma = sqrt(1.1564453 - 0.0029907) = 1.07399
    #             -> Base correct 1.0546875/1.07399 = 0.9820, Bank correct 1.2796875/1.07399 = 1.1915,
    #                wrong -0.9453125/1.07399 = -0.8802
    #   beta 0.6: Bank correct 1.45; mu = (2 + 7.25 - 9)/16 = 0.015625; E[r^2] = (2 + 5*2.1025 + 9)/16 = 1.3445313,
    #             sigma = sqrt(1.3445313 - 0.0002441) = 1.15943
    #             -> Base correct 0.984375/1.15943 = 0.8490, Bank correct 1.434375/1.15943 = 1.2371,
    #                wrong -1.015625/1.15943 = -0.8760
    ("beta", "bank_correct", "adv_base_correct", "adv_bank_correct", "adv_wrong"),
    [(0.0, 1.0, 1.1339, 1.1339, -0.8819), (0.3, 1.225, 0.9820, 1.1915, -0.8802), (0.6, 1.45, 0.8490, 1.2371, -0.8760)],
)
def test_one_group_of_8_plus_8_moves_with_beta(
    beta: float, bank_correct: float, adv_base_correct: float, adv_bank_correct: float, adv_wrong: float
) -> None:
    scores = score(beta)
    assert [s["score"] for s in scores] == pytest.approx([1, 1] + [-1] * 6 + [bank_correct] * 5 + [-1] * 3)
    assert {s["uid"] for s in scores} == {"run/p1/1/experience"}  # one GRPO group of 16
    assert {s["p_base"] for s in scores} == {0.25}
    assert [s["correct"] for s in scores] == [1, 1] + [0] * 6 + [1] * 5 + [0] * 3
    adv = advantages_by_uid(scores)
    assert adv[0] == pytest.approx(adv_base_correct, abs=1e-4)
    assert adv[8] == pytest.approx(adv_bank_correct, abs=1e-4)
    assert adv[2] == pytest.approx(adv_wrong, abs=1e-4) and adv[13] == pytest.approx(adv_wrong, abs=1e-4)


def test_the_bonus_is_lost_when_halves_are_separate_groups() -> None:
    # Verl's own per-row groups (the old layout): the Bank half's rewards take two values, and standardising them
    # gives sqrt(3/5) = 0.7746 and -sqrt(5/3) = -1.2910 whatever beta is. The shared uid is what makes beta count.
    for scores in (score(0.0), score(0.6)):
        for s, variant in zip(scores, ["base"] * 8 + ["bank"] * 8, strict=True):
            s["row"] = variant
        per_row = advantages_by_uid(scores, key="row")
        assert per_row[8] == pytest.approx(0.7746, abs=1e-4) and per_row[13] == pytest.approx(-1.2910, abs=1e-4)
    assert advantages_by_uid(score(0.0)) != pytest.approx(advantages_by_uid(score(0.6)))


def test_a_group_cut_by_the_batch_is_scored_not_raised() -> None:
    # Bank half alone: no Base rollout to measure p_base with -> plain correctness, flagged.
    alone = verl_reward.compute_score_batch(["tmas/experience"] * 8, BANK, ["391"] * 8, [info("bank")] * 8, beta=0.6)
    assert [s["score"] for s in alone] == [1.0] * 5 + [-1.0] * 3
    assert {(s["p_base"], s["group_incomplete"]) for s in alone} == {(-1.0, 1)}
    # 8 Base with 4 Bank: p_base from the Base present (0.25), bonus 0.6 * 0.75 = 0.45 on the correct Bank ones.
    part = verl_reward.compute_score_batch(
        ["tmas/experience"] * 12, BASE + BANK[3:7], ["391"] * 12, [info("base")] * 8 + [info("bank")] * 4, beta=0.6
    )
    assert [s["score"] for s in part][8:] == pytest.approx([1.45, 1.45, -1.0, -1.0])
    assert {s["group_incomplete"] for s in part} == {1}


def test_foreign_rows_keep_verls_own_groups() -> None:
    scores = verl_reward.compute_score_batch(
        ["gsm8k", "tmas/experience"], ["\\boxed{7}", "\\boxed{391}"], ["7", "391"], [None, info("base")]
    )
    assert [s["score"] for s in scores] == [1.0, 1.0]
    assert all("uid" not in s for s in scores)  # a uid on some rows only would not line up with verl's


def test_think_opened_reads_responses_as_starting_inside_the_think_block() -> None:
    # Qwen3-4B-Thinking-2507's template opens <think> in the prompt, so verl's decoded responses hold only the
    # closing tag, and one cut while it thinks none: with the think_opened reward kwarg its box is no answer (-1), on
    # our rows and on a foreign data set's alike; an answer after </think> is graded as before.
    cut, done = "maybe \\boxed{391}, then 17*20 = 340 and", "so 391.</think>\n\n\\boxed{391}"
    normal = {**info("base"), "task": "normal", "variant": None}
    args = (["tmas/normal", "tmas/normal"], [cut, done], ["391", "391"], [normal, normal])
    assert [s["score"] for s in verl_reward.compute_score_batch(*args, think_opened=True)] == [-1.0, 1.0]
    assert [s["score"] for s in verl_reward.compute_score_batch(*args)] == [1.0, 1.0]
    assert verl_reward.compute_score("gsm8k", cut, "391", None, think_opened=True) == -1.0
    assert verl_reward.compute_score("gsm8k", done, "391", None, think_opened=True) == 1.0


async def test_no_batch_boundary_raises(sim: SimServer, tmp_path: Path) -> None:
    problems = [
        Problem(problem_id="p1", question=Q, answer="391"),
        Problem(problem_id="p2", question="What is 12*11?", answer="132"),
    ]
    settings = settings_for(sim, method={"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 3}})
    store, settings, todo = prepare_run(tmp_path / "run", settings, problems, resume=False)
    with store:
        await run_problems(settings, todo, store)
    rows = build_dataset([tmp_path / "run"], mix=None, layout="verl").train
    config = tmp_path / "judge.toml"
    config.write_text(f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "sim-model"\n')
    # Every group is exactly two adjacent rows, so an even batch from the start never cuts one.
    keys = [r["extra_info"]["group"] for r in rows]
    assert len(rows) % 2 == 0 and all(keys[i] == keys[i + 1] for i in range(0, len(rows), 2))
    rng = random.Random(0)
    answers = {p.question: p.answer for p in problems}
    incomplete = 0
    n = 2  # rollouts per row
    for skip in (0, 1):  # 1: as if a row had been filtered out, shifting every later pair
        for size in range(1, 7):
            for start in range(skip, len(rows) - size + 1, size):  # drop_last, as verl's loader
                batch = [r for r in rows[start : start + size] for _ in range(n)]
                truth = [answers[r["extra_info"]["question"]] for r in batch]
                completions = [f"\\boxed{{{t if rng.random() < 0.5 else 0}}}" for t in truth]
                scores = verl_reward.compute_score_batch(
                    [r["data_source"] for r in batch],
                    completions,
                    truth,
                    [r["extra_info"] for r in batch],
                    tmas_config=str(config),
                )
                assert [set(s) for s in scores] == [set(verl_reward.SCORE_KEYS)] * len(batch)
                assert [s["uid"] for s in scores] == [r["extra_info"]["group"] for r in batch]
                cut = {s["uid"] for s in scores if s["group_incomplete"]}
                whole = skip == 0 and size % 2 == 0
                assert not (whole and cut), (size, start)
                # Only an experience group can be incomplete (a copied row is one prompt either way).
                assert all(k.endswith("/experience") for k in cut)
                incomplete += len(cut)
    assert incomplete  # odd sizes and the shifted start did cut experience groups, and were scored


def test_the_judges_unusable_replies_are_recorded_on_their_rollouts(tmp_path: Path) -> None:
    # Eq. 9 on four exploration rollouts; the judge's reply on the two marked ones is no verdict: they count as known
    # (0.2 correct, -1.0 wrong), and each says so, where it read as a verdict of "known" before.
    script = SimScript(
        rules=[
            Rule(role="judge", pattern="ZQX-UNREAD", replies=["I cannot decide."]),
            Rule(role="judge", replies=['```json\n{"identified_strategy": "s", "novelty": 1, "same_as": null}\n```']),
        ]
    )
    guideline = {**info("base"), "task": "guideline", "group": "run/p1/1/guideline", "variant": None}
    guideline["guideline_bank"] = [{"id": "G1", "description": "Multiply digit by digit."}]
    completions = ["\\boxed{391}", "\\boxed{0}", "\\boxed{391} ZQX-UNREAD", "\\boxed{0} ZQX-UNREAD"]
    with SimServer(script) as server:
        config = tmp_path / "judge.toml"
        config.write_text(f'[endpoint]\nbase_url = "{server.base_url}"\nmodel = "sim-model"\n')
        scores = verl_reward.compute_score_batch(
            ["tmas/guideline"] * 4, completions, ["391"] * 4, [guideline] * 4, tmas_config=str(config)
        )
    assert [s["score"] for s in scores] == [1.0, -0.5, 0.2, -1.0]
    assert [(s["novel"], s["judge_unusable"]) for s in scores] == [(1, 0), (1, 0), (0, 1), (0, 1)]


@pytest.mark.slow
def test_verls_own_reward_path_in_its_environment() -> None:
    """test_rl_verl_manager.py in the environment verl is installed in (``make verl-env``; ``make test`` names it
    in ``TMAS_VERL_PYTHON``, so there a missing one fails rather than skips)."""
    named = os.environ.get("TMAS_VERL_PYTHON")
    python = Path(named) if named else ROOT / ".venv-verl" / "bin" / "python"
    if not python.is_file():
        assert not named, f"TMAS_VERL_PYTHON={named}: no such interpreter"
        pytest.skip("verl's environment is not built here (make verl-env)")
    # Its own tmas install is used, not this process's import path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    test = ROOT / "tests" / "test_rl_verl_manager.py"
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "2 passed" in summary and "skipped" not in summary, summary
