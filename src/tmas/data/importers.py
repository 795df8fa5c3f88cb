"""Importers: the official files of the papers' benchmarks, as a user downloads them, into tmas's problem JSONL
(``problem_id``, ``question``, ``answer``, then the source's other fields).

- ``hle``: Humanity's Last Exam's release (``cais/hle``: ``id, question, image, answer, answer_type, category,
  raw_subject, ...``); by default only text-only Math questions are kept, as in HLE-Math (``--all``: the text-only
  questions of every category; a question with an image is never kept, as questions are sent as text).
- ``imo-answerbench``: IMO-AnswerBench's CSV (``Problem ID, Problem, Short Answer, Category, Subcategory, Source``).
- ``matharena``: a MathArena competition (e.g. HMMT: ``problem_idx, problem, answer, problem_type``).

Files are read as CSV, JSON Lines, a JSON array, or Parquet (Parquet needs ``pyarrow``). A file of another layout is a
one-line error naming the file and the columns it lacks; a bad row names its line in a CSV or JSON Lines file
(blank lines counted, as an editor counts them), its place in the array of a JSON or Parquet file. An answer of several
values (a list) is kept as ``2, 3``, as the benchmarks' golds write them; an object answer as JSON; a number in
positional notation (``0.0000001``, not ``1e-07``, which the graders read as Euler's e).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tmas.errors import InputError
from tmas.jsonl import other_format, read_objects
from tmas.problems import answer_text, holds_image


@dataclass(frozen=True)
class Layout:
    """One official layout: the columns it must have and how a row becomes a problem (None: the row is left out)."""

    name: str
    description: str
    required: tuple[str, ...]
    convert: Callable[[dict[str, Any], bool], dict[str, Any] | None]


def _text(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    return "" if value is None else str(value).strip()


def _answer(row: dict[str, Any], key: str) -> str:
    """The reference answer as text the graders read: a list (an answer of several values) as its items joined by
    ``, ``, as the benchmarks' own golds write several values; an object, or a list inside the list, as JSON."""
    value = _plain(row.get(key))
    if isinstance(value, list):
        return ", ".join(_item(v) for v in value if _item(v))
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return _item(value)


def _item(value: Any) -> str:
    """One value as text: a number as a model writes it (1e-07 in positional notation, which the graders read)."""
    value = _plain(value)
    if isinstance(value, list | dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, float) and math.isfinite(value):
        return answer_text(value)
    return "" if value is None else str(value).strip()


def _hle(row: dict[str, Any], keep_all: bool) -> dict[str, Any] | None:
    if holds_image(_plain(row.get("image"))):
        return None  # asked without its picture, it would be another question (questions are sent as text)
    if not keep_all and _text(row, "category") != "Math":
        return None  # HLE-Math: text-only questions of the Math category
    extra: dict[str, Any] = {k: row[k] for k in ("answer_type", "raw_subject", "category") if k in row}
    return {"problem_id": _text(row, "id"), "question": row["question"], "answer": _answer(row, "answer"), **extra}


def _imo(row: dict[str, Any], keep_all: bool) -> dict[str, Any] | None:
    extra: dict[str, Any] = {k: row[k] for k in ("Category", "Subcategory", "Source") if k in row}
    return {
        "problem_id": _text(row, "Problem ID"),
        "question": row["Problem"],
        "answer": _answer(row, "Short Answer"),
        **extra,
    }


def _matharena(row: dict[str, Any], keep_all: bool) -> dict[str, Any] | None:
    extra: dict[str, Any] = {k: _plain(row[k]) for k in ("problem_type", "source", "competition") if k in row}
    return {
        "problem_id": _text(row, "problem_idx"),
        "question": row["problem"],
        "answer": _answer(row, "answer"),
        **extra,
    }


def _plain(value: Any) -> Any:
    """Parquet list columns come back as arrays in some readers: plain lists for JSON."""
    if hasattr(value, "tolist"):  # an array (or a scalar) of numpy's
        return value.tolist()
    return list(value) if isinstance(value, tuple) else value


LAYOUTS: dict[str, Layout] = {
    "hle": Layout("hle", "Humanity's Last Exam release", ("id", "question", "answer", "image", "category"), _hle),
    "imo-answerbench": Layout(
        "imo-answerbench", "IMO-AnswerBench CSV", ("Problem ID", "Problem", "Short Answer"), _imo
    ),
    "matharena": Layout("matharena", "MathArena competition", ("problem_idx", "problem", "answer"), _matharena),
}


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The file's rows as dicts, by its extension."""
    return (row for _, row in located_rows(path))


def located_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The file's rows as dicts, each with where it is: ``line N`` of a CSV or JSON Lines file (the line an editor
    shows; a CSV record over several lines, its last), ``row N`` of a JSON array or a Parquet table."""
    suffix = path.suffix.lower()
    if path.is_dir():
        raise InputError(f"{path}: a directory: give the file of its rows (.csv, .jsonl, .json or .parquet)")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if suffix == ".csv":
        yield from _csv_rows(path)
    elif suffix == ".jsonl":
        yield from ((f"line {number}", row) for _, number, row in read_objects(path))
    elif suffix == ".json":
        raw = path.read_bytes()
        if what := other_format(raw):
            raise InputError(f"{path}: {what}")
        try:
            data = json.loads(raw.decode("utf-8-sig"))
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}") from None
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise InputError(f"{path}: expected a JSON array of objects")
        yield from ((f"row {number}", row) for number, row in enumerate(data, start=1))
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise InputError(
                f"{path}: reading Parquet needs pyarrow: pip install 'tmas[rl]' (or pyarrow alone),"
                " or convert it to JSONL"
            ) from None
        import pyarrow as pa  # type: ignore[import-not-found,unused-ignore]

        try:
            table = pq.read_table(path)
        except pa.ArrowException as exc:
            raise InputError(f"{path}: not a Parquet file this reader takes: {exc}") from None
        yield from ((f"row {number}", row) for number, row in enumerate(table.to_pylist(), start=1))
    else:
        raise InputError(f"{path}: unknown file type {suffix or '(none)'}: give .csv, .jsonl, .json or .parquet")


# A field as long as a question may be (the csv module's own limit is 128 KiB).
_CSV_FIELD_LIMIT = 2**31 - 1


def _csv_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """A CSV file's rows under its header; a row of more or fewer fields than the header names, text that is not
    UTF-8 or quoting the csv module cannot read is a one-line error naming the line."""
    raw = path.read_bytes()
    if what := other_format(raw):
        raise InputError(f"{path}: line 1: {what}")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputError(f"{path}: line {line}: not valid UTF-8 (byte {exc.start} of the file)") from None
    csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_LIMIT))
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            if None in row:  # the fields past the header's columns, which DictReader keeps under None
                raise InputError(
                    f"{path}: line {reader.line_num}: {len(row) - 1 + len(row[None])} fields, but the header names"
                    f" {len(row) - 1} columns"
                )
            if None in row.values():  # DictReader's filler for the columns a short row lacks: read as empty, they
                # would be said as an empty answer, or drop the row as of no category
                given = sum(value is not None for value in row.values())
                raise InputError(
                    f"{path}: line {reader.line_num}: {given} fields, but the header names {len(row)} columns"
                )
            yield f"line {reader.line_num}", row
    except csv.Error as exc:
        raise InputError(f"{path}: line {reader.line_num}: not valid CSV: {exc}") from None


def import_problems(path: Path, layout_name: str, *, keep_all: bool = False) -> list[dict[str, Any]]:
    """Every row of ``path`` in the official ``layout_name`` as a tmas problem record."""
    layout = LAYOUTS.get(layout_name)
    if layout is None:
        raise InputError(f"unknown source {layout_name!r}; known: {', '.join(LAYOUTS)}")
    out: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for where, row in located_rows(path):
        missing = [c for c in layout.required if c not in row]
        if missing:
            found = ", ".join(sorted(row)[:8]) or "none"
            raise InputError(
                f"{path}: {where}: not in the {layout.description} layout: missing column(s) "
                f"{', '.join(repr(c) for c in missing)} (found: {found})"
            )
        record = layout.convert(row, keep_all)
        if record is None:
            continue
        if not record["problem_id"]:
            raise InputError(f"{path}: {where}: empty problem id")
        if not isinstance(record["question"], str) or not record["question"].strip():
            raise InputError(f"{path}: {where}: empty or non-text question")
        if not record["answer"]:
            raise InputError(f"{path}: {where}: empty answer")
        if record["problem_id"] in seen:
            raise InputError(
                f"{path}: {where}: duplicate problem id {record['problem_id']!r} (first at "
                f"{seen[record['problem_id']]})"
            )
        seen[record["problem_id"]] = where
        out.append(record)
    if not out:
        # Only HLE's release is filtered (to its text-only Math questions) unless --all.
        filtered = layout.name == "hle" and not keep_all
        raise InputError(f"{path}: no problems to import" + (" (none matched the default filter)" if filtered else ""))
    return out
