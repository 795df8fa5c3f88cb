"""Default simulated replies for the experience pool build: the ``judge`` role's turn scores and the ``summarizer``.

The pool build asks the ``judge`` role, which also grades answers, three things of its own, each told apart by its
prompt's tagged sections as a model would read them:
- a specialist's turn (``<target_turn>``, B.6): a score from its boxed answer against ``<reference_answer>``: the
  first turn to reach it scores 4, a turn repeating it 3, one more when the turn's reviews caught a peer's error;
  a turn with no answer 1 (2 when it caught an error), a wrong answer 0;
- one round of the discussion (``<this_round>``, Eq. 17-18): 5 times the share of the round's turns whose answer is
  the reference answer, so a specialist left silent takes its share away;
- a teacher's utterance (education, C.4.6, ``<teacher_utterance>``): the four rubric scores, information gain high
  when the utterance points at the correct option.
The medicine grader's diagnosis matching (``<predicted>`` and ``<reference>``) gets the rank a diagnosis judge would
give (mattrl_responders.diagnosis_verdict). Any other ``judge`` prompt is an answer grading and gets the answer
grader's default.

The ``summarizer`` turns ``<contribution>`` (or education's ``<teacher_utterance>``) into entries in the shape its
prompt asks for: a general entry naming the move the turn made, and (when more than one is allowed) a case entry
with the problem's own computation. "Good practice:" when the turn's answer is the reference answer (education: the
post-test was right), "Pitfall:" otherwise. All of it is a pure function of the prompt.
"""

from __future__ import annotations

import json
import re

from tmas.answers import last_boxed, normalize_answer
from tmas.testing.mattrl_responders import diagnosis_verdict
from tmas.testing.responders import SimRequest, evaluate_expression, judge_responder, register_responder
from tmas.testing.tmas_responders import tag

_TURN = re.compile(r"<turn agent=\"([^\"]*)\"[^>]*>\n?(.*?)\n?</turn>", re.S)
_REVISE = re.compile(r"\"verdict\":\s*\"revise\"")
_TARGET = re.compile(r"<target_turn round=\"(\d+)\" agent=\"([^\"]*)\"")
_CONTRIBUTION = re.compile(r"<contribution round=\"(\d+)\" agent=\"([^\"]*)\"(?: specialty=\"([^\"]*)\")?")
_OUTCOME = re.compile(r"the team's final answer was (correct|wrong|partly correct)")
_AT_MOST = re.compile(r"at most (\d+) ")
_OPTION = re.compile(r"\boption ([A-J])\b")
_UTTERANCE = re.compile(r"<teacher_utterance round=\"(\d+)\" role=\"([^\"]*)\"")
_QUESTION = re.compile(r"<question(?: subject=\"([^\"]*)\")?(?: difficulty=\"([^\"]*)\")?>")
_POST_TEST = re.compile(r"post_test=\"(\w+)\"")


def _same(answer: str | None, gold: str) -> bool:
    return answer is not None and bool(gold) and normalize_answer(answer) == normalize_answer(gold)


def _answer(turn: str) -> str | None:
    """A turn's own answer: the last boxed one before its reviews of peers."""
    return last_boxed(turn.split("[review of ", 1)[0])


def _turn_score(text: str) -> str:
    gold = tag(text, "reference_answer")
    target = tag(text, "target_turn")
    found = _TARGET.search(text)
    agent = found.group(2) if found else "the specialist"
    answer = _answer(target)
    caught = _REVISE.search(target) is not None
    known = any(_same(_answer(t), gold) for _, t in _TURN.findall(tag(text, "earlier_rounds")))
    if _same(answer, gold):
        score = (3 if known else 4) + caught
        said = f"{agent} reached the reference answer {answer}" + (", as an earlier round had." if known else " first.")
    elif answer is None:
        score = 1 + caught
        said = f"{agent} gave no answer of its own."
    else:
        score = 0
        said = f"{agent} argued for {answer}, not the reference answer."
    if caught:
        said += " Its review caught a peer's error."
    return json.dumps({"analysis": said, "score": score})


def _round_value(text: str) -> str:
    gold = tag(text, "reference_answer")
    turns = _TURN.findall(tag(text, "this_round"))
    right = [agent for agent, t in turns if _same(_answer(t), gold)]
    score = (10 * len(right) + len(turns)) // (2 * len(turns)) if turns else 0  # 5 * share, halves up
    said = f"{len(right)} of the round's {len(turns)} turns reach the reference answer" + (
        f" ({', '.join(right)})." if right else "."
    )
    return json.dumps({"analysis": said, "score": score})


def _rubric(text: str) -> str:
    gold = tag(text, "correct_answer").strip()
    utterance = tag(text, "teacher_utterance")
    pointed = _OPTION.findall(utterance)
    right = bool(pointed) and pointed[-1] == gold
    wrong = bool(pointed) and not right
    scores = {
        "correctness_score": 1 if wrong else 4,
        "information_gain_score": 5 if right else 1 if wrong else 3,
        "relevance_score": 4,
        "clarity_score": 4 if len(utterance.split()) <= 40 else 3,
    }
    said = (
        f"The utterance points the student at option {pointed[-1]}."
        if pointed
        else "The utterance asks the student to reconsider without naming an option."
    )
    return json.dumps({**scores, "analysis": said})


@register_responder("judge")
def pool_judge_responder(req: SimRequest) -> str:
    """The pool build's scores for its own prompts, the diagnosis judge's rank for its prompt, and the answer
    grader's verdict for every other judge prompt."""
    text = req.question
    if "<target_turn " in text:
        return _turn_score(text)
    if "<this_round " in text:
        return _round_value(text)
    if "<teacher_utterance " in text and "correctness_score" in text:
        return _rubric(text)
    verdict = diagnosis_verdict(text)
    return judge_responder(req) if verdict is None else verdict


def _at_most(text: str) -> int:
    found = _AT_MOST.findall(text)  # the instructions follow the data: the last mention is theirs
    return int(found[-1]) if found else 1


def _math_entries(text: str) -> list[dict[str, str]]:
    found = _CONTRIBUTION.search(text)
    specialty = (found.group(3) if found and found.group(3) else "") or "Specialist"
    contribution = tag(text, "contribution")
    gold = tag(text, "reference_answer")
    answer = _answer(contribution)
    outcome = _OUTCOME.search(text)
    good = _same(answer, gold) and (outcome is None or outcome.group(1) == "correct")
    caught = _REVISE.search(contribution) is not None
    if caught:
        move = "recompute a peer's result before accepting it"
        lesson = ("redoing the peer's last operation exposed the slip before the team settled on it.", "")
    elif answer is None:
        move = "state a checked result instead of commenting only"
        lesson = ("", "a turn without its own result leaves the team nothing to verify.")
    else:
        move = "carry out the computation in the usual order and box the result"
        lesson = ("working each operation in turn made the result easy for the reviewers to check.", "")
    helped, warning = lesson
    if not good:
        warning = warning or "a boxed result that was never checked against the problem's conditions misled the team."
    head = "Good practice:" if good else "Pitfall:"
    said = helped if good else warning
    entries = [{"action": f"{specialty}: {move}", "experience": f"{head} {said}", "scope": "general"}]
    expression = evaluate_expression(tag(text, "problem"))
    if expression is not None and answer is not None:
        shown, _ = expression
        entries.append(
            {
                "action": f"{specialty}: evaluate {shown}",
                "experience": f"{head} {shown} was answered {answer}; the reference answer is {gold}.",
                "scope": "case",
            }
        )
    return entries


def _teaching_entries(text: str) -> list[dict[str, str]]:
    found = _UTTERANCE.search(text)
    role = found.group(2) if found else "teacher"
    question = _QUESTION.search(text)
    subject = (question.group(1) if question else None) or "any subject"
    difficulty = (question.group(2) if question else None) or "any"
    utterance = tag(text, "teacher_utterance")
    post = _POST_TEST.search(text)
    good = post is not None and post.group(1) == "correct"
    asks = utterance.rstrip().endswith("?")
    kind, gist = ("probing question", "ask for the rule behind the choice") if asks else ("hint", "point at the cue")
    head = "Good practice:" if good else "Pitfall:"
    lesson = (
        "a short question about the student's own reasoning let the student find the misconception."
        if asks
        else "naming where to look again gave the student a concrete next step."
    )
    entry = {
        "class": "GUIDANCE" if asks else "STRATEGY",
        "action": f"{role} {kind}, {subject} question of {difficulty} difficulty: {gist}",
        "experience": f"{head} {lesson} [{'helpful' if good else 'harmful'}]",
        "scope": "general",
    }
    return [entry]


@register_responder("summarizer")
def summarizer_responder(req: SimRequest) -> str:
    """Pool entries distilled from the contribution the prompt shows, in the JSON shape the prompt asks for."""
    text = req.question
    entries = _teaching_entries(text) if "<teacher_utterance " in text else _math_entries(text)
    return json.dumps({"entries": entries[: _at_most(text)]})
