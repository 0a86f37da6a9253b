"""The progress of shipping a workspace (build, push, snapshot, copy), as ``run`` shows it on stderr.

On a terminal, one live line is rewritten with each line of output (cut to the terminal's
width) and a line is left for each finished stage. Elsewhere (a pipe, a CI log) only the start and
the end of each stage are written, one line each. ``--quiet`` writes nothing; a failure still shows
the last lines of the build's output.
"""

from __future__ import annotations

import shutil
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from asynctorchx.schedulers.workspace import WorkspaceEvent


class ProgressPrinter:
    """A ``progress=`` callback writing workspace events to ``stream``.

    Args:
        stream: where to write (stderr).
        live: rewrite one line with every event (a terminal); else only starts and ends.
        quiet: write nothing.
    """

    def __init__(self, stream: TextIO, *, live: bool, quiet: bool = False) -> None:
        self.stream = stream
        self.live = live
        self.quiet = quiet
        self._open = False
        self._started: set[tuple[str, str]] = set()

    @classmethod
    def for_stderr(cls, quiet: bool) -> ProgressPrinter:
        """A printer for stderr: live on a terminal (unless ``TERM=dumb``)."""
        import os

        try:
            tty = sys.stderr.isatty()
        except (AttributeError, ValueError):
            tty = False
        return cls(sys.stderr, live=tty and os.environ.get("TERM") != "dumb", quiet=quiet)

    def __call__(self, event: WorkspaceEvent) -> None:
        if self.quiet:
            return
        key = (event.stage, event.target)
        first = key not in self._started
        self._started.add(key)
        if event.final:
            self._started.discard(key)
            self._line(f"{event.stage}: {event.message}")
        elif self.live:
            width = max(shutil.get_terminal_size((100, 24)).columns - 1, 20)
            text = f"{event.stage}: {event.message}"
            if len(text) > width:
                text = text[: width - 1] + "…"
            self.stream.write(f"\r\x1b[K{text}")
            self.stream.flush()
            self._open = True
        elif first:
            self._line(f"{event.stage}: {event.message}")

    def _line(self, text: str) -> None:
        prefix = "\r\x1b[K" if self._open else ""
        self._open = False
        self.stream.write(f"{prefix}{text}\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends a live line left open (a failure in the middle of a stage)."""
        if self._open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._open = False


def print_log_tail(lines: list[str]) -> None:
    """The last lines of a failed build or push, on stderr, indented."""
    from asynctorchx.cli._output import DIM, err_styler

    if not lines:
        return
    style = err_styler()
    print(style("last lines of the output:", DIM), file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    sys.stderr.flush()
