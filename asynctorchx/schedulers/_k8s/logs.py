"""Pod log lines: timestamps, filtering, and resuming a stream without duplicates.

The backend always reads pod logs with ``timestamps=true``: the kubelet prefixes each line with its
RFC 3339 time at nanosecond precision and a space. A stream that is resumed (after a dropped
connection) asks for ``sinceTime`` rounded down to the second, so it starts with lines already
seen; ``LogCursor`` skips them: everything before the last timestamp seen, and as many lines at that
exact timestamp as were already yielded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

from asynctorchx.schedulers._k8s.status import parse_time_ns

_PREFIX = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:\d\d)) ")


def split_timestamp(line: str) -> tuple[int | None, str]:
    """``(nanoseconds since the epoch, text)`` of a timestamped log line (text keeps its ``\\n``).

    A line without a timestamp prefix is returned whole, with None.
    """
    m = _PREFIX.match(line)
    if not m:
        return None, line
    return parse_time_ns(m.group(1)), line[m.end() :]


def to_rfc3339_seconds(ns: int) -> str:
    """Nanoseconds since the epoch as RFC 3339 in UTC, rounded down to the second (``sinceTime``)."""
    seconds = ns // 1_000_000_000
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def datetime_to_ns(value: datetime) -> int:
    """A datetime (naive = local time) as nanoseconds since the epoch."""
    if value.tzinfo is None:
        value = value.astimezone()
    delta = value - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000


@dataclass
class LogCursor:
    """How far a pod's log has been read: the last timestamp and the lines yielded at it."""

    last_ns: int | None = None
    at_last: int = 0

    def since_time(self) -> str | None:
        """The ``sinceTime`` to resume from, or None to read from the start."""
        return None if self.last_ns is None else to_rfc3339_seconds(self.last_ns)

    def begin_pass(self) -> _Pass:
        """Starts reading a (re)opened stream."""
        return _Pass(self)


class _Pass:
    def __init__(self, cursor: LogCursor) -> None:
        self._cursor = cursor
        self._skip_at_last = cursor.at_last

    def accept(self, ts: int | None) -> bool:
        """True when a line with timestamp ``ts`` is new (and records it as read)."""
        c = self._cursor
        if ts is None:
            return True
        if c.last_ns is not None:
            if ts < c.last_ns:
                return False
            if ts == c.last_ns and self._skip_at_last > 0:
                self._skip_at_last -= 1
                return False
        if ts == c.last_ns:
            c.at_last += 1
        else:
            c.last_ns = ts
            c.at_last = 1
        self._skip_at_last = 0
        return True
