"""Every selection rule replayed on a run's stored candidates: one run shows what each rule would have returned.

For each rule x pool (methods/selection.py) and each iteration t: per problem, the rule picks from the candidates of
iteration t (pool ``last``) or of iterations 0..t (pool ``all``), and the pick's grade is its accuracy. Problems are
counted as in metrics.py (a stopped one keeps its last iteration; one still mid-way only up to where it got).
Answers are grouped by value with ``classes`` (per problem, as the run's votes grouped them), and with ``fallback``
an iteration whose pool has no answer takes the earlier answer, as the run did (``answer_fallback``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tmas.grading.grades import Grades
from tmas.methods.base import Candidate
from tmas.methods.selection import SELECT_FROM, SELECT_RULES, SelectFrom, SelectRule, select_answered
from tmas.reports.metrics import labeled_results, reached


@dataclass
class SelectionTable:
    iterations: list[int] = field(default_factory=list)
    # (rule, candidates it selects from) -> accuracy per iteration in ``iterations``.
    accuracy: dict[tuple[SelectRule, SelectFrom], list[float]] = field(default_factory=dict)
    problems: list[int] = field(default_factory=list)


def has_scores(results: list[dict[str, Any]]) -> bool:
    return any(
        c.get("score") is not None for r in results for rec in r.get("iterations", []) for c in rec["candidates"]
    )


def selection_table(
    results: list[dict[str, Any]],
    grades: Grades,
    mode: str,
    *,
    classes: Mapping[str, Mapping[str, str]] | None = None,
    fallback: bool = False,
) -> SelectionTable:
    labeled = labeled_results(results, grades)
    # Per problem, each iteration's candidates (parsed once) and the iteration each candidate object came from.
    per_problem: dict[str, list[tuple[int, list[Candidate]]]] = {}
    origin: dict[int, int] = {}
    for result in labeled:
        rounds = []
        for record in result.get("iterations", []):
            cands = [Candidate.model_validate(c) for c in record["candidates"]]
            origin.update((id(c), int(record["iteration"])) for c in cands)
            rounds.append((int(record["iteration"]), cands))
        per_problem[result["problem_id"]] = rounds
    last = max((it for rounds in per_problem.values() for it, _ in rounds), default=-1)
    table = SelectionTable(iterations=list(range(last + 1)))
    for t in table.iterations:
        present = [r for r in labeled if reached(r, t)]
        table.problems.append(len(present))
        for rule in SELECT_RULES:
            for select_from in SELECT_FROM:
                hits = 0.0
                for result in present:
                    pid = result["problem_id"]
                    seen = [cands for it, cands in per_problem[pid] if it <= t]
                    own = (classes or {}).get(pid)
                    chosen, _ = select_answered(seen, select_from, mode, rule, own, fallback=fallback)
                    if chosen is not None:
                        key = (pid, origin[id(chosen)], chosen.index)
                        hits += grades.share_correct(key)
                table.accuracy.setdefault((rule, select_from), []).append(hits / max(1, len(present)))
    return table
