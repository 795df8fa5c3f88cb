"""The follow-up turn that asks a solution agent, once, for the final answer its reply left out.

A small model asked to refine correct attempts may reply only that they are correct, with no solution and no answer:
the reply is sent back as the assistant turn with ``answer_reminder.j2``, which describes the required
output (a complete solution ending in a boxed final answer) without any example value.
"""

from __future__ import annotations

from collections.abc import Sequence

from tmas.agents.templates import render
from tmas.llm.types import Message


def answer_reminder_prompt(messages: Sequence[Message], reply: str) -> list[Message]:
    """``messages`` and the answerless ``reply``, followed by the reminder of the required output."""
    return [
        *messages,
        Message(role="assistant", content=reply),
        Message(role="user", content=render("answer_reminder.j2")),
    ]
