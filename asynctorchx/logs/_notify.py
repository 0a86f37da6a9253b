"""In-process wake-ups: writers tell readers of the same directory that new data is there.

Readers register a ``Waker`` for a directory; ``wake_readers(directory)`` (called by every
``ReplicaLogWriter`` after it writes, reaches EOF or closes) sets them, from any thread, with a
``Wake`` reason. The registry also knows which directories have a live writer in this process
(anything that is a ``LiveWriter``), so a reader can ignore inotify events that the direct wake-up
already covered, and wait for that writer to drain before its final read. This module imports no
writer: the writers register themselves.
"""

from __future__ import annotations

import asyncio
import enum
import os
import threading
from typing import Generic, Protocol, TypeVar

from asynctorchx.logs._query import Stream


class LiveWriter(Protocol):
    """What a reader needs of a writer of its directory in this process."""

    @property
    def attached(self) -> int:
        """How many pipes still feed it."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that pumps its pipes."""

    async def wait_drained(self) -> None:
        """Returns once every attached pipe reached EOF and its data is written."""


T = TypeVar("T")


def directory_key(directory: str | os.PathLike[str]) -> str:
    """The registry key of a directory: its absolute, normalised path (no filesystem access)."""
    return os.path.normpath(os.path.abspath(os.fspath(directory)))


class Wake(enum.Enum):
    """Why a follower woke up (or why it reads again).

    When several wake-ups arrive before the reader runs, the one of highest ``priority`` is kept:
    the reasons that say the writer may be done (``may_be_done``) win over data, which wins over
    the timer, because after them the reader asks at once whether the replica finished.
    """

    NONE = "none"
    #: the reader's first pass (set by the reader itself)
    START = "start"
    #: the last read stopped at its size limit: more is there (set by the reader itself)
    MORE = "more"
    #: the reader's back-off timer ran out
    TIMER = "timer"
    #: a writer of this process wrote
    DATA = "data"
    #: inotify saw the directory change (a writer of another process, or the file appeared)
    INOTIFY = "inotify"
    #: a writer of this process opened the files
    CREATED = "created"
    #: a pipe of a writer of this process reached EOF
    EOF = "eof"
    #: a writer closed the files
    CLOSED = "closed"
    #: a backend said the replica's state changed (``wake_readers``)
    STATE = "state"

    @property
    def priority(self) -> int:
        """Which of two pending wake-ups is kept (the higher)."""
        return _PRIORITY[self]

    @property
    def may_be_done(self) -> bool:
        """True for the reasons after which the reader checks at once whether the replica ended."""
        return _PRIORITY[self] == _DONE_PRIORITY


_DONE_PRIORITY = 3
_PRIORITY = {
    Wake.NONE: 0,
    Wake.START: 1,
    Wake.MORE: 1,
    Wake.TIMER: 1,
    Wake.DATA: 2,
    Wake.INOTIFY: 2,
    Wake.CREATED: _DONE_PRIORITY,
    Wake.EOF: _DONE_PRIORITY,
    Wake.CLOSED: _DONE_PRIORITY,
    Wake.STATE: _DONE_PRIORITY,
}


class Waker:
    """An event a reader waits on, settable from any thread.

    Args:
        loop: the loop the reader runs on.
    """

    __slots__ = ("_event", "_loop", "reason", "stream")

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: Stream = Stream.COMBINED) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self.reason = Wake.NONE
        self.stream = stream

    def set(self, reason: Wake = Wake.DATA) -> None:
        """Wakes the reader (thread-safe)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._set(reason)
        else:
            try:
                self._loop.call_soon_threadsafe(self._set, reason)
            except RuntimeError:
                pass

    def _set(self, reason: Wake) -> None:
        if reason.priority > self.reason.priority:
            self.reason = reason
        self._event.set()

    def clear(self) -> None:
        """Forgets past wake-ups."""
        self._event.clear()
        self.reason = Wake.NONE

    def is_set(self) -> bool:
        """True when a wake-up is pending."""
        return self._event.is_set()

    async def wait(self, timeout: float) -> Wake:
        """Waits for a wake-up or ``timeout`` seconds; returns the reason (TIMER on timeout)."""
        if not self._event.is_set():
            handle = self._loop.call_later(max(timeout, 0.0), self._set, Wake.TIMER)
            try:
                await self._event.wait()
            finally:
                handle.cancel()
        return Wake.DATA if self.reason is Wake.NONE else self.reason


class _Registry(Generic[T]):
    """Sets of items by directory key, shared between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, set[T]] = {}

    def add(self, key: str, item: T) -> None:
        with self._lock:
            self._by_key.setdefault(key, set()).add(item)

    def remove(self, key: str, item: T) -> None:
        with self._lock:
            found = self._by_key.get(key)
            if found is not None:
                found.discard(item)
                if not found:
                    del self._by_key[key]

    def get(self, key: str) -> list[T]:
        with self._lock:
            return list(self._by_key.get(key, ()))

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._by_key


_wakers: _Registry[Waker] = _Registry()
_writers: _Registry[LiveWriter] = _Registry()


def add_waker(key: str, waker: Waker) -> None:
    """Registers ``waker`` for the directory ``key``."""
    _wakers.add(key, waker)


def remove_waker(key: str, waker: Waker) -> None:
    """Unregisters ``waker``."""
    _wakers.remove(key, waker)


def wake_readers(directory: str | os.PathLike[str], reason: Wake | str = Wake.STATE) -> None:
    """Wakes every reader of ``directory`` in this process (whatever stream it reads).

    A backend calls it when a replica's state changes (e.g. it becomes terminal) so that followers
    check ``is_finished`` at once instead of on their back-off timer. ``reason`` is a ``Wake`` or
    its value (e.g. ``"state"``).

    Raises:
        ValueError: ``reason`` is not a wake-up reason.
    """
    if not isinstance(reason, Wake):
        try:
            reason = Wake(reason)
        except ValueError:
            names = ", ".join(repr(w.value) for w in Wake)
            raise ValueError(f"reason must be a Wake or one of {names}, got {reason!r}") from None
    wake_key(directory_key(directory), reason)


def wake_key(key: str, reason: Wake = Wake.DATA, stream: Stream | None = None) -> None:
    """Wakes the readers of the directory ``key``: those of ``stream`` and of combined, or all."""
    for waker in _wakers.get(key):
        if stream is None or waker.stream is stream or waker.stream is Stream.COMBINED:
            waker.set(reason)


def add_writer(key: str, writer: LiveWriter) -> None:
    """Records that ``writer`` writes the directory ``key``."""
    _writers.add(key, writer)


def remove_writer(key: str, writer: LiveWriter) -> None:
    """Forgets ``writer``."""
    _writers.remove(key, writer)


def live_writers(key: str) -> list[LiveWriter]:
    """The writers of directory ``key`` open in this process."""
    return _writers.get(key)
