"""The ``tmas`` command's entry point: a Ctrl-C while the command's modules are imported (a second or so) ends it as
a stop before any work began, in one line with exit code 130, rather than in a traceback of the import. The handler
imports nothing: a module cut off part way may not import again."""

from __future__ import annotations

import sys

from tmas.cli.outcome import EXIT_INTERRUPTED, NOTHING_STARTED, stop_line


def main() -> None:
    try:
        from tmas.cli.main import main as command
    except KeyboardInterrupt:
        print(stop_line("Ctrl-C", NOTHING_STARTED), file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    command()
