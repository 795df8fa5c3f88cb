"""Run directories holding MATTRL-shaped results (transcripts in the iteration records), written through the run
store as the method writes them: the experience tests read them back like real runs."""

from __future__ import annotations

from pathlib import Path

from tmas.llm.types import Usage
from tmas.memory.transcript import TeamMember, Transcript, Utterance
from tmas.methods.base import Candidate, IterationRecord, ProblemResult
from tmas.problems import Problem
from tmas.store.run_store import RunStore


def write_run(
    run_dir: Path,
    cases: list[tuple[Problem, Transcript | None, str | None]],
    method: str = "mattrl",
    tokens: int = 0,
    last_state: dict[str, object] | None = None,
) -> Path:
    """One finished problem per case: a record per deliberation round, the transcript so far in each, the decision
    (``selected``) in the last. ``None`` as transcript: a single-agent result. ``tokens``: each problem's spend;
    ``last_state``: more state for each problem's last record (e.g. a medicine decision)."""
    with RunStore(run_dir) as store:
        store.add_problems([p for p, _, _ in cases])
        for problem, transcript, answer in cases:
            rounds = transcript.rounds if transcript is not None else 1
            records = []
            for r in range(rounds):
                state: dict[str, object] = {}
                if transcript is not None:
                    part = transcript.model_copy(
                        update={
                            "utterances": [u for u in transcript.utterances if u.round <= r],
                            "final_answer": transcript.final_answer if r == rounds - 1 else None,
                        }
                    )
                    state["transcript"] = part.model_dump(mode="json")
                if r == rounds - 1:
                    state.update(last_state or {})
                text = f"The answer is \\boxed{{{answer}}}." if answer is not None else ""
                records.append(
                    IterationRecord(
                        problem_id=problem.problem_id,
                        iteration=r,
                        candidates=[Candidate(index=0, text=text, answer=answer)],
                        selected=answer if r == rounds - 1 else None,
                        state=state,
                    )
                )
            result = ProblemResult(
                problem_id=problem.problem_id,
                method=method,
                answer=answer,
                iterations=records,
                usage=Usage(completion_tokens=tokens),
            )
            store.save_result(result)
    return run_dir


def hand_worked_transcript(problem_id: str = "p1") -> Transcript:
    """The transcript of tests/test_pool_credit.py: turn 1 with S1, S2, S3; turn 2 with S1, S2."""
    team = [
        TeamMember(id="S1", specialty="algebra", leader=True),
        TeamMember(id="S2", specialty="number theory"),
        TeamMember(id="S3", specialty="combinatorics"),
    ]
    u = [
        Utterance(round=0, agent="S1", kind="opinion", text="R1-S1 factor the product as 6 times 7", answer="42"),
        Utterance(round=0, agent="S2", kind="opinion", text="R1-S2 guess it is about 40", answer="40"),
        Utterance(round=0, agent="S3", kind="opinion", text="R1-S3 count the objects one by one", answer="41"),
        Utterance(round=0, agent="S2", kind="review", target="S1", text="R1-S2-review accept the factoring"),
        Utterance(round=0, agent="coordinator", kind="meeting", text="bulletin: S1 says 42"),
        Utterance(round=1, agent="S1", kind="opinion", text="R2-S1 verify 6*7 = 42 by repeated addition", answer="42"),
        Utterance(round=1, agent="S2", kind="opinion", text="R2-S2 agree with S1", answer="42"),
        Utterance(round=1, agent="coordinator", kind="decision", text="<final_answer>42</final_answer>", answer="42"),
    ]
    return Transcript(problem_id=problem_id, team=team, utterances=u, final_answer="42")
