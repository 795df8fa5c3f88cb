"""The baselines' own agents (Self-Refine, Verify-Refine's corrector, PaCoRe, RSE): prompt builders over the
``self_refine.j2``, ``vr_correct.j2``, ``pacore_*.j2`` and ``rse_*.j2`` templates, and their parsers.

Solving, verifying and the first generation reuse TMAS's solution and verification agents
(:mod:`tmas.agents.solution`, :mod:`tmas.agents.verification`), so every method starts from the same prompt. Each
answer-writing builder takes the output ``style`` (:mod:`tmas.agents.style`).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Annotated, Any

from pydantic import BaseModel, Field, create_model

from tmas.agents.echo import EchoGuard
from tmas.agents.output import AgentOutputError, extract_json_object
from tmas.agents.solution import SolutionOutput, parse_section, solution_section
from tmas.agents.style import Style
from tmas.agents.templates import MATH_SYSTEM, prompt
from tmas.agents.verification import CHARS_PER_TOKEN
from tmas.answers import extract_answer
from tmas.llm.types import Message

_THINK = re.compile(r"<think>.*?</think>", re.S)


def self_refine_prompt(question: str, mode: str, attempt: str, style: Style = "paper") -> list[Message]:
    """Self-Refine: review one's own previous attempt and rewrite it; nothing of any other trajectory."""
    return prompt("self_refine.j2", system_name=MATH_SYSTEM, question=question, mode=mode, attempt=attempt, style=style)


def parse_refinement(content: str, mode: str) -> SolutionOutput:
    """The reading of a reply that revises an earlier solution (Self-Refine's refinement, Verify-Refine's correction):
    the solution under the last ``## Solution`` heading, and in numeric mode the answer that solution gives. Text
    written before it (a refinement's feedback, a corrector's discussion of the report) may quote the earlier boxed
    answer; it is never read as the new answer (a solution without one is answerless, and reminded)."""
    parsed = parse_section(content, mode)
    if mode != "numeric" or not parsed.has_section:
        return parsed
    answer, source = extract_answer(parsed.text)
    return parsed.model_copy(update={"answer": answer, "extraction": source})


def correction_prompt(
    question: str, mode: str, solution: str, feedback: str | None, score: float | None, style: Style = "paper"
) -> list[Message]:
    """Verify-Refine's corrector: the previous solution and its verification report; with ``feedback`` None (no
    verification call came back) the solution alone, said to be neither confirmed nor faulted."""
    shown = "unreadable" if score is None else f"{score:g}"
    return prompt(
        "vr_correct.j2",
        system_name=MATH_SYSTEM,
        question=question,
        mode=mode,
        solution=solution,
        feedback=feedback,
        score=shown,
        style=style,
    )


def pacore_round_prompt(question: str, mode: str, messages: list[str], style: Style = "paper") -> list[Message]:
    """A PaCoRe round after the first: the problem with the compact messages of the previous round."""
    return prompt(
        "pacore_round.j2", system_name=MATH_SYSTEM, question=question, mode=mode, messages=messages, style=style
    )


def pacore_synthesis_prompt(question: str, mode: str, messages: list[str], style: Style = "paper") -> list[Message]:
    """PaCoRe's final synthesis: one solution from the compact messages of the last round."""
    return prompt(
        "pacore_synthesis.j2", system_name=MATH_SYSTEM, question=question, mode=mode, messages=messages, style=style
    )


def compact_message(reply: str, max_chars: int | None) -> str:
    """PaCoRe's compact message of a response: its final conclusion, not its reasoning.

    The conclusion is the response's final content (reasoning in ``<think>`` was already split off by the client;
    stray tags are dropped here), cut to ``max_chars`` from the end, where the answer is; whole with None, as
    PaCoRe's official implementation passes it.
    """
    text = _THINK.sub("", solution_section(reply)).strip()
    if max_chars is None or len(text) <= max_chars:
        return text
    cut = text[-max_chars:]
    # Start at a line or sentence boundary where one is near, so the message does not open mid-word.
    for sep in ("\n", ". "):
        pos = cut.find(sep)
        if 0 <= pos < max_chars // 3:
            cut = cut[pos + len(sep) :]
            break
    return "[...] " + cut.strip()


def rse_solve_prompt(
    question: str, mode: str, propositions: list[str], pitfalls: list[str], style: Style = "paper"
) -> list[Message]:
    """RSE sampling after the first iteration: the problem with the experience bank injected."""
    return prompt(
        "rse_solve.j2",
        system_name=MATH_SYSTEM,
        question=question,
        mode=mode,
        propositions=propositions,
        pitfalls=pitfalls,
        style=style,
    )


def distill_prompt(question: str, attempt: str, max_items: int) -> list[Message]:
    """RSE distillation of one trajectory. The reference answer is never an input: only problem and attempt."""
    return prompt("rse_distill.j2", system_name=MATH_SYSTEM, question=question, attempt=attempt, max_items=max_items)


class Distillation(BaseModel):
    """What the distiller extracted from one trajectory."""

    propositions: list[str] = Field(default_factory=list)
    pitfalls: list[str] = Field(default_factory=list)

    def without_echoes(self, guard: EchoGuard) -> tuple[Distillation, list[str]]:
        """The distillation without the items that echo the prompt's instructions."""
        echoed = [item for item in [*self.propositions, *self.pitfalls] if guard.echoes_text(item)]
        kept = Distillation(
            propositions=[item for item in self.propositions if item not in echoed],
            pitfalls=[item for item in self.pitfalls if item not in echoed],
        )
        return kept, [f"{item!r:.120} echoes the instructions" for item in echoed]


class DistillationReply(BaseModel):
    """The reply's shape, sent as the call's JSON schema (``reply_model``): both lists present, possibly empty."""

    propositions: list[str]
    pitfalls: list[str]


# Under a schema the server closes the JSON only where the schema lets it, and a distillation cut at max_tokens adds
# nothing to the bank (on the embedded 0.5B model at 640 tokens, 7 of 50 unbounded, all loops; none with these
# bounds, measured by benchmarks/schema_bounds.py). So the schema sent holds each list to the prompt's "at most N
# items of each kind" and, with max_tokens known, each item to an equal share of what max_tokens holds after the keys:
# at most CHARS_PER_TOKEN characters a token (as for the verifier), and never more than ITEM_CHARS (one fact or one
# warning, not an essay). Reading a reply stays unbounded.
ITEM_CHARS = 400
KEYS_TOKENS = 16
ITEM_QUOTES_TOKENS = 3


@lru_cache(maxsize=32)
def distillation_reply_model(max_tokens: int | None, max_items: int) -> type[DistillationReply]:
    """:class:`DistillationReply` with at most ``max_items`` items a list, each bounded so that both full lists fit
    in ``max_tokens``."""
    chars = ITEM_CHARS
    if max_tokens is not None:
        per_item = (max_tokens - KEYS_TOKENS) / (2 * max_items) - ITEM_QUOTES_TOKENS
        chars = max(1, min(ITEM_CHARS, int(per_item * CHARS_PER_TOKEN)))
    items = (list[Annotated[str, Field(max_length=chars)]], Field(max_length=max_items))
    return create_model("DistillationReply", __base__=DistillationReply, propositions=items, pitfalls=items)


def _items(value: Any, limit: int) -> list[str]:
    if not isinstance(value, list):
        return []
    out = [" ".join(str(v).split()) for v in value if isinstance(v, str | int | float) and str(v).strip()]
    return out[:limit]


def parse_distillation(content: str, *, max_items: int, truncated: bool = False) -> Distillation:
    """The distiller's JSON; raises :class:`AgentOutputError` when there is none (a truncated reply says so)."""
    try:
        data = extract_json_object(content)
    except AgentOutputError as exc:
        raise AgentOutputError(f"{exc} (reply truncated at max_tokens)" if truncated else str(exc)) from None
    if "propositions" not in data and "pitfalls" not in data:
        raise AgentOutputError("JSON object has neither 'propositions' nor 'pitfalls'")
    return Distillation(
        propositions=_items(data.get("propositions"), max_items),
        pitfalls=_items(data.get("pitfalls"), max_items),
    )
