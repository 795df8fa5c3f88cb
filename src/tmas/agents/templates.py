"""Rendering of the prompt template files.

Problem text, solutions and banks are passed as variables, so they are data: Jinja2 never evaluates template syntax
that appears inside them.

Every template follows two rules (issue 16; tests/test_prompt_audit.py checks both on every file):
- data first, in tagged blocks (an opening tag alone on a line, ``<problem>`` first), the role's instructions last,
  so calls about one problem share the longest prefix (prefix caches) and the echo guard can tell data from
  instructions (:mod:`tmas.agents.echo`);
- nothing to copy: no example value, example answer or example JSON; output formats are described (fields, types,
  allowed values), since small models return what a prompt shows.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2

from tmas.llm.types import Message

# The system message of every math agent: solvers of every method, verifiers, MATTRL's math specialists.
MATH_SYSTEM = "system_math.j2"


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("tmas.agents", "prompts"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=False,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(name: str, **variables: Any) -> str:
    return _environment().get_template(name).render(**variables).strip()


def prompt(name: str, *, system_name: str | None = None, **variables: Any) -> list[Message]:
    """Messages for one call: an optional system template, then the user template."""
    messages = []
    if system_name is not None:
        messages.append(Message(role="system", content=render(system_name, **variables)))
    messages.append(Message(role="user", content=render(name, **variables)))
    return messages
