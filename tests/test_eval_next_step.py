"""``tmas eval`` stopped by a lost endpoint or a store that cannot be written says its next steps in one line, as
``tmas run`` and ``tmas sweep`` do: the resume that finishes the run, then the report the command would have written."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest

from conftest import isolate
from tmas.cli import main as cli
from tmas.llm.model import EndpointUnreachable
from tmas.llm.types import ChatRequest, Completion
from tmas.store.call_log import CallLog
from tmas.testing import SimScript, SimServer


def eval_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """The last line ``tmas ARGS`` writes to stderr, run in this process as the command line runs it."""
    monkeypatch.setattr(sys, "argv", ["tmas", *args])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 1
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("fault", "said"),
    [
        (sqlite3.OperationalError("database or disk is full"), "the run's store failed (database or disk is full)"),
        (EndpointUnreachable("the endpoint went away"), "the endpoint went away"),
    ],
)
def test_eval_stopped_by_its_store_or_endpoint_names_the_resume_then_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fault: Exception, said: str
) -> None:
    isolate(monkeypatch, tmp_path)
    problems = tmp_path / "p.jsonl"
    lines = [json.dumps({"problem_id": f"p{i}", "question": f"What is {i + 2}*7?", "answer": str((i + 2) * 7)})
             for i in range(2)]  # fmt: skip
    problems.write_text("\n".join(lines) + "\n")
    real_record = CallLog.record

    def record(log: CallLog, completion: Completion, request: ChatRequest) -> int:
        # The second problem's reply meets the fault as it is stored.
        if completion.key.problem_id == "p1":
            raise fault
        return real_record(log, completion, request)

    monkeypatch.setattr(CallLog, "record", record)
    out, report = tmp_path / "run", tmp_path / "rep"
    with SimServer(SimScript()) as sim:
        args = ["eval", str(problems), "-o", str(out), "--report-dir", str(report), "-m", "cot", "--grade", "rules"]
        line = eval_line(monkeypatch, capsys, [*args, "--base-url", sim.base_url, "--problems-in-flight", "1"])
    assert said in line and "\n" not in line
    written = " once it can be written" if "store" in said else ""
    assert line.endswith(
        f"continue with 'tmas run --resume {out}'{written}, then 'tmas report {out} -o {report} --grade rules'"
    ), line
