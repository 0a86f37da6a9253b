"""In-process wake-ups: writers tell readers of the same directory that new data is there.

Readers register a ``Waker`` for a directory; ``wake_readers(directory)`` (called by every
``ReplicaLogWriter`` after it writes, reaches EOF or closes) sets them, from any thread. The registry also
knows which directories have a live writer in this process, so a reader can ignore inotify events that
the direct wake-up already covered, and wait for that writer to drain before its final read.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import TYPE_CHECKING

from asynctorchx.logs._query import Stream

if TYPE_CHECKING:
    from asynctorchx.logs._writer import ReplicaLogWriter

_lock = threading.Lock()
_wakers: dict[str, set[Waker]] = {}
_writers: dict[str, set[ReplicaLogWriter]] = {}


def directory_key(directory: str | os.PathLike[str]) -> str:
    """The registry key of a directory: its absolute, normalised path (no filesystem access)."""
    return os.path.normpath(os.path.abspath(os.fspath(directory)))


#: Wake-up reasons that say the writer may be done ("eof", "closed", "wake") win over data wake-ups,
#: which win over the timer: the reader checks ``is_finished`` at once after the former.
STATE_REASONS = frozenset({"eof", "closed", "wake", "created"})
_PRIORITY = {"": 0, "timer": 1, "data": 2, "inotify": 2, **dict.fromkeys(STATE_REASONS, 3)}


class Waker:
    """An event a reader waits on, settable from any thread.

    Args:
        loop: the loop the reader runs on.
    """

    __slots__ = ("_event", "_loop", "reason", "stream")

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: Stream = Stream.COMBINED) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self.reason = ""
        self.stream = stream

    def set(self, reason: str = "data") -> None:
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

    def _set(self, reason: str) -> None:
        if _PRIORITY.get(reason, 1) > _PRIORITY.get(self.reason, 0):
            self.reason = reason
        self._event.set()

    def clear(self) -> None:
        """Forgets past wake-ups."""
        self._event.clear()
        self.reason = ""

    def is_set(self) -> bool:
        """True when a wake-up is pending."""
        return self._event.is_set()

    async def wait(self, timeout: float) -> str:
        """Waits for a wake-up or ``timeout`` seconds; returns the reason (``"timer"`` on timeout)."""
        if not self._event.is_set():
            handle = self._loop.call_later(max(timeout, 0.0), self._set, "timer")
            try:
                await self._event.wait()
            finally:
                handle.cancel()
        return self.reason or "data"


def add_waker(key: str, waker: Waker) -> None:
    """Registers ``waker`` for the directory ``key``."""
    with _lock:
        _wakers.setdefault(key, set()).add(waker)


def remove_waker(key: str, waker: Waker) -> None:
    """Unregisters ``waker``."""
    with _lock:
        found = _wakers.get(key)
        if found is not None:
            found.discard(waker)
            if not found:
                del _wakers[key]


def wake_readers(directory: str | os.PathLike[str], reason: str = "wake") -> None:
    """Wakes every reader of ``directory`` in this process (whatever stream it reads).

    A backend calls it when a replica's state changes (e.g. it becomes terminal) so that followers
    check ``is_finished`` at once instead of on their back-off timer.
    """
    wake_key(directory_key(directory), reason)


def wake_key(key: str, reason: str = "data", stream: Stream | None = None) -> None:
    """Wakes the readers of the directory ``key``: those of ``stream`` and of combined, or all."""
    with _lock:
        wakers = list(_wakers.get(key, ()))
    for waker in wakers:
        if stream is None or waker.stream is stream or waker.stream is Stream.COMBINED:
            waker.set(reason)


def add_writer(key: str, writer: ReplicaLogWriter) -> None:
    """Records that ``writer`` writes the directory ``key``."""
    with _lock:
        _writers.setdefault(key, set()).add(writer)


def remove_writer(key: str, writer: ReplicaLogWriter) -> None:
    """Forgets ``writer``."""
    with _lock:
        found = _writers.get(key)
        if found is not None:
            found.discard(writer)
            if not found:
                del _writers[key]


def live_writers(key: str) -> list[ReplicaLogWriter]:
    """The writers of directory ``key`` open in this process."""
    with _lock:
        return list(_writers.get(key, ()))
