"""The committed RL data keeps its held-out problems held out: no question of a set's ``eval.jsonl`` appears, in any
case or spacing, in that set's training problems (``train-*.jsonl``) or in the prompts of its training parquet files
(``extra_info.question``). The before/after evaluation of ``benchmarks/rl_device.py`` would otherwise measure
questions the policy was trained on."""

from __future__ import annotations

import json
import re
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
