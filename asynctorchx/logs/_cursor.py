"""Log cursors: opaque strings that resume a replica's log exactly after a given line.

A cursor is ``"v1."`` followed by the base64url (unpadded) of a compact JSON object: the app, role,
replica and stream it was taken on, the kind of position (which backend family made it) and the
position itself. The position depends on the backend:

- ``file`` (local, Slurm): ``[file, offset]``, the stream whose file was read and the byte offset
  just past the line in it;
- ``docker``: ``[attempt, container id]`` then, for each stream read (stdout, then stderr),
  ``since ns, count, partial``: each stream has its own cursor (and its own unfinished last line).
  ``partial`` is the size of an unterminated line given out after the counted ones (0: none), see
  ``ResumeCursor``. An older single-stream cursor ``[attempt, container id, timestamp ns, count]``
  still reads (``partial`` 0); an older combined one (one count for both streams) cannot be placed
  exactly, and is rejected;
- ``kubernetes``: ``[pod uid, since ns, count]``;
- ``index`` (the testing scheduler): ``[number of lines of the selection read]``.

The engine backends' ``since ns, count`` is a ``ResumeCursor``: a time at or before the stamp of
every line after the cursor (the newest stamp read, to the second, less a margin: the engines'
stamps can go back a little along the log) and how many lines read carry that time or later, which
a log resumed from that time gives again and the reader skips; so lines with equal or out-of-order
stamps are neither repeated nor skipped. The earlier form of these two numbers (the last timestamp
returned and how many lines carried it) reads the same way: exact where the stamps did not go
back, as that form was. Decoding checks the cursor's shape and what it is bound to, so that a damaged
or foreign cursor is a one-line ValueError at the call rather than a wrong read; a forged position
of the right shape is caught by the reader (a file offset past the file's end, a container that
is not the replica's), as a ValueError when read. A file offset inside a line is how the cursor of
an unfinished last line reads (see ``iter_log_entries``): it resumes at that line's start.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal, NamedTuple

CursorKind = Literal["file", "docker", "kubernetes", "index"]

_PREFIX = "v1."
_STREAMS = frozenset({"stdout", "stderr", "combined"})
# one encoder: json.dumps with separators= builds a new one per call (half the cost of a cursor)
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_MAX_LEN = 8192
_SHAPES: dict[str, tuple[type, ...]] = {
    "file": (str, int),
    "docker": (int, str, int, int, int),
    "kubernetes": (str, int, int),
    "index": (int,),
}

Position = tuple[int | str, ...]
"""A backend's place in a replica's log (its shape is fixed by the cursor's kind)."""


class LogEntry(NamedTuple):
    """One log line and the cursor that resumes the log right after it."""

    cursor: str
    line: str


def _show(text: object) -> str:
    """``text`` as an error message names it (a very long one shortened)."""
    r = repr(text)
    return r if len(r) <= 120 else f"{r[:100]}...{r[-12:]} ({len(r)} chars)"


@dataclass(frozen=True, slots=True)
class LogCursor:
    """A decoded cursor (see the module docstring).

    Args:
        app_id: the app's id on its scheduler.
        role: the role's name.
        k: the replica's index.
        stream: the stream selection it was taken with (a ``Stream`` value: this module sits
            below ``_query``, which decodes cursors).
        kind: which backend family made it (fixes the shape of ``position``).
        position: where the line it was taken at ends.
    """

    app_id: str
    role: str
    k: int
    stream: str
    kind: CursorKind
    position: Position

    def encode(self) -> str:
        """The cursor as an opaque, URL-safe string."""
        return CursorEncoder(self.app_id, self.role, self.k, self.stream, self.kind)(self.position)

    @classmethod
    def decode(cls, text: object) -> LogCursor:
        """Parses a cursor string and checks its shape (not what it is bound to: see ``check``).

        Raises:
            ValueError: not a cursor of this library, or a damaged one (names the value).
        """
        if not isinstance(text, str):
            raise ValueError(f"a log cursor must be a string, got {_show(text)}")
        if not text.startswith(_PREFIX) or len(text) > _MAX_LEN:
            raise ValueError(f"malformed log cursor {_show(text)}: not a v1 cursor")
        body = text[len(_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            doc = json.loads(raw)
        except (binascii.Error, ValueError, RecursionError):
            raise ValueError(f"malformed log cursor {_show(text)}: undecodable") from None
        try:
            app_id, role, k, stream, kind, position = (
                doc["a"],
                doc["r"],
                doc["k"],
                doc["s"],
                doc["x"],
                tuple(doc["p"]),
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"malformed log cursor {_show(text)}: missing fields") from None
        shape = _SHAPES.get(kind) if isinstance(kind, str) else None
        if kind == "docker" and stream in _STREAMS:
            if stream == "combined" and len(position) == 4:
                raise ValueError(
                    f"log cursor {_show(text)} is an older combined Docker cursor (one count for "
                    "both streams), which cannot be resumed exactly: read the log again without it"
                )
            shape = _docker_shape(stream, len(position))
        ok = (
            isinstance(app_id, str)
            and isinstance(role, str)
            and stream in _STREAMS
            and _is_count(k)
            and shape is not None
            and len(position) == len(shape)
            and all(
                _is_count(v) if t is int else isinstance(v, t)
                for v, t in zip(position, shape, strict=True)
            )
        )
        if not ok:
            raise ValueError(f"malformed log cursor {_show(text)}: fields out of range")
        return cls(app_id, role, k, stream, kind, position)

    def check(
        self, text: str, kind: CursorKind, app_id: str, role: str, k: int, stream: str
    ) -> None:
        """Raises ValueError (naming the cursor) unless it was taken on this log and backend."""
        for what, mine, theirs in (
            ("backend kind", self.kind, kind),
            ("app", self.app_id, app_id),
            ("role", self.role, role),
            ("replica", self.k, k),
            ("streams", self.stream, stream),
        ):
            if mine != theirs:
                raise ValueError(
                    f"log cursor {_show(text)} was taken on {what} {mine!r}, not {theirs!r}"
                )


class CursorEncoder:
    """Encodes the cursors of one read (same app, role, replica, streams and kind) fast.

    The JSON object's fixed part is padded with spaces (JSON whitespace) to a multiple of three
    bytes, so its base64 is computed once and each cursor only encodes its position.
    """

    __slots__ = ("_head",)

    def __init__(self, app_id: str, role: str, k: int, stream: str, kind: CursorKind) -> None:
        fixed = {"a": app_id, "r": role, "k": k, "s": stream, "x": kind}
        head = json.dumps(fixed, separators=(",", ":"), ensure_ascii=False)[:-1].encode()
        head += b" " * (-(len(head) + 5) % 3) + b',"p":'
        self._head = _PREFIX + base64.urlsafe_b64encode(head).decode("ascii")

    def __call__(self, position: Position) -> str:
        tail = _JSON(position).encode() + b"}"
        return self._head + base64.urlsafe_b64encode(tail).rstrip(b"=").decode("ascii")


def _docker_shape(stream: str, length: int) -> tuple[type, ...]:
    """The shape of a Docker position taken on ``stream`` (an older single-stream one is 4 long)."""
    if stream != "combined" and length == 4:
        return (int, str, int, int)
    return (int, str) + (int, int, int) * (2 if stream == "combined" else 1)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63


def parse_cursor(
    text: object,
    kind: CursorKind | None,
    backend: str,
    app_id: str,
    role: str,
    k: int,
    stream: str,
) -> LogCursor:
    """Decodes ``text`` and checks it was taken on this app, role, replica, streams and backend.

    Raises:
        NotImplementedError: ``kind`` is None: the backend cannot resume logs.
        ValueError: a malformed cursor, or one taken elsewhere (names the value).
    """
    if kind is None:
        raise NotImplementedError(f"the {backend} scheduler does not support log cursors")
    cursor = LogCursor.decode(text)
    assert isinstance(text, str)
    cursor.check(text, kind, app_id, role, k, stream)
    return cursor


async def lines_of(
    entries: AsyncGenerator[tuple[Position, str], None],
) -> AsyncGenerator[str, None]:
    """The lines of ``(position, line)`` pairs: a read that needs no cursors, over a backend that
    reads with positions (closes ``entries`` when closed)."""
    async with contextlib.aclosing(entries):
        async for _, line in entries:
            yield line
