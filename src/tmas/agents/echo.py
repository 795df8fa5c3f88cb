"""The echo guard (issue 16, part 1): is an agent's answer or content field a copy of its own prompt's instructions?

Small models copy what a prompt shows: a format description returned as a bank entry, an example value returned as
the answer. The prompts hold no example values any more, but a model can still copy the wording of an instruction,
so every agent output that becomes an answer or enters a bank, pool, review or plan is checked here first.

What counts as instructions: every prompt template puts its data (the problem, solutions, banks, reports) in tagged
blocks, an opening tag at the start of a line and its closing tag at the start of a later line (``<problem>`` ...
``</problem>``); everything else of the messages (the system message, the role's instructions) is instruction text.
An assistant turn (the agent's own earlier reply, sent back before a follow-up such as the answer reminder) is data
as a whole. Text that also occurs in data is never counted: quoting the problem, a solution, a bank entry or one's
own earlier reply is honest.

Two checks, both on lowercased word tokens (words, numbers, LaTeX commands):
- a text field echoes when at least :data:`ECHO_SHARE` of its word trigrams occur in the instructions and in no
  data block (fields of fewer than three words: when the whole field is such a run of at least two words);
- an answer echoes when it is a value the instructions themselves present as an answer (inside ``\\boxed{}`` or
  after "final answer:") and no data block holds it, or, for an answer of several words, by the text check.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Self

from tmas.answers import extract_answer, normalize_answer
from tmas.llm.types import Message

# A data block of a rendered template: an opening tag alone at the start of a line, up to its closing tag at the start
# of a later line. Tags mentioned inside a sentence ("inside <final_answer></final_answer> tags") are instructions.
DATA_BLOCK = re.compile(r"^<([A-Za-z_][\w-]*)(?:\s[^>\n]*)?>[ \t]*\n.*?^</\1>[ \t]*$", re.M | re.S)
_TOKEN = re.compile(r"\\[a-z]+|[a-z0-9]+")
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Word n-grams of this length are what a copied phrase shares with the instructions.
NGRAM = 3
# Share of a field's trigrams that must be instruction-only for the field to be an echo.
ECHO_SHARE = 0.5
# The sample index offset of the one retry after an echo: far from every method's own sample numbering, so the
# retry is a distinct call (its own seed and its own record) that a resumed run replays like any other.
ECHO_RETRY_SAMPLE = 900_000


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def _grams(words: Sequence[str]) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + NGRAM]) for i in range(len(words) - NGRAM + 1)]


def split_prompt(messages: Sequence[Message]) -> tuple[str, str]:
    """(instructions, data) of a prompt: the text outside its tagged data blocks, and the text inside them (and
    every assistant turn, the agent's own earlier reply)."""
    instructions: list[str] = []
    data: list[str] = []
    for message in messages:
        if message.role == "assistant":
            data.append(message.content)
            continue
        data.extend(match.group(0) for match in DATA_BLOCK.finditer(message.content))
        instructions.append(DATA_BLOCK.sub("\n", message.content))
    return "\n".join(instructions), "\n".join(data)


def _boxed_values(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` of ``text`` (nested braces allowed)."""
    values: list[str] = []
    for match in _BOX_OPEN.finditer(text):
        depth = 1
        for pos in range(match.end(), len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    values.append(text[match.end() : pos].strip())
                    break
    return values


@dataclass
class EchoGuard:
    """The instruction text of one prompt, ready to check any number of output fields against."""

    instructions: str
    data: str
    _only: set[tuple[str, ...]] = field(init=False, repr=False)
    _words: str = field(init=False, repr=False)
    _data_words: str = field(init=False, repr=False)
    _literals: set[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        words, data_words = tokens(self.instructions), tokens(self.data)
        self._only = set(_grams(words)) - set(_grams(data_words))
        # Space-delimited, so that a run of whole words can be looked up as a substring.
        self._words, self._data_words = f" {' '.join(words)} ", f" {' '.join(data_words)} "
        stated = extract_answer(self.instructions).answer
        shown = [*_boxed_values(self.instructions), *([stated] if stated else [])]
        self._literals = {normalize_answer(value) for value in shown if value.strip()}

    @classmethod
    def of(cls, messages: Sequence[Message]) -> EchoGuard:
        return cls(*split_prompt(messages))

    def share(self, text: str) -> float:
        """The share of ``text``'s word trigrams that occur in the instructions and in no data block."""
        grams = _grams(tokens(text))
        if not grams:
            return 0.0
        return sum(g in self._only for g in grams) / len(grams)

    def echoes_text(self, text: str | None) -> bool:
        """Whether ``text`` (a bank entry, a strategy, a summary, a review, a solution) repeats the instructions."""
        if not text:
            return False
        words = tokens(text)
        if len(words) < NGRAM:
            run = f" {' '.join(words)} "
            return len(words) >= 2 and run in self._words and run not in self._data_words
        return self.share(text) >= ECHO_SHARE

    def echoes_answer(self, answer: str | None) -> bool:
        """Whether ``answer`` is a value the instructions present as an answer (and no data block holds), or a
        several-word answer made of instruction text."""
        if not answer or not answer.strip():
            return False
        key = normalize_answer(answer)
        if key in self._literals and f" {' '.join(tokens(answer))} " not in self._data_words:
            return True
        return len(tokens(answer)) >= NGRAM and self.echoes_text(answer)

    def first_echo(self, fields: Iterable[tuple[str, str | None]]) -> str | None:
        """The name of the first of ``(name, text)`` fields that echoes the instructions; None when none does."""
        for name, text in fields:
            if self.echoes_text(text):
                return name
        return None

    def solution_echo(self, text: str, answer: str | None) -> str | None:
        """What of a solution echoes the instructions: ``"answer"``, ``"solution text"`` or None."""
        if self.echoes_answer(answer):
            return "answer"
        return "solution text" if self.echoes_text(text) else None


class EchoFiltered(Protocol):
    """A parsed agent update that can leave out its items whose text echoes the prompt's instructions."""

    def without_echoes(self, guard: EchoGuard) -> tuple[Self, list[str]]:
        """The update without those items, and one line per item left out."""
        ...
