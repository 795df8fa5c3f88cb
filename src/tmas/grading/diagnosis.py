"""Grading ranked differentials (MATTRL's medicine domain, paper 003 section 4 and A.5): the rank at which the
reference diagnosis appears in a run's top-10, by name match or by an LLM judge using the A.5 matching rules, and
the ranking metrics Hit@1/3/5/10 and MRR.

The ``diagnosis`` grader grades an iteration's selected answer by its decision's top-10 (the record's state): right
when the reference is ranked at all, wrong when not, undecided when the judge's reply could not be read; the rank
is kept in ``Grades.findings`` (with ``error`` saying why a judgement could not be read). Nothing is stored in the
grades table: ranks by spelling cost nothing, and the judge's calls replay from the run's store.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tmas.agents.templates import prompt
from tmas.grading.grader import GradingContext, StoredGrades, Verdicts
from tmas.grading.grades import SELECTED, GradeConfig, Item
from tmas.llm.model import ChatModel
from tmas.llm.sampling import retried
from tmas.llm.types import CallKey
from tmas.methods.state import MATTRLState

DIAGNOSIS = "diagnosis"
HITS = (1, 3, 5, 10)
_ANSWER = re.compile(r"<answer>\s*(No|\d{1,2})\s*</answer>", re.I)
_NON_WORD = re.compile(r"[^a-z0-9]+")


def _name_key(name: str) -> str:
    return _NON_WORD.sub(" ", name.lower()).strip()


def name_rank(predicted: Sequence[str], reference: str) -> int | None:
    """The first rank whose name equals one of the reference's names (`` | ``-separated), ignoring case and
    punctuation; None when none does."""
    wanted = {_name_key(n) for n in reference.split("|") if n.strip()}
    return next((i for i, name in enumerate(predicted[:10], start=1) if _name_key(name) in wanted), None)


class UnreadableJudgement(ValueError):
    """A judge reply without a valid ``<answer>No|1-10</answer>``."""


def parse_judge_rank(content: str, count: int = 10) -> int | None:
    """The judge's rank (1 to ``count``, the number of predictions it was shown), or None for "No"; raises
    :class:`UnreadableJudgement` otherwise."""
    found = _ANSWER.findall(content)
    if not found:
        raise UnreadableJudgement(f"judge reply has no <answer>No|1-{count}</answer>: {content[:120]!r}")
    if found[-1].lower() == "no":
        return None
    rank = int(found[-1])
    if not 1 <= rank <= count:
        raise UnreadableJudgement(f"judge rank {rank} is outside 1-{count}, the ranks it was shown")
    return rank


async def judge_rank(
    llm: ChatModel, problem_id: str, predicted: Sequence[str], reference: str, *, retries: int = 1
) -> tuple[int | None, str | None]:
    """The rank by the ``judge`` role (exact name matches skip the call); the second value says why a judgement
    could not be read (the rank is then None)."""
    by_name = name_rank(predicted, reference)
    if by_name is not None or not predicted:
        return by_name, None
    shown = list(predicted[:10])
    messages = prompt("judge_diagnosis.j2", predicted=shown, reference=reference)
    why = ""
    configured = llm.resolve_sampling("judge")
    for attempt in range(retries + 1):
        key = CallKey(problem_id=problem_id, role="judge", sample=attempt)
        reply = await llm.chat("judge", messages, key=key, sampling=retried(configured, attempt))
        if not reply.ok:
            why = f"judge call failed: {reply.error}"
            continue
        try:
            return parse_judge_rank(reply.content, len(shown)), None
        except UnreadableJudgement as exc:
            why = str(exc)
    return None, why


def ranking_metrics(ranks: Sequence[int | None]) -> dict[str, float]:
    """Hit@k = share of cases whose reference is within the top k; MRR = mean of 1/rank (0 when not ranked)."""
    n = len(ranks)
    if n == 0:
        return {**{f"hit@{k}": 0.0 for k in HITS}, "mrr": 0.0}
    metrics = {f"hit@{k}": sum(1 for r in ranks if r is not None and r <= k) / n for k in HITS}
    metrics["mrr"] = sum(1.0 / r for r in ranks if r is not None) / n
    return metrics


def top10(state: Mapping[str, Any]) -> list[str]:
    """The differential of a record (its MATTRL state's decision)."""
    decision = MATTRLState.model_validate(dict(state)).decision
    return list(decision.top10) if decision is not None else []


class DiagnosisGrader:
    name = DIAGNOSIS

    def runs(self, config: GradeConfig) -> int:
        return 1

    async def grade(self, items: Sequence[Item], context: GradingContext) -> Verdicts:
        """By spelling, or by the ``judge`` role where the context has its settings (one case at a time)."""
        ranked = [item for item in items if item.key[2] == SELECTED]
        settings = context.judge_settings
        if settings is None:
            found: list[tuple[int | None, str | None]] = [
                (name_rank(top10(item.state), item.problem.answer or ""), None) for item in ranked
            ]
        else:
            async with context.open_judge(settings) as llm:
                found = [
                    await judge_rank(llm, item.problem.problem_id, top10(item.state), item.problem.answer or "")
                    for item in ranked
                ]
        out: Verdicts = {item.key: [None] for item in items}
        for item, (rank, why) in zip(ranked, found, strict=True):
            context.grades.findings[item.key] = {"rank": rank, **({"error": why} if why else {})}
            out[item.key] = [None if why else rank is not None]
        return out

    def stored_runs(self, stored: StoredGrades) -> int:
        return 1  # recalled by spelling: nothing to have stored

    def recall(self, items: Sequence[Item], stored: StoredGrades, runs: int) -> Verdicts:
        return {item.key: [self.grade_one(item)] for item in items}

    def grade_one(self, item: Item) -> bool | None:
        if item.key[2] != SELECTED:
            return None
        return name_rank(top10(item.state), item.problem.answer or "") is not None
