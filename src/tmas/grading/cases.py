"""Grading a run of MATTRL's medicine or education cases by the domain's own metrics (``tmas cases grade``).

Medicine: the rank of the gold disease in the team's final top-10, by spelling or by the ``judge`` role (A.5 rules),
then Hit@1/3/5/10 and MRR. Education: the student's pre- and post-test answers, then Acc_pre, Acc_post and their
delta. Only problems with a gold answer count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tmas.config import Settings
from tmas.grading.diagnosis import judge_rank, name_rank, ranking_metrics
from tmas.grading.teaching import teaching_metrics
from tmas.llm.factory import open_model
from tmas.store.run_store import RunStore

# The domains whose runs are graded by their own metrics, not by the answer alone.
CASE_DOMAINS = ("medicine", "education")


@dataclass
class CaseGrades:
    """One row per graded case (in the run's order) and the metrics over them (with ``cases``, their count)."""

    rows: list[dict[str, Any]]
    metrics: dict[str, Any]


async def grade_cases(run_dir: Path, judge: Settings | None = None) -> CaseGrades:
    """Grade the run in ``run_dir``; with ``judge`` settings, medicine names are matched by the judge role (its
    calls are kept in the run's own store), else by spelling."""
    with RunStore(run_dir, create=False) as store:
        answers = {p.problem_id: p.answer for p in store.iter_problems()}
        results = [r for r in store.results() if answers.get(r["problem_id"])]
        states = [last_state(r) for r in results]
        if any("pre" in s for s in states):
            rows = [
                {
                    "problem_id": r["problem_id"],
                    "pre": s.get("pre"),
                    "post": s.get("post"),
                    "pre_correct": bool(s.get("pre_correct")),
                    "post_correct": bool(s.get("post_correct")),
                }
                for r, s in zip(results, states, strict=True)
            ]
            return CaseGrades(rows, {"cases": len(rows), **teaching_metrics(rows)})
        cases = [
            (r["problem_id"], final_top10(s), answers[r["problem_id"]] or "")
            for r, s in zip(results, states, strict=True)
        ]
        if judge is None:
            ranked: list[tuple[int | None, str | None]] = [(name_rank(top, gold), None) for _, top, gold in cases]
        else:
            async with open_model(judge, store, log_dir=run_dir) as llm:
                ranked = [await judge_rank(llm, pid, top, gold) for pid, top, gold in cases]
    rows = [
        {"problem_id": pid, "rank": rank, **({"error": why} if why else {})}
        for (pid, _, _), (rank, why) in zip(cases, ranked, strict=True)
    ]
    return CaseGrades(rows, {"cases": len(cases), **ranking_metrics([rank for rank, _ in ranked])})


async def case_metrics(run_dir: Path, params: dict[str, Any], judge: Settings | None) -> dict[str, Any] | None:
    """The domain's metrics of a run of a case domain (``domain`` in its method parameters), with ``cases``, their
    count; None for a run of any other domain, or with no graded case."""
    if params.get("domain") not in CASE_DOMAINS:
        return None
    graded = await grade_cases(run_dir, judge)
    return graded.metrics if graded.rows else None


def last_state(result: dict[str, Any]) -> dict[str, Any]:
    """The state of a result's last iteration record (empty when it has none)."""
    iterations = result.get("iterations") or []
    state = iterations[-1].get("state", {}) if iterations else {}
    return state if isinstance(state, dict) else {}


def final_top10(state: dict[str, Any]) -> list[str]:
    """The final differential of a result (its last record's decision)."""
    decision = state.get("decision") or {}
    return [str(name) for name in decision.get("top10", [])]
