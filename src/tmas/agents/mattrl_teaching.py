"""MATTRL's education agents (paper 003, C.4): the student (pre-test, replies, post-test), the teachers (one
teacher's questions, team members' analyses, closing guidance) and the coordinator's question plan.

The student's answer is the letter on its last ``Answer: X`` line (``Final Answer: X``, a boxed letter, or the letter
followed by its option's own text too); the plan is the question on its ``ROUND k:`` line for the round (the whole
reply when there is none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tmas.agents.templates import prompt
from tmas.llm.types import Message
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import TeamMember

# What may stand before the letter: a box, a text command inside it ("\\boxed{\\text{C}}"), the word "option".
_LETTER_WRAP = r"(?:\\boxed\s*\{\s*)?(?:\\(?:text|textbf|mathrm|mathbf)\s*\{\s*)?(?:option\s+)?"
# "Answer: C" alone on its line; "Final Answer", emphasis, brackets and a box around the letter allowed.
_LETTER = re.compile(rf"^\W*(?:final\s+)?answer\W*{_LETTER_WRAP}\(?([A-J])\)?\W*$", re.I | re.M)
# "Answer: B) Its speed": the letter with its option's text after it (read only when the text is that option's).
_LETTER_AND_TEXT = re.compile(
    rf"^\W*(?:final\s+)?answer\W*{_LETTER_WRAP}\(?([A-J])(?:\)|\.|:|\s-)\s*(.+?)\s*$", re.I | re.M
)
# The options of a question, one a line ("A) Its speed"), as ``tmas cases import`` writes them.
_OPTION = re.compile(r"^\s*\(?([A-J])[).]\s*(.+?)\s*$", re.M)
_PLAN = re.compile(r"^\s*\**ROUND\s*(\d+)\**\s*:\s*\**\s*(.+?)\s*$", re.I | re.M)


@dataclass(frozen=True)
class Turn:
    teacher: str
    student: str


@dataclass(frozen=True)
class Case:
    """What every teacher prompt shows: the question, the student's pre-test, the correct answer, the dialogue."""

    question: str
    gold: str
    pre_answer: str | None
    pre_reasoning: str
    dialogue: tuple[Turn, ...] = ()

    @property
    def pre_correct(self) -> bool:
        """Whether the pre-test answer is the correct one (C.1: the teachers are told)."""
        return self.pre_answer is not None and self.pre_answer.strip().upper() == self.gold.strip().upper()

    def variables(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "gold": self.gold,
            "pre_answer": self.pre_answer,
            "pre_correct": self.pre_correct,
            "pre_reasoning": self.pre_reasoning,
            "dialogue": self.dialogue,
        }


# Where SuperGPQA-style records name a question's subject and difficulty (``tmas cases import`` keeps them in
# ``Problem.metadata``): the most specific subject field first.
SUBJECT_FIELDS = ("subject", "field", "discipline")
DIFFICULTY_FIELDS = ("difficulty", "level")


def subject_of(metadata: dict[str, Any]) -> str:
    """The question's subject from its metadata ("" when it has none)."""
    return next((str(metadata[k]).strip() for k in SUBJECT_FIELDS if str(metadata.get(k) or "").strip()), "")


def difficulty_of(metadata: dict[str, Any]) -> str:
    """The question's difficulty from its metadata ("" when it has none)."""
    return next((str(metadata[k]).strip() for k in DIFFICULTY_FIELDS if str(metadata.get(k) or "").strip()), "")


def student_prompt(
    question: str, dialogue: tuple[Turn, ...] = (), guidance: str = "", pretest: str = ""
) -> list[Message]:
    """The pre-test (no dialogue) or the post-test (after the dialogue and the closing guidance). C.1's student is
    one agent taught after its own pre-test: the post-test shows it ``pretest``, the reply it gave then."""
    return prompt("edu_student.j2", question=question, dialogue=dialogue, guidance=guidance, pretest=pretest)


def student_reply_prompt(question: str, dialogue: tuple[Turn, ...], asked: str, pretest: str = "") -> list[Message]:
    """The student's reply to the teacher's question ``asked``; the teachers ask about its pre-test answer and
    reasoning, so the reply is written knowing ``pretest``, the pre-test reply it gave."""
    return prompt("edu_student_reply.j2", question=question, dialogue=dialogue, asked=asked, pretest=pretest)


def teacher_prompt(
    case: Case,
    *,
    task: str,
    round_: int,
    rounds: int,
    member: TeamMember | None = None,
    hints: list[PoolEntry] | None = None,
) -> list[Message]:
    """``task``: ``ask`` (a single teacher's question), ``analyse`` (a team member's analysis) or ``guidance``."""
    return prompt(
        "edu_teacher.j2",
        task=task,
        single=member is None,
        member=member,
        round=round_,
        rounds=rounds,
        hints=hints or [],
        **case.variables(),
    )


def plan_prompt(case: Case, round_: int, analyses: list[tuple[str, str]]) -> list[Message]:
    return prompt("edu_plan.j2", round=round_, analyses=analyses, **case.variables())


def _plain(text: str) -> str:
    """Text compared as an option's: letter case, spacing, emphasis and the closing punctuation aside."""
    return " ".join(text.replace("*", "").replace("$", "").split()).strip(" .").lower()


def parse_letter(content: str, question: str = "") -> str | None:
    """The letter of the reply's last answer line: ``Answer: X`` alone, or (with the ``question`` whose options it
    names) ``Answer: X) text`` where the text is option X's own, as a student may copy the option out. A line that
    goes on otherwise ("Answer: C, unless D") names no single option and is not read."""
    found = [(m.start(), m.group(1)) for m in _LETTER.finditer(content)]
    options = {letter.upper(): _plain(text) for letter, text in _OPTION.findall(question)}
    for m in _LETTER_AND_TEXT.finditer(content):
        letter = m.group(1).upper()
        if letter in options and _plain(m.group(2).rstrip("}$ ")) == options[letter]:
            found.append((m.start(), letter))
    return max(found)[1].upper() if found else None


def plan_labelled(content: str) -> bool:
    """Whether a plan puts its question on a ``ROUND k:`` line, as asked (else :func:`parse_plan` reads it whole)."""
    return _PLAN.search(content) is not None


def parse_plan(content: str, round_: int | None = None) -> str:
    """The question a plan puts to the student in round ``round_``: its last ``ROUND k:`` line for that round (a plan
    that also drafts later rounds' questions asks this round's), else its last ``ROUND k:`` line, else the whole
    reply."""
    found = _PLAN.findall(content)
    own = [question for number, question in found if round_ is not None and int(number) == round_]
    if own:
        return str(own[-1])
    return str(found[-1][1]) if found else content.strip()
