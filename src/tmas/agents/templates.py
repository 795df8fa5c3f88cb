"""Rendering of the prompt template files.

Problem text, solutions and banks are passed as variables, so they are data: Jinja2 never evaluates template syntax
that appears inside them.

Text inserted into a template (any ``{{ }}`` value: a problem, a solution, a report, a bank entry) has the tags a
data block opens and closes with written as entities (``&lt;/solution&gt;``, :func:`inert_tags`): a solution that
writes ``</solution>`` stays inside its block, for the model that reads it and for the echo guard alike. What gets
graded is never read from a prompt: answers come from the replies as the model wrote them.

Every template follows two rules (tests/test_prompt_audit.py checks both on every file):
- data first, in tagged blocks (an opening tag alone on a line, ``<problem>`` first), the role's instructions last,
  so calls about one problem share the longest prefix (prefix caches) and the echo guard can tell data from
  instructions (:mod:`tmas.agents.echo`);
- nothing to copy: no example value, example answer or example JSON; output formats are described (fields, types,
  allowed values), since small models return what a prompt shows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

from tmas.llm.types import Message

# The tags of a data block, as a text inserted into one may write them: a closing tag anywhere (any spacing, anything
# up to its ">"; "</" begins nothing in mathematics), and an opening tag, bare or with quoted attributes, where it
# stands alone on its line, as a block opens ("the subgroup <g> of G" and "0<x and x>1" are left as they are).
_CLOSING_TAG = re.compile(r"<(\s*/\s*[A-Za-z_][\w-]*\b[^<>\n]*)>")
_OPENING_LINE = re.compile(
    r"^([ \t]*)<([A-Za-z_][\w-]*(?:[ \t]+[\w-]+[ \t]*=[ \t]*\"[^\"<>\n]*\")*[ \t]*)>(?=[ \t]*$)", re.M
)


def inert_tags(text: str) -> str:
    """``text`` with the tags it holds written as entities (``&lt;/solution&gt;``): a text that closes its block and
    writes on after it, as a prompt would, stays inside its block."""
    if "<" not in text:
        return text
    return _OPENING_LINE.sub(r"\1&lt;\2&gt;", _CLOSING_TAG.sub(r"&lt;\1&gt;", text))


class TaggedText(str):
    """Text laid out in tagged blocks of its own, whose inserted parts went through :func:`inert_tags`: a template
    inserts it as it is."""

    __slots__ = ()


def _inserted(value: Any) -> Any:
    """What a template's ``{{ }}`` writes for ``value``: text with its tags made inert."""
    return inert_tags(value) if isinstance(value, str) and not isinstance(value, TaggedText) else value


# The system message of every math agent: solvers of every method, verifiers, MATTRL's math specialists.
MATH_SYSTEM = "system_math.j2"

_OPTIONS: dict[str, Any] = {
    "undefined": jinja2.StrictUndefined,
    "autoescape": False,
    "keep_trailing_newline": False,
    "trim_blocks": True,
    "lstrip_blocks": True,
    "finalize": _inserted,
}


@lru_cache(maxsize=1)
def packaged_environment() -> jinja2.Environment:
    """The packaged templates alone."""
    return jinja2.Environment(loader=jinja2.PackageLoader("tmas.agents", "prompts"), **_OPTIONS)


# A folder's templates as read once: name -> (text, the file's path). A run renders from what it read at its start, so
# a template edited while it goes on changes none of its prompts (and the run's record of each override's SHA-256,
# :mod:`tmas.agents.overrides`, is of the text it rendered).
Sources = dict[str, tuple[str, str]]


def read_folder(prompts_dir: str | Path) -> Sources:
    """The templates (``*.j2``) of ``prompts_dir``, read now; a file that is not UTF-8 raises UnicodeDecodeError."""
    folder = Path(prompts_dir)
    return {path.name: (path.read_bytes().decode("utf-8"), str(path)) for path in sorted(folder.glob("*.j2"))}


class _ReadOnce(jinja2.BaseLoader):
    """Templates from :data:`Sources` read before: never read again, never out of date."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def get_source(self, environment: jinja2.Environment, template: str) -> tuple[str, str, Callable[[], bool]]:
        if template not in self.sources:
            raise jinja2.TemplateNotFound(template)
        text, filename = self.sources[template]
        return text, filename, lambda: True

    def list_templates(self) -> list[str]:
        return sorted(self.sources)


def environment(sources: Sources) -> jinja2.Environment:
    """A new environment in which each template of ``sources`` (:func:`read_folder`) replaces the packaged one of the
    same name, includes as well as top-level ones (rendering as a run does)."""
    loader = jinja2.ChoiceLoader([_ReadOnce(sources), packaged_environment().loader])  # type: ignore[list-item]
    return jinja2.Environment(loader=loader, **_OPTIONS)


@lru_cache(maxsize=8)
def _overridden_environment(sources: frozenset[tuple[str, tuple[str, str]]]) -> jinja2.Environment:
    return environment(dict(sources))


# The environment of the run in progress: a context variable, so concurrent runs in one process (tmas serve) and
# the asyncio tasks each one starts see their own prompts directory.
_ENVIRONMENT: ContextVar[jinja2.Environment | None] = ContextVar("tmas_prompt_environment", default=None)


def _environment() -> jinja2.Environment:
    return _ENVIRONMENT.get() or packaged_environment()


@contextmanager
def prompts_from(prompts: str | Path | Sources | None) -> Iterator[None]:
    """Within the block, templates replace the packaged ones of the same name: those of a folder, read as the block
    begins, or ``Sources`` read before (those a run's checks read: :class:`tmas.agents.overrides.Override`); None:
    none do. Check them first with :func:`tmas.agents.overrides.check_overrides`."""
    if prompts is None:
        env = None
    else:
        sources = prompts if isinstance(prompts, dict) else read_folder(prompts)
        env = _overridden_environment(frozenset(sources.items()))
    token = _ENVIRONMENT.set(env)
    try:
        yield
    finally:
        _ENVIRONMENT.reset(token)


def render(name: str, **variables: Any) -> str:
    return _environment().get_template(name).render(**variables).strip()


def prompt(name: str, *, system_name: str | None = None, **variables: Any) -> list[Message]:
    """Messages for one call: an optional system template, then the user template."""
    messages = []
    if system_name is not None:
        messages.append(Message(role="system", content=render(system_name, **variables)))
    messages.append(Message(role="user", content=render(name, **variables)))
    return messages
