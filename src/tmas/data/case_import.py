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


def _unique(case_id: str, where: str, number: int, seen: dict[str, int]) -> str:
    """``case_id``, first seen on line ``number``; an id an earlier line gave its case is an error naming both."""
    if case_id in seen:
        raise InputError(f"{where}: the id {case_id!r} is given to two cases (first at line {seen[case_id]})")
    seen[case_id] = number
    return case_id


def read_cases(reader: Callable[[Path], Iterator[Problem]], path: Path) -> list[Problem]:
    """Every case ``reader`` reads of ``path`` (each reader checks its ids are unique, naming the line), and at
    least one, as ``tmas run`` will read them."""
    problems = list(reader(path))
    if not problems:
        raise InputError(f"{path}: no case in the file")
    return problems


def read_rarebench(path: Path) -> Iterator[Problem]:
    """RareBench-style cases as problems; a bad line (or an id given twice) is an :class:`InputError` naming file,
    line and field."""
    seen: dict[str, int] = {}
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
        case_id = _unique(_case_id(record, ID_FIELDS, where, f"case-{number}"), where, number, seen)
        extra = {k: v for k, v in record.items() if k not in (field, gold_field, *ID_FIELDS)}
        yield Problem(problem_id=case_id, question=patient, answer=gold, metadata=extra)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _option_of(answer: str | float, options: list[Any]) -> int | None:
    """The index of the option ``answer`` names: by its text, else, where both are numbers, by value (``"3"`` is
    the option ``3``, ``2`` the option ``"2.0"``); None when none or several options have that value."""
    text = str(answer).strip()
    texts = [str(option).strip() for option in options]
    if text in texts:
        return texts.index(text)
    value = _number(text)
    if value is None:
        return None
    same = [i for i, option in enumerate(texts) if _number(option) == value]
    return same[0] if len(same) == 1 else None


def read_supergpqa(path: Path) -> Iterator[Problem]:
    """SuperGPQA-style multiple choice: ``question``, ``options`` (a list, lettered A, B, ... in order) and
    ``answer_letter`` (or ``answer``, a letter or the text of an option, a number naming the option of that value).
    The question shown to the student lists the options as ``A) ...``; the reference answer is the letter."""
    seen: dict[str, int] = {}
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
        elif isinstance(raw, str | int | float) and not isinstance(raw, bool):
            chosen = _option_of(raw, options)
            letter = None if chosen is None else LETTERS[chosen]
        if raw is not None and letter is None:
            raise InputError(f"{where}: the answer {raw!r} is neither an option's letter nor an option's text or value")
        lettered = "\n".join(f"{LETTERS[i]}) {option}" for i, option in enumerate(options))
        case_id = _unique(_case_id(record, (*ID_FIELDS, "uuid"), where, f"question-{number}"), where, number, seen)
        extra = {k: v for k, v in record.items() if k not in ("question", "options", "answer", "answer_letter")}
        yield Problem(problem_id=case_id, question=f"{question.strip()}\n{lettered}", answer=letter, metadata=extra)


READERS = {"rarebench": read_rarebench, "supergpqa": read_supergpqa}
