"""Clocks of the testing scheduler: real time, or a virtual clock that moves only when told to."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable
from datetime import datetime

#: Where a VirtualClock starts by default: 2023-11-14 22:13:20 UTC.
DEFAULT_START = 1_700_000_000.0


def _seconds(value: object, what: str, error: type[ValueError] = ValueError) -> float:
    """``value`` as seconds; ``error`` names ``what`` and the value unless it is finite and >= 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise error(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


class Timer:
    """A callback due at a time of a clock; ``cancel()`` stops it from being called."""

    __slots__ = ("_handle", "cancelled", "when")

    def __init__(self, when: float) -> None:
        self.when = when
        self.cancelled = False
        self._handle: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        """Stops the callback from being called (idempotent)."""
        self.cancelled = True
        if self._handle is not None:
            self._handle.cancel()


class _Clock:
    """What the testing scheduler needs of a clock."""

    def time(self) -> float:
        """The wall-clock time (POSIX seconds): log timestamps, ``since``/``until``."""
        raise NotImplementedError

    def monotonic(self) -> float:
        """Seconds that never go back: scripts are timed on it."""
        raise NotImplementedError

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Calls ``callback()`` once ``monotonic()`` reaches ``when``."""
        raise NotImplementedError

    async def sleep(self, seconds: float) -> None:
        """Returns once ``seconds`` have passed on this clock."""
        raise NotImplementedError


class RealClock(_Clock):
    """Real time, with timers on the running event loop."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(when)
        loop = asyncio.get_running_loop()
        timer._handle = loop.call_later(max(0.0, when - time.monotonic()), callback)
        return timer

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class VirtualClock(_Clock):
    """Time that moves only when the test calls ``advance``: no real sleeping, no flaky timing.

    Scripts of a ``ScriptedBackend`` built with this clock run on it (a transition at 60 s happens
    when the test has advanced the clock by 60 s), and it is a ``Clock`` for the runner's rate
    limits (``AsyncRunner(clock=...)``).

    Args:
        start: the wall-clock time the clock starts at (a POSIX timestamp or a datetime; naive
            means local time). It dates log lines and is what ``since``/``until`` compare to.
    """

    def __init__(self, start: float | datetime = DEFAULT_START) -> None:
        epoch = start.timestamp() if isinstance(start, datetime) else start
        if (
            isinstance(epoch, bool)
            or not isinstance(epoch, (int, float))
            or not math.isfinite(epoch)
        ):
            raise ValueError(f"start must be a datetime or a finite POSIX timestamp, got {start!r}")
        self._epoch = float(epoch)
        self._elapsed = 0.0
        self._timers: list[tuple[float, int, Timer, Callable[[], None]]] = []
        self._seq = itertools.count()

    def time(self) -> float:
        """The clock's wall-clock time (POSIX seconds): ``start`` plus the time advanced."""
        return self._epoch + self._elapsed

    def now(self) -> datetime:
        """``time()`` as a naive local datetime (what ``since``/``until`` take)."""
        return datetime.fromtimestamp(self.time())

    def monotonic(self) -> float:
        """Seconds advanced since the clock was made."""
        return self._elapsed

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Calls ``callback()`` when ``advance`` reaches ``when`` (at once on the next advance if due)."""
        timer = Timer(when)
        heapq.heappush(self._timers, (when, next(self._seq), timer, callback))
        return timer

    def advance(self, seconds: float) -> None:
        """Moves time forward by ``seconds``, firing what falls due in time order.

        Each callback runs with the clock set to its own due time; woken tasks (``sleep``, tail
        readers, the runner's waiters) run when the test next awaits.

        Raises:
            ValueError: ``seconds`` is negative, NaN, infinite or not a number.
        """
        self.advance_to(self._elapsed + _seconds(seconds, "advance"))

    def advance_to(self, monotonic: float) -> None:
        """Moves time forward to ``monotonic`` seconds since the clock was made (see ``advance``).

        Raises:
            ValueError: the time is in the clock's past or not a finite number.
        """
        target = _seconds(monotonic, "advance_to")
        if target < self._elapsed:
            raise ValueError(
                f"advance_to({monotonic!r}) is in the past: the clock is at {self._elapsed!r}"
            )
        while self._timers and self._timers[0][0] <= target:
            when, _, timer, callback = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._elapsed = max(self._elapsed, when)
            callback()
        self._elapsed = target

    @property
    def pending_timers(self) -> int:
        """How many timers wait for the clock (e.g. tasks in ``sleep``): a test can wait for them."""
        return sum(not t[2].cancelled for t in self._timers)

    @property
    def next_due(self) -> float | None:
        """When the next pending timer is due (``monotonic`` seconds), or None."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    async def sleep(self, seconds: float) -> None:
        """Returns once the test has advanced the clock by ``seconds`` (at once for 0)."""
        delay = _seconds(seconds, "sleep")
        if delay == 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        timer = self.call_at(self._elapsed + delay, wake)
        try:
            await future
        finally:
            timer.cancel()

    def __repr__(self) -> str:
        return f"<VirtualClock at {self._elapsed:g} s ({self.now().isoformat(sep=' ')})>"
