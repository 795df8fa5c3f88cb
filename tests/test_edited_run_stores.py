"""A run directory whose store was edited by hand (a value that is no longer JSON) is said by every command that reads
it in one line naming the run and what of it cannot be read (the setting, the problem, the call, the result), never
a traceback; the command writes nothing into it."""

from __future__ import annotations

import json
import re
import sqlite3
import sys
from pathlib import Path

import pytest

from conftest import isolate
from tmas.cli import main as cli
from tmas.testing import SimServer


def tmas_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The exit code and last line on stderr of ``tmas ARGS``, run in this process as the command line runs it."""
    monkeypatch.setattr(sys, "argv", ["tmas", *args])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    code = exited.value.code
    return (code if isinstance(code, int) else 0), err.strip().splitlines()[-1]


def finished_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sim: SimServer
) -> Path:
    """A finished run of two problems (p0, p1), each solved with one call."""
    isolate(monkeypatch, tmp_path)
    problems = tmp_path / "p.jsonl"
    lines = [json.dumps({"problem_id": f"p{i}", "question": f"What is {i + 2}*7?", "answer": str((i + 2) * 7)})
             for i in range(2)]  # fmt: skip
    problems.write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    code, _ = tmas_line(monkeypatch, capsys, "run", str(problems), "-o", str(run), "-m", "cot",
                        "--base-url", sim.base_url, "--yes")  # fmt: skip
    assert code == 0
    return run


def edit(run: Path, sql: str) -> None:
    db = sqlite3.connect(run / "run.sqlite")
    db.executescript(sql)
    db.close()


@pytest.mark.parametrize(
    ("sql", "said"),
    [
        (
            "UPDATE meta SET value = substr(value, 1, 40) WHERE key = 'settings'",
            "a stored setting is not JSON ('settings': ",
        ),
        (
            "UPDATE problems SET metadata = '{bad' WHERE problem_id = 'p1'",
            "problem 'p1': its stored metadata is not JSON (",
        ),
    ],
    ids=["setting", "problem-metadata"],
)
def test_a_stored_value_that_is_not_json_is_named(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    sim: SimServer,
    sql: str,
    said: str,
) -> None:
    # Before, report and resume ended in json's traceback.
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    edit(run, sql)
    for args in (
        ["report", str(run), "-o", str(tmp_path / "report"), "--grade", "rules"],
        ["run", "--resume", str(run), "--yes"],
    ):
        code, line = tmas_line(monkeypatch, capsys, *args)
        assert code == 2 and line.startswith(f"tmas: error: {run}: {said}"), line
    assert sim.stats().total_requests == 2


# A report reads no call's texts, and every call's retry causes (its cost table counts them); a resume that replays
# the call fails its problem (exit 3, the record's own line its reason), and one that counts the retry causes stops
# (exit 2).
@pytest.mark.parametrize(
    ("column", "value", "reported", "resumed"),
    [("text_parts", "substr(text_parts, 1, 30)", True, 3), ("retry_causes", "'['", False, 2)],
)
def test_a_stored_call_whose_json_column_is_not_json_is_named(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    sim: SimServer,
    column: str,
    value: str,
    reported: bool,
    resumed: int,
) -> None:
    # Before, 'tmas export --calls' ended in json's traceback, and a resume that replayed the call failed its problem
    # with json's words alone ("JSONDecodeError: Expecting value: line 1 column 31 (char 30)").
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    db = sqlite3.connect(run / "run.sqlite")
    [(call,)] = db.execute("SELECT id FROM calls WHERE problem_id = 'p1'").fetchall()
    db.close()
    edit(run, f"UPDATE calls SET {column} = {value} WHERE id = {call}")
    said = f"{run}: call {call}: its stored {column} is not JSON ("
    code, line = tmas_line(monkeypatch, capsys, "export", str(run), "--calls")
    assert code == 2 and line.startswith(f"tmas: error: {said}"), line
    code, line = tmas_line(monkeypatch, capsys, "report", str(run), "-o", str(tmp_path / "report"), "--grade", "rules")
    assert (code, line.startswith(f"tmas: error: {said}")) == ((0, False) if reported else (2, True)), line
    edit(run, "DELETE FROM results WHERE problem_id = 'p1'")
    code, line = tmas_line(monkeypatch, capsys, "run", "--resume", str(run), "--yes")
    assert code == resumed and said in line, line
    if resumed == 3:  # the failed problem's reason is the record's own line, not led by the exception's class name
        assert line.startswith(f"tmas: 1 of 2 problems failed: 1 x {said}"), line


def test_a_stored_result_that_is_not_json_is_named_by_a_resume(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sim: SimServer
) -> None:
    # Before: "tmas: error: a run store could not be read: malformed JSON" (SQLite's words: which run, which record?).
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    edit(run, "UPDATE results SET record = substr(record, 1, 50) WHERE problem_id = 'p0'")
    code, line = tmas_line(monkeypatch, capsys, "run", "--resume", str(run), "--yes")
    assert code == 2 and line.startswith(f"tmas: error: {run}: the result of problem 'p0': not JSON ("), line
    assert sim.stats().total_requests == 2


def test_a_stored_schema_version_that_is_not_json_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sim: SimServer
) -> None:
    # Before, every command that opened the store ended in json's traceback.
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    edit(run, "UPDATE meta SET value = 'x' WHERE key = 'schema_version'")
    said = f"tmas: error: {run / 'run.sqlite'}: not a readable run store (its schema version is not JSON: "
    for args in (["export", str(run)], ["run", "--resume", str(run), "--yes"]):
        code, line = tmas_line(monkeypatch, capsys, *args)
        assert code == 2 and line.startswith(said), line
    assert sim.stats().total_requests == 2


def test_a_store_damaged_past_its_opening_checks_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sim: SimServer
) -> None:
    # The page of the calls table overwritten (a disk's damage): the store opens, and the first read of its calls
    # fails. Before: "tmas: error: a run store could not be read: database disk image is malformed" (which run?).
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    db = sqlite3.connect(run / "run.sqlite")
    [(page,)] = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'calls'").fetchall()
    [(size,)] = db.execute("PRAGMA page_size").fetchall()
    db.close()
    assert not (run / "run.sqlite-wal").exists() or (run / "run.sqlite-wal").stat().st_size == 0
    with (run / "run.sqlite").open("r+b") as store:
        store.seek((page - 1) * size)
        store.write(b"\xff" * size)
    said = f"tmas: error: {run / 'run.sqlite'}: not a readable run store (database disk image is malformed)"
    for args in (
        ["report", str(run), "-o", str(tmp_path / "report"), "--grade", "rules"],
        ["run", "--resume", str(run), "--yes"],
        ["export", str(run), "--calls"],
    ):
        code, line = tmas_line(monkeypatch, capsys, *args)
        assert (code, line) == (2, said)
    assert sim.stats().total_requests == 2


@pytest.mark.parametrize(
    ("sql", "said"),
    [("UPDATE blobs SET data = x'00112233'", "cannot be read (ZstdError: "), ("DELETE FROM blobs", "is missing")],
)
def test_a_stored_text_that_cannot_be_read_is_named(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    sim: SimServer,
    sql: str,
    said: str,
) -> None:
    # Before, 'tmas export --calls' ended in zstandard's traceback, or in a KeyError's.
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    edit(run, sql)
    code, line = tmas_line(monkeypatch, capsys, "export", str(run), "--calls")
    assert code == 2 and re.fullmatch(rf"tmas: error: {re.escape(str(run))}: stored text \d+ {re.escape(said)}.*", line)


def test_a_report_names_a_run_directory_that_is_not_one_before_it_grades_any(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sim: SimServer
) -> None:
    # Before, the runs before it were graded first (a judge's calls sent) and the report then stopped at it.
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    (tmp_path / "empty").mkdir()
    for other in ("missing", "empty"):
        monkeypatch.setattr(
            sys,
            "argv",
            ["tmas", "report", str(run), str(tmp_path / other), "-o", str(tmp_path / "report"), "--grade", "rules"],
        )
        with pytest.raises(SystemExit) as exited:
            cli.main()
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"tmas: error: {tmp_path / other}: not a run directory (no run.sqlite)"]
    db = sqlite3.connect(run / "run.sqlite")
    assert db.execute("SELECT COUNT(*) FROM grades").fetchone() == (0,)
    db.close()


def test_stored_settings_that_are_not_a_table_are_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sim: SimServer
) -> None:
    # Before, a report ended in "AttributeError: 'int' object has no attribute 'get'", a resume said "bad value for
    # '': ...", of no key, and the viewer's runs page failed as a whole (its test: tests/test_view.py).
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    edit(run, "CREATE TABLE kept AS SELECT * FROM meta")
    for key, value, held in (("settings", "5", "5"), ("method", '["cot"]', '["cot"]')):
        restore = "UPDATE meta SET value = (SELECT value FROM kept WHERE kept.key = meta.key)"
        edit(run, f"{restore}; UPDATE meta SET value = '{value}' WHERE key = '{key}'")
        said = f"tmas: error: {run}: a stored setting is not a table ({key!r} holds {held})"
        for args in (
            ["report", str(run), "-o", str(tmp_path / "report"), "--grade", "rules"],
            ["run", "--resume", str(run), "--yes"],
        ):
            code, line = tmas_line(monkeypatch, capsys, *args)
            assert (code, line) == (2, said)


def test_a_report_refuses_a_run_given_twice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sim: SimServer
) -> None:
    # Before, it was graded twice and reported as two runs, its two columns of one run.
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    again = tmp_path / "run" / ".." / "run"
    args = ["report", str(run), str(again), "-o", str(tmp_path / "report"), "--grade", "rules"]
    code, line = tmas_line(monkeypatch, capsys, *args)
    assert (code, line) == (2, f"tmas: error: run directory given twice: {run.resolve()}")
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("spelled", ["run", "run/../run", "other"])
def test_a_report_refuses_to_be_written_into_a_run_directory_before_it_grades(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, sim: SimServer, spelled: str
) -> None:
    # Before, report.md, report.html and the plots were written among the run's own files (its store beside them).
    run = finished_run(monkeypatch, capsys, tmp_path, sim)
    if spelled == "other":  # another run's directory, not one of those reported
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "run.sqlite").write_bytes((run / "run.sqlite").read_bytes())
    given = tmp_path / spelled
    before = sorted(p.name for p in given.iterdir())
    code, line = tmas_line(monkeypatch, capsys, "report", str(run), "-o", str(given), "--grade", "rules")
    held = run if spelled != "other" else given
    assert (code, line) == (
        2,
        f"tmas: error: --out {given} is the run directory {held}: a report is not written among a run's files"
        f" (choose another, such as {held / 'report'})",
    )
    assert sorted(p.name for p in given.iterdir()) == before
    db = sqlite3.connect(run / "run.sqlite")
    assert db.execute("SELECT COUNT(*) FROM grades").fetchone() == (0,)
    db.close()
    code, _ = tmas_line(monkeypatch, capsys, "report", str(run), "-o", str(run / "report"), "--grade", "rules")
    assert code == 0 and (run / "report" / "report.md").is_file()  # where 'tmas eval' writes a run's report
