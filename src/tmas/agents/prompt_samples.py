"""Sample contexts for the prompt templates: for each top-level template, the variables its role renders it with,
as values of the same shapes (strings, numbers, lists of the objects the agents pass, None where a role passes none).

Used only to check a user's override template before a run (:func:`tmas.agents.overrides.check_overrides` renders
it once with each context, so a missing attribute or a wrong index fails at start, not on every problem), never to
build a prompt sent to a model. Every template is rendered in each branch a run can take from problem to problem
(a member or none, a bank or none, a first round or a later one) and in each mode, style and domain.
"""

from __future__ import annotations

from typing import Any

from tmas.agents.guideline_judge import StrategyView
from tmas.agents.mattrl_teaching import Turn
from tmas.agents.rollouts import RolloutView
from tmas.agents.summary import VerificationView
from tmas.agents.utterance_judge import DialogueTurn, RoundView, TurnView
from tmas.memory.experience_bank import ExperienceBank, ExperienceEntry
from tmas.memory.guideline_bank import GuidelineBank, Strategy
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import TeamMember
from tmas.problems import Problem

Context = dict[str, Any]

MODES = ("numeric", "proof")
STYLES = ("paper", "concise")
DOMAINS = ("math", "medicine", "education")
TEXT = "sample text"


def _each(base: Context, **choices: tuple[Any, ...]) -> list[Context]:
    """``base`` once per value of each choice (one choice varied at a time, the others at their first value)."""
    first = {key: values[0] for key, values in choices.items()}
    out = [{**base, **first}]
    for key, values in choices.items():
        out += [{**base, **first, key: value} for value in values[1:]]
    return out


def _contexts() -> dict[str, list[Context]]:
    rollouts = [
        RolloutView(number=1, solution=TEXT, summary=TEXT, score_text="0.5"),
        RolloutView(number=2, solution=TEXT, summary=TEXT, score_text=None),
    ]
    bank = ExperienceBank(
        entries=[
            ExperienceEntry(id="E1", kind="anchor", subtype="intermediate_result", content=TEXT),
            ExperienceEntry(id="E2", kind="heuristic", content=TEXT),
        ],
        next_id=3,
    )
    strategies = [Strategy(id="G1", description=TEXT, first_iteration=0, last_iteration=0)]
    guidelines = GuidelineBank(strategies=strategies, next_id=2)
    hints: tuple[list[PoolEntry], ...] = ([PoolEntry(id="h1", action=TEXT, experience=TEXT)], [])
    member = TeamMember(id="S1", specialty=TEXT, role="leader", description=TEXT, leader=True)
    peer = TeamMember(id="S2", specialty=TEXT)
    target = TurnView(agent="S2", specialty=TEXT, text=TEXT)
    history = [RoundView(number=1, turns=[TurnView(agent="S1", specialty=TEXT, text=TEXT), target])]
    dialogue = ((Turn(teacher=TEXT, student=TEXT),), ())
    judged_dialogue: tuple[list[DialogueTurn], ...] = ([DialogueTurn(teacher=TEXT, student=TEXT)], [])
    q = {"question": TEXT}
    solve = {**q, "mode": MODES[0], "style": STYLES[0]}
    how = {"mode": MODES, "style": STYLES}
    case = {**q, "gold": TEXT, "pre_reasoning": TEXT}
    taught = {**case, "pre_correct": False}
    session = {**case, "subject": TEXT, "difficulty": TEXT, "role": TEXT, "round_number": 1, "target": target}
    team = {**q, "gold": TEXT, "domain": DOMAINS[0], "history": history}
    summarized = {"outcome": TEXT, "reward": "0.500", "judge_analysis": TEXT, "max_entries": 3}
    return {
        "answer_reminder.j2": [{}],
        "system_math.j2": [{}],
        "judge_system.j2": [{}],
        "tmas_generate.j2": _each(solve, **how),
        "tmas_explore.j2": _each({**solve, "strategies": strategies}, strategies=(strategies, []), **how),
        "tmas_refine.j2": _each(
            {**solve, "rollouts": rollouts}, experience=(bank, None), rollouts=(rollouts, []), **how
        ),
        "tmas_verify.j2": _each({**solve, "solution": TEXT}, **how),
        "tmas_verify_score.j2": _each({**q, "solution": TEXT}, mode=MODES),
        "tmas_summary.j2": [
            {
                **q,
                "solution": TEXT,
                "max_words": 200,
                "verifications": [VerificationView(feedback=TEXT, score_text="1")],
            }
        ],
        "tmas_experience.j2": _each({**q, "rollouts": rollouts, "bank": bank}, max_entries=(35, 10, None)),
        "tmas_guideline.j2": _each({**q, "rollouts": rollouts}, bank=(guidelines, GuidelineBank())),
        "rl_guideline_judge.j2": [{**q, "solution": TEXT, "strategies": [StrategyView(id="G1", description=TEXT)]}],
        "self_refine.j2": _each({**solve, "attempt": TEXT}, **how),
        "vr_correct.j2": _each({**solve, "solution": TEXT, "score": "0.5"}, feedback=(TEXT, None), **how),
        "pacore_round.j2": _each({**solve, "messages": [TEXT, TEXT]}, **how),
        "pacore_synthesis.j2": _each({**solve, "messages": [TEXT, TEXT]}, **how),
        "rse_solve.j2": _each({**solve, "propositions": [TEXT], "pitfalls": [TEXT]}, **how),
        "rse_distill.j2": [{**q, "attempt": TEXT, "max_items": 3}],
        "mattrl_recruit.j2": [
            *_each({**q, "n": 3}, domain=DOMAINS, catalog=((TEXT, TEXT), ())),
            *_each({**q, "domain": "education", "catalog": (TEXT, TEXT)}, n=(2, 1)),
        ],
        "mattrl_opinion.j2": _each(
            {**q, "member": member, "previous": TEXT, "feedback": TEXT, "snapshot": TEXT, "bulletin": TEXT},
            domain=DOMAINS,
            round=(0, 1),
            member=(member, peer),
            hints=hints,
        ),
        "mattrl_review.j2": [{"reviewer": peer, "bundle": TEXT}],
        "mattrl_med_review.j2": [{"reviewer": peer, "target": member, "bundle": TEXT}],
        "mattrl_decision.j2": _each({**q, "summary": TEXT}, domain=DOMAINS),
        "mattrl_rewrite.j2": _each({"reply": TEXT}, domain=DOMAINS),
        "mattrl_summarizer.j2": _each({**team, **summarized, "target": target, "round_number": 1}, domain=DOMAINS),
        "mattrl_utterance_judge.j2": _each(
            {**team, "final_answer": TEXT, "target": target, "round_number": 1},
            domain=DOMAINS,
            final_answer=(TEXT, None),
        ),
        "mattrl_turn_value.j2": _each({**team, "turn": history[0]}, domain=DOMAINS, history=(history, [])),
        "mattrl_edu_judge.j2": _each(session, dialogue=judged_dialogue, pre_answer=(TEXT, None)),
        "mattrl_edu_summarizer.j2": _each({**session, **summarized}, dialogue=judged_dialogue, pre_answer=(TEXT, None)),
        "edu_student.j2": _each(q, dialogue=dialogue, guidance=(TEXT, ""), pretest=(TEXT, "")),
        "edu_student_reply.j2": _each({**q, "asked": TEXT}, dialogue=dialogue, pretest=(TEXT, "")),
        "edu_teacher.j2": [
            *_each(
                {**taught, "single": True, "member": None, "round": 1, "rounds": 3},
                task=("ask", "guidance"),
                dialogue=dialogue,
                pre_answer=(TEXT, None),
                hints=hints,
            ),
            {**taught, "task": "analyse", "single": False, "member": member, "round": 1, "rounds": 3}
            | {"dialogue": dialogue[0], "pre_answer": TEXT, "hints": hints[0]},
        ],
        "edu_plan.j2": _each(
            {**taught, "round": 2, "analyses": [(TEXT, TEXT)]}, dialogue=dialogue, pre_answer=(TEXT, None)
        ),
        "judge_user.j2": [{"problem": TEXT, "reference": TEXT, "student": TEXT}],
        "judge_diagnosis.j2": [{"predicted": [TEXT, TEXT], "reference": TEXT}],
        "fewshot_question.j2": [{**q, "exemplars": [Problem(problem_id="sample", question=TEXT, answer=TEXT)]}],
        "serve_question.j2": _each(
            {"problem": TEXT}, context=([{"role": "user", "content": TEXT}, {"role": "assistant", "content": TEXT}], [])
        ),
    }


_CONTEXTS: dict[str, list[Context]] | None = None


def sample_contexts(name: str) -> list[Context]:
    """The contexts top-level template ``name`` is checked with (empty for a partial, which is checked through the
    templates that include it)."""
    global _CONTEXTS
    if _CONTEXTS is None:
        _CONTEXTS = _contexts()
    return _CONTEXTS.get(name, [])


def sampled_names() -> list[str]:
    """The top-level templates that have sample contexts."""
    sample_contexts("")
    assert _CONTEXTS is not None
    return sorted(_CONTEXTS)
