"""What a log read asks for: the ``Stream`` enum and ``LogQuery``, one validated and frozen request.

Every backend's ``log_iter`` takes the same arguments; ``Scheduler.log_iter`` checks them once, here,
and hands the backend a ``LogQuery``, so that a bad argument raises the same error, with the same
message, at the call, whichever backend reads the log.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from datetime import datetime
from enum import Enum

from asynctorchx.logs._cursor import CursorKind, LogCursor, parse_cursor


class Stream(str, Enum):
    """Which output of a replica ``log_iter`` reads."""

    STDOUT = "stdout"
    STDERR = "stderr"
    #: everything the replica wrote, both streams in the order they arrived (the default)
    COMBINED = "combined"


ALL_STREAMS: frozenset[Stream] = frozenset(Stream)
_STREAMS = {s.value: s for s in Stream}


def compile_log_regex(regex: str | re.Pattern[str] | None) -> re.Pattern[str] | None:
    """Compiles a log filter (None or ``""``: no filter). A compiled pattern is taken as it is,
    with its flags (``re.IGNORECASE``...): TorchX passes ``regex`` to ``re.compile``, which returns
    a compiled pattern unchanged. Either way ``LineFilter`` then checks the pattern (a risky one is
    matched with a time limit, or refused when too large).

    Raises:
        ValueError: the pattern does not compile (names it).
        TypeError: ``regex`` is neither a string nor a compiled string pattern (a bytes pattern
            cannot match the lines, which are str).
    """
    if isinstance(regex, re.Pattern):
        if not isinstance(regex.pattern, str):
            raise TypeError(
                f"regex must be a string or a compiled str pattern, got the bytes pattern "
                f"{regex.pattern!r}: log lines are str (compile it from a str)"
            )
        return regex
    if regex is None or regex == "":
        return None
    if not isinstance(regex, str):
        raise TypeError(f"regex must be a string or a compiled str pattern, got {regex!r}")
    try:
        return re.compile(regex)
    except (re.error, OverflowError, RecursionError) as e:
        # (a repetition count too large, or groups nested too deep, are not re.error)
        shown = repr(regex) if len(regex) <= 200 else f"{regex[:200]!r}... ({len(regex)} chars)"
        raise ValueError(f"invalid log regex {shown}: {e}") from None


def to_timestamp(value: datetime | None, name: str) -> float | None:
    """A datetime (naive = local time) as a POSIX timestamp, or None.

    Raises:
        TypeError: ``value`` is not a datetime (names ``name``).
        ValueError: ``value`` has no POSIX timestamp (e.g. a naive ``datetime.min``; names it).
    """
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise TypeError(f"{name} must be a datetime, got {value!r}")
    try:
        return value.timestamp()
    except (ValueError, OverflowError) as e:
        raise ValueError(f"{name} ({value}) is out of range: {e}") from None


def check_time_window(
    since: datetime | None, until: datetime | None
) -> tuple[float | None, float | None]:
    """Validates ``since``/``until`` and returns them as POSIX timestamps.

    Raises:
        ValueError: ``since`` is after ``until``, or one of them is out of range.
        TypeError: one of them is not a datetime.
    """
    lo, hi = to_timestamp(since, "since"), to_timestamp(until, "until")
    check_window_order(lo, hi, since, until)
    return lo, hi


def check_window_order(lo: float | None, hi: float | None, since: object, until: object) -> None:
    """Raises ValueError, naming ``since`` and ``until`` as given, when ``lo`` is after ``hi``."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"since ({since}) is after until ({until})")


def parse_stream(
    streams: Stream | str | None, supported: Collection[Stream], reader: str
) -> Stream:
    """The stream asked for (COMBINED when None), checked against what ``reader`` can read.

    Args:
        reader: who reads, for the error message (e.g. ``"the slurm scheduler"``).

    Raises:
        ValueError: an unknown stream, or one the reader cannot read (lists those it can).
    """
    if streams is None:
        stream: Stream | None = Stream.COMBINED
    else:
        value = streams.value if isinstance(streams, Stream) else streams
        stream = _STREAMS.get(value) if isinstance(value, str) else None
    if stream is None or stream not in supported:
        can = ", ".join(s.value for s in Stream if s in supported)
        raise ValueError(f"unsupported log stream {streams!r}; {reader} reads {can}")
    return stream


@dataclass(frozen=True, slots=True)
class LogQuery:
    """A checked ``log_iter`` request.

    Args:
        app_id: the app's id on its scheduler.
        role: the role's name.
        k: the replica's index (>= 0; whether the role has it is the backend's to tell).
        regex: the filter (``re.search``), or None.
        since: only lines written at or after this POSIX time, or None.
        until: only lines written at or before this POSIX time, or None.
        follow: follow the log until the app is terminal, then drain it (``should_tail``).
        stream: which output to read.
        after: resume after the line this cursor was taken at (checked: it was taken on this
            app, role, replica and stream selection), or None.
    """

    app_id: str
    role: str
    k: int
    regex: re.Pattern[str] | None
    since: float | None
    until: float | None
    follow: bool
    stream: Stream
    after: LogCursor | None = None

    @classmethod
    def build(
        cls,
        backend: str,
        supported: Collection[Stream],
        app_id: str,
        role_name: str,
        k: int,
        regex: str | re.Pattern[str] | None,
        since: datetime | None,
        until: datetime | None,
        should_tail: bool,
        streams: Stream | str | None,
        cursor: str | None = None,
        cursor_kind: CursorKind | None = None,
    ) -> LogQuery:
        """Checks ``log_iter``'s arguments for ``backend``.

        Raises:
            ValueError: an unsupported stream, an invalid regex, ``since`` after ``until``, a
                negative replica index, or a cursor that is malformed or was taken elsewhere.
            TypeError: an argument of the wrong type (names it).
            NotImplementedError: a cursor for a backend that cannot resume (``cursor_kind`` None).
        """
        for name, value in (("app_id", app_id), ("role_name", role_name)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a string, got {value!r}")
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"the replica index k must be an int, got {k!r}")
        if k < 0:
            raise ValueError(f"the replica index k must be >= 0, got {k}")
        stream = parse_stream(streams, supported, f"the {backend} scheduler")
        pattern = compile_log_regex(regex)
        lo, hi = check_time_window(since, until)
        after = None
        if cursor is not None:
            after = parse_cursor(cursor, cursor_kind, backend, app_id, role_name, k, stream.value)
        return cls(app_id, role_name, k, pattern, lo, hi, bool(should_tail), stream, after)

    def matches(self, line: str) -> bool:
        """True when ``line`` passes the regex filter."""
        return self.regex is None or self.regex.search(line) is not None

    def in_window(self, t: float) -> bool:
        """True when a line written at POSIX time ``t`` is within ``since``/``until``."""
        return (self.since is None or t >= self.since) and (self.until is None or t <= self.until)


async def filter_regex(
    regex: str | re.Pattern[str] | None, lines: AsyncIterator[str]
) -> AsyncIterator[str]:
    """The lines of ``lines`` that match ``regex`` (all of them when it is None; a compiled pattern
    is used as it is, as TorchX's ``filter_regex`` uses it)."""
    pattern = compile_log_regex(regex)
    async for line in lines:
        if pattern is None or pattern.search(line):
            yield line


def split_lines(text: str) -> list[str]:
    """Splits ``text`` on ``\\n`` only; lines keep it, ``\\r`` stays inside, a final partial line
    is kept."""
    parts = text.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out
