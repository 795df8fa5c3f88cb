"""The rules of reading stored runs, read from the source (AST) so that they stay kept.

A stored result is read only as the typed records of ``tmas.store.records``, validated in one place, the store's
reader:

- the store gives back records, never dictionaries: its reading methods (and ``load_results``) are annotated with
  the record models, so under ``mypy --strict`` a key read of what they return does not type-check;
- no module outside the store queries the tables that hold the records, or parses them itself;
- the two dictionaries a record holds are read through models too: an iteration's method state (``state``, read
  through the method's declared ``State``) and a record dumped back to JSON (``model_dump``). No module reads one of
  them by a string key (``x.state["transcript"]``, ``state.get("pre")``, ``"pre" in item.state``,
  ``record.model_dump()["answer"]``), following simple assignments within a function;
- ``rl/`` imports nothing of TMAS's insides: what RL data needs of a method comes through the registry and
  ``methods/training_prompts.py``.

MATTRL's domains are the same kind of rule, kept by ``tests/test_mattrl_domain_names.py``; methods' names by
``tests/test_method_traits.py``.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from pydantic import BaseModel

from tmas.config import Settings
from tmas.grading.run_results import load_results
from tmas.store.records import IterationRecord, ProblemResult
from tmas.store.run_store import RunStore

SRC = Path(__file__).resolve().parents[1] / "src" / "tmas"
STORE = SRC / "store"
# Where a state is declared and dumped by its own model.
STATE_MODELS = (SRC / "store" / "records.py", SRC / "methods" / "state.py")
# Attributes holding a record's untyped part, and calls that turn a record back into a dictionary.
UNTYPED_ATTRS = ("state",)
DUMPS = ("model_dump",)
# The tables of the stored records.
TABLES = ("results", "iterations", "result_summaries")


def test_the_store_gives_back_the_record_models() -> None:
    def returns(function: object) -> str:
        return str(typing.get_type_hints(function)["return"])

    for method in (RunStore.result, RunStore.results, RunStore.result_summaries):
        assert "ProblemResult" in returns(method), method
    assert "IterationRecord" in returns(RunStore.iterations)
    assert "ProblemResult" in returns(load_results)
    for method in (RunStore.save_result, RunStore.save_iteration):
        hints = typing.get_type_hints(method)
        assert {hints.get("result"), hints.get("record")} & {ProblemResult, IterationRecord}, method


def _fields(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[str]:
    """The field names of ``model`` and of every model its fields hold."""
    if model in seen:
        return set()
    seen.add(model)
    names = set(model.model_fields)
    for field in model.model_fields.values():
        for held in _models_in(field.annotation):
            names |= _fields(held, seen)
    return names


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


# The keys of a dumped record: its models' field names, less the settings' (a dumped Settings is read by key where
# the settings are rewritten, e.g. a pilot's iterations, and shares ``method`` with a result).
RECORD_KEYS = _fields(ProblemResult, set()) - set(Settings.model_fields)


def _untyped(node: ast.expr, tainted: dict[str, str]) -> str | None:
    """What of a record's untyped parts ``node`` is: ``"state"`` (``x.state``, or a name bound to one), ``"dump"``
    (``x.model_dump(...)``, or a name bound to one), else None."""
    if isinstance(node, ast.Attribute) and node.attr in UNTYPED_ATTRS:
        return "state"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DUMPS:
        return "dump"
    return tainted.get(node.id) if isinstance(node, ast.Name) else None


def _read(node: ast.AST, tainted: dict[str, str]) -> tuple[str | None, ast.expr | None]:
    """The untyped part a node reads by key and the key, where it is one: ``x[key]``, ``x.get(key)``, ``key in x``."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return _untyped(node.value, tainted), node.slice
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return _untyped(node.func.value, tainted), node.args[0]
    if isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
        kinds = [_untyped(side, tainted) for side in node.comparators]
        return next((k for k in kinds if k), None), node.left
    return None, None


def untyped_key_reads(path: Path) -> list[str]:
    """String-key reads of a method state (any key) or of a dumped record (a key of the records), in one file."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    scopes: list[ast.AST] = [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)),
    ]
    for scope in scopes:
        tainted: dict[str, str] = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and (kind := _untyped(node.value, {})):
                tainted.update((t.id, kind) for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(scope):
            kind, key = _read(node, tainted)
            if kind is None or not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                continue
            if kind == "state" or key.value in RECORD_KEYS:
                found.append(f"{path.name}:{node.lineno} reads {key.value!r} by key")
    return sorted(set(found))


def test_no_module_reads_a_method_state_or_a_dumped_record_by_key() -> None:
    paths = [p for p in sorted(SRC.rglob("*.py")) if p not in STATE_MODELS]
    assert [hit for path in paths for hit in untyped_key_reads(path)] == []


def test_the_key_finder_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The check above can fail: planted reads are found; writes, typed reads and other dictionaries are not."""
    planted = tmp_path / "tmas" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(
        "def f(record, item, rows):\n"
        '    x = record.state["transcript"]\n'
        "    state = item.state\n"
        '    y = state.get("pre"), "post" in item.state, record.model_dump()["answer"]\n'
        '    record.state["votes"] = 1\n'
        "    settings = config.model_dump()\n"
        '    return record.selected, rows["answer"], settings["method"], x, y\n'
    )
    found = {hit.split(" reads ")[1].split()[0] for hit in untyped_key_reads(planted)}
    assert found == {"'transcript'", "'pre'", "'post'", "'answer'"}


def record_queries(path: Path) -> list[str]:
    """String constants of a file that query (or parse) the tables of the stored records."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = " ".join(node.value.split()).upper()
            if any(f"FROM {table.upper()}" in text or f"INTO {table.upper()}" in text for table in TABLES):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_module_outside_the_store_queries_the_records() -> None:
    outside = [p for p in sorted(SRC.rglob("*.py")) if STORE not in p.parents]
    assert [hit for path in outside for hit in record_queries(path)] == []
    # The store's own parts do, so the finder finds them.
    assert record_queries(STORE / "result_table.py")


def tmas_imports(path: Path) -> list[str]:
    """The modules of TMAS's own (``tmas.methods.tmas``, ``tmas.methods.tmas_params``) a file imports."""
    inner = ("tmas.methods.tmas", "tmas.methods.tmas_params")
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n in inner]
    return sorted(set(found))


def test_rl_imports_nothing_of_tmas_insides() -> None:
    assert [hit for path in sorted((SRC / "rl").rglob("*.py")) for hit in tmas_imports(path)] == []


def test_the_import_finder_finds_one(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("from tmas.methods.tmas_params import TMASParams\nfrom tmas.methods import tmas\n")
    assert len(tmas_imports(planted)) == 2
