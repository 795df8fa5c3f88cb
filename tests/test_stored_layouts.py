"""Runs stored by earlier versions read through the same typed records as runs stored now
(``tmas.store.records``): the store's reader validates them, a field added since reads at its default, an old name
reads under the current one, and a record that no layout reads is a one-line error naming the run and the problem.

The layouts: the run of ``data/pre_seam_tmas_run.sql`` (schema 1: no summaries; tallies under the old ``fallback``
name; no stored selection), a result as the first version wrote it (no counters, notices, fallback, budget or
online-stop fields; an extraction then called ``fallback``), and the old names of ``tests/test_stored_names.py``
in a result written through the store.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from conftest import run_tmas
from tmas.config import Settings
from tmas.grading.grades import SELECTED, Grades
from tmas.methods.rse import RSEState
from tmas.methods.state import FallbackState, TMASState
from tmas.reports.selection_table import chosen_accuracy
from tmas.store.records import (
    CandidateMeta,
    Fallback,
    IterationRecord,
    ProblemResult,
    ReplyTally,
    UnreadableRecord,
    VerificationRecord,
)
from tmas.store.run_store import SCHEMA_VERSION, RunStore

DUMP = Path(__file__).parent / "data" / "pre_seam_tmas_run.sql"
SUMMARY = (
    "## Validated Steps\n- The setup of the problem is restated correctly.\n- 1 of 1 verifiers confirmed the final"
    " value 391.\n\n## Remaining Flaws\n- none found\n\n## Verdict\nThe solution is correct."
)


def pre_seam_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.executescript(DUMP.read_text(encoding="utf-8"))
    db.close()
    return run_dir


def check_pre_seam_result(result: ProblemResult) -> None:
    """The values of the dump's one result, read off its JSON by hand."""
    assert (result.problem_id, result.method, result.answer, result.status) == ("a", "tmas", "391", "done")
    assert (result.calls, result.usage.prompt_tokens, result.usage.completion_tokens) == (8, 3560, 352)
    assert result.fingerprint == "4f94a285a611aa0a" and result.fallback is None and result.notices == []
    [record] = result.iterations
    assert record.selected == "391" and record.selection is None  # stored before selections were
    assert [c.meta for c in record.candidates] == [
        CandidateMeta(
            mode="generate",
            prompt="generate",
            extraction="boxed",
            verifications=[VerificationRecord(score=1.0, call_id=verifier)],
            summary=SUMMARY,
            summary_call_id=summary,
        )
        for verifier, summary in ((2, 4), (5, 6))
    ]
    # Tallies stored under the old name of ``stated``: 0 of them.
    assert record.replies["solution"] == ReplyTally(replies=2) and record.replies["experience"] == ReplyTally(replies=1)
    state = TMASState.model_validate(record.state)
    assert [e.id for e in state.experience_bank.entries] == ["E1"] and state.experience_update["status"] == "applied"


def test_the_pre_seam_run_reads_as_typed_records_read_only_and_after_its_migration(tmp_path: Path) -> None:
    run_dir = pre_seam_run(tmp_path)
    with RunStore(run_dir, read_only=True) as reader:
        [result] = reader.results()
        check_pre_seam_result(result)
        assert reader.result("a") == result and reader.iterations("a") == result.iterations
        # No summary stored yet: summarized as it is read (the texts left out).
        [(pid, _, summary)] = list(reader.result_summaries())
        assert pid == "a" and summary.text == "" and summary.answer == "391"
        assert [c.text for c in summary.iterations[0].candidates] == ["", ""]
    with RunStore(run_dir, create=False) as store:
        assert store.get_meta("schema_version") == SCHEMA_VERSION
        [result] = store.results()
        check_pre_seam_result(result)
        [(_, _, stored)] = list(store.result_summaries())
        assert stored == summary


def test_an_old_run_without_stored_selections_reports_the_answer_it_returned(tmp_path: Path) -> None:
    """The report's row of the run's own rule reads, for a record with no stored selection, the grade of the answer
    the run returned after the iteration (its ``selected``), never a rule run again."""
    with RunStore(pre_seam_run(tmp_path), read_only=True) as reader:
        [result] = reader.results()
    right = {("a", 0, 0): [True], ("a", 0, 1): [True]}
    assert chosen_accuracy(result, 0, Grades(runs=1, verdicts={**right, ("a", 0, SELECTED): [True]})) == 1.0
    # Graded wrong as returned (as a judge may), right as candidates: the row follows what was returned.
    assert chosen_accuracy(result, 0, Grades(runs=1, verdicts={**right, ("a", 0, SELECTED): [False]})) == 0.0


# A result as the first version stored it (its ProblemResult, IterationRecord and Candidate fields only; usage
# without cached tokens), with an extraction under its old name.
FIRST_LAYOUT = {
    "problem_id": "p",
    "method": "self_refine",
    "answer": "12",
    "text": "so \\boxed{12}",
    "status": "done",
    "error": None,
    "stopped_reason": None,
    "iterations": [
        {
            "problem_id": "p",
            "iteration": 0,
            "candidates": [
                {
                    "index": 0,
                    "text": "so \\boxed{12}",
                    "answer": "12",
                    "score": None,
                    "call_id": 1,
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "reasoning_tokens": 0, "estimated": False},
                    "finish_reason": "stop",
                    "error": None,
                    "meta": {"prompt": "generate", "extraction": "fallback"},
                }
            ],
            "selected": "12",
            "calls": 1,
            "failed_calls": 0,
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "reasoning_tokens": 0, "estimated": False},
            "state": {},
            "notes": [],
        }
    ],
    "calls": 1,
    "failed_calls": 0,
    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "reasoning_tokens": 0, "estimated": False},
}


def stored_raw(run_dir: Path, record: dict[str, object] | str, problem_id: str = "p") -> None:
    """``record`` written into the results table as an earlier version wrote it (no summary beside it)."""
    with RunStore(run_dir) as store:
        store._db.execute("INSERT INTO problems (position, problem_id, question) VALUES (0, ?, 'Q')", (problem_id,))
        text = record if isinstance(record, str) else json.dumps(record)
        store._db.execute(
            "INSERT INTO results (problem_id, status, record, finished_at) VALUES (?, 'done', ?, 1.0)",
            (problem_id, text),
        )
        store._db.commit()


def test_a_result_of_the_first_layout_reads_with_the_fields_added_since_at_their_defaults(tmp_path: Path) -> None:
    stored_raw(tmp_path / "run", FIRST_LAYOUT)
    with RunStore(tmp_path / "run", read_only=True) as reader:
        [result] = reader.results()
    assert (result.counters, result.fallback, result.notices, result.budget_drawn) == ({}, None, [], 0)
    assert (result.stopped_traces, result.stopped_tokens_saved, result.fingerprint) == (0, 0, None)
    assert result.usage.cached_prompt_tokens == 0
    [record] = result.iterations
    assert record.replies == {} and record.selection is None and record.state == {}
    [candidate] = record.candidates
    assert candidate.meta == CandidateMeta(prompt="generate", extraction="stated") and candidate.confidence is None


def test_the_old_names_in_a_stored_result_read_as_the_current_ones(tmp_path: Path) -> None:
    fallback = {"iteration": 0, "candidate": 1, "answer": "9", "reason": "no answered candidate in the last iteration"}
    layout = json.loads(json.dumps(FIRST_LAYOUT))
    layout["fallback"] = fallback
    record = layout["iterations"][0]
    record["replies"] = {"solution": {"replies": 3, "unusable": 1, "fallback": 2}}
    record["state"] = {"answer_fallback": fallback}
    stored_raw(tmp_path / "run", layout)
    with RunStore(tmp_path / "run", read_only=True) as reader:
        [result] = reader.results()
    expected = Fallback(iteration=0, candidate=1, answer="9", reason="no answered candidate in the last iteration")
    assert result.fallback == expected
    assert result.iterations[0].replies["solution"] == ReplyTally(replies=3, unusable=1, stated=2)
    assert FallbackState.model_validate(result.iterations[0].state).answer_fallback == expected
    # Written back under the current names.
    written = result.model_dump(mode="json")
    assert written["iterations"][0]["replies"]["solution"]["stated"] == 2
    assert written["iterations"][0]["candidates"][0]["meta"] == {"prompt": "generate", "extraction": "stated"}


@pytest.mark.parametrize(
    ("stored", "says"),
    [("{", "not JSON"), (json.dumps({"problem_id": "p"}), "unreadable at method: Field required")],
)
def test_a_record_no_layout_reads_is_one_line_naming_the_run_and_problem(
    tmp_path: Path, stored: str, says: str
) -> None:
    stored_raw(tmp_path / "run", stored)
    with RunStore(tmp_path / "run", read_only=True) as reader, pytest.raises(UnreadableRecord) as caught:
        reader.results()
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'run'}: the result of problem 'p': ") and says in message
    assert "\n" not in message


@pytest.mark.parametrize("command", ["export", "report"])
def test_a_record_no_layout_reads_is_said_by_the_commands_in_that_line(tmp_path: Path, command: str) -> None:
    stored_raw(tmp_path / "run", json.dumps({"problem_id": "p"}))
    with RunStore(tmp_path / "run") as store:
        store.set_meta("settings", Settings().model_dump(mode="json"))  # a run that began
    given = ["-o", str(tmp_path / "report"), "--grade", "rules"] if command == "report" else []
    out = run_tmas(command, str(tmp_path / "run"), *given, text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"tmas: error: {tmp_path / 'run'}: the result of problem 'p': unreadable at method: Field required"
    )


def test_an_iteration_record_round_trips_through_the_store(tmp_path: Path) -> None:
    record = IterationRecord(
        problem_id="p",
        iteration=0,
        candidates=[],
        selected="1",
        state={"samples": 1},
        replies={"solution": ReplyTally(replies=1)},
    )
    with RunStore(tmp_path / "run") as store:
        store.save_iteration(record)
        assert store.iterations("p") == [record]


def test_an_rse_distillation_stored_before_its_refused_count_reads_with_none_refused() -> None:
    # An RSE record's state as runs stored it before the count of distillations the budget refused existed.
    stored = {"distilled": 2, "added": 3, "duplicates": 1, "dropped_old": 0, "similarity": "embedding"}
    distill = RSEState.model_validate({"distill": stored}).distill
    assert distill is not None and (distill.distilled, distill.refused) == (2, 0)
