"""MATTRL Stage II opinions (paper 003, A.3-A.4, B.3): a specialist's attempt (math) or strict top-10 differential
(medicine), with the retrieved experience as the experience hints block (``<experience_hints>``, data after the case).

Math opinions end in ``\\boxed{}``, like every other method's solutions, so one extraction serves all. Medicine
opinions carry a ``<diagnosis>`` block of ten numbered lines ``N. Name: rationale``.
"""

from __future__ import annotations

import re

from tmas.agents.output import tagged_block
from tmas.agents.templates import prompt, render
from tmas.llm.types import Message
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import TeamMember

# One numbered line: "1. Name: why", "2) Name" or "[3] Name"; its text may be empty (the name on the next line).
_NUMBERED = re.compile(r"^[ \t]*(?:\[(\d{1,2})\]|(\d{1,2})[.)])[ \t]*(.*?)[ \t]*$")


def hints_block(hints: list[PoolEntry]) -> str:
    """The experience hints block (A.3) for ``hints``: a tagged data block; empty when there are none."""
    return render("_mattrl_hints.j2", hints=hints)


def opinion_prompt(
    question: str,
    member: TeamMember,
    domain: str,
    *,
    round_: int = 0,
    previous: str = "",
    feedback: str = "",
    snapshot: str = "",
    bulletin: str = "",
    hints: list[PoolEntry] | None = None,
    system_name: str | None = None,
) -> list[Message]:
    """The specialist's opinion call of round ``round_`` in ``domain`` (``system_name``: the domain's specialists'
    system text, when it has one)."""
    return prompt(
        "mattrl_opinion.j2",
        system_name=system_name,
        question=question,
        member=member,
        domain=domain,
        round=round_,
        previous=previous,
        feedback=feedback,
        snapshot=snapshot,
        bulletin=bulletin,
        hints=hints or [],
    )


def numbered_items(text: str) -> list[tuple[int, str]]:
    """The numbered lines of ``text`` as (number, text), in order. A number alone on its line takes the next line as
    its text when that line is not numbered itself (a name written under its rank); otherwise its text is empty."""
    lines = text.splitlines()
    items: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        match = _NUMBERED.match(line)
        if match is None:
            continue
        said = match.group(3)
        if not said and i + 1 < len(lines) and _NUMBERED.match(lines[i + 1]) is None:
            said = lines[i + 1].strip()
        items.append((int(match.group(1) or match.group(2)), said))
    return items


# What a rank holds when it names no diagnosis: the prompts ask for "insufficient evidence" rather than a guess.
_NO_DIAGNOSIS = frozenset({"insufficient evidence", "n/a", "na", "none", "unknown"})


def _names(items: list[tuple[int, str]], limit: int) -> list[str]:
    names: list[str] = []
    for _, said in items:
        name = said.split(":", 1)[0].strip().strip("[]*").strip()
        if name.lower().strip(" .") in _NO_DIAGNOSIS:
            continue
        if name and name.lower() not in (n.lower() for n in names):
            names.append(name)
    return names[:limit]


def ranked_names(block: str, limit: int = 10) -> list[str]:
    """The names of a numbered list (``1. Name: why`` or ``[1] Name``), in rank order, de-duplicated; a rank left
    empty, or holding "insufficient evidence" (or N/A, none, unknown) instead of a name, names nothing."""
    return _names(numbered_items(block), limit)


def parse_differential(content: str) -> list[str]:
    """A medicine opinion's ranked diagnoses: the ``<diagnosis>`` block's; without one, the reply's longest numbered
    list (the last of equally long ones), so the numbered parts of an outline around the list ("1) Reflection: ...",
    "2) Differential:") are not read as diagnoses."""
    block = tagged_block(content, "diagnosis")
    if block is not None:
        return ranked_names(block)
    lists: list[list[tuple[int, str]]] = []
    for number, said in numbered_items(content):
        if number == 1 or not lists:
            lists.append([])
        lists[-1].append((number, said))
    longest = max((len(items) for items in lists), default=0)
    chosen = next((items for items in reversed(lists) if len(items) == longest), [])
    return _names(chosen, 10)


def top_diagnosis(content: str) -> str | None:
    """The answer a medicine opinion states: the first diagnosis of its differential."""
    ranked = parse_differential(content)
    return ranked[0] if ranked else None
