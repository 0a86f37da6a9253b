"""Terminal output: colour decisions, ANSI styles, tables and messages on stderr.

Colour follows the usual conventions, per stream: ``NO_COLOR`` (non-empty) turns it off, else
``FORCE_COLOR`` (non-empty, not ``0``) turns it on, else it is on only when the stream is a terminal
whose ``TERM`` is not ``dumb``. Plain ANSI escapes are used (no rich): the CLI starts faster that way.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

RESET = "\x1b[0m"
BOLD = "1"
DIM = "2"
RED = "31"
GREEN = "32"
YELLOW = "33"
BLUE = "34"
MAGENTA = "35"
CYAN = "36"

# Distinct, readable on dark and light backgrounds; red is kept for errors and stderr markers.
REPLICA_PALETTE: tuple[str, ...] = (
    CYAN,
    MAGENTA,
    YELLOW,
    GREEN,
    BLUE,
    "96",
    "95",
    "93",
    "92",
    "94",
)

STATE_STYLES: dict[str, str] = {
    "SUCCEEDED": f"{BOLD};{GREEN}",
    "FAILED": f"{BOLD};{RED}",
    "CANCELLED": f"{BOLD};{YELLOW}",
    "UNKNOWN": f"{BOLD};{MAGENTA}",
    "RUNNING": BLUE,
    "PENDING": DIM,
    "SUBMITTED": DIM,
    "UNSUBMITTED": DIM,
}


def colour_enabled(stream: TextIO) -> bool:
    """Whether to write ANSI colours to ``stream`` (see the module docstring for the rules)."""
    if os.environ.get("NO_COLOR"):
        return False
    force = os.environ.get("FORCE_COLOR")
    if force and force != "0":
        return True
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Styler:
    """Applies ANSI styles to text written to one stream, or leaves it plain."""

    def __init__(self, stream: TextIO, enabled: bool | None = None) -> None:
        self.stream = stream
        self.enabled = colour_enabled(stream) if enabled is None else enabled

    def __call__(self, text: str, style: str) -> str:
        """``text`` wrapped in the SGR ``style`` (e.g. ``"1;31"``), or ``text`` when colour is off."""
        if not self.enabled or not style or not text:
            return text
        return f"\x1b[{style}m{text}{RESET}"

    def state(self, name: str, width: int = 0) -> str:
        """An app state's name, coloured by its meaning and padded to ``width``."""
        return self(name, STATE_STYLES.get(name, "")) + " " * max(0, width - len(name))


def err_styler() -> Styler:
    """A styler for ``sys.stderr``."""
    return Styler(sys.stderr)


def out_styler() -> Styler:
    """A styler for ``sys.stdout``."""
    return Styler(sys.stdout)


def info(message: str) -> None:
    """Writes a line of chatter to stderr (stdout is kept for results)."""
    print(message, file=sys.stderr, flush=True)


def print_error(prog: str, message: str, hint: str = "") -> None:
    """Writes ``PROG: error: MESSAGE (hint: HINT)`` as one line on stderr."""
    style = err_styler()
    tail = f"; {style('hint', DIM)}: {hint}" if hint else ""
    print(
        f"{prog}: {style('error', f'{BOLD};{RED}')}: {message}{tail}", file=sys.stderr, flush=True
    )


#: Characters a terminal would obey rather than show: C0 and C1 controls (ESC starts colour and
#: cursor sequences) and DEL. (Surrogates are left to stdout's error handler, below: one that
#: stands for a byte that is not UTF-8 is written as that byte.)
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """``text`` with its control characters as Python escapes (``\\x1b``, ``\\n``): text from a job
    (a role's argument, a tracker's metadata) holding ESC would otherwise recolour or rewrite the
    terminal, and a line break would pass for another field or row. (``--json`` escapes them its
    way.)"""
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], text)


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], style: Styler, state_col: int = -1
) -> str:
    """A plain-text table with aligned columns; the ``state_col`` column is coloured by state."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    last = len(headers) - 1

    def line(cells: Sequence[str], header: bool) -> str:
        parts = []
        for i, cell in enumerate(cells):
            pad = "" if i == last else " " * (widths[i] - len(cell))
            if header:
                parts.append(style(cell, BOLD) + pad)
            elif i == state_col:
                parts.append(style.state(cell) + pad)
            else:
                parts.append(cell + pad)
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers, True), *(line(r, False) for r in rows)])


def json_text(value: object, *, indent: int | None = 2, default: Any = None) -> str:
    """``value`` as strict JSON (what any parser reads): a NaN or infinite float is written as the
    string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, not as a bare token."""
    import json

    return json.dumps(_finite(value), indent=indent, default=default, allow_nan=False)


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def tolerant_output() -> None:
    """Makes stdout and stderr write what their encoding cannot hold rather than fail the command:
    a surrogate standing for a byte that was not UTF-8 (a file name's, an argument's, as Python
    decodes them) as that byte, any other character as a backslash escape (``\\ud800``)."""
    import codecs

    try:
        codecs.lookup_error(_ERRORS)
    except LookupError:
        codecs.register_error(_ERRORS, _escape_unencodable)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", None) in _FAILING:
            with contextlib.suppress(Exception):  # (a stream that cannot change: left alone)
                reconfigure(errors=_ERRORS)


_ERRORS = "asynctorchx.escape"
#: the error handlers that fail on some characters (surrogateescape: the C locale's default)
_FAILING = ("strict", "surrogateescape")


def _escape_unencodable(error: UnicodeError) -> tuple[bytes, int]:
    if not isinstance(error, UnicodeEncodeError):
        raise error
    out = bytearray()
    for char in error.object[error.start : error.end]:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(code - 0xDC00)
        else:
            out += char.encode("ascii", "backslashreplace")
    return bytes(out), error.end
