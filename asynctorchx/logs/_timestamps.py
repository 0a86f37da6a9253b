"""Engine timestamps on log lines: one RFC 3339 parser and one resume cursor.

Docker (``logs?timestamps=1``) and the kubelet (``log?timestamps=true``) both prefix every log line
with its RFC 3339 time at nanosecond precision and a space, and both can resume a log from a time
(Docker's ``since``, the kubelet's ``sinceTime``). A resumed stream starts with lines already read
(the kubelet rounds ``sinceTime`` down to the second; several lines can share one timestamp), so a
reader keeps a ``ResumeCursor``: the last timestamp it returned and how many lines of exactly that
timestamp it returned. The cursor is two integers, so it can be handed out and taken back later.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

_NS = 1_000_000_000
_RFC3339 = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[Tt](\d\d):(\d\d):(\d\d)(?:\.(\d+))?(?:([Zz])|([+-])(\d\d):(\d\d))"
)
_PREFIX = re.compile(rb"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(?:\.\d+)?(?:[Zz]|[+-]\d\d:\d\d) ")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


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
    """How far a log has been read: the last timestamp returned, and how many lines carried it.

    A line still being written when a read ended (given out unterminated) is not counted: it is
    the next line after the cursor, given again whole once it has grown; ``partial`` is its size,
    so that it is not given again while it has not.

    Args:
        last_ns: the timestamp of the last line returned (None: nothing returned yet).
        at_last: how many of the lines returned carry exactly ``last_ns``.
        partial: the size in bytes of the unterminated line returned after those (0: none).
    """

    last_ns: int | None = None
    at_last: int = 0
    partial: int = 0

    def begin_pass(self) -> CursorPass:
        """Starts reading a stream (re)opened at ``last_ns`` or before."""
        return CursorPass(self)


class CursorPass:
    """One read of a (re)opened stream: drops what the cursor says was returned before."""

    __slots__ = ("_cursor", "_skip")

    def __init__(self, cursor: ResumeCursor) -> None:
        self._cursor = cursor
        self._skip = cursor.at_last

    def admit(self, ts: int | None) -> bool:
        """True when a line of timestamp ``ts`` is new (it is then counted as returned).

        Lines older than the cursor, and the first ``at_last`` lines at its timestamp, were returned
        before. A line without a timestamp cannot be placed: it is always new.
        """
        c = self._cursor
        if ts is None:
            return True
        if c.last_ns is not None:
            if ts < c.last_ns:
                return False
            if ts == c.last_ns and self._skip > 0:
                self._skip -= 1
                return False
        if ts == c.last_ns:
            c.at_last += 1
        else:
            c.last_ns, c.at_last = ts, 1
        c.partial = 0
        self._skip = 0
        return True

    def admit_partial(self, ts: int | None, size: int) -> bool:
        """True when an unterminated last line of ``size`` bytes is new: it is not counted (it is
        the next line after the cursor), only its size is kept; the same unterminated line read
        again (same size) is not new. A line older than the cursor never is."""
        c = self._cursor
        if (
            ts is not None
            and c.last_ns is not None
            and (ts < c.last_ns or (ts == c.last_ns and self._skip > 0))
        ):
            return False
        if size == c.partial:
            return False
        c.partial = size
        return True
