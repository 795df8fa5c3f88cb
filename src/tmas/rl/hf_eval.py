"""Chain-of-thought accuracy of a model in-process with transformers: the before/after measure of an RL run where no
inference server runs.

Each problem is asked once with CoT's prompt (TMAS's generation prompt, the ``concise`` layout the embedded model
uses) and graded as the rewards grade (:func:`tmas.rl.scoring.is_correct`: the last ``\\boxed{}``, the ``rules``
grader). The summary gives accuracy with its standard error, the share of replies with no boxed answer and the
share cut at the token limit; :func:`paired_difference` compares two models on the same problems.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from tmas.agents.solution import generation_prompt
from tmas.agents.style import Style
from tmas.problems import Problem
from tmas.rl.hf_generate import GenerationSettings, generate
from tmas.rl.scoring import completion_answer, is_correct


class ProblemOutcome(BaseModel):
    problem_id: str
    answer: str | None
    gold: str
    correct: bool
    cut: bool
    tokens: int
    completion: str


class EvalSummary(BaseModel):
    label: str
    settings: GenerationSettings
    problems: int
    correct: int
    accuracy: float
    stderr: float
    no_answer_rate: float
    cut_rate: float
    mean_tokens: float


class PairedDifference(BaseModel):
    """``after`` minus ``before`` on the same problems: the mean of per-problem differences and its standard error."""

    problems: int
    difference: float
    stderr: float
    gained: int
    lost: int


def proportion_stderr(successes: int, n: int) -> float:
    """Standard error of a proportion p = successes / n: sqrt(p (1 - p) / n) (the binomial one)."""
    if n <= 0:
        return 0.0
    p = successes / n
    return math.sqrt(p * (1 - p) / n)


def paired_difference(before: Sequence[bool], after: Sequence[bool]) -> PairedDifference:
    """d_i = after_i - before_i in {-1, 0, 1}; mean d and its standard error s_d / sqrt(n), s_d the sample standard
    deviation (n - 1). Pairing removes the problems' own difficulty from the comparison."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} and {len(after)} outcomes: a paired comparison needs the same problems")
    n = len(before)
    diffs = [int(a) - int(b) for b, a in zip(before, after, strict=True)]
    mean = sum(diffs) / n if n else 0.0
    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return PairedDifference(
        problems=n,
        difference=mean,
        stderr=math.sqrt(variance / n) if n else 0.0,
        gained=diffs.count(1),
        lost=diffs.count(-1),
    )


def summarize(label: str, settings: GenerationSettings, outcomes: Sequence[ProblemOutcome]) -> EvalSummary:
    n = len(outcomes)
    correct = sum(o.correct for o in outcomes)
    return EvalSummary(
        label=label,
        settings=settings,
        problems=n,
        correct=correct,
        accuracy=correct / n if n else 0.0,
        stderr=proportion_stderr(correct, n),
        no_answer_rate=sum(o.answer is None for o in outcomes) / n if n else 0.0,
        cut_rate=sum(o.cut for o in outcomes) / n if n else 0.0,
        mean_tokens=sum(o.tokens for o in outcomes) / n if n else 0.0,
    )


def cot_messages(problem: Problem, style: Style = "concise") -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in generation_prompt(problem.question, "numeric", style)]


def evaluate(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    settings: GenerationSettings,
    label: str,
    style: Style = "concise",
) -> tuple[list[ProblemOutcome], EvalSummary]:
    labeled = [p for p in problems if p.labeled]
    completions = generate(model, tokenizer, [cot_messages(p, style) for p in labeled], settings)
    outcomes = []
    for problem, completion in zip(labeled, completions, strict=True):
        assert problem.answer is not None
        outcomes.append(
            ProblemOutcome(
                problem_id=problem.problem_id,
                answer=completion_answer(completion.text),
                gold=problem.answer,
                correct=is_correct(completion.text, problem.answer, question=problem.question),
                cut=completion.cut,
                tokens=completion.tokens,
                completion=completion.text,
            )
        )
    return outcomes, summarize(label, settings, outcomes)
