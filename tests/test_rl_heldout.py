"""The committed RL data: its held-out problems stay held out (no question of a set's ``eval.jsonl`` appears, in any
case or spacing, in that set's training problems ``train-*.jsonl`` or in the prompts of its training parquet files,
``extra_info.question``; the before/after evaluation of ``benchmarks/rl_device.py`` would otherwise measure questions
the policy was trained on), and the scripts beside it still make what is committed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pq = pytest.importorskip("pyarrow.parquet")

DATA = Path(__file__).resolve().parents[1] / "data" / "rl"
SETS = [DATA, DATA / "level1"]


def normalised(question: str) -> str:
    """Case and every whitespace dropped: stricter than the project's question hash, which keeps single spaces."""
    return re.sub(r"\s+", "", question).lower()


def jsonl_questions(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(row["problem_id"], row["question"]) for row in map(json.loads, filter(str.strip, lines))]


def parquet_questions(path: Path) -> list[tuple[str, str]]:
    infos = pq.read_table(path, columns=["extra_info"]).column("extra_info").to_pylist()
    return [(str(info["problem_id"]), info["question"]) for info in infos]


def training_files(folder: Path) -> list[Path]:
    return sorted([*folder.glob("train*.jsonl"), *folder.glob("*.parquet")])


@pytest.mark.parametrize("folder", SETS, ids=lambda p: str(p.relative_to(DATA.parent)))
def test_no_evaluation_question_in_any_training_file(folder: Path) -> None:
    held_out = {normalised(q): pid for pid, q in jsonl_questions(folder / "eval.jsonl")}
    files = training_files(folder)
    assert held_out and files, f"{folder}: no evaluation set or no training file"
    leaks = []
    for path in files:
        read = parquet_questions if path.suffix == ".parquet" else jsonl_questions
        questions = read(path)
        assert questions, f"{path}: no question read"
        leaks += [
            f"{path.name}: {pid} is evaluation problem {held_out[normalised(q)]}"
            for pid, q in questions
            if normalised(q) in held_out
        ]
    assert not leaks, "\n".join(leaks)


def test_the_level1_pool_script_makes_the_committed_pool(tmp_path: Path) -> None:
    # data/rl/README.md's recipe: the rows of level1/train.parquet and one normal row per problem of train-pool.jsonl.
    root = DATA.parents[1]
    pool = tmp_path / "pool.parquet"
    level1 = DATA / "level1"
    script = [str(DATA / "cot_pool.py"), str(level1 / "train-pool.jsonl"), str(level1 / "train.parquet"), str(pool)]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run([sys.executable, *script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "191 rows of" in done.stdout and "244 normal rows of" in done.stdout
    assert pq.read_table(pool).to_pylist() == pq.read_table(level1 / "pool.parquet").to_pylist()
