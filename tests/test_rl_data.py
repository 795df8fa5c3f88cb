"""``tmas rl build-data`` on a TMAS run made in process on the simulator's script: the release's columns and types, the
project's own prompts, the banks of the right iteration, the exclude list and the dataset card."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env, scripted_settings
from scripted_runs import scripted_run
from tmas.agents.overrides import packaged_source
from tmas.agents.solution import generation_prompt
from tmas.errors import InputError
from tmas.llm.types import Message
from tmas.problems import Problem, question_hash
from tmas.rl.data import build_dataset, mix_targets
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

PROBLEMS = [
    Problem(problem_id="p1", question="What is 17*23?", answer="391"),
    Problem(problem_id="p2", question="What is 12*11?", answer="132"),
    Problem(problem_id="p3", question="What is 9*9?", answer="81"),
    Problem(problem_id="p4", question="What is 5*5?"),  # unlabeled: no reward possible
]


def tmas(*args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    return subprocess.run([sys.executable, "-m", "tmas", *args], capture_output=True, text=True, env=env, timeout=120)


async def tmas_run(run_dir: Path, iterations: int = 3, script: SimScript | None = None, **params: Any) -> ScriptedModel:
    """A TMAS run of PROBLEMS (or ``params["problems"]``) in process on ``script`` (the simulator's by default); the
    model, whose calls are what the run sent."""
    problems = params.pop("problems", PROBLEMS)
    prompts_dir = params.pop("prompts_dir", None)
    method = {"name": "tmas", "params": {"n": 2, "m": 1, "iterations": iterations, **params}}
    settings = scripted_settings(method=method, **({"prompts_dir": prompts_dir} if prompts_dir else {}))
    model = ScriptedModel(script or SimScript(), settings)
    await scripted_run(model, run_dir, problems)
    return model


@pytest.mark.slow
async def test_build_data_writes_the_release_schema(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    model = await tmas_run(run_dir)
    # An evaluation file naming p3 by its question under another id: it must stay out.
    evalset = tmp_path / "eval.jsonl"
    evalset.write_text(json.dumps({"problem_id": "aime-7", "question": "what is  9*9?", "answer": "81"}) + "\n")
    out = tmp_path / "data" / "train.parquet"
    done = tmas("rl", "build-data", str(run_dir), "-o", str(out), "--exclude", str(evalset), "--mix", "all")
    assert done.returncode == 0, done.stderr

    table = pq.read_table(out)
    assert table.column_names == ["prompt", "data_source", "reward_model", "extra_info", "_source"]
    schema = table.schema
    assert schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert schema.field("data_source").type == pa.string() and schema.field("_source").type == pa.string()
    assert schema.field("reward_model").type == pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
    info_type = schema.field("extra_info").type
    assert {info_type.field(i).name for i in range(info_type.num_fields)} >= {
        "task", "group", "variant", "question", "iteration", "experience_bank", "guideline_bank",
    }  # fmt: skip
    rows = table.to_pylist()

    # p3 excluded by question hash, p4 unlabeled: only p1 and p2 are there.
    assert {r["extra_info"]["problem_id"] for r in rows} == {"p1", "p2"}
    assert all(r["reward_model"] == {"style": "rule", "ground_truth": {"p1": "391", "p2": "132"}[
        r["extra_info"]["problem_id"]]} for r in rows)  # fmt: skip
    by_source: dict[str, list[dict]] = {}
    for r in rows:
        by_source.setdefault(r["_source"], []).append(r)
        assert r["data_source"] == f"tmas/{r['_source']}" and r["extra_info"]["task"] == r["_source"]

    # normal: the iteration-0 prompt TMAS itself sends, one per problem.
    normal = {r["extra_info"]["problem_id"]: r for r in by_source["normal"]}
    assert normal["p1"]["prompt"] == [m.model_dump() for m in generation_prompt("What is 17*23?", "numeric")]
    sent = [c.body["messages"] for c in model.calls_of("solution") if "17*23" in str(c.body)]
    assert normal["p1"]["prompt"] in sent

    with RunStore(run_dir, create=False) as store:
        records = {pid: store.iterations(pid) for pid in ("p1", "p2")}
    # experience: per iteration t >= 1, Base then Bank, one group; the bank is E_{t-1} and shows in Bank only.
    experience = by_source["experience"]
    assert len(experience) == 2 * 2 * 2  # 2 problems x iterations 1, 2 x (base, bank)
    for base, bank in zip(experience[::2], experience[1::2], strict=True):
        assert (base["extra_info"]["variant"], bank["extra_info"]["variant"]) == ("base", "bank")
        assert base["extra_info"]["group"] == bank["extra_info"]["group"]
        t, pid = bank["extra_info"]["iteration"], bank["extra_info"]["problem_id"]
        entries = records[pid][t - 1].state["experience_bank"]["entries"]
        assert [e["content"] for e in bank["extra_info"]["experience_bank"]] == [e["content"] for e in entries]
        assert "<rollouts>" in base["prompt"][-1]["content"]
        assert "<experience>" in bank["prompt"][-1]["content"] and "<experience>" not in base["prompt"][-1]["content"]
        assert all(e["content"] in bank["prompt"][-1]["content"] for e in entries)
        # Each rollout of R_{t-1} is shown with its summary.
        for cand in records[pid][t - 1].candidates:
            assert cand.meta.summary in base["prompt"][-1]["content"]
    # guideline: the explore prompt listing G_{t-1}.
    guideline = by_source["guideline"]
    assert len(guideline) == 4
    for r in guideline:
        t, pid = r["extra_info"]["iteration"], r["extra_info"]["problem_id"]
        strategies = records[pid][t - 1].state["guideline_bank"]["strategies"]
        assert strategies and [s["id"] for s in r["extra_info"]["guideline_bank"]] == [s["id"] for s in strategies]
        assert all(f"[{s['id']}] {s['description']}" in r["prompt"][-1]["content"] for s in strategies)
        assert "<attempted_strategies>" in r["prompt"][-1]["content"]

    card = out.with_name("train.md").read_text()
    # Columns: groups available, prompt groups written, train rows, validation rows.
    assert "| normal | correctness (+1/-1) | 2 | 2 | 2 | 0 |" in card
    assert "| experience | experience utilization (eq. 7-8) | 4 | 4 | 8 | 0 |" in card
    assert "| guideline | novel strategy exploration (eq. 9) | 4 | 4 | 4 | 0 |" in card
    assert "Mix: all examples (no mix)" in card and "style paper, no context window known" in card
    assert "Left out: 1 evaluation problems" in card and "1 without a reference answer" in card


@pytest.mark.slow
async def test_validation_split_is_by_question(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    await tmas_run(run_dir, iterations=2)
    out = tmp_path / "d.parquet"
    done = tmas("rl", "build-data", str(run_dir), "-o", str(out), "--val-fraction", "0.5", "--mix", "all")
    assert done.returncode == 0, done.stderr
    train = pq.read_table(out).to_pylist()
    val = pq.read_table(tmp_path / "d.val.parquet").to_pylist() if (tmp_path / "d.val.parquet").exists() else []
    train_q = {r["extra_info"]["question_hash"] for r in train}
    val_q = {r["extra_info"]["question_hash"] for r in val}
    assert not train_q & val_q and len(train_q | val_q) == 3
    assert train_q | val_q == {question_hash(p.question) for p in PROBLEMS[:3]}
    # Built again without a split: the earlier split's file goes (its questions are in the training file now).
    again = tmas("rl", "build-data", str(run_dir), "-o", str(out), "--mix", "all")
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "d.val.parquet").exists()


@pytest.mark.slow
async def test_a_group_holds_one_runs_rows(tmp_path: Path) -> None:
    # Two runs of one name (two sweeps' "tmas"): each group stays its own run's (two rows, or one).
    for parent in ("a", "b"):
        await tmas_run(tmp_path / parent / "tmas", iterations=2)
    out = tmp_path / "d.parquet"
    done = tmas("rl", "build-data", str(tmp_path / "a" / "tmas"), str(tmp_path / "b" / "tmas"), "-o", str(out))
    assert done.returncode == 0, done.stderr
    sizes = Counter(r["extra_info"]["group"] for r in pq.read_table(out).to_pylist())
    assert sizes and set(sizes.values()) <= {1, 2}
    twice = tmas("rl", "build-data", str(tmp_path / "a" / "tmas"), str(tmp_path / "a" / "tmas"), "-o", str(out))
    assert twice.returncode == 2 and "run directory given twice" in twice.stderr


@pytest.mark.slow
def test_build_data_bad_input(tmp_path: Path) -> None:
    done = tmas("rl", "build-data", str(tmp_path), "-o", str(tmp_path / "x.parquet"))
    assert done.returncode == 2 and "not a run directory" in done.stderr
    assert not (tmp_path / "x.parquet").exists()
    for mix in ("1:2", "a:b:c", "0:0:0", "1:-1:1", "1:inf:1"):
        done = tmas("rl", "build-data", str(tmp_path), "-o", str(tmp_path / "x.parquet"), "--mix", mix)
        assert done.returncode == 2 and f"--mix {mix!r}" in done.stderr


def test_build_data_reads_only_runs_of_a_method_that_keeps_banks(tmp_path: Path) -> None:
    from tmas.store.run_store import RunStore

    with RunStore(tmp_path / "cot-run") as store:
        store.set_meta("method", {"name": "cot", "params": {}})
    with pytest.raises(InputError, match="method 'cot' keeps no experience or guideline banks"):
        build_dataset([tmp_path / "cot-run"])
    # A store a run left before its setup: said so, not as a run of "method None".
    (tmp_path / "never-began").mkdir()
    (tmp_path / "never-began" / "run.sqlite").write_bytes(b"")
    with pytest.raises(InputError) as caught:
        build_dataset([tmp_path / "never-began"])
    assert str(caught.value) == f"{tmp_path / 'never-began'}: holds no run: it was stopped before its first call"
    # Read, not written: the empty file stays empty, with nothing beside it.
    assert [(p.name, p.read_bytes()) for p in (tmp_path / "never-began").iterdir()] == [("run.sqlite", b"")]


def test_mix_targets_by_hand() -> None:
    # Section 4.2's 2.2 : 1.6 : 0.6 on 40 / 120 / 120 groups: scale min(40/2.2, 120/1.6, 120/0.6) = 18.18
    # -> 2.2*18.18 = 40, 1.6*18.18 = 29.1 -> 29, 0.6*18.18 = 10.9 -> 11.
    assert mix_targets(Counter(normal=40, experience=120, guideline=120), (2.2, 1.6, 0.6)) == {
        "normal": 40, "experience": 29, "guideline": 11,
    }  # fmt: skip
    # Experience is scarce: scale 16/1.6 = 10 -> 22, 16, 6.
    assert mix_targets(Counter(normal=100, experience=16, guideline=50), (2.2, 1.6, 0.6)) == {
        "normal": 22, "experience": 16, "guideline": 6,
    }  # fmt: skip
    # No guideline group at all (an ablation run): the others keep their ratio.
    assert mix_targets(Counter(normal=11, experience=30), (2.2, 1.6, 0.6)) == {
        "normal": 11, "experience": 8, "guideline": 0,
    }  # fmt: skip


@pytest.mark.slow
async def test_mix_draws_groups_by_problem(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Every verification confirms its candidate, so every iteration's experience bank gains an anchor (the default
    # verifier doubts some steps, and a bank left empty gives no experience group).
    confirmed = SimScript(rules=[Rule(role="verifier", replies=["Every step checks out.\n\nScore: 1"])])
    await tmas_run(run_dir, script=confirmed)  # 3 labeled problems, T = 3: 3 normal, 6 experience, 6 guideline groups
    everything = build_dataset([run_dir], mix=None).report
    assert (everything.groups["normal"], everything.groups["experience"], everything.groups["guideline"]) == (3, 6, 6)

    def groups_of(data: list[dict]) -> dict[str, list[tuple[str, int]]]:
        out: dict[str, list[tuple[str, int]]] = {}
        for r in data:
            info = r["extra_info"]
            if info["variant"] != "bank":
                out.setdefault(r["_source"], []).append((info["problem_id"], info["iteration"]))
        return out

    # 2.2 : 1.6 : 0.6 on 3 / 6 / 6: scale min(3/2.2, 6/1.6, 6/0.6) = 1.364 -> 3, 2.18 -> 2, 0.82 -> 1.
    paper = build_dataset([run_dir], seed=1)
    drawn = groups_of(paper.train)
    assert {k: len(v) for k, v in drawn.items()} == {"normal": 3, "experience": 2, "guideline": 1}
    assert len({pid for pid, _ in drawn["experience"]}) == 2  # two problems, not two iterations of one
    assert (paper.report.rows["experience"], paper.report.available["experience"]) == (4, 6)
    # 1 : 1 : 1: scale min(3, 6, 6) = 3 -> 3 groups each, one per problem (drawn one problem at a time).
    even = groups_of(build_dataset([run_dir], mix=(1, 1, 1), seed=1).train)
    assert sorted(pid for pid, _ in even["experience"]) == ["p1", "p2", "p3"]
    assert sorted(pid for pid, _ in even["guideline"]) == ["p1", "p2", "p3"]
    # Seeded: the same seed draws the same file; Base and Bank stay next to each other in it.
    again = build_dataset([run_dir], seed=1).train
    assert again == paper.train
    rows = [r for r in again if r["_source"] == "experience"]
    assert all(a["extra_info"]["group"] == b["extra_info"]["group"] for a, b in zip(rows[::2], rows[1::2], strict=True))

    out = tmp_path / "mix.parquet"
    done = tmas("rl", "build-data", str(run_dir), "-o", str(out), "--seed", "1")
    assert done.returncode == 0, done.stderr
    card = out.with_name("mix.md").read_text()
    assert "Mix: 2.2:1.6:0.6 (normal:experience:guideline)" in card and "seed 1" in card
    assert "| experience | experience utilization (eq. 7-8) | 6 | 2 | 4 | 0 |" in card
    assert "| guideline | novel strategy exploration (eq. 9) | 6 | 1 | 1 | 0 |" in card


async def test_prompts_are_rendered_as_the_run_rendered_them(tmp_path: Path) -> None:
    # A run in the concise style whose exploit prompts were fitted to a 512-token prompt budget (epsilon 0: every
    # candidate of iterations 1 and 2 exploits, so the Bank prompt of each is one the run sent).
    params = {"epsilon": 0.0, "style": "concise", "context_tokens": 512}
    model = await tmas_run(tmp_path / "run", 3, problems=PROBLEMS[:1], **params)
    with RunStore(tmp_path / "run", create=False) as store:
        notes = [n for record in store.iterations("p1") for n in record.notes]
    assert any(n.startswith("exploit prompt:") for n in notes)  # the run did fit R_{t-1}
    sent = [c.body["messages"] for c in model.calls_of("solution")]
    data = build_dataset([tmp_path / "run"], mix=None)
    bank = [r["prompt"] for r in data.train if r["extra_info"]["variant"] == "bank"]
    normal = [r["prompt"] for r in data.train if r["_source"] == "normal"]
    assert len(bank) == 2 and all(p in sent for p in bank) and normal[0] in sent
    assert "style concise, prompt budget 512 tokens" in data.report.rendering[0]


async def test_a_change_to_tmas_prompt_builders_reaches_the_rl_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # RL data is built by TMAS's own prompt builders (methods/training_prompts.py), not by a copy of them: a change
    # to how TMAS builds its solution prompts changes every training prompt the same way.
    await tmas_run(tmp_path / "run", 3, problems=PROBLEMS[:1], epsilon=0.5)
    before = build_dataset([tmp_path / "run"], mix=None).train
    assert {r["_source"] for r in before} == {"normal", "experience", "guideline"}
    import tmas.methods.tmas as tmas_method

    def marked(builder: Any) -> Any:
        def build(*args: Any, **kwargs: Any) -> list[Message]:
            *head, last = builder(*args, **kwargs)
            return [*head, last.model_copy(update={"content": last.content + "\nZQX-CHANGED"})]

        return build

    for name in ("generation_prompt", "refine_prompt", "explore_prompt"):
        monkeypatch.setattr(tmas_method, name, marked(getattr(tmas_method, name)))
    after = build_dataset([tmp_path / "run"], mix=None).train
    assert len(after) == len(before)
    for old, new in zip(before, after, strict=True):
        assert new["prompt"][-1]["content"] == old["prompt"][-1]["content"] + "\nZQX-CHANGED"
        assert new["prompt"][:-1] == old["prompt"][:-1] and new["extra_info"] == old["extra_info"]


async def test_a_runs_prompt_overrides_reach_its_rl_data_and_must_not_change(tmp_path: Path) -> None:
    # A run made with its own solution templates: its training prompts are the ones it sent, in its templates.
    overrides = tmp_path / "my-prompts"
    overrides.mkdir()
    for name in ("tmas_generate.j2", "tmas_refine.j2", "tmas_explore.j2"):
        (overrides / name).write_text(packaged_source(name) + "\nOverridden zqx template.\n")
    model = await tmas_run(tmp_path / "run", 3, problems=PROBLEMS[:1], epsilon=0.0, prompts_dir=str(overrides))
    sent = [c.body["messages"] for c in model.calls_of("solution")]
    assert sent and all("Overridden zqx template." in m[-1]["content"] for m in sent)
    data = build_dataset([tmp_path / "run"], mix=None)
    normal = [r["prompt"] for r in data.train if r["_source"] == "normal"]
    bank = [r["prompt"] for r in data.train if r["extra_info"]["variant"] == "bank"]
    assert bank and normal[0] in sent and all(p in sent for p in bank)
    assert all("Overridden zqx template." in r["prompt"][-1]["content"] for r in data.train)
    # Edited since the run: the rows would not be the run's prompts, so none are built.
    (overrides / "tmas_refine.j2").write_text(packaged_source("tmas_refine.j2") + "\nEdited later.\n")
    with pytest.raises(InputError, match=r"prompt template tmas_refine\.j2 in .* is not the one the run used"):
        build_dataset([tmp_path / "run"], mix=None)


async def test_the_state_after_the_last_iteration_gives_rows_where_its_memory_update_ran(tmp_path: Path) -> None:
    # Section 4.2 distils experiences and guidelines from a run's rounds, the last one's included: where the run
    # updated its banks after its last iteration (the paper preset: skip_final_memory off), that state gives the
    # prompts an iteration after it would send. epsilon 0: every candidate after iteration 0 exploits.
    confirmed = SimScript(rules=[Rule(role="verifier", replies=["Every step checks out.\n\nScore: 1"])])
    params = {"problems": PROBLEMS[:1], "epsilon": 0.0, "skip_final_memory": False}
    await tmas_run(tmp_path / "short", 2, script=confirmed, **params)
    data = build_dataset([tmp_path / "short"], mix=None)
    bank = {r["extra_info"]["iteration"]: r for r in data.train if r["extra_info"]["variant"] == "bank"}
    guideline = {r["extra_info"]["iteration"]: r for r in data.train if r["_source"] == "guideline"}
    assert sorted(bank) == sorted(guideline) == [1, 2]
    with RunStore(tmp_path / "short", create=False) as store:
        last = store.iterations("p1")[-1]
    assert last.iteration == 1 and all(c.meta.summary for c in last.candidates)
    entries = last.state["experience_bank"]["entries"]
    assert [e["content"] for e in bank[2]["extra_info"]["experience_bank"]] == [e["content"] for e in entries]
    assert [s["id"] for s in guideline[2]["extra_info"]["guideline_bank"]] == [
        s["id"] for s in last.state["guideline_bank"]["strategies"]
    ]
    # The same run one iteration longer sent exactly that Bank prompt at iteration 2.
    longer = await tmas_run(tmp_path / "long", 3, script=confirmed, **params)
    sent = [c.body["messages"] for c in longer.calls_of("solution")]
    assert bank[2]["prompt"] in sent

    # Under skip_final_memory (the default) the last iteration has no summaries and no memory update: no row of it.
    await tmas_run(tmp_path / "skipped", 2, script=confirmed, problems=PROBLEMS[:1], epsilon=0.0)
    skipped = build_dataset([tmp_path / "skipped"], mix=None)
    assert sorted({r["extra_info"]["iteration"] for r in skipped.train}) == [0, 1]


async def test_a_problem_with_a_blank_reference_answer_gives_no_row(tmp_path: Path) -> None:
    # A blank answer rewards nothing ('tmas rl train' refuses its rows): left out as unlabeled, as a missing one is.
    blank = Problem(problem_id="p5", question="What is 6*7?", answer=" ")
    await tmas_run(tmp_path / "run", 1, problems=[PROBLEMS[0], blank])
    data = build_dataset([tmp_path / "run"], mix=None)
    assert {r["extra_info"]["problem_id"] for r in data.train} == {"p1"}
    assert data.report.unlabeled == 1 and data.report.problems == 1


async def test_a_run_stored_with_a_role_extra_body_key_refused_since_still_gives_its_data(tmp_path: Path) -> None:
    # A TMAS role's extra_body key that tmas sends itself is refused when given now; a run stored when it was taken
    # (top_k went in extra_body before it was a setting) is read as it ran: before, build-data refused it.
    run_dir = tmp_path / "run"
    await tmas_run(run_dir, 2, problems=PROBLEMS[:1])
    before = build_dataset([run_dir], mix=None).train
    stored = {"solution": {"extra_body": {"top_k": 20}}}
    with RunStore(run_dir) as store:
        recorded, settings = store.get_meta("method"), store.get_meta("settings")
        recorded["params"]["sampling"] = stored
        settings["method"]["params"]["sampling"] = stored
        store.set_meta("method", recorded)
        store.set_meta("settings", settings)
    assert before and build_dataset([run_dir], mix=None).train == before
