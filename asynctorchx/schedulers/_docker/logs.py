"""Decoding Docker's container log stream into lines. Pure, no I/O.

``GET /containers/{id}/logs`` (no TTY) answers with a multiplexed stream: frames of an 8-byte header
(stream id: 1 = stdout, 2 = stderr; three zero bytes; a big-endian payload size) and the payload.
With ``timestamps=1`` every payload is one log message prefixed with its RFC 3339 nanosecond time
and a space. Docker splits a line longer than 16 KiB into several messages; every part but the last
lacks the trailing ``\\n``, and the parts are joined back here, so a line is never truncated.
"""

from __future__ import annotations

import calendar
import re
import struct
from dataclasses import dataclass

STDOUT = 1
STDERR = 2

_HEADER = struct.Struct(">BxxxL")
_TS_RE = re.compile(rb"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")


@dataclass(frozen=True)
class LogLine:
    """One line of a container's output.

    Args:
        ts_ns: when Docker received the line's first byte (nanoseconds since the epoch).
        stream: ``STDOUT`` or ``STDERR``.
        text: the line, ending with ``\\n`` unless it is an unterminated last line.
    """

    ts_ns: int
    stream: int
    text: str


class FrameDecoder:
    """Splits a multiplexed log stream into ``(stream id, payload)`` frames, across any chunking."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Adds bytes read from the stream and returns the frames they complete."""
        self._buf += data
        frames: list[tuple[int, bytes]] = []
        offset = 0
        size = _HEADER.size
        while len(self._buf) - offset >= size:
            stream, length = _HEADER.unpack_from(self._buf, offset)
            if len(self._buf) - offset - size < length:
                break
            start = offset + size
            frames.append((stream, bytes(self._buf[start : start + length])))
            offset = start + length
        del self._buf[:offset]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still buffered."""
        return len(self._buf)


def parse_timestamp(raw: bytes) -> int | None:
    """An RFC 3339 time (as Docker writes it, up to nanoseconds) as nanoseconds since the epoch."""
    m = _TS_RE.fullmatch(raw)
    if not m:
        return None
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    frac = m.group(7) or b""
    try:
        secs = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    except (OverflowError, ValueError):
        return None
    tz = m.group(8)
    if tz != b"Z":
        sign = 1 if tz[:1] == b"+" else -1
        secs -= sign * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)
    return secs * 1_000_000_000 + int(frac.ljust(9, b"0") or b"0")


def format_api_time(ts_ns: int) -> str:
    """Nanoseconds since the epoch in the ``seconds.nanoseconds`` form Docker's ``since``/``until`` take."""
    secs, nanos = divmod(ts_ns, 1_000_000_000)
    return f"{secs}.{nanos:09d}"


class LineAssembler:
    """Turns timestamped log messages into whole lines, per stream.

    Invalid UTF-8 is replaced (U+FFFD), never raised.
    """

    def __init__(self) -> None:
        self._parts: dict[int, tuple[int, bytearray]] = {}

    def feed(self, stream: int, payload: bytes) -> LogLine | None:
        """Adds one message; returns the line it completes, if any."""
        head, sep, body = payload.partition(b" ")
        ts = parse_timestamp(head) if sep else None
        if ts is None:
            # Not timestamped (should not happen with timestamps=1): keep the bytes as they are.
            ts, body = -1, payload
        pending = self._parts.get(stream)
        if pending is None:
            pending = (ts, bytearray())
            self._parts[stream] = pending
        pending[1].extend(body)
        if not body.endswith(b"\n"):
            return None
        del self._parts[stream]
        return LogLine(pending[0], stream, pending[1].decode("utf-8", errors="replace"))

    def flush(self) -> list[LogLine]:
        """The unterminated lines still buffered (end of the log), oldest first; clears them."""
        lines = [
            LogLine(ts, stream, data.decode("utf-8", errors="replace"))
            for stream, (ts, data) in self._parts.items()
            if data
        ]
        self._parts.clear()
        return sorted(lines, key=lambda line: line.ts_ns)

    def discard(self) -> None:
        """Forgets buffered parts (the stream dropped; they will be read again)."""
        self._parts.clear()
