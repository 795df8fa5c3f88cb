"""MATTRL Stage III, the decision (paper 003, A.4 and B.5): the coordinator's discussion report (``<analysis>``)
and final decision in strict tags, ``<final_answer>`` (math) or ``<top10>`` (medicine), with one rewrite pass when
the tags are missing. The chair reads every round's opinions (Eq. 7), fitted to its context window
(:func:`discussion_record`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pydantic import BaseModel, Field

from tmas.agents.mattrl_opinion import ranked_names
from tmas.agents.output import tagged_block
from tmas.agents.templates import TaggedText, inert_tags, prompt
from tmas.answers import extract_answer
from tmas.llm.types import Message


class Decision(BaseModel):
    report: str = ""
    answer: str | None = None
    # Medicine: the ranked differential; math: empty.
    top10: list[str] = Field(default_factory=list)
    proof: str = ""


def decision_prompt(question: str, domain: str, summary: str, *, system_name: str | None = None) -> list[Message]:
    """The chair's decision call; ``system_name``: the specialists' system text where the domain has one, so the
    decision shares their prefix up to the problem (prefix caches)."""
    return prompt("mattrl_decision.j2", system_name=system_name, question=question, domain=domain, summary=summary)


def rewrite_prompt(reply: str, domain: str) -> list[Message]:
    return prompt("mattrl_rewrite.j2", reply=reply, domain=domain)


# A line of the tag that holds no value: a display-math delimiter ("$$", "\\[", "\\]") or a label with nothing after it
# ("**Final answer:**").
_NO_VALUE_LINE = re.compile(r"^[\s*_#-]*(?:\$\$|\\\[|\\\]|[^:$\\]*:)?[\s*_]*$")
_DISPLAY = re.compile(r"^\\\[(.*)\\\]$|^\\\((.*)\\\)$", re.S)


def _clean_answer(block: str) -> str | None:
    """The answer in a ``<final_answer>`` block: a boxed value or a stated one ("the final answer is ...") anywhere in
    it; else its first line that holds a value (a display-math delimiter or a bare label on its own line holds none),
    as written, its math delimiters dropped."""
    stated = extract_answer(block).answer
    line = next((line for line in block.splitlines() if not _NO_VALUE_LINE.match(line)), "")
    text = (stated or line).strip().lstrip("-").strip()
    if stated is None:
        text = text.strip("$").strip()
        display = _DISPLAY.match(text)
        text = next((part for part in display.groups() if part is not None), "").strip() if display else text
    return None if not text or text.upper() in ("N/A", "NA", "UNKNOWN") else text


def parse_final_answer(content: str) -> Decision | None:
    """A decision in ``<final_answer>`` (with its ``<analysis>`` and any ``<formal_proof>``); None when the tag is
    missing (the caller then asks for a rewrite)."""
    final = tagged_block(content, "final_answer")
    if final is None:
        return None
    report = tagged_block(content, "analysis") or ""
    return Decision(report=report, answer=_clean_answer(final), proof=tagged_block(content, "formal_proof") or "")


def parse_top10(content: str) -> Decision | None:
    """A ranked decision in ``<top10>`` (with its ``<analysis>``), the first name its answer; None when the tag is
    missing or names nothing."""
    block = tagged_block(content, "top10")
    if block is None:
        return None
    ranked = ranked_names(block)
    if not ranked:
        return None
    return Decision(report=tagged_block(content, "analysis") or "", answer=ranked[0], top10=ranked)


# ---- the chair's reading of the discussion (Eq. 7) ------------------------------------------------------------


def clip(text: str, cap: int) -> str:
    """``text`` cut to about ``cap`` characters, head and tail kept, saying how much was left out."""
    if len(text) <= cap:
        return text
    if cap <= 0:
        return f"[{len(text)} characters left out to fit the context window]"
    head = cap // 2
    left_out = len(text) - cap
    note = f"[... {left_out} characters left out to fit the context window ...]"
    return f"{text[:head]}\n{note}\n{text[len(text) - (cap - head) :]}"


def discussion_record(
    status: list[str], rounds: list[tuple[int, list[tuple[str, str]]]], budget: int | None
) -> TaggedText:
    """Eq. 7's input: every round's opinions (``rounds``: round number, then (speaker, text) pairs) after the team's
    final status lines, fitted to ``budget`` characters (None: no limit). Older rounds are shortened first (each
    opinion to the same cap, head and tail kept); the latest round only when the older ones are down to a note.

    The record is laid out in ``<round>`` blocks of its own, so the decision template inserts it as it is; the
    opinions and status lines in it have their tags made inert first (an opinion that writes ``</team_summary>``
    stays inside the record), and the budget counts them so."""
    status = [inert_tags(line) for line in status]
    rounds = [(number, [(inert_tags(who), inert_tags(text)) for who, text in said]) for number, said in rounds]

    def render(cap_old: int | None, cap_last: int | None) -> str:
        parts = ["\n".join(status)]
        for k, (number, said) in enumerate(rounds):
            cap = cap_last if k == len(rounds) - 1 else cap_old
            lines = [f'<round number="{number}">']
            lines += [f"{who}:\n{text if cap is None else clip(text, cap)}" for who, text in said]
            parts.append("\n\n".join(lines) + "\n</round>")
        return "\n\n".join(parts)

    full = render(None, None)
    if budget is None or len(full) <= budget:
        return TaggedText(full)
    longest = max((len(text) for _, said in rounds for _, text in said), default=0)

    def largest(fits: Callable[[int], bool]) -> int:
        lo, hi = 0, longest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    if len(render(0, None)) <= budget:
        return TaggedText(render(largest(lambda cap: len(render(cap, None)) <= budget), None))
    return TaggedText(render(0, largest(lambda cap: len(render(0, cap)) <= budget)))
