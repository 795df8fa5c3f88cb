"""The few-shot control of paper 003, Table 6: every problem gets k random solved exemplars (question and final
answer) prepended, so a method run on the result sees extra context but no distilled experience.

The exemplars come from a labelled split disjoint from the problems (an exemplar with the same id or the same question
is never used for its own problem); the draw is seeded per problem, so the file is reproducible.
"""

from __future__ import annotations

import random

from tmas.agents.templates import render
from tmas.errors import InputError
from tmas.problems import Problem, question_hash


def with_exemplars(problems: list[Problem], exemplars: list[Problem], k: int = 3, seed: int = 0) -> list[Problem]:
    labelled = [e for e in exemplars if e.answer is not None]
    if len(labelled) < k:
        raise InputError(f"few-shot needs at least {k} labelled exemplars, got {len(labelled)}")
    if k < 1:
        raise InputError(f"-k {k}: give at least 1 exemplar a problem")
    out = []
    for problem in problems:
        # Never itself, under its id or another (the same question twice in two files): matched by question too.
        own = question_hash(problem.question)
        pool = [e for e in labelled if e.problem_id != problem.problem_id and question_hash(e.question) != own]
        if len(pool) < k:
            raise InputError(f"problem {problem.problem_id}: fewer than {k} exemplars besides itself")
        chosen = random.Random(f"{seed}|{problem.problem_id}").sample(pool, k)
        question = render("fewshot_question.j2", exemplars=chosen, question=problem.question)
        metadata = {**problem.metadata, "few_shot": [e.problem_id for e in chosen]}
        out.append(problem.model_copy(update={"question": question, "metadata": metadata}))
    return out
