"""Every command line the README, the pages under docs/ and the scripts' own docstrings give for a script of
``benchmarks/`` is one that script takes: a whole command (``python benchmarks/NAME.py ...``) is parsed by the script's
own argument parser, arguments and values included, and every flag a fragment names (`` `NAME.py --flag` ``) is one
of its flags. The scripts run in a subprocess with their parser stopped right after parsing, so nothing is measured."""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_scripts import BENCHMARKS

ROOT = BENCHMARKS.parent
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
PAGES = [
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
    *sorted(str(p.relative_to(ROOT)) for p in BENCHMARKS.glob("*.py")),
]
_NAMES = "|".join(SCRIPTS)
# A whole command: the interpreter, the script, its arguments up to the end of the line (a backslash continues it)
# or a shell operator; `... [--flag V]` in a usage line is an optional part, read as given.
WHOLE = re.compile(rf'python3? +(?:benchmarks/)?({_NAMES})\.py\b((?:"[^"\n]*"|[^`\n#|&>;"])*)')
# Inline code in backticks, which Markdown lets run on over a line break.
INLINE = re.compile(r"(?<!`)`[^`]+`(?!`)")
# A fragment in backticks: the script and some of its flags, named in prose or a table.
FRAGMENT = re.compile(rf"`(?:[^`\n]*/)?({_NAMES})\.py\b([^`]*)`")

# Runs SCRIPT as __main__ once for each argument list of ARGVS, with ArgumentParser.parse_args replaced by one that
# notes every flag of the parser (and of its subcommands), parses, and stops the script there; prints, per list,
# its flags and the parser's error (None when it parsed).
DRIVER = r"""
import argparse, contextlib, io, json, os, runpy, sys

class Parsed(BaseException):
    pass

def flags(parser):
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= flags(sub)
    return found

original = argparse.ArgumentParser.parse_args
seen = {}

def parse_args(self, args=None, namespace=None):
    seen["flags"] = sorted(flags(self))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            original(self, args, namespace)
        seen["error"] = None
    except SystemExit:
        seen["error"] = err.getvalue().strip().splitlines()[-1]
    raise Parsed

argparse.ArgumentParser.parse_args = parse_args
script, argvs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` has it: the sibling scripts it imports
results = []
for argv in argvs:
    seen.clear()
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except Parsed:
        pass
    results.append(dict(seen) or {"flags": [], "error": "the script never parsed its arguments"})
print(json.dumps(results))
"""


def arguments(text: str) -> list[str]:
    """The words of a documented command line, with a usage line's brackets and ellipses taken out and a shell
    variable standing for a number."""
    text = re.sub(r"\$\w+", "1", text.replace("[", " ").replace("]", " ").replace("...", " "))
    return shlex.split(text)


def documented(script: str) -> list[tuple[str, list[str], bool]]:
    """(page, arguments, whole) for every command line given for ``script`` (in a script, by its docstring)."""
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        if page.endswith(".py"):
            text = ast.get_docstring(ast.parse(text)) or ""
        text = re.sub(r"\\{1,2}\n\s*", " ", text)
        text = INLINE.sub(lambda code: code.group(0).replace("\n", " "), text)
        for pattern, whole in ((WHOLE, True), (FRAGMENT, False)):
            for match in pattern.finditer(text):
                if match.group(1) == script:
                    found.append((page, arguments(match.group(2)), whole))
    return found


def parse(script: str, argvs: list[list[str]]) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(BENCHMARKS / f"{script}.py"), json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results: list[dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def test_the_pages_give_commands_for_the_scripts() -> None:
    given = {script for script in SCRIPTS if any(whole for _, _, whole in documented(script))}
    assert {"orchestrator_scale", "paper_scale", "comparison_device", "rl_device"} <= given


def test_the_argument_list_of_a_usage_line() -> None:
    assert arguments('cap --cap 16 [--latency 0.2] --calibrate RUN_DIR [RUN_DIR ...] --level $level --x "a b"') == [
        *["cap", "--cap", "16", "--latency", "0.2", "--calibrate", "RUN_DIR", "RUN_DIR", "--level", "1"],
        *["--x", "a b"],
    ]


def test_the_driver_reports_a_flag_a_script_does_not_take(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(
        "import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--n', type=int)\n"
        "parser.parse_args()\nraise SystemExit('ran past its parser')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(script), json.dumps([["--n", "3"], ["--m", "3"], ["--n", "x"]])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    ok, unknown, bad_value = json.loads(done.stdout)
    assert ok == {"flags": ["--help", "--n", "-h"], "error": None}
    assert "unrecognized arguments: --m 3" in str(unknown["error"])
    assert "invalid int value: 'x'" in str(bad_value["error"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_documented_commands_parse(script: str) -> None:
    commands = documented(script)
    if not commands:
        pytest.skip(f"no page gives a command line for {script}.py")
    results = parse(script, [argv for _, argv, _ in commands])
    problems = []
    for (page, argv, whole), result in zip(commands, results, strict=True):
        line = f"{page}: {script}.py {shlex.join(argv)}"
        if whole and result["error"] is not None:
            problems.append(f"{line}: {result['error']}")
        unknown = [word.split("=")[0] for word in argv if word.startswith("--")]
        unknown = [flag for flag in unknown if flag not in result["flags"]]  # type: ignore[operator]
        if unknown:
            problems.append(f"{line}: no flag {', '.join(unknown)}")
    assert not problems, "\n".join(problems)
