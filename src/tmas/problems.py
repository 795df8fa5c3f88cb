"""Problems and the JSONL files that hold them.

The official TMAS format is one JSON object a line with ``problem_id``, ``question`` and ``answer``; files that name
the id ``question_id`` or ``id`` are read too. Other fields are kept as metadata.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tmas.errors import InputError
from tmas.jsonl import read_objects

ID_FIELDS = ("problem_id", "question_id", "id")
# Fields that hold a question's picture in the files benchmarks are exported as (HLE's ``image``; ``images``).
IMAGE_FIELDS = ("image", "images")


class Problem(BaseModel):
    model_config = ConfigDict(frozen=True)

    problem_id: str
    question: str
    # The reference answer; None for unlabeled problems (they are solved but not graded).
    answer: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def labeled(self) -> bool:
        """Whether there is a reference answer to reward or filter by: a blank one (a file's "" for a missing
        answer) matches no reply, so it is none."""
        return self.answer is not None and bool(self.answer.strip())


def check_question(question: object, where: str) -> str:
    """A question must be non-empty text; returns it unchanged."""
    if not isinstance(question, str):
        raise InputError(f"{where}: 'question' must be a string, not {type(question).__name__}")
    if not question.strip():
        raise InputError(f"{where}: 'question' is empty")
    return question


def iter_problems(path: str | Path) -> Iterator[Problem]:
    """Read problems one line at a time; a bad line raises :class:`InputError` naming file and line."""
    for _, problem in located_problems(path):
        yield problem


def located_problems(path: str | Path) -> Iterator[tuple[str, Problem]]:
    """Each problem of ``path`` with where it is (``file:line``), as :func:`iter_problems` reads them."""
    path = Path(path)
    seen: dict[str, int] = {}
    for where, number, record in read_objects(path):
        problem = _problem(record, where)
        if problem.problem_id in seen:
            raise InputError(
                f"{where}: duplicate problem id {problem.problem_id!r} (first on line {seen[problem.problem_id]})"
            )
        seen[problem.problem_id] = number
        yield where, problem


def load_problems(path: str | Path) -> list[Problem]:
    problems = list(iter_problems(path))
    if not problems:
        raise InputError(f"{path}: no problems in file")
    return problems


def _is_answer(value: object) -> bool:
    """A string or a finite number: a JSON true or false is neither (though Python's bool is an int), and NaN or
    1e400 (read as inf) is no answer a model could give."""
    if isinstance(value, bool):
        return False
    return isinstance(value, str | int) or (isinstance(value, float) and math.isfinite(value))


def answer_text(answer: str | int | float) -> str:
    """A JSON number as a model writes it: 1e-07 and 1e+20 in positional notation (graders read 'e' as a letter)."""
    if isinstance(answer, float):
        return format(Decimal(repr(answer)), "f")
    return str(answer)


def _fields_found(record: dict[str, Any]) -> str:
    """The fields a line has instead, for a file of another layout (an export that names the question 'problem')."""
    found = ", ".join(sorted(record)[:8]) + (", ..." if len(record) > 8 else "")
    return f" (the line has: {found or 'no fields'}; 'tmas data import' converts official benchmark files)"


def holds_image(value: object) -> bool:
    """Whether a field holds a picture: "" (HLE's text-only rows), null, an empty list and an object of nulls (a
    datasets export of no image, ``{"bytes": null, "path": null}``) hold none."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return False
    if isinstance(value, list):
        return any(holds_image(item) for item in value)
    if isinstance(value, dict):
        return any(holds_image(item) for item in value.values())
    return True


def _problem(record: dict[str, Any], where: str) -> Problem:
    id_field = next((name for name in ID_FIELDS if name in record), None)
    if id_field is None:
        raise InputError(f"{where}: missing field 'problem_id' (or 'question_id' / 'id'){_fields_found(record)}")
    raw_id = record[id_field]
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or not str(raw_id).strip():
        raise InputError(f"{where}: field {id_field!r} must be a non-empty string or integer")
    if "question" not in record:
        raise InputError(f"{where}: missing field 'question'{_fields_found(record)}")
    question = check_question(record["question"], where)
    pictured = next((name for name in IMAGE_FIELDS if holds_image(record.get(name))), None)
    if pictured is not None:
        # Questions go to the model as text: one whose picture is left behind is asked without what it shows.
        raise InputError(
            f"{where}: field {pictured!r} holds an image, but questions are sent as text only: leave the problem out"
            f" (or the field, to ask its text alone)"
        )
    answer = record.get("answer")
    if answer is not None and not _is_answer(answer):
        raise InputError(f"{where}: field 'answer' must be a string or a finite number")
    metadata = {k: v for k, v in record.items() if k not in ("question", "answer", id_field)}
    return Problem(
        problem_id=str(raw_id).strip(),
        question=question,
        answer=None if answer is None else answer_text(answer),
        metadata=metadata,
    )


# Named benchmarks: alias -> file name under the benchmarks folder (read at run time, never committed).
DATASET_ALIASES: dict[str, str] = {
    "hle-math-100": "HLE_MATH_text_100_sample_subset.jsonl",
    "hmmt24": "HMMT_24.jsonl",
    "hmmt25": "HMMT_25.jsonl",
    "imo-answerbench": "IMO-ANSWERBENCH.jsonl",
}
BENCHMARKS_ENV = "TMAS_BENCHMARKS_DIR"


def benchmarks_dirs() -> list[Path]:
    """Where named benchmarks are looked for: $TMAS_BENCHMARKS_DIR, then ../shared/benchmarks from the cwd or repo."""
    dirs = []
    if os.environ.get(BENCHMARKS_ENV):
        dirs.append(Path(os.environ[BENCHMARKS_ENV]))
    repo_root = Path(__file__).resolve().parents[2]
    for base in (Path.cwd(), repo_root):
        dirs.append(base.parent / "shared" / "benchmarks")
        dirs.append(base / "shared" / "benchmarks")
    return dirs


def resolve_dataset(name_or_path: str | Path) -> Path:
    """A problem file: an existing path as given, else a named benchmark alias (see :data:`DATASET_ALIASES`)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    key = str(name_or_path).strip().lower()
    if key not in DATASET_ALIASES:
        known = ", ".join(sorted(DATASET_ALIASES))
        raise InputError(f"{name_or_path}: no such file, and not a named benchmark ({known})")
    file_name = DATASET_ALIASES[key]
    searched = benchmarks_dirs()
    for folder in searched:
        candidate = folder / file_name
        if candidate.is_file():
            return candidate
    where = ", ".join(str(d) for d in dict.fromkeys(searched))
    raise InputError(f"benchmark {key!r}: {file_name} not found (looked in {where}; set {BENCHMARKS_ENV})")


def question_hash(question: str) -> str:
    """The identity of a question across files: case and whitespace do not matter."""
    canonical = re.sub(r"\s+", " ", question).strip().lower()
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def dataset_name(name_or_path: str | Path) -> str:
    """A short benchmark name for reports: the alias when the file is a named benchmark, else the file stem."""
    path = Path(name_or_path)
    for alias, file_name in DATASET_ALIASES.items():
        if str(name_or_path).strip().lower() == alias or path.name == file_name:
            return alias
    return path.stem
