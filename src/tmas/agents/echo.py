"""The echo guard: is an agent's answer or content field a copy of its own prompt's instructions?

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
from functools import lru_cache
from typing import Protocol, Self

from tmas.answers import boxed_values, extract_answer, normalize_answer
from tmas.llm.types import Message

# A data block of a rendered template: an opening tag alone at the start of a line, up to its closing tag at the start
# of a later line. Tags mentioned inside a sentence ("inside <final_answer></final_answer> tags") are instructions.
DATA_BLOCK = re.compile(r"^<([A-Za-z_][\w-]*)(?:\s[^>\n]*)?>[ \t]*\n.*?^</\1>[ \t]*$", re.M | re.S)
_TOKEN = re.compile(r"\\[a-z]+|[a-z0-9]+")
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
    return list(zip(*(words[i:] for i in range(NGRAM)), strict=False))


def _spaced(words: Iterable[str]) -> str:
    """Words joined and padded by spaces: a run of whole words is then a substring (a token holds no space)."""
    return f" {' '.join(words)} "


@lru_cache(maxsize=256)
def _block_words(block: str) -> str:
    """A data block's words, joined by spaces. Cached by content: the rollouts block of iteration t is quoted word
    for word in the memory agents' prompts and in every exploit prompt of t + 1, and a resumed run checks them all
    again."""
    return " ".join(tokens(block))


def _prompt_parts(messages: Sequence[Message]) -> tuple[str, list[str]]:
    """The instructions of a prompt (the text outside its tagged data blocks) and its data blocks (with every
    assistant turn, the agent's own earlier reply)."""
    instructions: list[str] = []
    data: list[str] = []
    for message in messages:
        if message.role == "assistant":
            data.append(message.content)
            continue
        data.extend(match.group(0) for match in DATA_BLOCK.finditer(message.content))
        instructions.append(DATA_BLOCK.sub("\n", message.content))
    return "\n".join(instructions), data


def split_prompt(messages: Sequence[Message]) -> tuple[str, str]:
    """(instructions, data) of a prompt: the text outside its tagged data blocks, and the text inside them (and
    every assistant turn, the agent's own earlier reply)."""
    instructions, data = _prompt_parts(messages)
    return instructions, "\n".join(data)


@dataclass
class EchoGuard:
    """The instruction text of one prompt, ready to check any number of output fields against.

    The instructions are short and the data long (quoted solutions, reports, banks), so only the instructions'
    trigrams are kept as a set; whether one of them also occurs in the data is looked up in the data's spaced words
    when an output holds it, and remembered."""

    instructions: str
    data: Sequence[str]
    _grams: set[tuple[str, ...]] = field(init=False, repr=False)
    _words: str = field(init=False, repr=False)
    _data_words: str = field(init=False, repr=False)
    _literals: set[str] = field(init=False, repr=False)
    _in_data: dict[tuple[str, ...], bool] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        words = tokens(self.instructions)
        self._grams = set(_grams(words))
        # The words of the data as tokens("\n".join(data)) gives them: the newline between two blocks ends a token.
        self._words, self._data_words = _spaced(words), _spaced(filter(None, map(_block_words, self.data)))
        stated = extract_answer(self.instructions).answer
        shown = [*boxed_values(self.instructions), *([stated] if stated else [])]
        self._literals = {normalize_answer(value) for value in shown if value.strip()}

    @classmethod
    def of(cls, messages: Sequence[Message]) -> EchoGuard:
        return _guard_of(tuple(messages))

    def _instruction_only(self, gram: tuple[str, ...]) -> bool:
        """Whether ``gram`` occurs in the instructions and in no data block."""
        if gram not in self._grams:
            return False
        known = self._in_data.get(gram)
        if known is None:
            known = self._in_data[gram] = _spaced(gram) in self._data_words
        return not known

    def share(self, text: str) -> float:
        """The share of ``text``'s word trigrams that occur in the instructions and in no data block."""
        return self._share(tokens(text))

    def _share(self, words: Sequence[str]) -> float:
        grams = _grams(words)
        if not grams:
            return 0.0
        # Most of a long output's trigrams are in no instruction: the set tells at once, only the others are looked
        # up in the data.
        shared = [g for g in grams if g in self._grams]
        return sum(self._instruction_only(g) for g in shared) / len(grams)

    def echoes_text(self, text: str | None) -> bool:
        """Whether ``text`` (a bank entry, a strategy, a summary, a review, a solution) repeats the instructions."""
        if not text:
            return False
        words = tokens(text)
        if len(words) < NGRAM:
            run = _spaced(words)
            return len(words) >= 2 and run in self._words and run not in self._data_words
        return self._share(words) >= ECHO_SHARE

    def echoes_answer(self, answer: str | None) -> bool:
        """Whether ``answer`` is a value the instructions present as an answer (and no data block holds), or a
        several-word answer made of instruction text."""
        if not answer or not answer.strip():
            return False
        key = normalize_answer(answer)
        if key in self._literals and _spaced(tokens(answer)) not in self._data_words:
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


@lru_cache(maxsize=64)
def _guard_of(messages: tuple[Message, ...]) -> EchoGuard:
    """One guard per prompt (by content): the N candidates of an iteration share their few prompts."""
    return EchoGuard(*_prompt_parts(messages))
