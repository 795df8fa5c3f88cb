"""What RL's data builder (``tmas rl build-data``, TMAS paper section 3.3) asks of a method: the prompts its solution
role was given at each iteration of a stored run, built by the method's own prompt builders, so a change to how the
method prompts reaches what RL trains on. A method that keeps TMAS's banks and can rebuild them implements
:class:`BankPrompts` (``tmas.methods.tmas.TMAS`` does; a subclass inherits it); RL data refuses runs of any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tmas.agents.style import Style
from tmas.config import Settings
from tmas.llm.types import Message
from tmas.memory.experience_bank import ExperienceBank
from tmas.memory.guideline_bank import GuidelineBank
from tmas.store.records import IterationRecord


@dataclass(frozen=True)
class Rendering:
    """How a run rendered its solution prompts: the output style, and what fitted R_{t-1} to the prompt budget."""

    style: Style = "paper"
    top_k: int | None = None
    max_solution_chars: int | None = None
    context_tokens: int | None = None
    window: int | None = None
    reply_tokens: int | None = None

    def describe(self) -> str:
        if self.context_tokens is not None:
            budget = f"prompt budget {self.context_tokens} tokens (context_tokens)"
        elif self.window is not None:
            budget = f"context window {self.window} tokens, reply max_tokens {self.reply_tokens or 'unset'}"
        else:
            budget = "no context window known: R_{t-1} shown whole"
        extra = [f"top_k {self.top_k}"] * (self.top_k is not None)
        extra += [f"max_solution_chars {self.max_solution_chars}"] * (self.max_solution_chars is not None)
        return ", ".join([f"style {self.style}", budget, *extra])


@dataclass(frozen=True)
class IterationPrompts:
    """The solution prompts of iteration t, built from the state iteration t-1 left: its banks E_{t-1} and G_{t-1},
    the exploit prompt with R_{t-1} alone (Base) and with E_{t-1} too (Bank), R_{t-1} shown alike in both, and the
    explore prompt listing G_{t-1}. A prompt the run could not have sent (no rollout, an empty or ablated bank) is
    None."""

    experience_bank: ExperienceBank
    guideline_bank: GuidelineBank
    exploit: tuple[list[Message], list[Message]] | None
    explore: list[Message] | None


@runtime_checkable
class BankPrompts(Protocol):
    """A method whose solution prompts RL's hybrid rewards train on (normal, experience and guideline tasks)."""

    def rendering(self, settings: Settings | None, context_length: int | None) -> Rendering:
        """How the run with these parameters and ``settings`` rendered its solution prompts; ``context_length``:
        the solution role's context window where the settings do not hold it."""
        ...

    def first_prompt(self, question: str, rendering: Rendering) -> list[Message]:
        """Iteration 0's prompt (the normal task)."""
        ...

    def prompts_after(self, question: str, record: IterationRecord, rendering: Rendering) -> IterationPrompts:
        """The prompts of the iteration after the stored iteration ``record``."""
        ...

    def leaves_next_state(self, record: IterationRecord) -> bool:
        """Whether ``record`` stores the state an iteration after it would start from: False where the run left out
        the iteration's memory update (nothing would read it: the last iteration, an early stop), so its banks are
        still those of the iteration before."""
        ...
