"""Engine timestamps on log lines: one RFC 3339 parser and one resume cursor.

Docker (``logs?timestamps=1``) and the kubelet (``log?timestamps=true``) both prefix every log line
with its RFC 3339 time at nanosecond precision and a space, and both can resume a log from a time
(Docker's ``since``, the kubelet's ``sinceTime``, rounded down to the second): the resumed stream
gives every line stamped at or after that time, in the order the log stores them. That order is
not the stamps' order: a line can carry an earlier time than the line stored ahead of it (both
engines stamp a line when they read it from its pipe, before the writer that stdout and stderr
share takes it). So a reader keeps a ``ResumeCursor``: a time at or before every line not read
yet, and how many lines read are stamped at or after it, which a resumed stream skips. The cursor
is two integers (and the size of an unfinished last line), so it can be handed out and taken back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

_NS = 1_000_000_000
_RFC3339 = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[Tt](\d\d):(\d\d):(\d\d)(?:\.(\d+))?(?:([Zz])|([+-])(\d\d):(\d\d))"
)
_PREFIX = re.compile(rb"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(?:\.\d+)?(?:[Zz]|[+-]\d\d:\d\d) ")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

#: how long before the newest line read (rounded down to the second) a ``ResumeCursor`` resumes:
#: the engines stamp a line before the writer shared by stdout and stderr stores it, so a line can
#: carry an earlier time than the one stored ahead of it (by microseconds: the writer's lock)
MARGIN_NS = _NS


def parse_rfc3339_ns(value: str | bytes) -> int:
    """An RFC 3339 time as integer nanoseconds since the epoch (exact: no float on the way).

    Accepts ``T`` or ``t``, ``Z``/``z`` or a ``+HH:MM``/``-HH:MM`` offset, and a fraction of any
    length (digits past the ninth are dropped). A leap second (``:60``) counts as the next second's
    start.

    Raises:
        ValueError: ``value`` is not such a time, or a field is out of range (names the value).
    """
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    m = _RFC3339.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not an RFC 3339 time: {value!r}")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    frac, sign, off_h, off_m = m.group(7), m.group(9), m.group(10), m.group(11)
    leap = second == 60
    try:
        if sign is not None and (int(off_h) > 23 or int(off_m) > 59):
            raise ValueError("the offset is out of range")
        base = datetime(year, month, day, hour, minute, 59 if leap else second, tzinfo=timezone.utc)
    except ValueError as e:
        raise ValueError(f"not an RFC 3339 time: {value!r} ({e})") from None
    delta = base - _EPOCH
    seconds = delta.days * 86_400 + delta.seconds + (1 if leap else 0)
    if sign is not None:
        offset = int(off_h) * 3600 + int(off_m) * 60
        seconds -= offset if sign == "+" else -offset
    nanos = int(frac[:9].ljust(9, "0")) if frac else 0
    return seconds * _NS + nanos


def split_timestamp(line: bytes) -> tuple[int | None, bytes]:
    """``(nanoseconds since the epoch, rest)`` of a line prefixed with an RFC 3339 time and a space.

    A line without such a prefix (or with an impossible date in it) comes back whole, with None:
    the engine wrote a line it did not stamp, which is returned rather than lost.
    """
    m = _PREFIX.match(line)
    if m is None:
        return None, line
    try:
        return parse_rfc3339_ns(line[: m.end() - 1]), line[m.end() :]
    except ValueError:
        return None, line


def seconds_to_ns(seconds: float) -> int:
    """A POSIX time (as ``LogQuery.since``/``until`` carry it) as nanoseconds, to the microsecond.

    The float came from a ``datetime``, which has microseconds: rounding to the microsecond gives
    back its exact value (a float of today's epoch seconds is off by up to ~0.1 µs).
    """
    return round(seconds * 1_000_000) * 1000


def format_rfc3339_seconds(ns: int) -> str:
    """Nanoseconds since the epoch as RFC 3339 in UTC, rounded down to the second."""
    return (_EPOCH + timedelta(seconds=ns // _NS)).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ResumeCursor:
    """How far a log has been read, as a time to resume from and a count of lines to skip there.

    The engines stamp a line when they read it from its pipe, before the writer that stdout and
    stderr share stores it, so a stored log's stamps can go back a little (by microseconds; more
    under load): a line can carry an earlier time than the line stored ahead of it. A stream
    resumed from a time (Docker's ``since``, the kubelet's ``sinceTime``) gives every line stamped
    at or after it, in stored order. So the cursor is:

    - ``since_ns``: a time at or before the stamp of every line after the cursor: the newest stamp
      read, rounded down to the second, less a margin (``MARGIN_NS``: a line is not stamped that
      much before a line stored ahead of it);
    - ``count``: how many lines before the cursor carry ``since_ns`` or later.

    A stream (re)opened at ``since_ns`` or before gives the lines before the cursor stamped before
    ``since_ns``, and the first ``count`` stamped at or after it, again: they are dropped, the rest
    is new. A first read (no ``since_ns`` yet) drops no line. A line stamped more than the margin
    before one stored ahead of it is read by a pass under way, but not by a resume from a cursor
    before it (the engine does not send it). The cursor does not depend on the query's time
    window (the reader applies it after the cursor): it is a place in the log. The lines counted
    are remembered per second of their stamps (two or three seconds' worth, not part of the
    cursor), rebuilt from the lines a resumed stream skips.

    A cursor of the earlier form (the last timestamp returned and how many lines carried it) reads
    as this one: exactly so where the stamps did not go back. A line still being written when a
    read ended (given out unterminated) is not counted: it is the next line after the cursor,
    given again whole once it has grown; ``partial`` is its size, so that it is not given again
    while it has not.

    Args:
        since_ns: where a resumed stream starts (None: from the start of the log, or of the
            query's window).
        count: how many lines read carry ``since_ns`` or later.
        partial: the size in bytes of the unterminated line returned after those (0: none).
    """

    since_ns: int | None = None
    count: int = 0
    partial: int = 0
    _seconds: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _newest: int | None = field(default=None, init=False, repr=False, compare=False)

    def begin_pass(self, opened_ns: int | None = None) -> CursorPass:
        """Starts reading a stream (re)opened at ``opened_ns`` (None: at its start), which is
        ``since_ns`` or before when ``since_ns`` is set."""
        self._seconds.clear()  # rebuilt from the lines skipped
        self._newest = None
        return CursorPass(self, opened_ns)

    def _skipped(self, ts: int) -> None:
        """Remembers a counted line read again (the rebuild of a resumed pass)."""
        second = ts // _NS
        self._seconds[second] = self._seconds.get(second, 0) + 1
        if self._newest is None or ts > self._newest:
            self._newest = ts

    def _returned(self, ts: int, opened_ns: int | None) -> None:
        """Moves the cursor past a new line: ``since_ns`` follows the newest stamp (never back,
        and never before where this pass was opened), ``count`` what is at or after it."""
        newest = ts if self._newest is None or ts > self._newest else self._newest
        self._newest = newest
        start = newest // _NS * _NS - MARGIN_NS
        since = self.since_ns
        if since is None:
            # lines before the opening were not read: the cursor cannot count them
            since = self.since_ns = start if opened_ns is None else max(start, opened_ns)
        elif start > since:
            since = self.since_ns = start
            first = start // _NS
            for second in [s for s in self._seconds if s < first]:
                self.count -= self._seconds.pop(second)
        if ts >= since:
            second = ts // _NS
            self._seconds[second] = self._seconds.get(second, 0) + 1
            self.count += 1


class CursorPass:
    """One read of a (re)opened stream: drops what the cursor says was returned before."""

    __slots__ = ("_cursor", "_floor", "_opened", "_skip")

    def __init__(self, cursor: ResumeCursor, opened_ns: int | None) -> None:
        self._cursor = cursor
        self._floor = cursor.since_ns
        self._opened = opened_ns
        self._skip = cursor.count

    def admit(self, ts: int | None) -> bool:
        """True when a line of timestamp ``ts`` is new (it is then counted as returned).

        A resumed pass drops the lines stamped before the cursor's ``since_ns`` and the first
        ``count`` at or after it: the lines before the cursor. Every later line is new, whatever
        its stamp; a first read drops none. A line without a timestamp cannot be placed: it is
        always new.
        """
        if ts is None:
            return True
        c = self._cursor
        if self._floor is not None:
            if ts < self._floor:
                return False
            if self._skip:
                self._skip -= 1
                c._skipped(ts)
                return False
        c.partial = 0
        c._returned(ts, self._opened)
        return True

    def admit_partial(self, ts: int | None, size: int) -> bool:
        """True when an unterminated last line of ``size`` bytes is new: it is not counted (it is
        the next line after the cursor), only its size is kept; the same unterminated line read
        again (same size) is not new, and neither is one the pass reads before the cursor."""
        c = self._cursor
        if ts is not None and self._floor is not None and (ts < self._floor or self._skip):
            return False
        if size == c.partial:
            return False
        c.partial = size
        return True
