"""Launches that take turns with the exits someone waits for.

A local launch runs on the event loop from its start to its record write without yielding (about a
millisecond). A burst of launches, such as a sweep driver replacing the trials that just finished,
therefore fills one loop iteration with tens of milliseconds of launching, and every exit that
arrives meanwhile (the pidfd, its reaping, the app's record, the hub's round, the waiter: each a
step of its own) waits for that iteration and the next ones. Finished trials then queue behind the
launches of their replacements, ~200 ms in ``bench_sweep.py``.

``LaunchPacer`` lets launches start in an iteration until ``BUDGET`` seconds of them have run; the
rest wait for later iterations, in order, so that the exits in between are heard. It paces only
while someone waits for an exit (``wait``, ``as_completed``, a watch): when nobody does, a burst of
launches runs in one go, which costs least in all (one record write, one move and one reaping for
the whole batch).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

#: Launch work (seconds) allowed in one event-loop iteration while exits are awaited.
BUDGET = 0.005


class LaunchPacer:
    """Turns for launches: ``await pacer.turn()`` before each launch's synchronous part.

    Args:
        awaited: True while someone waits for an app to end (launches are paced only then).
    """

    def __init__(self, awaited: Callable[[], bool]) -> None:
        self._awaited = awaited
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._opened = 0.0  # perf_counter when this iteration's launches began; 0: none yet
        self._count = 0  # launches let go in this iteration
        self._cost = 0.001  # a launch's cost in seconds, averaged over the iterations

    @property
    def waiting(self) -> int:
        """Launches waiting for their turn."""
        return sum(not f.done() for f in self._waiting)

    async def turn(self) -> None:
        """Returns at once if the launch fits this iteration's budget (or nobody waits for an
        exit), else once its turn comes: in order of arrival, in a later iteration."""
        if not self._waiting:
            if not self._opened:
                if self._awaited():
                    self._open(1)
                return
            if time.perf_counter() - self._opened < BUDGET:
                self._count += 1
                return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        await fut  # a cancelled waiter is skipped; one cancelled after its turn came uses it up

    def _open(self, count: int) -> None:
        self._opened = time.perf_counter()
        self._count = count
        asyncio.get_running_loop().call_soon(self._next)

    def _next(self) -> None:
        """The next iteration: lets as many waiting launches go as the budget holds (at least
        one); they run in the iteration after this one."""
        if self._opened:
            each = (time.perf_counter() - self._opened) / self._count
            self._cost += 0.25 * (each - self._cost)
        self._opened = 0.0
        quota = max(1, int(BUDGET / max(self._cost, 1e-5)))
        released = 0
        while self._waiting and released < quota:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                released += 1
        if released:
            self._open(released)
