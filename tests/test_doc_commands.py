"""Every ``tmas`` command line the README, the pages on configuration and the example grids' comments show names a
command that exists, every flag on it (on the lines a backslash continues it onto too) is one that command takes,
and every method parameter it gives is one its method takes, with a value it accepts; each command of a page's shell
blocks is one its command parses whole, arguments and values included."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from test_doc_defaults import CONFIG_PAGES
from tmas.cli.main import app
from tmas.cli.options import parse_params
from tmas.cli.usage import ParserError, error_line
from tmas.errors import ConfigError
from tmas.methods import create_method

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    *CONFIG_PAGES,
    # The other pages under docs/.
    *sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if str(p.relative_to(ROOT)) not in CONFIG_PAGES
    ),
    "examples/tiling_2xn/README.md",
    # The commands in the grid files' comments.
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*.toml")),
]
# A command line: in backticks, or a line of a shell block (a "$ " prompt or an environment variable before it).
COMMAND = re.compile(r"`(tmas [^`]+)`|^(?:\$ )?(?:[A-Z_]+=\S+ )*(tmas [^\n#]+)", re.M)


def command_lines(doc: str) -> list[str]:
    text = (ROOT / doc).read_text()
    if doc.endswith(".toml"):
        text = re.sub(r"^#\s*", "", text, flags=re.M)
    text = re.sub(r"\\\n\s*", " ", text)  # a command continued on the next line with a backslash
    lines = []
    for match in COMMAND.finditer(text):
        line = (match.group(1) or match.group(2)).split("&&")[0].split("|")[0].split(">")[0]
        lines.append(line.strip())
    return lines


def resolve(root: Any, words: list[str]) -> tuple[Any, list[str]]:
    """The command ``words`` name and the words after it; None where the first word names no command (prose such
    as "tmas splits ..."), an error where a later one names no subcommand."""
    command, rest = root, list(words)
    while getattr(command, "commands", None) and rest and not rest[0].startswith("-"):
        sub = command.commands.get(rest[0])
        if sub is None:
            assert command is root, (
                f"'{rest[0]}' is no command of {command.name} ({', '.join(sorted(command.commands))})"
            )
            return None, rest
        command, rest = sub, rest[1:]
    return command, rest


def flags_of(command: Any) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}


@pytest.mark.parametrize("doc", DOCS)
def test_documented_commands_and_flags_exist(doc: str) -> None:
    root: Any = typer.main.get_command(app)
    checked = 0
    for line in command_lines(doc):
        words = line.split()[1:]
        if not words or "/" in words[0]:  # "tmas solve/run/eval/sweep": several commands named in prose
            continue
        if "..." in words[:2]:  # "tmas pool ...": a command group named in prose
            continue
        command, rest = resolve(root, words)
        if command is None:  # prose such as "tmas splits it ...", not a command line
            assert words[0] not in root.commands, line
            continue
        known = flags_of(command)
        for word in rest:
            flag = word.split("=")[0].rstrip(",.;:)")
            if re.fullmatch(r"--?[a-zA-Z][\w-]*", flag):
                assert flag in known, f"{doc}: '{line}': {command.name} has no {flag}"
        checked += 1
    assert checked > 0 or doc in ("docs/servers.md", "docs/viewer.md") or doc.endswith(".toml")


def method_and_parameters(words: list[str]) -> tuple[str, dict[str, Any]]:
    """The method a command line names (``-m``/``--method``; TMAS without one) and the parameters it gives it
    (``-p``/``--param KEY=VALUE`` read as the command reads them, ``-T``, ``--domain``)."""
    method, items = "tmas", []
    params: dict[str, Any] = {}
    for flag, value in itertools.pairwise(words):
        if flag in ("-m", "--method"):
            method = value
        elif flag in ("-p", "--param"):
            items.append(value)
        elif flag in ("-T", "--iterations") and value.isdigit():
            params["iterations"] = int(value)
        elif flag == "--domain":
            params["domain"] = value
    params.update(parse_params(items))
    # A placeholder (`--domain NAME`) stands for any value.
    return method, {key: value for key, value in params.items() if not re.fullmatch(r"[A-Z_]+", str(value))}


@pytest.mark.parametrize("doc", DOCS)
def test_documented_method_parameters_exist(doc: str) -> None:
    # Each -p KEY=VALUE of a command that starts a method names a parameter of that method, with a value it takes.
    for line in command_lines(doc):
        try:
            words = shlex.split(line)[1:]
        except ValueError:  # a fragment in prose, such as `tmas solve "...`
            continue
        if not words or words[0] not in ("solve", "run", "eval") or "--resume" in words:
            continue
        method, params = method_and_parameters(words)
        try:
            create_method(method, params)
        except ConfigError as exc:
            raise AssertionError(f"{doc}: '{line}': {exc}") from None


# A shell block of a page: its lines, a backslash's continuation joined on.
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)


def block_commands(doc: str) -> list[str]:
    """The ``tmas`` commands of ``doc``'s shell blocks, whole: each piece of a line between ``&&``, ``|`` and ``;``
    that starts with ``tmas`` (after a ``$ `` prompt or environment variables), its redirections, a trailing ``&``
    and its comment left out."""
    commands = []
    for block in SHELL_BLOCK.findall((ROOT / doc).read_text()):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            for piece in re.split(r"&&|\|\|?|;", line.split(" #")[0]):
                piece = re.sub(r"^\s*(?:\$ )?(?:[A-Z_]+=\S+ )*", "", piece).strip()
                if piece.startswith("tmas "):
                    commands.append(re.sub(r"\s+&$|\s+\d?>.*$", "", piece))
    return commands


@pytest.mark.parametrize("doc", [doc for doc in DOCS if doc.endswith(".md")])
def test_documented_command_blocks_parse(doc: str) -> None:
    # Each command a shell block shows is one its command reads whole as written: its arguments all there and no
    # more, every option's value of the type and among the choices the option takes (a flag that exists but whose
    # value the parser refuses, or a positional argument a command lost, rots a copied command as surely as a
    # renamed flag). A line with a shell variable or "..." in it stands for values the page names elsewhere.
    root: Any = typer.main.get_command(app)
    for line in block_commands(doc):
        words = shlex.split(line)[1:]
        if "..." in words or "$" in line:
            continue
        command, rest = resolve(root, words)
        if command is None or getattr(command, "commands", None) or "--help" in rest:
            continue
        try:
            command.make_context(" ".join(["tmas", *words[: len(words) - len(rest)]]), list(rest))
        except ParserError as exc:
            raise AssertionError(f"{doc}: '{line}': {error_line(exc)}") from None
