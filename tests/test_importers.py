"""Importers of the official benchmark files (HLE, IMO-AnswerBench, MathArena) on small hand-made files in their
layouts, and their one-line errors on malformed ones."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import clean_env, run_tmas
from tmas.answer_rules import check_pair
from tmas.data.importers import import_problems
from tmas.errors import InputError
from tmas.jsonl import write_jsonl as write_records
from tmas.problems import load_problems

HLE_ROWS = [
    # A text-only Math question (kept), one with an image (left out), one of another category (left out).
    {
        "id": "66e8a3",
        "question": "Find the density.",
        "image": "",
        "answer": "\\frac{2}{7}",
        "answer_type": "exactMatch",
        "raw_subject": "Mathematics",
        "category": "Math",
        "rationale": "...",
        "canary": "c",
    },
    {
        "id": "66e8b4",
        "question": "Read the plot.",
        "image": "data:image/png;base64,AAA",
        "answer": "3",
        "answer_type": "exactMatch",
        "raw_subject": "Mathematics",
        "category": "Math",
        "rationale": "",
        "canary": "c",
    },
    {
        "id": "66e8c5",
        "question": "Name the law.",
        "image": "",
        "answer": "Ohm",
        "answer_type": "exactMatch",
        "raw_subject": "Physics",
        "category": "Physics",
        "rationale": "",
        "canary": "c",
    },
]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_hle_release_keeps_text_only_math(tmp_path: Path) -> None:
    rows = import_problems(write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS), "hle")
    assert rows == [
        {
            "problem_id": "66e8a3",
            "question": "Find the density.",
            "answer": "\\frac{2}{7}",
            "answer_type": "exactMatch",
            "raw_subject": "Mathematics",
            "category": "Math",
        }
    ]
    # --all keeps every category, but never a question with an image: questions are sent as text, and "Read the
    # plot." asked without its plot is another question (before, it was written out and graded against its answer).
    every = import_problems(tmp_path / "hle.jsonl", "hle", keep_all=True)
    assert [row["problem_id"] for row in every] == ["66e8a3", "66e8c5"]


def test_hle_image_of_a_datasets_export_holding_nothing_is_text_only(tmp_path: Path) -> None:
    rows = [{**HLE_ROWS[0], "image": {"bytes": None, "path": None}}, {**HLE_ROWS[1], "image": {"path": "plot.png"}}]
    imported = import_problems(write_jsonl(tmp_path / "hle.jsonl", rows), "hle", keep_all=True)
    assert [row["problem_id"] for row in imported] == ["66e8a3"]


def test_imo_answerbench_csv(tmp_path: Path) -> None:
    path = tmp_path / "answerbench.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Problem ID", "Problem", "Short Answer", "Category", "Subcategory", "Source"])
        w.writerow(
            ["imo-bench-algebra-001", "Find all N, with $N \\ge 1$, such that ...", "3", "Algebra", "Operation", "x"]
        )
        w.writerow(["imo-bench-geometry-002", "Find the angle, in degrees.", "60", "Geometry", "Angles", "y"])
    rows = import_problems(path, "imo-answerbench")
    assert [(r["problem_id"], r["answer"], r["Category"]) for r in rows] == [
        ("imo-bench-algebra-001", "3", "Algebra"),
        ("imo-bench-geometry-002", "60", "Geometry"),
    ]
    assert rows[0]["question"].startswith("Find all N, with $N \\ge 1$")


def test_matharena_json_and_parquet(tmp_path: Path) -> None:
    data = [
        {"problem_idx": 1, "problem": "Compute the sum.", "answer": "103", "problem_type": ["Number Theory"]},
        {"problem_idx": 2, "problem": "Compute the number.", "answer": "3375", "problem_type": ["Algebra"]},
    ]
    path = tmp_path / "hmmt.json"
    path.write_text(json.dumps(data))
    rows = import_problems(path, "matharena")
    assert [(r["problem_id"], r["answer"], r["problem_type"]) for r in rows] == [
        ("1", "103", ["Number Theory"]),
        ("2", "3375", ["Algebra"]),
    ]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(data), tmp_path / "train-00000-of-00001.parquet")
    assert import_problems(tmp_path / "train-00000-of-00001.parquet", "matharena") == rows


def test_an_answer_of_several_values_is_stored_as_the_graders_read_it(tmp_path: Path) -> None:
    # A list answer is its values joined by ", " (as the benchmarks' own golds write several values), not Python's
    # repr; an object is JSON.
    data = [
        {"problem_idx": 1, "problem": "Find both roots.", "answer": [2, 3]},
        {"problem_idx": 2, "problem": "Name the pieces.", "answer": ["AB", "CL"]},
        {"problem_idx": 3, "problem": "Give the pairs.", "answer": [[1, 2], [3, 4]]},
        {"problem_idx": 4, "problem": "Give the map.", "answer": {"a": 1, "b": "é"}},
    ]
    path = tmp_path / "several.json"
    path.write_text(json.dumps(data))
    rows = import_problems(path, "matharena")
    assert [r["answer"] for r in rows] == ["2, 3", "AB, CL", "[1, 2], [3, 4]", '{"a": 1, "b": "é"}']
    # The rules grader takes the stored gold's values in their order; another order (a set's, or a wrong sequence's:
    # the problem says which) is left to the judge.
    assert check_pair(rows[0]["answer"], "\\boxed{2, 3}").correct is True
    assert check_pair(rows[0]["answer"], "\\boxed{3, 2}").correct is None
    written = tmp_path / "out.jsonl"
    write_records(rows, written)
    assert [p.answer for p in load_problems(written)] == ["2, 3", "AB, CL", "[1, 2], [3, 4]", '{"a": 1, "b": "é"}']
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(data[:1]), tmp_path / "several.parquet")
    assert import_problems(tmp_path / "several.parquet", "matharena")[0]["answer"] == "2, 3"


def test_a_number_answer_is_stored_in_positional_notation(tmp_path: Path) -> None:
    # str() of a float wrote 1e-07 and 2.5e+20, which the rules read with Euler's e: every right reply was "a
    # different number".
    data = [
        {"problem_idx": 1, "problem": "Find the rate.", "answer": 3e-07},
        {"problem_idx": 2, "problem": "Find the count.", "answer": 4.5e20},
        {"problem_idx": 3, "problem": "Find both.", "answer": [0.25, 2e-06]},
        {"problem_idx": 4, "problem": "Find n.", "answer": 12},
    ]
    path = tmp_path / "numbers.json"
    path.write_text(json.dumps(data))
    rows = import_problems(path, "matharena")
    assert [r["answer"] for r in rows] == ["0.0000003", "450000000000000000000", "0.25, 0.000002", "12"]
    assert check_pair(rows[0]["answer"], "3 \\times 10^{-7}").correct is True
    assert check_pair(rows[1]["answer"], "4.5 \\cdot 10^{20}").correct is True


@pytest.mark.parametrize(
    ("name", "content", "source", "message"),
    [
        # IMO-AnswerBench without its answer column: the file is not in that layout.
        (
            "a.csv",
            "Problem ID,Problem\nx,Find it.\n",
            "imo-answerbench",
            "a.csv: line 2: not in the IMO-AnswerBench CSV layout: missing column(s) 'Short Answer' (found: Problem, "
            "Problem ID)",
        ),
        # An HLE file given as MathArena.
        (
            "h.jsonl",
            json.dumps(HLE_ROWS[0]) + "\n",
            "matharena",
            "not in the MathArena competition layout: missing column(s) 'problem_idx', 'problem'",
        ),
        (
            "b.jsonl",
            '{"problem_idx": 1, "problem": "Q", "answer": "2"}\n{"problem_idx": 1,\n',
            "matharena",
            "b.jsonl:2: not valid JSON",
        ),
        # A JSON Lines file's error names the line an editor shows, blank lines counted.
        (
            "c.jsonl",
            '{"problem_idx": 1, "problem": "Q", "answer": "2"}\n\n{"problem_idx": 1, "problem": "R", "answer": "3"}\n',
            "matharena",
            "c.jsonl: line 3: duplicate problem id '1' (first at line 1)",
        ),
        (
            "d.jsonl",
            '\n{"problem_idx": 1, "problem": "  ", "answer": "2"}\n',
            "matharena",
            "d.jsonl: line 2: empty or non-text question",
        ),
        # A JSON array has no line per row: the row's place in the array: its place in the array.
        (
            "d.json",
            '[{"problem_idx": 1, "problem": "Q", "answer": "2"},\n\n{"problem_idx": 2, "problem": "R", "answer": ""}]',
            "matharena",
            "d.json: row 2: empty answer",
        ),
        ("e.json", '{"problem_idx": 1}', "matharena", "e.json: expected a JSON array of objects"),
        ("f.txt", "anything", "hle", "f.txt: unknown file type .txt"),
        (
            "g.jsonl",
            json.dumps(HLE_ROWS[2]) + "\n",
            "hle",
            "g.jsonl: no problems to import (none matched the default filter)",
        ),
        # RSE's HLE-Math-100 file (already tmas JSONL) is not HLE's release.
        (
            "hle100.jsonl",
            json.dumps({"id": 8, "question": "Q", "answer": "2", "hle_raw_id": "66e8a3", "question_id": 1}) + "\n",
            "hle",
            "not in the Humanity's Last Exam release layout: missing column(s) 'image', 'category'",
        ),
    ],
)
def test_malformed_files_are_one_line_errors(
    tmp_path: Path, name: str, content: str, source: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(InputError) as info:
        import_problems(path, source)
    assert message in str(info.value) and "\n" not in str(info.value)


CSV_HEAD = b"Problem ID,Problem,Short Answer\n"


@pytest.mark.parametrize(
    ("name", "content", "source", "message"),
    [
        ("u.csv", CSV_HEAD + b"imo-1,Find \xff.,2\n", "imo-answerbench", "u.csv: line 2: not valid UTF-8 (byte 43 "),
        ("u.json", b'[{"problem_idx": 1, "problem": "\xff"}]', "matharena", "u.json: not valid UTF-8 (byte 32)"),
        # Files of another format say which, not only that they are no UTF-8.
        ("g.csv", gzip.compress(CSV_HEAD), "imo-answerbench", "g.csv: line 1: a gzip-compressed file: decompress it"),
        ("g.json", gzip.compress(b"[]"), "matharena", "g.json: a gzip-compressed file"),
        ("w.csv", CSV_HEAD.decode().encode("utf-16"), "imo-answerbench", "w.csv: line 1: UTF-16 text"),
        # A row of more fields than the header names (an unquoted comma): its fields would land in other columns.
        (
            "x.csv",
            CSV_HEAD + b"imo-1,Find 1,2.,3\n",
            "imo-answerbench",
            "x.csv: line 2: 4 fields, but the header names 3",
        ),
        ("y.csv", b"A,B\nimo-1,Find,2\n", "imo-answerbench", "y.csv: line 2: 3 fields, but the header names 2"),
        # A row of fewer fields (a cut-off line): before, its missing fields read as empty, said as an "empty answer",
        # or, in HLE's release, the row was dropped without a word as of no category.
        (
            "s.csv",
            CSV_HEAD + b"imo-1,Find 1,2\nimo-2,Find 2.\n",
            "imo-answerbench",
            "s.csv: line 3: 2 fields, but the header names 3",
        ),
        (
            "h.csv",
            b"id,question,answer,image,category\nh1,What?,4\n",
            "hle",
            "h.csv: line 2: 3 fields, but the header names 5",
        ),
        ("p.parquet", b"not a parquet file", "matharena", "p.parquet: not a Parquet file this reader takes: "),
        # Only HLE's release is filtered by default: an empty file of another layout is not said to be.
        ("e.csv", CSV_HEAD, "imo-answerbench", "e.csv: no problems to import"),
    ],
)
def test_unreadable_rows_are_one_line_errors_naming_the_line(
    tmp_path: Path, name: str, content: bytes, source: str, message: str
) -> None:
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow.parquet")
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InputError) as info:
        import_problems(path, source)
    said = str(info.value)
    assert said.startswith(f"{tmp_path}/") and message in said and "\n" not in said
    assert "default filter" not in said


def test_a_question_longer_than_the_csv_modules_field_limit_is_imported(tmp_path: Path) -> None:
    question = "Find the sum of " + "1 + " * 50_000 + "1."
    path = tmp_path / "long.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Problem ID", "Problem", "Short Answer"])
        writer.writerow(["imo-1", question, "50001"])
    [row] = import_problems(path, "imo-answerbench")
    assert (row["question"], row["answer"]) == (question, "50001")


@pytest.mark.slow
def test_cli_import_writes_problems_tmas_reads(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS)
    env = clean_env()
    run = [sys.executable, "-m", "tmas", "data", "import"]
    done = subprocess.run([*run, "hle", str(src), "-o", str(tmp_path / "hle-math.jsonl")], capture_output=True, env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == f"wrote 1 problems to {tmp_path / 'hle-math.jsonl'}"
    [problem] = load_problems(tmp_path / "hle-math.jsonl")
    assert (problem.problem_id, problem.answer) == ("66e8a3", "\\frac{2}{7}")
    bad = subprocess.run([*run, "aime", str(src), "-o", str(tmp_path / "x.jsonl")], capture_output=True, env=env)
    assert bad.returncode != 0
    assert bad.stderr.decode().strip() == "tmas: error: unknown source 'aime'; known: hle, imo-answerbench, matharena"


@pytest.mark.parametrize("out", ["itself", "a folder"])
def test_an_out_that_is_the_download_or_a_folder_is_refused_before_anything_is_written(
    tmp_path: Path, out: str
) -> None:
    # Before: the download was replaced by its conversion (its other fields lost), or "DIR: Is a directory", exit 1.
    src = write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS)
    before = src.read_bytes()
    target = src if out == "itself" else tmp_path
    done = run_tmas("data", "import", "hle", str(src), "-o", str(target), text=True)
    assert done.returncode == 2
    said = (
        "is the file being imported: write the problems to another file"
        if out == "itself"
        else ("is a directory: give the file to write")
    )
    assert done.stderr.strip().splitlines() == [f"tmas: error: --out {target} {said}"]
    assert src.read_bytes() == before


def test_an_out_under_a_file_is_refused_in_one_line_before_anything_is_read(tmp_path: Path) -> None:
    # Before: "FILE: File exists", exit 1, once the whole download was read.
    above = tmp_path / "taken"
    above.write_text("kept")
    target = above / "x.jsonl"
    done = run_tmas("data", "import", "hle", str(tmp_path / "none.jsonl"), "-o", str(target), text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"tmas: error: --out {target}: {above} is a file, not a directory (choose another)"
    ]
    assert above.read_text() == "kept"


def test_a_write_cut_short_leaves_the_earlier_file_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "problems.jsonl"
    out.write_text('{"problem_id": "old"}\n')

    def records() -> Iterator[dict[str, object]]:
        yield {"problem_id": "new"}
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_records(records(), out)
    assert out.read_text() == '{"problem_id": "old"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["problems.jsonl"]


def test_a_directory_or_a_missing_file_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="a directory: give the file of its rows"):
        import_problems(tmp_path, "hle")
    with pytest.raises(InputError, match="no such file"):
        import_problems(tmp_path / "x.csv", "hle")
