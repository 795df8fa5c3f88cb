"""Default simulated replies for TMAS's verifier, summary, experience and guideline roles.

They read the TMAS prompts (``tmas_*.j2``) the way a model would, by their tagged sections, and answer in the format
each prompt asks for. Everything is a pure function of the request, so replies are deterministic given the request
body (seed included). They vary believably: on a computable question the verifier checks the candidate's boxed
answer (right: 1, sometimes 0.5 for a "minor gap"; wrong or missing: 0), so selection has something to select.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from tmas.answers import last_boxed
from tmas.testing.responders import (
    SimRequest,
    evaluate_expression,
    format_number,
    register_responder,
    stable_hash,
)

# A rollout's mean verifier score is shown beside it unless the run shows rollouts as (c, s) alone (show_scores off).
_ROLLOUT = re.compile(
    r'<(?:rollout|attempt) number="(\d+)"(?: mean_verifier_score="([^"]*)")?>(.*?)</(?:rollout|attempt)>', re.S
)
_VERIFICATION = re.compile(r'<verification number="(\d+)" score="([^"]*)">', re.S)
_ENTRY = re.compile(r"^\[(E\d+)\] (anchor|heuristic)(?: / \w+)?: (.*)$", re.M)
_STRATEGY = re.compile(r"^- \[(G\d+)\] (.*)$", re.M)

STRATEGIES = (
    "Evaluate the expression directly, following the usual order of operations.",
    "Split each factor into tens and units and add up the partial products.",
    "Start from a rough estimate and correct it with exact arithmetic.",
    "Set up an equation for the unknown quantity and solve it step by step.",
    "Work out small cases first and generalise the pattern they show.",
)


def tag(text: str, name: str) -> str:
    """The content of the first ``<name ...>...</name>`` section of ``text`` ('' when there is none)."""
    match = re.search(rf"<{name}(?:\s[^>]*)?>\n?(.*?)\n?</{name}>", text, re.S)
    return match.group(1).strip() if match else ""


def expected_answer(problem: str) -> str | None:
    found = evaluate_expression(problem)
    return None if found is None else format_number(found[1])


# The score-first prompt (tmas_verify_score.j2) asks for one digit: 2 / 1 / 0 for 1 / 0.5 / 0.
_SCORE_FIRST = "Reply with the grade first"
_DIGIT = {"1": "2", "0.5": "1", "0": "0"}


@register_responder("verifier")
def verifier_responder(req: SimRequest) -> str:
    """An analysis and a ``Score:`` line on the 1 / 0.5 / 0 scale; for the score-first prompt, the ``Score:`` line
    first, on its one-digit scale, then the analysis."""
    text = req.question
    answer = last_boxed(tag(text, "solution"))
    expected = expected_answer(tag(text, "problem"))
    rng = random.Random(req.sample_key)
    if answer is None:
        analysis, score = "The solution never states a final answer in a box, so it is incomplete.", "0"
    elif expected is not None and answer.replace(" ", "") != expected:
        analysis = (
            f"Redoing the computation gives {expected}, not {answer}. "
            "The final step contains an arithmetic slip; this is a fatal error."
        )
        score = "0"
    elif expected is not None:
        if rng.random() < 0.15:
            analysis, score = "The result is right, but one intermediate step is stated without justification.", "0.5"
        else:
            analysis, score = f"Every step checks out and the final value {answer} is correct.", "1"
    else:
        score = rng.choice(("1", "1", "0.5", "0"))
        analysis = {
            "1": "Each step follows from the previous one and all cases are covered.",
            "0.5": "The approach is sound, but one case is only sketched.",
            "0": "A key step assumes what it should prove; this is a fatal error.",
        }[score]
    if _SCORE_FIRST in text:
        return f"Score: {_DIGIT[score]}\n{analysis}"
    return f"## Analysis\n{analysis}\n\n## Score\nScore: {score}"


@register_responder("summary")
def summary_responder(req: SimRequest) -> str:
    """Validated steps / remaining flaws / verdict, from the verification scores in the prompt."""
    text = req.question
    scores = [score for _, score in _VERIFICATION.findall(text)]
    answer = last_boxed(tag(text, "solution"))
    good = sum(s == "1" for s in scores)
    validated = ["- The setup of the problem is restated correctly."]
    flaws: list[str] = []
    if good:
        validated.append(f"- {good} of {len(scores)} verifiers confirmed the final value {answer}.")
    if any(s == "0" for s in scores):
        flaws.append(f"- Verifiers found a fatal error in the final computation (value {answer}).")
    if any(s == "0.5" for s in scores):
        flaws.append("- One intermediate step is stated without justification.")
    verdict = "The solution is correct." if scores and good == len(scores) else "The solution needs repair."
    return (
        "## Validated Steps\n"
        + "\n".join(validated)
        + "\n\n## Remaining Flaws\n"
        + ("\n".join(flaws) or "- none found")
        + f"\n\n## Verdict\n{verdict}"
    )


def _rollouts(text: str) -> list[tuple[int, float, str | None, str]]:
    """(number, mean score, boxed answer, solution text) of each rollout in the prompt; a rollout shown without its
    score is judged by its verification summary, as a model reads it."""
    out = []
    for number, score, body in _ROLLOUT.findall(tag(text, "rollouts") or text):
        solution = tag(body, "solution")
        try:
            value = float(score) if score else _summary_score(tag(body, "verification_summary"))
        except ValueError:
            value = 0.0
        out.append((int(number), value, last_boxed(solution), solution))
    return out


def _summary_score(summary: str) -> float:
    """The score a verification summary reports in words: 1 for a correct solution, 0 for a fatal error, else 0.5."""
    verdict = summary.lower()
    if "fatal error" in verdict:
        return 0.0
    return 1.0 if "solution is correct" in verdict else 0.5


@register_responder("experience")
def experience_responder(req: SimRequest) -> str:
    """KEEP what still holds, DELETE heuristics a verified answer contradicts, ADD anchors and heuristics."""
    text = req.question
    rollouts = _rollouts(text)
    confirmed = {answer for _, score, answer, _ in rollouts if answer is not None and score >= 0.75}
    ops: list[dict[str, Any]] = []
    for entry_id, kind, content in _ENTRY.findall(tag(text, "experience_bank")):
        contradicted = kind == "heuristic" and any(f"value {a}:" in content for a in confirmed)
        ops.append({"op": "DELETE" if contradicted else "KEEP", "id": entry_id})
    best = max(rollouts, key=lambda r: (r[1], -r[0]), default=None)
    if best is not None and best[2] is not None and best[1] >= 0.75:
        ops.append(
            {
                "op": "ADD",
                "kind": "anchor",
                "subtype": "intermediate_result",
                "content": f"The verifiers confirmed the final value {best[2]}; every step of that computation holds.",
            }
        )
    for _, score, answer, _ in rollouts:
        if answer is None:
            content = "Always finish with the final value in a box: an attempt without one scores zero."
        elif score == 0 and answer not in confirmed:
            content = f"Avoid the slip that produced the value {answer}: the verifiers marked it as a fatal error."
        else:
            continue
        ops.append({"op": "ADD", "kind": "heuristic", "content": content})
    return "```json\n" + json.dumps({"operations": ops}, indent=1) + "\n```"


@register_responder("guideline")
def guideline_responder(req: SimRequest) -> str:
    """One verdict per rollout: its strategy (picked by its solution text), new (1), already logged (0, its id) or
    the same as an earlier rollout's new one (0, "R" and that rollout's number), as the prompt asks."""
    text = req.question
    logged = {description: sid for sid, description in _STRATEGY.findall(tag(text, "attempted_strategies"))}
    verdicts = []
    for number, _, _, solution in _rollouts(text):
        strategy = STRATEGIES[stable_hash(solution) % len(STRATEGIES)]
        if strategy in logged:
            verdicts.append({"rollout": number, "strategy": strategy, "novelty": 0, "same_as": logged[strategy]})
        else:
            verdicts.append({"rollout": number, "strategy": strategy, "novelty": 1, "same_as": None})
            logged[strategy] = f"R{number}"
    return "```json\n" + json.dumps({"rollouts": verdicts}, indent=1) + "\n```"
