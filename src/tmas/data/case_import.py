"""Public case formats read into problems for MATTRL's domains: RareBench-style medical cases (medicine) and
SuperGPQA-style multiple choice (education).

RareBench style, one JSON object a line: the patient record is ``question``, ``patient``, ``case`` or
``Phenotype`` (a list of findings, joined); the reference diagnosis is ``answer``, ``diagnosis`` or
``RareDisease`` (a list of alternative names, kept as ``name | name``, which the diagnosis grader accepts any of).
The id is ``problem_id``, ``id`` or ``case_id``, else the line number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tmas.errors import InputError
from tmas.jsonl import read_objects
from tmas.problems import Problem

RECORD_FIELDS = ("question", "patient", "case", "Phenotype")
DIAGNOSIS_FIELDS = ("answer", "diagnosis", "RareDisease")
ID_FIELDS = ("problem_id", "id", "case_id")


def _text(value: Any, joiner: str) -> str | None:
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, list) and value and all(isinstance(v, str) and v.strip() for v in value):
        return joiner.join(v.strip() for v in value)
    return None


LETTERS = "ABCDEFGHIJ"


def _case_id(record: dict[str, Any], fields: tuple[str, ...], where: str, default: str) -> str:
    """The case's id from the first of ``fields`` it has (text or a number), else ``default``."""
    field = next((f for f in fields if f in record), None)
    if field is None:
        return default
    value = record[field]
    if isinstance(value, bool) or not isinstance(value, str | int) or not str(value).strip():
        raise InputError(f"{where}: {field!r} must be a non-empty text or an integer")
    return str(value).strip()


def read_cases(reader: Callable[[Path], Iterator[Problem]], path: Path) -> list[Problem]:
    """Every case ``reader`` reads of ``path``, checked as ``tmas run`` will read them: at least one, ids unique."""
    problems = list(reader(path))
    if not problems:
        raise InputError(f"{path}: no case in the file")
    seen: set[str] = set()
    for problem in problems:
        if problem.problem_id in seen:
            raise InputError(f"{path}: the id {problem.problem_id!r} is given to two cases")
        seen.add(problem.problem_id)
    return problems


def read_rarebench(path: Path) -> Iterator[Problem]:
    """RareBench-style cases as problems; a bad line is an :class:`InputError` naming file, line and field."""
    for where, number, record in read_objects(path):
        field = next((f for f in RECORD_FIELDS if f in record), None)
        patient = _text(record.get(field), "; ") if field else None
        if patient is None:
            raise InputError(f"{where}: no patient record (one of {', '.join(RECORD_FIELDS)}, as text or a list)")
        if field == "Phenotype":
            patient = f"Observed phenotypes: {patient}."
        gold_field = next((f for f in DIAGNOSIS_FIELDS if f in record), None)
        gold = _text(record.get(gold_field), " | ") if gold_field else None
        if gold_field and gold is None:
            raise InputError(f"{where}: {gold_field!r} must be a diagnosis name or a list of names")
        case_id = _case_id(record, ID_FIELDS, where, f"case-{number}")
        extra = {k: v for k, v in record.items() if k not in (field, gold_field, *ID_FIELDS)}
        yield Problem(problem_id=case_id, question=patient, answer=gold, metadata=extra)


def read_supergpqa(path: Path) -> Iterator[Problem]:
    """SuperGPQA-style multiple choice: ``question``, ``options`` (a list, lettered A, B, ... in order) and
    ``answer_letter`` (or ``answer``, a letter or the text of an option). The question shown to the student lists
    the options as ``A) ...``; the reference answer is the letter."""
    for where, number, record in read_objects(path):
        question, options = record.get("question"), record.get("options")
        if not isinstance(question, str) or not question.strip():
            raise InputError(f"{where}: 'question' must be non-empty text")
        if not (isinstance(options, list) and 2 <= len(options) <= len(LETTERS)):
            raise InputError(f"{where}: 'options' must be a list of 2 to {len(LETTERS)} options")
        if not all(isinstance(o, str | int | float) and not isinstance(o, bool) and str(o).strip() for o in options):
            raise InputError(f"{where}: each option must be a non-empty text or a number")
        raw = record.get("answer_letter", record.get("answer"))
        letter = None
        if isinstance(raw, str) and raw.strip().upper() in LETTERS[: len(options)] and len(raw.strip()) == 1:
            letter = raw.strip().upper()
        elif isinstance(raw, str) and raw in options:
            letter = LETTERS[options.index(raw)]
        if raw is not None and letter is None:
            raise InputError(f"{where}: the answer {raw!r} is neither an option's letter nor an option's text")
        lettered = "\n".join(f"{LETTERS[i]}) {option}" for i, option in enumerate(options))
        case_id = _case_id(record, (*ID_FIELDS, "uuid"), where, f"question-{number}")
        extra = {k: v for k, v in record.items() if k not in ("question", "options", "answer", "answer_letter")}
        yield Problem(problem_id=case_id, question=f"{question.strip()}\n{lettered}", answer=letter, metadata=extra)


READERS = {"rarebench": read_rarebench, "supergpqa": read_supergpqa}
