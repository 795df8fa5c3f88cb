"""``tmas rl build-data`` on a TMAS run made against the simulated server: the release's columns and types, the
project's own prompts, the banks of the right iteration, the exclude list and the dataset card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import settings_for
from tmas.agents.solution import generation_prompt
from tmas.problems import Problem
from tmas.rl.data import question_hash
from tmas.runner import prepare_run, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import SimServer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

PROBLEMS = [
    Problem(problem_id="p1", question="What is 17*23?", answer="391"),
    Problem(problem_id="p2", question="What is 12*11?", answer="132"),
    Problem(problem_id="p3", question="What is 9*9?", answer="81"),
    Problem(problem_id="p4", question="What is 5*5?"),  # unlabeled: no reward possible
]


def tmas(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMAS_")}
    return subprocess.run([sys.executable, "-m", "tmas", *args], capture_output=True, text=True, env=env, timeout=120)


async def tmas_run(sim: SimServer, run_dir: Path, iterations: int = 3) -> None:
    settings = settings_for(sim, method={"name": "tmas", "params": {"n": 2, "m": 1, "iterations": iterations}})
    store, settings, todo = prepare_run(run_dir, settings, PROBLEMS, resume=False)
    with store:
        await run_problems(settings, todo, store)


async def test_build_data_writes_the_release_schema(sim: SimServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    await tmas_run(sim, run_dir)
    # An evaluation file naming p3 by its question under another id: it must stay out.
    evalset = tmp_path / "eval.jsonl"
    evalset.write_text(json.dumps({"problem_id": "aime-7", "question": "what is  9*9?", "answer": "81"}) + "\n")
    out = tmp_path / "data" / "train.parquet"
    done = tmas("rl", "build-data", str(run_dir), "-o", str(out), "--exclude", str(evalset))
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
    sent = [r.body["messages"] for r in sim.requests if r.role == "solution" and "17*23" in str(r.body)]
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
        entries = records[pid][t - 1]["state"]["experience_bank"]["entries"]
        assert [e["content"] for e in bank["extra_info"]["experience_bank"]] == [e["content"] for e in entries]
        assert "<previous_attempts>" in base["prompt"][-1]["content"]
        assert "<experience>" in bank["prompt"][-1]["content"] and "<experience>" not in base["prompt"][-1]["content"]
        assert all(e["content"] in bank["prompt"][-1]["content"] for e in entries)
        # Each rollout of R_{t-1} is shown with its summary.
        for cand in records[pid][t - 1]["candidates"]:
            assert cand["meta"]["summary"] in base["prompt"][-1]["content"]
    # guideline: the explore prompt listing G_{t-1}.
    guideline = by_source["guideline"]
    assert len(guideline) == 4
    for r in guideline:
        t, pid = r["extra_info"]["iteration"], r["extra_info"]["problem_id"]
        strategies = records[pid][t - 1]["state"]["guideline_bank"]["strategies"]
        assert strategies and [s["id"] for s in r["extra_info"]["guideline_bank"]] == [s["id"] for s in strategies]
        assert all(f"[{s['id']}] {s['description']}" in r["prompt"][-1]["content"] for s in strategies)
        assert "<attempted_strategies>" in r["prompt"][-1]["content"]

    card = out.with_name("train.md").read_text()
    assert "| normal | correctness (+1/-1) | 2 | 2 | 0 |" in card
    assert "| experience | experience utilization (eq. 7-8) | 8 | 4 | 0 |" in card
    assert "| guideline | novel strategy exploration (eq. 9) | 4 | 4 | 0 |" in card
    assert "Left out: 1 evaluation problems" in card and "1 without a reference answer" in card


async def test_validation_split_is_by_question(sim: SimServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    await tmas_run(sim, run_dir, iterations=2)
    out = tmp_path / "d.parquet"
    assert tmas("rl", "build-data", str(run_dir), "-o", str(out), "--val-fraction", "0.5").returncode == 0
    train = pq.read_table(out).to_pylist()
    val = pq.read_table(tmp_path / "d.val.parquet").to_pylist() if (tmp_path / "d.val.parquet").exists() else []
    train_q = {r["extra_info"]["question_hash"] for r in train}
    val_q = {r["extra_info"]["question_hash"] for r in val}
    assert not train_q & val_q and len(train_q | val_q) == 3
    assert train_q | val_q == {question_hash(p.question) for p in PROBLEMS[:3]}


def test_build_data_bad_input(tmp_path: Path) -> None:
    done = tmas("rl", "build-data", str(tmp_path), "-o", str(tmp_path / "x.parquet"))
    assert done.returncode == 2 and "not a run directory" in done.stderr
    assert not (tmp_path / "x.parquet").exists()
