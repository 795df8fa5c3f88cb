"""The one JSON Lines reader: every file of objects (problems, imports, cases, credits) is read alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from tmas.data.importers import read_rows
from tmas.errors import InputError
from tmas.jsonl import read_objects
from tmas.problems import load_problems


def test_a_file_led_by_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"problem_id": "a", "question": "What is 1+1?"}\n\n{"id": 2, "question": "x"}\n')
    assert [(p.problem_id, p.question) for p in load_problems(path)] == [("a", "What is 1+1?"), ("2", "x")]
    assert [row["question"] for row in read_rows(path)] == ["What is 1+1?", "x"]


def test_lines_and_their_places_come_in_order_blank_ones_skipped(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n   \n{"a": 2}\n', encoding="utf-8")
    assert list(read_objects(path)) == [(f"{path}:1", 1, {"a": 1}), (f"{path}:3", 3, {"a": 2})]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"a": ', "r.jsonl:2: not valid JSON"),
        (b'{"a": "open', "r.jsonl:2: not valid JSON: Unterminated string starting at column 7$"),
        (b"[1]", "r.jsonl:2: expected a JSON object, got list"),
        (b'{"a": "\xe9"}', "r.jsonl:2: not valid UTF-8"),
        # A byte-order mark leads the file only (json's own words were "decode using utf-8-sig").
        (b'\xef\xbb\xbf{"a": 2}', r"r.jsonl:2: a byte-order mark \(U\+FEFF\) begins the line, where only the file's"),
        (b'{"a": ' + b"9" * 5000 + b"}", "r.jsonl:2: JSON this reader does not take: Exceeds the limit"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "r.jsonl:2: JSON this reader does not take: maximum"),
        (b'{"a": "x \\ud800"}', "r.jsonl:2: a .u escape of half a UTF-16 surrogate pair"),
        # JSON leaves a repeated name open (Python's json kept the last): which answer was meant is not said.
        (b'{"answer": "2", "b": {"c": 1, "c": 2}}', "r.jsonl:2: field 'c' is given twice in one object$"),
    ],
)
def test_a_bad_line_is_named_or_skipped_when_lenient(tmp_path: Path, line: bytes, message: str) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"a": 1}\n' + line + b'\n{"a": 3}\n')
    with pytest.raises(InputError, match=message):
        list(read_objects(path))
    assert [record for _, _, record in read_objects(path, lenient=True)] == [{"a": 1}, {"a": 3}]


def test_lines_ended_by_a_carriage_return_alone_are_said_so(tmp_path: Path) -> None:
    # Before: "r.jsonl:1: not valid JSON: Extra data at column 9", of a file whose every line is valid.
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"a": 1}\r{"a": 2}\r')
    with pytest.raises(InputError) as caught:
        list(read_objects(path))
    assert str(caught.value) == (
        f"{path}:1: lines end in a carriage return alone (CR): save the file with LF or CRLF line ends"
    )
    # CRLF line ends, and a CR inside an object (JSON whitespace), read as before.
    path.write_bytes(b'{"a": 1}\r\n{"a":\r 2}\r\n')
    assert [record for _, _, record in read_objects(path)] == [{"a": 1}, {"a": 2}]
    # A bad line of a CRLF file is said as any bad line.
    path.write_bytes(b'{"a": 1}\r\n{"a":\r }\r\n')
    with pytest.raises(InputError, match=r"r.jsonl:2: not valid JSON: Expecting value at column 8$"):
        list(read_objects(path))


def test_an_escaped_surrogate_pair_is_one_character(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"a": "\\ud83d\\ude00"}\n')
    assert [record for _, _, record in read_objects(path)] == [{"a": "\U0001f600"}]


def test_a_missing_file_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot open"):
        list(read_objects(tmp_path / "none.jsonl"))


def test_a_numeric_answer_is_kept_in_positional_notation(tmp_path: Path) -> None:
    # Python writes the float 1e-7 as "1e-07", which the grading rules read as the letter e: a right "0.0000001" was
    # graded a different number.
    path = tmp_path / "p.jsonl"
    lines = [
        '{"id": 1, "question": "q", "answer": 3e-06}',
        '{"id": 2, "question": "q", "answer": 2.5E+17}',
        '{"id": 3, "question": "q", "answer": 0.75}',
        '{"id": 4, "question": "q", "answer": 40}',
    ]
    path.write_text("\n".join(lines) + "\n")
    assert [p.answer for p in load_problems(path)] == ["0.000003", "250000000000000000", "0.75", "40"]
