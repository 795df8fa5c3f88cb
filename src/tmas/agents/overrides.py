"""Prompt templates a user overrides: ``prompts_dir`` holds ``NAME.j2`` files that replace the packaged ones.

Checked before a run sends anything: every file must be named after a packaged template and use exactly the
variables its packaged template uses (the data its role renders it with), counting what included templates use,
so a typo fails at start with one line naming the file and the variable, not in the middle of a run, and no data
the role hands its template (the problem, the solutions, the banks) is silently left out. Then each override is
rendered, through every packaged template that uses it, with sample contexts of the shapes its role passes
(:mod:`tmas.agents.prompt_samples`), so an attribute the data lacks, a method it has not or a wrong index fails at
start with one line naming the file and its line, not on every problem of a run. Each file is read once, by the
check: a run renders its prompts from that text and records its SHA-256 (store meta ``prompt_overrides``).
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2
from jinja2 import meta, nodes

from tmas.agents.prompt_samples import sample_contexts
from tmas.agents.templates import Sources, environment, packaged_environment
from tmas.errors import ConfigError

SUFFIX = ".j2"


# The templates grading renders (the answer judge, the diagnosis judge): always the packaged ones. A run's verdicts are
# stored with it and reused by every later grading of it and its reports, so a judge of a user's own would grade some
# of its answers one way and the rest another.
GRADING_TEMPLATES = frozenset({"judge_system.j2", "judge_user.j2", "judge_diagnosis.j2"})


@dataclass(frozen=True)
class Override:
    """One template of ``prompts_dir`` that replaces the packaged one of the same name."""

    name: str
    path: Path
    sha256: str
    # The text as read by the check (once): what the run renders and what its SHA-256 is of.
    source: str


def packaged_names() -> list[str]:
    """Every packaged template, partials (``_*.j2``, included by others) too."""
    return sorted(packaged_environment().list_templates(filter_func=lambda name: name.endswith(SUFFIX)))


def packaged_source(name: str) -> str:
    """The text of packaged template ``name`` (a one-line :class:`ConfigError` for an unknown name)."""
    env = packaged_environment()
    known = packaged_names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0].removesuffix(SUFFIX)!r}? " if close else ""
        raise ConfigError(f"no packaged prompt template named {name!r} ({hint}see `tmas prompts list`)")
    assert env.loader is not None
    source, _, _ = env.loader.get_source(env, name)
    return source


def _variables(env: jinja2.Environment, name: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The variables template ``name`` reads from its context, with those of the templates it includes."""
    assert env.loader is not None
    source, filename, _ = env.loader.get_source(env, name)
    try:
        ast = env.parse(source, name, filename)
        _check_names(env, ast)
        found = set(meta.find_undeclared_variables(ast))
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{filename or name}: line {exc.lineno}: {exc.message}") from None
    for included in meta.find_referenced_templates(ast):
        if included is not None and included not in seen:
            found |= _variables(env, included, seen | {name})
    return found


def _check_names(env: jinja2.Environment, ast: nodes.Template) -> None:
    """Every filter and test the template names exists: Jinja finds an unknown one only when it renders the line
    (in a condition) or compiles the template, which would be in the middle of a run."""
    for node in ast.find_all((nodes.Filter, nodes.Test)):
        kind, known = ("filter", env.filters) if isinstance(node, nodes.Filter) else ("test", env.tests)
        if node.name not in known:
            raise jinja2.TemplateSyntaxError(f"no {kind} named {node.name!r}", node.lineno)


@cache
def packaged_variables(name: str) -> frozenset[str]:
    return frozenset(_variables(packaged_environment(), name))


@cache
def _includers(name: str) -> frozenset[str]:
    """The packaged top-level templates that include ``name``, directly or through other partials."""
    env = packaged_environment()
    out = set()
    for top in packaged_names():
        if top != name and name in _referenced(env, top, frozenset()):
            out.add(top)
    return frozenset(out)


def _referenced(env: jinja2.Environment, name: str, seen: frozenset[str]) -> set[str]:
    assert env.loader is not None
    source, _, _ = env.loader.get_source(env, name)
    out: set[str] = set()
    for included in meta.find_referenced_templates(env.parse(source)):
        if included is not None and included not in seen:
            out |= {included, *_referenced(env, included, seen | {name})}
    return out


def given_variables(name: str) -> frozenset[str]:
    """What a template called ``name`` is rendered with: its packaged template's variables, or for a partial, the
    variables of every template that includes it."""
    includers = _includers(name)
    if name.startswith("_") and includers:
        return frozenset().union(*(packaged_variables(top) for top in includers))
    return packaged_variables(name)


def check_overrides(prompts_dir: str | Path) -> list[Override]:
    """The overrides in ``prompts_dir``, each checked; the first problem is a one-line :class:`ConfigError`."""
    folder = Path(prompts_dir)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: prompts_dir is not a directory")
    known = set(packaged_names())
    # Each file read once, here: the checks, the SHA-256 a run records and the run's prompts are all of this text.
    sources: Sources = {}
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        if path.name not in known:
            close = difflib.get_close_matches(path.name, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else " (see `tmas prompts list`)"
            raise ConfigError(f"{path}: no packaged prompt template of this name{hint}")
        try:
            sources[path.name] = (path.read_bytes().decode("utf-8"), str(path))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: cannot read it: {type(exc).__name__}: {exc}") from None
    env = environment(sources)
    overrides: list[Override] = []
    for name, (text, filename) in sources.items():
        path = Path(filename)
        try:
            used = _variables(env, name)
        except jinja2.TemplateNotFound as exc:
            raise ConfigError(f"{path}: cannot read it: {type(exc).__name__}: {exc}") from None
        given = given_variables(name)
        unknown = sorted(used - given)
        if unknown:
            raise ConfigError(
                f"{path}: unknown variable {unknown[0]!r}: the template is rendered with {_listed(given)}"
            )
        needed = packaged_variables(name)
        missing = sorted(needed - used)
        if missing:
            raise ConfigError(
                f"{path}: missing variable {missing[0]!r}: the packaged template uses {_listed(needed)}"
                " and so must its override"
            )
        overrides.append(Override(name, path, hashlib.sha256(text.encode()).hexdigest(), text))
    for override in overrides:
        _check_rendering(env, override)
    return overrides


def sources_of(overrides: list[Override]) -> Sources:
    """The templates ``overrides`` read, for :func:`tmas.agents.templates.prompts_from`: rendered as checked."""
    return {o.name: (o.source, str(o.path)) for o in overrides}


def check_not_grading(overrides: list[Override]) -> list[Override]:
    """``overrides``, a one-line :class:`ConfigError` where one changes a template grading renders (an unchanged
    copy, as a folder copied whole holds, changes nothing)."""
    for override in overrides:
        if override.name in GRADING_TEMPLATES and override.source != packaged_source(override.name):
            raise ConfigError(
                f"{override.path}: grading always renders the packaged {override.name} (a run's verdicts are stored"
                " and reused by its later gradings and reports); take it out of the prompts folder"
            )
    return overrides


def _check_rendering(env: jinja2.Environment, override: Override) -> None:
    """Render every template that uses ``override`` (itself, or those including it) with its sample contexts."""
    tops = sorted(_includers(override.name)) if override.name.startswith("_") else [override.name]
    for top in tops:
        for context in sample_contexts(top):
            try:
                env.get_template(top).render(**context)
            except jinja2.TemplateSyntaxError as exc:
                raise ConfigError(f"{exc.filename or override.path}: line {exc.lineno}: {exc.message}") from None
            except Exception as exc:  # any error of the template code is the override's mistake
                where, line = _template_line(exc)
                raise ConfigError(
                    f"{where or override.path}: line {line or '?'}: {type(exc).__name__}: {exc}"
                    f" (rendering {top} with sample data of the shapes a run passes)"
                ) from None


def _template_line(exc: BaseException) -> tuple[str | None, int | None]:
    """The template file and line where ``exc`` was raised: Jinja rewrites a rendering error's traceback so that
    the frames of template code carry the template's file name and line; the innermost one is the culprit."""
    where: tuple[str | None, int | None] = (None, None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(SUFFIX):
            where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return where


def _listed(names: frozenset[str]) -> str:
    return ", ".join(sorted(names)) or "no variables"


def override_diff(override: Override) -> str:
    """A unified diff from the packaged template to its override."""
    ours = packaged_source(override.name).splitlines(keepends=True)
    theirs = override.source.splitlines(keepends=True)
    return "".join(difflib.unified_diff(ours, theirs, f"packaged/{override.name}", str(override.path)))
