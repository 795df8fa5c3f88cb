"""Default simulated replies for the baselines' own roles: ``refiner``, ``corrector``, ``synthesis`` (write a
solution to the ``<problem>`` section, as the solution role does) and ``distiller`` (RSE's JSON of propositions and
pitfalls read off the ``<attempt>``).

Deterministic given the request body, like every responder. The solution roles answer the problem section alone,
so a number quoted from an earlier attempt elsewhere in the prompt never becomes the question.
"""

from __future__ import annotations

import json
from dataclasses import replace

from tmas.answers import last_boxed
from tmas.testing.responders import SimRequest, evaluate_expression, register_responder, solution_responder
from tmas.testing.tmas_responders import expected_answer, tag


@register_responder("refiner", "corrector", "synthesis")
def solve_problem_section(req: SimRequest) -> str:
    """A worked solution of the prompt's ``<problem>`` (the whole prompt when it has none)."""
    problem = tag(req.question, "problem") or req.question
    only_problem = replace(req, messages=[{"role": "user", "content": problem}])
    return "## Feedback\n- Rechecked every step.\n\n## Solution\n" + solution_responder(only_problem)


@register_responder("distiller")
def distiller_responder(req: SimRequest) -> str:
    """A checked proposition when the attempt's answer is right, a pitfall when it is wrong or missing."""
    problem, attempt = tag(req.question, "problem"), tag(req.question, "attempt")
    found = evaluate_expression(problem)
    answer, expected = last_boxed(attempt), expected_answer(problem)
    propositions: list[str] = []
    pitfalls: list[str] = []
    if found is not None:
        propositions.append(f"The quantity to compute is the expression {found[0]}.")
    if answer is None:
        pitfalls.append("An attempt ended without a boxed final value; always finish with one.")
    elif expected is not None and answer.replace(" ", "") == expected:
        propositions.append(
            f"Carrying out the operations of {found[0] if found else 'the expression'} step by step gives {answer}."
        )
    else:
        pitfalls.append(f"One attempt slipped in the last operation and reached {answer}; redo that step.")
    return "```json\n" + json.dumps({"propositions": propositions, "pitfalls": pitfalls}) + "\n```"
