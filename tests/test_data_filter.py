"""``tmas data filter`` (TMAS appendix A.2): in process on a scripted model, the counts worked by hand decide what
is kept and selected, the samples are a resumable run at the paper's sampling, failed problems are left out; the
command itself against the simulated server, its flags in the request bodies."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from conftest import SCRIPTED_URL, clean_env, config_file, run_tmas, scripted_settings, settings_for, wait_for
from scripted_runs import by_role, scripted_run
from tmas.config import Sampling, load_settings
from tmas.data.difficulty_filter import (
    FilterCard,
    default_max_tokens,
    filter_settings,
    run_filter,
    samples_sampling,
    sampling_notes,
    user_sampling,
    write_subset,
)
from tmas.errors import ConfigError, InputError
from tmas.grading.grades import GradeConfig
from tmas.llm.sampling import with_sampling
from tmas.methods import METHODS, register_method
from tmas.methods.traits import Traits
from tmas.problems import Problem, load_problems
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript, SimServer
from tmas.testing.script import Rule

# name, question, answer, how many of the k = 4 samples the script answers right.
CASES = [
    ("alpha", "Alpha: what is 2*3?", "6", 4),
    ("beta", "Beta: what is 5*5?", "25", 1),
    ("gamma", "Gamma: what is 7*7?", "49", 0),
    ("delta", "Delta: what is 3*3?", "9", 2),
    ("epsilon", "Epsilon: what is 4*4?", "16", 1),
    ("zeta", "Zeta: what is 8*8?", "64", 0),
]
# Problems of a file of their own: gamma (no sample right), and eta and iota, which the scripts below answer.
GAMMA = ("gamma", CASES[2][1], "49")
ETA = ("eta", "Eta: what is 9*9?", "81")
IOTA = ("iota", "Iota: what is 10*10?", "100")


def script() -> SimScript:
    rules = []
    for name, _, answer, right in CASES:
        replies = [
            f"So the result is \\boxed{{{answer}}}." if i < right else "So the result is \\boxed{1000}."
            for i in range(4)
        ]
        rules.append(Rule(role="solution", pattern=name.capitalize() + ":", replies=replies))
    return SimScript(rules=rules)


def tmas(*args: str) -> subprocess.CompletedProcess[bytes]:
    return run_tmas(*args, timeout=120)


def write_problems(path: Path, rows: Sequence[tuple[str, str, str]]) -> None:
    """A problem file of ``(problem_id, question, answer)`` rows."""
    path.write_text("".join(json.dumps({"problem_id": i, "question": q, "answer": a}) + "\n" for i, q, a in rows))


def filter_command(problems: Path, out: Path, k: int, *flags: str) -> tuple[str, ...]:
    """``tmas data filter`` of ``problems`` into ``out``, k samples a problem graded by the rules, then ``flags``."""
    return ("data", "filter", str(problems), "-o", str(out), "-k", str(k), "--grade", "rules", *flags)


def on_model(rules: SimScript, k: int, **overrides: Any) -> ScriptedModel:
    """A scripted model answering with ``rules``, on the settings ``tmas data filter -k K`` gives a run."""
    return ScriptedModel(rules, filter_settings(scripted_settings(**overrides), k, set()))


async def test_filter_keeps_the_problems_solved_fewer_than_t_times_and_selects_n(tmp_path: Path) -> None:
    problems = tmp_path / "bench.jsonl"
    problems.write_text(
        "".join(json.dumps({"id": n, "question": q, "answer": a, "src": "x"}) + "\n" for n, q, a, _ in CASES)
    )
    out, run_dir = tmp_path / "bench-hard.jsonl", tmp_path / "bench-hard.filter-run"
    model = on_model(script(), 4, endpoint__model="filter-model")

    async def run_filter_on(model: ScriptedModel, n: int, seed: int) -> FilterCard:
        return await run_filter(
            problems, run_dir, out, model.settings, GradeConfig(mode="rules"), k=4, below=2, n=n, seed=seed, model=model
        )

    card = await run_filter_on(model, 2, 0)
    # Solved counts by hand: alpha 4, beta 1, gamma 0, delta 2, epsilon 1, zeta 0.
    assert card.solved_counts == {0: 2, 1: 2, 2: 1, 4: 1}
    stored = json.loads((tmp_path / "bench-hard.card.json").read_text())
    assert stored["solved_counts"] == {"0": 2, "1": 2, "2": 1, "4": 1}
    assert stored["kept"] == 4 and stored["k"] == 4 and stored["below"] == 2 and stored["model"] == "filter-model"
    # Kept: beta, gamma, epsilon, zeta; seed 0 draws gamma and zeta (listed in file order).
    assert stored["selected"] == ["gamma", "zeta"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["problem_id"], r["answer"], r["src"]) for r in rows] == [("gamma", "49", "x"), ("zeta", "64", "x")]
    assert "| 1 | 2 | 2 |" in (tmp_path / "bench-hard.card.md").read_text()
    # Every sample was a plain chain-of-thought call at the paper's sampling: 6 problems x 4 samples.
    assert len(model.calls) == 24 and set(by_role(model)) == {"solution"}
    assert {(c.body["temperature"], c.body["top_p"], c.body["model"]) for c in model.calls} == {
        (1.0, 0.95, "filter-model")
    }
    with RunStore(run_dir, create=False) as store:
        assert store.get_meta("method")["params"]["k"] == 4

    # Run again (another n and seed): the samples are resumed from the store, no call is made.
    again = on_model(script(), 4, endpoint__model="filter-model")
    card = await run_filter_on(again, 3, 7)
    assert again.calls == []
    # Seed 7 draws epsilon, beta and gamma of the four kept (listed in file order).
    assert json.loads((tmp_path / "bench-hard.card.json").read_text())["selected"] == ["beta", "gamma", "epsilon"]

    # The samples of another k, or a run no filter made, are not sampled over.
    with pytest.raises(InputError, match=r"holds the samples of a filter of bench with k=4, not of bench with k=2"):
        await run_filter(problems, run_dir, out, model.settings, GradeConfig(mode="rules"), k=2, below=2, n=1, seed=0)
    other = tmp_path / "other-run"
    await scripted_run(on_model(script(), 1), other, [Problem(problem_id="a", question="What is 2+3?", answer="5")])
    with pytest.raises(InputError, match=r"other-run holds no filter's samples, not of bench with k=4"):
        await run_filter(problems, other, out, model.settings, GradeConfig(mode="rules"), k=4, below=2, n=1, seed=0)
    assert again.calls == []


async def test_a_filter_resumed_with_another_limit_samples_and_counts_the_problems_asked_for(tmp_path: Path) -> None:
    problems = tmp_path / "bench.jsonl"
    problems.write_text("".join(json.dumps({"id": n, "question": q, "answer": a}) + "\n" for n, q, a, _ in CASES))
    out, run_dir = tmp_path / "hard.jsonl", tmp_path / "hard.filter-run"

    async def run_filter_on(limit: int | None) -> tuple[FilterCard, ScriptedModel]:
        model = on_model(script(), 4)
        grading = GradeConfig(mode="rules")
        card = await run_filter(
            problems, run_dir, out, model.settings, grading, k=4, below=2, n=50, seed=0, limit=limit, model=model
        )
        return card, model

    # --limit 2: alpha (solved 4 times) and beta (1).
    card, model = await run_filter_on(2)
    assert card.solved_counts == {4: 1, 1: 1} and card.selected == ["beta"] and len(model.calls) == 8
    # The whole file in the same run directory: the four other problems are sampled (4 calls each), alpha and beta
    # resumed; counts by hand: alpha 4, beta 1, gamma 0, delta 2, epsilon 1, zeta 0.
    card, model = await run_filter_on(None)
    assert Counter(c.key.problem_id for c in model.calls) == {"gamma": 4, "delta": 4, "epsilon": 4, "zeta": 4}
    assert card.solved_counts == {0: 2, 1: 2, 2: 1, 4: 1} and card.selected == ["beta", "gamma", "epsilon", "zeta"]
    # --limit 3 again: the run's other problems are not counted (nor is any sample drawn).
    card, model = await run_filter_on(3)
    assert model.calls == [] and card.solved_counts == {4: 1, 1: 1, 0: 1} and card.selected == ["beta", "gamma"]
    assert [json.loads(line)["problem_id"] for line in out.read_text().splitlines()] == ["beta", "gamma"]


@pytest.mark.slow
def test_filter_flags_set_the_sampling(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(script())
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [("alpha", CASES[0][1], "6")])
    out = tmp_path / "hard.jsonl"
    done = tmas(
        *filter_command(problems, out, 2, "--base-url", sim.base_url, "--temperature", "0.6", "--max-tokens", "300")
    )
    assert done.returncode == 0, done.stderr.decode()
    assert "solved-of-2 counts {0: 0, 1: 0, 2: 1}; kept 0; selected 0" in done.stdout.decode()
    assert {(b["temperature"], b["top_p"], b["max_tokens"]) for b in sim.chat_bodies()} == {(0.6, 0.95, 300)}
    # Solved 2 of 2: nothing is kept, and the card says only that many were kept.
    card = json.loads((tmp_path / "hard.card.json").read_text())
    assert card["kept"] == 0 and card["selected"] == [] and out.read_text() == ""
    assert any("fewer than n = 50" in note for note in card["notes"])


async def test_a_problem_whose_every_sample_failed_is_left_out_not_kept(tmp_path: Path) -> None:
    model = on_model(SimScript(rules=[*script().rules, Rule(role="solution", pattern="Eta:", fault="http_400")]), 4)
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA, ETA])
    out = tmp_path / "hard.jsonl"
    grading = GradeConfig(mode="rules")
    await run_filter(problems, tmp_path / "run", out, model.settings, grading, k=4, below=2, n=50, seed=0, model=model)
    card = json.loads((tmp_path / "hard.card.json").read_text())
    # eta's four calls were refused: it failed, so it is neither counted as unsolved nor selected.
    assert card["failed_problems"] == ["eta"] and card["failed_samples"] == 4
    assert card["solved_counts"] == {"0": 1} and card["selected"] == ["gamma"]
    assert "1 problems failed (no usable sample): left out of the filter" in card["notes"]


async def test_a_problem_with_a_blank_reference_answer_is_left_out_not_kept_as_hard(tmp_path: Path) -> None:
    # A blank answer (a file written with "" for a missing one) matches no sample: counted, it would look unsolved
    # and be selected as hard. It is no reference answer: left out as unlabeled, as a problem without one is.
    model = on_model(script(), 4)
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA, ("blank", "Blank: what is 9*9?", " ")])
    out = tmp_path / "hard.jsonl"
    grading = GradeConfig(mode="rules")
    await run_filter(problems, tmp_path / "run", out, model.settings, grading, k=4, below=2, n=50, seed=0, model=model)
    card = json.loads((tmp_path / "hard.card.json").read_text())
    assert card["unlabeled"] == ["blank"] and card["selected"] == ["gamma"] and card["solved_counts"] == {"0": 1}
    # Graded by the rules alone: the card says no judge was asked, not "1 judge run(s)".
    assert card["grading"] == "rules only, no judge"


async def test_failed_samples_are_not_counted_as_unsolved(tmp_path: Path) -> None:
    # k = 4, below 2. eta: 3 of its 4 calls refused, its one reply wrong: too few replies to judge (undecided), where
    # counting the failures as unsolved would keep it as hard. iota: 2 refused, of its 2 replies 1 right: solved at a
    # rate of 1/2, not below 2/4, so not kept (counted over 4, its 1 would be). gamma: 4 replies, none right: kept.
    refused = [
        Rule(role="solution", pattern="Eta:", fault="http_400", times=3),
        Rule(role="solution", pattern="Eta:", replies=["So the result is \\boxed{1000}."]),
        Rule(role="solution", pattern="Iota:", fault="http_400", times=2),
        Rule(role="solution", pattern="Iota:", replies=["So \\boxed{100}.", "So \\boxed{1000}."]),
    ]
    model = on_model(SimScript(rules=[*refused, *script().rules]), 4)
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA, ETA, IOTA])
    out = tmp_path / "hard.jsonl"
    grading = GradeConfig(mode="rules")
    await run_filter(problems, tmp_path / "run", out, model.settings, grading, k=4, below=2, n=50, seed=0, model=model)
    assert len(model.calls) == 12
    card = json.loads((tmp_path / "hard.card.json").read_text())
    assert card["kept"] == 1 and card["selected"] == ["gamma"]
    assert card["failed_samples"] == 5 and card["failed_problems"] == [] and card["undecided"] == ["eta"]
    assert card["solved_counts"] == {"0": 1, "1": 1} and card["kept_counts"] == {"0": 1}
    assert [json.loads(line)["problem_id"] for line in out.read_text().splitlines()] == ["gamma"]
    markdown = (tmp_path / "hard.card.md").read_text()
    assert "- undecided (fewer than half of the 4 samples replied): 1, left out" in markdown
    assert "| 0 | 1 | 1 |" in markdown and "| 1 | 1 | 0 |" in markdown


async def test_a_judge_of_ones_own_grades_the_samples(tmp_path: Path) -> None:
    # The judge, on the model that drew the samples, calls every answer right: no problem is hard, none kept.
    rules = SimScript(rules=[Rule(role="judge", replies=['{"reasoning": "r", "equivalent": true}']), *script().rules])
    model = on_model(rules, 2)
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA])
    grading = GradeConfig(mode="judge", judge_runs=1)
    out = tmp_path / "hard.jsonl"
    card = await run_filter(
        problems, tmp_path / "run", out, model.settings, grading, k=2, below=2, n=5, seed=0, model=model
    )
    # Both samples box the same 1000: one judgement serves both.
    assert by_role(model) == {"solution": 2, "judge": 1}
    assert card.solved_counts == {2: 1} and card.kept == 0 and card.selected == []


def test_a_subset_of_a_file_whose_lines_name_two_ids_reads_back_under_the_same_ids(tmp_path: Path) -> None:
    # HLE-Math-100's lines carry question_id (the id read) and id (HLE's row, kept as metadata): the subset writes
    # problem_id next to that id, so a line naming the id in several fields must keep reading as the first of them.
    source = tmp_path / "p.jsonl"
    source.write_text(
        json.dumps({"id": 8, "question": "Q1", "answer": "2", "question_id": 1})
        + "\n"
        + json.dumps({"id": 3, "question": "Q2", "answer": "5", "question_id": 2})
        + "\n"
    )
    problems = load_problems(source)
    assert [(p.problem_id, p.metadata) for p in problems] == [("1", {"id": 8}), ("2", {"id": 3})]
    write_subset(problems, ["2"], tmp_path / "subset.jsonl")
    [again] = load_problems(tmp_path / "subset.jsonl")
    assert (again.problem_id, again.metadata) == ("2", {"id": 3})


def test_the_sampling_method_is_the_one_the_registry_declares() -> None:
    # By default the first registered method whose traits name a sample-count parameter: majority vote's k.
    settings = filter_settings(scripted_settings(), 4, set())
    assert (settings.method.name, settings.method.params) == ("majority", {"k": 4, "iterations": 1})
    # Settings that configure a sampling method keep it and its own parameters; k and one iteration are the filter's.
    own = scripted_settings(method={"name": "majority", "params": {"k": 64, "style": "concise"}})
    assert filter_settings(own, 8, set()).method.params == {"k": 8, "style": "concise", "iterations": 1}

    class Draws(METHODS["majority"]):  # type: ignore[misc,valid-type]
        name: ClassVar[str] = "draws_toy"
        traits: ClassVar[Traits] = Traits(frontier="votes", samples="k")

    register_method(Draws)
    try:
        chosen = filter_settings(scripted_settings(), 3, set(), method="draws_toy").method
        assert (chosen.name, chosen.params) == ("draws_toy", {"k": 3, "iterations": 1})
    finally:
        del METHODS["draws_toy"]
    # A method that draws no independent samples cannot be the filter's.
    with pytest.raises(ConfigError, match="'tmas' is not one"):
        filter_settings(scripted_settings(), 3, set(), method="tmas")


async def test_running_the_filter_again_asks_only_the_failed_samples_again(tmp_path: Path) -> None:
    # k = 4, below 2. First run, the server failing: eta's calls refused 3 times (1 reply: undecided), iota's twice
    # (2 replies, decided), gamma's never.
    refused = [
        Rule(role="solution", pattern="Eta:", fault="http_400", times=3),
        Rule(role="solution", pattern="Iota:", fault="http_400", times=2),
    ]
    replies = [
        Rule(role="solution", pattern="Eta:", replies=["So the result is \\boxed{1000}."]),
        Rule(role="solution", pattern="Iota:", replies=["So \\boxed{100}.", "So \\boxed{1000}."]),
    ]
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA, ETA, IOTA])
    out, run_dir = tmp_path / "hard.jsonl", tmp_path / "run"

    async def run_filter_on(model: ScriptedModel) -> FilterCard:
        grading = GradeConfig(mode="rules")
        return await run_filter(
            problems, run_dir, out, model.settings, grading, k=4, below=2, n=50, seed=0, model=model
        )

    first = await run_filter_on(on_model(SimScript(rules=[*refused, *replies, *script().rules]), 4))
    assert first.undecided == ["eta"] and first.failed_samples == 5 and first.selected == ["gamma"]
    with RunStore(run_dir, create=False) as store:
        failed = {
            (r.problem_id, c.index) for r in store.results() for rec in r.iterations for c in rec.candidates if c.error
        }
    assert Counter(pid for pid, _ in failed) == {"eta": 3, "iota": 2}

    # Again on the same run directory, the server healthy: exactly the failed samples are asked again (the replied
    # ones replayed from the store), and the card judges eta and iota on all four samples each.
    wrong = [Rule(role="solution", pattern=f"{name}:", replies=["So \\boxed{1000}."]) for name in ("Eta", "Iota")]
    healthy = on_model(SimScript(rules=[*wrong, *script().rules]), 4)
    card = await run_filter_on(healthy)
    assert sorted((c.key.problem_id, c.key.sample) for c in healthy.calls) == sorted(failed)
    assert card.failed_samples == 0 and card.undecided == []
    # The new replies box 1000. eta: solved 0 of 4 (kept); iota: 1 of 4 (kept, where its 1 of 2 replied was not).
    assert card.solved_counts == {0: 2, 1: 1} and card.selected == ["gamma", "eta", "iota"]

    # A third time, nothing failed: no call at all.
    again = on_model(SimScript(rules=[*wrong, *script().rules]), 4)
    assert (await run_filter_on(again)).selected == ["gamma", "eta", "iota"] and again.calls == []


@pytest.mark.slow
def test_the_command_run_again_sends_only_the_failed_samples(sim: SimServer, tmp_path: Path) -> None:
    eta = Rule(role="solution", pattern="Eta:", replies=["So the result is \\boxed{1000}."])
    sim.set_script(
        SimScript(rules=[Rule(role="solution", pattern="Eta:", fault="http_400", times=3), eta, *script().rules])
    )
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA, ETA])
    out = tmp_path / "hard.jsonl"
    command = filter_command(problems, out, 4, "--base-url", sim.base_url)
    first = tmas(*command)
    assert first.returncode == 0, first.stderr.decode()
    assert "undecided 1 (too few replies)" in first.stdout.decode()
    assert json.loads((tmp_path / "hard.card.json").read_text())["undecided"] == ["eta"]

    # The server healthy, the same command: only eta's three failed samples reach it, and eta is decided (kept).
    sim.reset()
    sim.set_script(SimScript(rules=[eta, *script().rules]))
    again = tmas(*command)
    assert again.returncode == 0, again.stderr.decode()
    asked = [b["messages"][-1]["content"] for b in sim.chat_bodies()]
    assert len(asked) == 3 and all("Eta:" in text for text in asked)
    card = json.loads((tmp_path / "hard.card.json").read_text())
    assert card["undecided"] == [] and card["failed_samples"] == 0 and card["selected"] == ["gamma", "eta"]


@pytest.mark.slow
def test_the_command_passes_the_cost_gate_before_any_sample(sim: SimServer, tmp_path: Path) -> None:
    # The filter sends k samples a problem (the paper's: 8 of 400 problems at up to 120,000 tokens each): before, it
    # sent them without an estimate, a question or --dry-run, unlike every other command that starts model calls.
    sim.set_script(script())
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [(pid, question, answer) for pid, question, answer, _ in CASES[:3]])
    out = tmp_path / "hard.jsonl"
    command = filter_command(problems, out, 4, "--base-url", sim.base_url)
    # 3 problems x 4 samples: 12 calls, 24 with every reply asked again; over 20, without a terminal, it refuses.
    refused = tmas(*command, "--confirm-calls", "20")
    assert refused.returncode == 2
    assert (
        refused.stderr.decode()
        .strip()
        .splitlines()[-1]
        .startswith("tmas: error: the estimate is 24 calls (threshold 20): pass --yes")
    )
    dry = tmas(*command, "--dry-run")
    assert dry.returncode == 0 and "hard.filter-run         3              4         12" in dry.stderr.decode()
    assert sim.chat_bodies() == [] and not out.exists() and not (tmp_path / "hard.filter-run").exists()
    # Under the threshold it says the estimate in one line and samples.
    done = tmas(*command, "--confirm-calls", "24")
    assert done.returncode == 0, done.stderr.decode()
    assert "tmas: estimate: 12 calls (24 at most, with replies asked again)" in done.stderr.decode()
    assert len(sim.chat_bodies()) == 12
    # Run again, every problem settled: nothing is left to send, so nothing passes any threshold.
    again = tmas(*command, "--confirm-calls", "0")
    assert again.returncode == 0, again.stderr.decode()
    assert "tmas: estimate: 0 calls" in again.stderr.decode() and len(sim.chat_bodies()) == 12
    # Another filter's samples in the run directory are refused before an estimate that would count them as its own.
    other = tmas(*filter_command(problems, out, 2, "--base-url", sim.base_url))
    assert other.returncode == 2 and other.stderr.decode().splitlines() == [
        f"tmas: error: --run-dir {tmp_path / 'hard.filter-run'} holds the samples of a filter of b with k=4, not of b"
        " with k=2: give another"
    ]


async def test_a_filter_run_again_with_another_model_or_server_is_refused_before_any_sample(tmp_path: Path) -> None:
    # k = 4. The first run's server refuses one of eta's calls: run again, that sample would be sent, and sent to
    # another model or server it would sit beside the three replies of the first in one problem's count.
    refused = Rule(role="solution", pattern="Eta:", fault="http_400", times=1)
    eta = Rule(role="solution", pattern="Eta:", replies=["So \\boxed{1000}."])
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA, ETA])
    out, run_dir = tmp_path / "hard.jsonl", tmp_path / "run"
    grading = GradeConfig(mode="rules")

    async def run_filter_on(model: ScriptedModel) -> FilterCard:
        return await run_filter(
            problems, run_dir, out, model.settings, grading, k=4, below=2, n=50, seed=0, model=model
        )

    first = await run_filter_on(on_model(SimScript(rules=[refused, eta, *script().rules]), 4))
    assert first.failed_samples == 1

    # Another model named: refused in one line naming it, before any call.
    other = on_model(SimScript(rules=[eta, *script().rules]), 4, endpoint__model="other-model")
    with pytest.raises(InputError, match=r'holds samples drawn with solution model "sim-model" \(now "other-model"\)'):
        await run_filter_on(other)
    # No model named, each server answering with its own: another server is another model.
    unnamed = on_model(SimScript(rules=[eta, *script().rules]), 4, endpoint__model=None)
    await run_filter(
        problems, tmp_path / "unnamed", out, unnamed.settings, grading, k=4, below=2, n=50, seed=0, model=unnamed
    )
    moved = on_model(
        SimScript(rules=[eta, *script().rules]), 4, endpoint__model=None, endpoint__base_url=["http://moved.invalid/v1"]
    )
    with pytest.raises(
        InputError,
        match=r"unnamed holds samples drawn with solution endpoint http://scripted.invalid/v1 \(now"
        r" http://moved.invalid/v1\): sampling on would mix them; run it again without the change, or give another",
    ):
        await run_filter(
            problems, tmp_path / "unnamed", out, moved.settings, grading, k=4, below=2, n=50, seed=0, model=moved
        )
    assert other.calls == [] and moved.calls == []
    # The same model again: only eta's failed sample is sent.
    same = on_model(SimScript(rules=[eta, *script().rules]), 4)
    card = await run_filter_on(same)
    assert [(c.key.problem_id, c.body["model"]) for c in same.calls] == [("eta", "sim-model")]
    assert card.failed_samples == 0


@pytest.mark.slow
def test_the_command_run_again_with_another_model_is_refused_before_its_estimate(
    sim: SimServer, sim2: SimServer, tmp_path: Path
) -> None:
    eta = Rule(role="solution", pattern="Eta:", replies=["So \\boxed{1000}."])
    sim.set_script(SimScript(rules=[Rule(role="solution", pattern="Eta:", fault="http_400", times=1), eta]))
    sim2.set_script(SimScript(model="sim-two", rules=[eta]))
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [ETA])
    out = tmp_path / "hard.jsonl"
    command = filter_command(problems, out, 2)
    first = tmas(*command, "--base-url", sim.base_url)
    assert first.returncode == 0, first.stderr.decode()
    assert json.loads((tmp_path / "hard.card.json").read_text())["failed_samples"] == 1
    where = tmp_path / "hard.filter-run"
    # Before, a server of its own model got the failed sample (its reply counted beside the first server's), and
    # another --model was refused only after the estimate (a --dry-run showed it and passed).
    for flags, changed in [
        (
            ("--base-url", sim2.base_url),
            f"solution endpoint {sim.base_url} (now {sim2.base_url}, which serves 'sim-two')",
        ),
        (("--base-url", sim.base_url, "--model", "other", "--dry-run"), 'solution model unset (now "other")'),
    ]:
        refused = tmas(*command, *flags)
        assert refused.returncode == 2 and refused.stderr.decode().splitlines() == [
            f"tmas: error: --run-dir {where} holds samples drawn with {changed}: sampling on would mix them; run it"
            " again without the change, or give another --run-dir"
        ]
    assert sim2.chat_bodies() == [] and len(sim.chat_bodies()) == 2


def test_a_subset_written_part_way_leaves_the_earlier_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the subset was opened for writing (emptied) and filled row by row: stopped after its first row (an
    # interrupt, a full disk), it held that row alone, a torn subset a later run would read as the filter's.
    out = tmp_path / "hard.jsonl"
    earlier = "".join(json.dumps({"problem_id": n, "question": q, "answer": a}) + "\n" for n, q, a, _ in CASES[:3])
    out.write_text(earlier)
    problems = [Problem(problem_id=n, question=q, answer=a) for n, q, a, _ in CASES]
    rows = 0
    dumps = json.dumps

    def stops_at_the_second_row(value: Any, **kwargs: Any) -> str:
        nonlocal rows
        rows += 1
        if rows == 2:
            raise OSError("No space left on device")
        return dumps(value, **kwargs)

    monkeypatch.setattr(json, "dumps", stops_at_the_second_row)
    with pytest.raises(OSError, match="No space left"):
        write_subset(problems, ["beta", "gamma", "zeta"], out)
    monkeypatch.undo()
    assert out.read_text() == earlier and [p.name for p in tmp_path.iterdir()] == ["hard.jsonl"]
    assert write_subset(problems, ["beta", "gamma", "zeta"], out) == 3
    assert [json.loads(line)["problem_id"] for line in out.read_text().splitlines()] == ["beta", "gamma", "zeta"]


async def test_a_sample_whose_judge_failed_is_not_counted_as_unsolved(tmp_path: Path) -> None:
    # alpha's four samples all box the right 6, but the judge's calls are refused: its verdicts are undecided. Before,
    # an undecided verdict counted as wrong, so alpha looked solved 0 times in 4 and was kept and selected as hard.
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [("alpha", CASES[0][1], "6")])
    out, run_dir = tmp_path / "hard.jsonl", tmp_path / "run"
    grading = GradeConfig(mode="judge", judge_runs=1)

    async def run_filter_on(model: ScriptedModel) -> FilterCard:
        return await run_filter(problems, run_dir, out, model.settings, grading, k=4, below=2, n=5, seed=0, model=model)

    down = on_model(SimScript(rules=[Rule(role="judge", fault="http_400"), *script().rules]), 4)
    card = await run_filter_on(down)
    assert by_role(down)["solution"] == 4
    assert card.kept == 0 and card.selected == [] and card.undecided == ["alpha"] and card.ungraded_samples == 4
    assert "4 samples were not counted: their judge's calls failed; run the same command again to grade them" in (
        card.notes
    )
    assert out.read_text() == ""
    # Again, the judge answering: only the judge is asked (one question: the four samples box the same answer), and
    # alpha is counted solved 4 times in 4, not kept.
    judge = Rule(role="judge", replies=['{"reasoning": "r", "equivalent": true}'])
    up = on_model(SimScript(rules=[judge, *script().rules]), 4)
    card = await run_filter_on(up)
    assert by_role(up) == {"judge": 1}
    assert card.ungraded_samples == 0 and card.solved_counts == {4: 1} and card.kept == 0 and card.undecided == []


async def test_samples_of_a_server_restarted_with_another_model_are_not_sampled_over(tmp_path: Path) -> None:
    # The filter names no model and its server, at the same URL, now serves another one: before, the samples of
    # both models would be counted together.
    problems = tmp_path / "b.jsonl"
    problems.write_text(json.dumps({"problem_id": "eta", "question": "Eta: what is 9*9?", "answer": "81"}) + "\n")
    out, run_dir = tmp_path / "hard.jsonl", tmp_path / "hard.filter-run"
    eta = Rule(role="solution", pattern="Eta:", replies=["So \\boxed{81}."])
    with SimServer(SimScript(model="model-a", rules=[eta])) as server:
        settings = filter_settings(settings_for(server, endpoint__model=None), 2, set())
        await run_filter(problems, run_dir, out, settings, GradeConfig(mode="rules"), k=2, below=2, n=1, seed=0)
        server.set_script(SimScript(model="model-b", rules=[eta]))
        server.reset()
        with pytest.raises(InputError) as refused:
            await run_filter(problems, run_dir, out, settings, GradeConfig(mode="rules"), k=2, below=2, n=1, seed=0)
        assert server.chat_bodies() == []
    assert str(refused.value) == (
        f"--run-dir {run_dir} holds samples drawn with solution model at {server.base_url} 'model-a' (now 'model-b'):"
        " sampling on would mix them; run it again without the change, or give another --run-dir"
    )


@pytest.mark.slow
def test_the_command_samples_at_the_papers_length_fitted_to_the_servers_window_and_a_configured_temperature(
    sim: SimServer, tmp_path: Path
) -> None:
    # Appendix A.2's filter allows the paper's 128K-token replies: before, the command sent the built-in 2048. The
    # simulated server states a window of 4096 tokens (max_model_len): the length is fitted down to it. A config
    # file's [sampling] temperature reaches the server (before, the paper's 1.0 replaced it without a word), and the
    # command says it differs from the paper's.
    sim.set_script(SimScript(context_length=4096, rules=script().rules))
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [("alpha", CASES[0][1], "6")])
    out = tmp_path / "hard.jsonl"
    config = config_file(sim, tmp_path, "[sampling]\ntemperature = 0.6\n")
    done = tmas(*filter_command(problems, out, 2, "--config", str(config)))
    assert done.returncode == 0, done.stderr.decode()
    bodies = sim.chat_bodies()
    assert len(bodies) == 2 and {(b["temperature"], b["top_p"]) for b in bodies} == {(0.6, 0.95)}
    # The per-call fit leaves the prompt its room below the window: at most 4096, far above the old 2048.
    assert all(2048 < b["max_tokens"] <= 4096 for b in bodies)
    assert "temperature 0.6 (from the config file; the paper's filter samples at 1.0)" in done.stderr.decode()
    card = json.loads((tmp_path / "hard.card.json").read_text())
    assert card["sampling"]["max_tokens"] == 4096 and card["sampling"]["temperature"] == 0.6
    assert any("temperature 0.6" in note and "1.0" in note for note in card["notes"])


@pytest.mark.slow
def test_a_filter_begun_with_the_old_default_length_resumes_with_it(sim: SimServer, tmp_path: Path) -> None:
    # A run directory whose samples were drawn at max_tokens 2048 (the default before the paper's 128K): the same
    # command without --max-tokens resumes it at its stored length (only the failed sample is sent, with 2048);
    # given another --max-tokens, it is refused in one line that names the flag to resume it with.
    eta = Rule(role="solution", pattern="Eta:", replies=["So \\boxed{1000}."])
    sim.set_script(SimScript(rules=[Rule(role="solution", pattern="Eta:", fault="http_400", times=1), eta]))
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [ETA])
    out = tmp_path / "hard.jsonl"
    command = filter_command(problems, out, 2, "--base-url", sim.base_url)
    first = tmas(*command, "--max-tokens", "2048")
    assert first.returncode == 0, first.stderr.decode()
    assert {b["max_tokens"] for b in sim.chat_bodies()} == {2048}
    sim.reset()
    sim.set_script(SimScript(rules=[eta]))
    refused = tmas(*command, "--max-tokens", "131072")
    assert refused.returncode == 2 and sim.chat_bodies() == []
    [line] = refused.stderr.decode().splitlines()
    assert "solution max_tokens 2048 (now 131072)" in line and "--max-tokens 2048" in line
    again = tmas(*command)
    assert again.returncode == 0, again.stderr.decode()
    assert [b["max_tokens"] for b in sim.chat_bodies()] == [2048]


async def test_problems_without_an_answer_are_neither_sampled_nor_counted(tmp_path: Path) -> None:
    # A problem with no answer, or a blank one, cannot be judged: before, its k samples were drawn all the same.
    model = on_model(script(), 4)
    problems = tmp_path / "b.jsonl"
    rows = [
        {"problem_id": "none", "question": "None: what is 9*9?"},
        *({"problem_id": i, "question": q, "answer": a} for i, q, a in [GAMMA, ("blank", "Blank: what is 9*9?", " ")]),
    ]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "hard.jsonl"
    grading = GradeConfig(mode="rules")
    card = await run_filter(
        problems, tmp_path / "run", out, model.settings, grading, k=4, below=2, n=50, seed=0, model=model
    )
    assert Counter(c.key.problem_id for c in model.calls) == {"gamma": 4}
    assert card.unlabeled == ["none", "blank"] and card.selected == ["gamma"]
    assert "Left out, no reference answer: 2 problems." in (tmp_path / "hard.card.md").read_text()


@pytest.mark.slow
def test_the_command_skips_unanswered_problems_says_so_and_prints_progress(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(script())
    problems = tmp_path / "b.jsonl"
    rows = [
        {"problem_id": "u", "question": "U: what is 1+1?"},
        {"problem_id": "gamma", "question": GAMMA[1], "answer": "49"},
    ]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "hard.jsonl"
    command = filter_command(problems, out, 2, "--base-url", sim.base_url)
    dry = tmas(*command, "--dry-run")
    # The estimate counts the one problem with an answer: 2 samples.
    assert dry.returncode == 0 and "hard.filter-run         1              2          2" in dry.stderr.decode()
    done = tmas(*command)
    assert done.returncode == 0, done.stderr.decode()
    assert len(sim.chat_bodies()) == 2 and all("Gamma:" in b["messages"][-1]["content"] for b in sim.chat_bodies())
    assert "skipped 1 problems without an answer" in done.stdout.decode()
    # Without a terminal, a line per problem sampled.
    assert "[1/1] gamma: done" in done.stderr.decode()


@pytest.mark.slow
def test_a_stopped_filter_says_how_to_resume_it(tmp_path: Path) -> None:
    # The server answers 2 samples and holds the next: SIGTERM then stops the command, whose last line says what is
    # kept and how to go on (before: that finished work is kept, and nothing of how to go on).
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA, ETA])
    out = tmp_path / "hard.jsonl"
    where = tmp_path / "hard.filter-run"
    with SimServer(SimScript(hold_after=2, rules=script().rules)) as server:
        command = filter_command(problems, out, 2, "--base-url", server.base_url)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tmas", *command], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        wait_for(lambda: proc.poll() is None and server.stats().held > 0, "the filter to wait on a held sample")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("tmas: stopped by SIGTERM; the samples drawn are kept in " + str(where))
    assert last.endswith("run the same command again to resume")


def test_the_papers_sampling_fills_only_what_no_one_set_and_a_set_value_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[sampling]\ntemperature = 0.6\n")
    monkeypatch.setenv("TMAS_TOP_P", "0.8")
    given = load_settings(config, overrides={"sampling.max_tokens": 300})
    settings = filter_settings(given, 4)
    drawn = samples_sampling(settings)
    assert (drawn.temperature, drawn.top_p, drawn.max_tokens) == (0.6, 0.8, 300)
    assert sampling_notes(user_sampling(given), settings) == [
        "temperature 0.6 (from the config file; the paper's filter samples at 1.0)",
        "top_p 0.8 (from TMAS_TOP_P; the paper's filter samples at 0.95)",
        "max_tokens 300 (from --max-tokens; the paper's filter samples at 131072)",
    ]
    # None set: the paper's, said nowhere; max_tokens the paper's 128K where no window is known.
    monkeypatch.delenv("TMAS_TOP_P")
    plain = load_settings(None, overrides={"endpoint.base_url": "http://127.0.0.1:9/v1"})
    paper = filter_settings(plain, 4)
    drawn = samples_sampling(paper)
    assert (drawn.temperature, drawn.top_p, drawn.max_tokens) == (1.0, 0.95, 131072)
    # On the samples' role alone: the top-level [sampling], which the grading judge is asked at, is the user's.
    assert (paper.sampling.temperature, paper.sampling.top_p, paper.sampling.max_tokens) == (0.7, None, 2048)
    assert sampling_notes(user_sampling(plain), paper) == []


async def test_the_default_length_is_the_windows_where_configured_and_a_filter_runs_own_on_resume(
    tmp_path: Path,
) -> None:
    windowed = load_settings(None, overrides={"endpoint.base_url": SCRIPTED_URL, "endpoint.context_length": 40000})
    assert await default_max_tokens(windowed, tmp_path / "none") == (
        40000,
        "the paper's 131072 fitted to the context window of 40000 tokens",
    )
    # A filter's run made at 2048 tokens: resumed at 2048, whatever the window.
    # (2048 equals the built-in default: such settings count it as no one's, and the paper's would replace it.)
    settings = filter_settings(scripted_settings(), 2)
    old = settings.model_copy(update={"sampling": settings.sampling.model_copy(update={"max_tokens": 2048})})
    model = ScriptedModel(script(), old)
    problems, run_dir = tmp_path / "b.jsonl", tmp_path / "run"
    write_problems(problems, [GAMMA])
    out, grading = tmp_path / "o.jsonl", GradeConfig(mode="rules")
    await run_filter(problems, run_dir, out, model.settings, grading, k=2, below=2, n=1, seed=0, model=model)
    assert {c.body["max_tokens"] for c in model.calls} == {2048}
    assert (await default_max_tokens(windowed, run_dir))[0] == 2048
    # Set by the user: theirs (None: nothing to fill).
    given = load_settings(None, overrides={"endpoint.base_url": SCRIPTED_URL, "sampling.max_tokens": 500})
    assert await default_max_tokens(given, run_dir) == (None, "")


JUDGED = GradeConfig(mode="judge", judge_runs=1)
JUDGE_RIGHT = Rule(role="judge", replies=['{"reasoning": "r", "equivalent": true}'])


def sampled(model: ScriptedModel, role: str) -> set[tuple[Any, Any, Any]]:
    """The (temperature, top_p, max_tokens) of ``model``'s calls of ``role``, as their request bodies sent them."""
    bodies = [c.body for c in model.calls if c.role == role]
    return {(b.get("temperature"), b.get("top_p"), b.get("max_tokens")) for b in bodies}


async def test_the_papers_sampling_goes_to_the_samples_and_the_judge_keeps_its_own(tmp_path: Path) -> None:
    # The paper's temperature 1.0, top_p 0.95 and 128K tokens are how it samples solutions. Before, they were laid on
    # the top-level [sampling], so the grading judge was asked at temperature 1.0 with a 128K max_tokens too; now it is
    # asked as `tmas eval`'s judge is: the settings' own sampling (here the built-in 0.7 and 2048).
    plain = load_settings(None, overrides={"endpoint.base_url": SCRIPTED_URL, "endpoint.model": "sim-model"})
    settings = filter_settings(plain, 2)
    model = ScriptedModel(SimScript(rules=[JUDGE_RIGHT, *script().rules]), settings)
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA])
    card = await run_filter(
        problems, tmp_path / "run", tmp_path / "o.jsonl", settings, JUDGED, k=2, below=2, n=1,
        seed=0, model=model,
    )  # fmt: skip
    assert by_role(model) == {"solution": 2, "judge": 1}
    assert sampled(model, "solution") == {(1.0, 0.95, 131072)}
    assert sampled(model, "judge") == {(0.7, None, 2048)}
    # The card says what the samples were drawn with.
    assert card.sampling == {"temperature": 1.0, "top_p": 0.95, "max_tokens": 131072}
    # A value a user set reaches both: the samples and the judge; a judge's own table holds for the judge.
    given = load_settings(
        None,
        overrides={
            "endpoint.base_url": SCRIPTED_URL,
            "endpoint.model": "sim-model",
            "sampling.top_p": 0.8,
            "roles": {"judge": {"sampling": {"max_tokens": 700}}},
        },
    )
    settings = filter_settings(given, 2)
    model = ScriptedModel(SimScript(rules=[JUDGE_RIGHT, *script().rules]), settings)
    await run_filter(
        problems, tmp_path / "run2", tmp_path / "o2.jsonl", settings, JUDGED, k=2, below=2, n=1,
        seed=0, model=model,
    )  # fmt: skip
    assert sampled(model, "solution") == {(1.0, 0.8, 131072)}
    assert sampled(model, "judge") == {(0.7, 0.8, 700)}


async def test_a_solution_roles_own_sampling_is_kept_under_the_papers(tmp_path: Path) -> None:
    # [roles.solution.sampling] temperature = 0.3 is the user's: the paper's fills only its other fields.
    given = load_settings(
        None,
        overrides={
            "endpoint.base_url": SCRIPTED_URL,
            "endpoint.model": "sim-model",
            "roles": {"solution": {"sampling": {"temperature": 0.3}}},
        },
    )
    settings = filter_settings(given, 2)
    model = ScriptedModel(script(), settings)
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA])
    await run_filter(
        problems, tmp_path / "run", tmp_path / "o.jsonl", settings, GradeConfig(mode="rules"), k=2, below=2, n=1,
        seed=0, model=model,
    )  # fmt: skip
    assert sampled(model, "solution") == {(0.3, 0.95, 131072)}


async def test_a_filter_begun_with_the_papers_sampling_on_every_role_resumes_without_a_call(tmp_path: Path) -> None:
    # A filter run begun when the paper's sampling was laid on the top-level [sampling] (its judge asked at 1.0 and
    # 128K tokens): resumed now, its samples draw alike and its judge's verdicts are kept, so nothing is sent again.
    plain = load_settings(None, overrides={"endpoint.base_url": SCRIPTED_URL, "endpoint.model": "sim-model"})
    new = filter_settings(plain, 2)
    paper = Sampling(temperature=1.0, top_p=0.95, max_tokens=131072)
    old = with_sampling(new.model_copy(update={"roles": {}}), "config", paper)
    rules = SimScript(rules=[JUDGE_RIGHT, *script().rules])
    before = ScriptedModel(rules, old)
    problems, run_dir = tmp_path / "b.jsonl", tmp_path / "run"
    write_problems(problems, [GAMMA, ("alpha", CASES[0][1], "6")])
    grading = GradeConfig(mode="judge", judge_runs=1)

    async def run_filter_on(model: ScriptedModel) -> FilterCard:
        return await run_filter(
            problems, run_dir, tmp_path / "o.jsonl", model.settings, grading, k=2, below=2, n=2, seed=0, model=model
        )

    first = await run_filter_on(before)
    assert by_role(before) == {"solution": 4, "judge": 2} and sampled(before, "judge") == {(1.0, 0.95, 131072)}
    assert (await default_max_tokens(plain, run_dir))[0] == 131072
    after = ScriptedModel(rules, new)
    again = await run_filter_on(after)
    assert after.calls == []
    assert again.solved_counts == first.solved_counts and again.selected == first.selected


def test_the_command_sends_the_papers_sampling_to_the_samples_and_not_to_the_judge(
    sim: SimServer, tmp_path: Path
) -> None:
    sim.set_script(SimScript(rules=[JUDGE_RIGHT, *script().rules]))
    problems = tmp_path / "b.jsonl"
    write_problems(problems, [GAMMA])
    out = tmp_path / "hard.jsonl"
    done = tmas(
        *filter_command(problems, out, 2, "--base-url", sim.base_url, "--max-tokens", "900"),
        "--grade",
        "judge",
        "--judge-runs",
        "1",
    )
    assert done.returncode == 0, done.stderr.decode()
    solution, judge = sim.chat_bodies("solution"), sim.chat_bodies("judge")
    assert len(solution) == 2 and {(b["temperature"], b["top_p"], b["max_tokens"]) for b in solution} == {
        (1.0, 0.95, 900)
    }
    # The judge: the --max-tokens given (a flag is the user's, for every role), the built-in temperature, no top_p.
    assert len(judge) == 1 and (judge[0]["temperature"], judge[0].get("top_p"), judge[0]["max_tokens"]) == (
        0.7,
        None,
        900,
    )
