"""Labelled MATTRL cases read back from run directories: each finished problem's transcript, its gold answer and the
terminal outcome G of Eq. 12. Math: the final answer graded against gold by the evaluation harness (1 or 0).
Medicine: the reciprocal rank of the gold disease in the team's top-10 (1 at rank 1, 1/3 at rank 3, 0 when absent;
names matched by spelling as in ``tmas diagnosis grade``), so a near miss still earns part of the credit."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tmas.config import Settings
from tmas.errors import InputError
from tmas.eval.diagnosis import name_rank
from tmas.eval.grading import SELECTED, GradeConfig, GradeMode, grade_run
from tmas.memory.transcript import Transcript, Utterance
from tmas.problems import Problem
from tmas.store.run_store import RunStore, StoreError

# Utterance kinds a specialist speaks; the coordinator's meeting, report and decision are context, not team turns.
SPECIALIST_KINDS = ("opinion", "review")


@dataclass
class AgentTurn:
    """u_{i,t} of the paper: everything specialist ``agent`` said in turn ``turn`` (1-based), joined."""

    turn: int
    agent: str
    specialty: str
    text: str
    experience_ids: list[str] = field(default_factory=list)


@dataclass
class LabelledCase:
    run: str
    problem: Problem
    transcript: Transcript
    # G of Eq. 12 in [0, 1] (see the module's docstring).
    outcome: float

    @property
    def gold(self) -> str:
        return self.problem.answer or ""

    def turns(self) -> list[AgentTurn]:
        """The specialists' turns, in round then agent order; an agent's several utterances in a round are one turn."""
        specialties = {m.id: m.specialty for m in self.transcript.team}
        grouped: dict[tuple[int, str], list[Utterance]] = {}
        for u in self.transcript.utterances:
            if u.kind in SPECIALIST_KINDS and u.agent != "coordinator":
                grouped.setdefault((u.round, u.agent), []).append(u)
        out = []
        for (round_, agent), utterances in sorted(grouped.items()):
            text = "\n\n".join(_utterance_text(u) for u in utterances)
            ids = list(dict.fromkeys(i for u in utterances for i in u.experience_ids))
            out.append(AgentTurn(round_ + 1, agent, specialties.get(agent, ""), text, ids))
        return out

    @property
    def rounds(self) -> int:
        """R of Eq. 10: the turns the deliberation actually took."""
        return max((t.turn for t in self.turns()), default=0)


def _utterance_text(u: Utterance) -> str:
    if u.kind == "review" and u.target:
        return f"[review of {u.target}]\n{u.text}"
    return u.text


def transcript_of(records: list[dict[str, Any]], where: str) -> Transcript | None:
    """The problem's transcript from its iteration records (one per round; the last holds the decision).

    Each record's ``state["transcript"]`` may hold the whole discussion so far or only its round: utterances are
    merged across records without repeats, the team and final answer taken from the latest record that has them.
    """
    merged: Transcript | None = None
    seen: set[tuple[int, str, str, str | None, str]] = set()
    for record in records:
        raw = (record.get("state") or {}).get("transcript")
        if raw is None:
            continue
        try:
            part = Transcript.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(map(str, first["loc"]))
            raise InputError(
                f"{where}: iteration {record.get('iteration')}: bad transcript at {loc}: {first['msg']}"
            ) from None
        if merged is None:
            merged = part.model_copy(update={"utterances": []})
        if part.team:
            merged.team = part.team
        if part.final_answer is not None:
            merged.final_answer = part.final_answer
        for u in part.utterances:
            key = (u.round, u.agent, u.kind, u.target, u.text)
            if key not in seen:
                seen.add(key)
                merged.utterances.append(u)
    return merged


@dataclass
class GradedResult:
    """A finished, labelled problem of a run, its result record and whether its final answer was graded correct
    (undecided counts as wrong, as everywhere in the harness)."""

    problem: Problem
    result: dict[str, Any]
    correct: bool

    @property
    def records(self) -> list[dict[str, Any]]:
        return list(self.result["iterations"])


async def graded_results(
    run_dir: Path, settings: Settings | None, grade_mode: GradeMode, notes: list[str]
) -> list[GradedResult]:
    """The run's finished, labelled problems, graded by the evaluation harness (grades stored in the run and
    reused); what is skipped and why goes to ``notes``."""
    try:
        store = RunStore(run_dir, create=False)
    except StoreError as exc:
        raise InputError(str(exc)) from None
    out: list[GradedResult] = []
    with store:
        grades = await grade_run(store, GradeConfig(mode=grade_mode, judge_runs=1), settings)
        problems = {p.problem_id: p for p in store.problems()}
        for result in store.results():
            pid = result["problem_id"]
            problem = problems.get(pid)
            records = result.get("iterations") or []
            if problem is None or problem.answer is None:
                notes.append(f"{run_dir}: problem {pid}: no gold answer, skipped")
            elif result.get("status") != "done" or not records:
                notes.append(f"{run_dir}: problem {pid}: not finished, skipped")
            else:
                correct = grades.correct((pid, int(records[-1]["iteration"]), SELECTED), 0)
                out.append(GradedResult(problem, result, correct))
    return out


async def load_cases(
    run_dirs: list[Path],
    settings: Settings | None,
    *,
    grade_mode: GradeMode = "combined",
    notes: list[str],
) -> list[LabelledCase]:
    """The labelled, finished MATTRL problems of ``run_dirs``; what is skipped and why goes to ``notes``."""
    cases: list[LabelledCase] = []
    for run_dir in run_dirs:
        for graded in await graded_results(run_dir, settings, grade_mode, notes):
            problem, records = graded.problem, graded.records
            where = f"{run_dir}: problem {problem.problem_id}"
            transcript = transcript_of(records, where)
            if transcript is None:
                notes.append(f"{where}: no MATTRL transcript in its records, skipped")
                continue
            outcome = 1.0 if graded.correct else 0.0
            if transcript.domain == "medicine":
                top10 = ((records[-1].get("state") or {}).get("decision") or {}).get("top10") or []
                rank = name_rank([str(name) for name in top10], problem.answer or "")
                outcome = 1.0 / rank if rank else 0.0
            cases.append(LabelledCase(str(run_dir), problem, transcript, outcome))
    return cases
