"""Decoding Docker's container log stream into lines. Pure, no I/O.

``GET /containers/{id}/logs`` (no TTY) answers with a multiplexed stream: frames of an 8-byte header
(stream id: 1 = stdout, 2 = stderr; three zero bytes; a big-endian payload size) and the payload.
With ``timestamps=1`` every payload is one log message prefixed with its RFC 3339 nanosecond time
and a space (parsed by ``asynctorchx.logs._timestamps``, which the Kubernetes backend shares). Docker splits a line longer than 16 KiB into several messages; every part but the last
lacks the trailing ``\\n``, and the parts are joined back here, so a line is never truncated.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from asynctorchx.logs._timestamps import split_timestamp

STDOUT = 1
STDERR = 2

_HEADER = struct.Struct(">BxxxL")


@dataclass(frozen=True)
class LogLine:
    """One line of a container's output.

    Args:
        ts_ns: when Docker received the line's first byte (nanoseconds since the epoch), or None
            for a message without a timestamp.
        stream: ``STDOUT`` or ``STDERR``.
        text: the line, ending with ``\\n`` unless it is an unterminated last line.
        size: the line's size in bytes, as the engine sent it.
    """

    ts_ns: int | None
    stream: int
    text: str
    size: int = 0


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


def format_api_time(ts_ns: int) -> str:
    """Nanoseconds since the epoch in the ``seconds.nanoseconds`` form Docker's ``since``/``until`` take."""
    secs, nanos = divmod(ts_ns, 1_000_000_000)
    return f"{secs}.{nanos:09d}"


class LineAssembler:
    """Turns timestamped log messages into whole lines, per stream.

    Invalid UTF-8 is replaced (U+FFFD), never raised.
    """

    def __init__(self) -> None:
        self._parts: dict[int, tuple[int | None, bytearray]] = {}

    def feed(self, stream: int, payload: bytes) -> LogLine | None:
        """Adds one message; returns the line it completes, if any."""
        # A message without a timestamp (not with timestamps=1) is kept as it is.
        ts, body = split_timestamp(payload)
        pending = self._parts.get(stream)
        if pending is None:
            pending = (ts, bytearray())
            self._parts[stream] = pending
        pending[1].extend(body)
        if not body.endswith(b"\n"):
            return None
        del self._parts[stream]
        data = pending[1]
        return LogLine(pending[0], stream, data.decode("utf-8", errors="replace"), len(data))

    def flush(self) -> list[LogLine]:
        """The unterminated lines still buffered (end of the log), oldest first; clears them."""
        lines = [
            LogLine(ts, stream, data.decode("utf-8", errors="replace"), len(data))
            for stream, (ts, data) in self._parts.items()
            if data
        ]
        self._parts.clear()
        return sorted(lines, key=lambda line: -1 if line.ts_ns is None else line.ts_ns)

    def discard(self) -> None:
        """Forgets buffered parts (the stream dropped; they will be read again)."""
        self._parts.clear()
