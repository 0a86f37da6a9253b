"""The one owner of a backend's follow-ups (retries, stopping survivors, clean-up).

A backend that must act on an app after it changed (recreate failed replicas, stop the others once
one failed for good, remove what a finished app leaves) learns of the change from its engine's
event feed (Docker's ``/events``, the Kubernetes watch) and asks its ``Reconciler`` to look at the
app. The reconciler runs the backend's ``work(app_id)`` as a task of the scheduler's
``TaskSupervisor``: at most one task per app at a time, and a request that comes while it runs makes
it run once more afterwards, so work is never lost and never done twice at once. ``work`` reads the
app's state afresh and does what is still owed: it must be idempotent. Status reads never come here.

``finish_shielded`` runs clean-up that must finish (a cancel, the removal of a failed submit's
objects) as such a task, and waits for it even if the caller is cancelled meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import anyio

from asynctorchx._tasks import TaskSupervisor, await_shielded

T = TypeVar("T")

logger = logging.getLogger(__name__)


class Reconciler:
    """Runs ``work(app_id)`` for apps that changed, one task per app, owned by ``tasks``.

    Args:
        tasks: the scheduler's supervisor (closing it cancels the work under way).
        work: the backend's follow-up of one app; its errors are logged, never raised.
        label: names the backend in task names and log messages.
    """

    def __init__(
        self, tasks: TaskSupervisor, work: Callable[[str], Awaitable[None]], label: str
    ) -> None:
        self._tasks = tasks
        self._work = work
        self._label = label
        self._running: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._closing = False

    def request(self, app_id: str) -> None:
        """Asks for a look at ``app_id`` (soon, or once more after the look under way)."""
        if self._closing or self._tasks.closed:
            return
        if app_id in self._running:
            self._again.add(app_id)
            return
        self._running[app_id] = self._tasks.spawn(self._run(app_id), name=f"reconcile:{app_id}")

    def busy(self, app_id: str) -> bool:
        """True while a look at ``app_id`` is under way."""
        return app_id in self._running

    async def _run(self, app_id: str) -> None:
        try:
            while True:
                self._again.discard(app_id)
                try:
                    await self._work(app_id)
                except Exception as e:
                    logger.warning("%s: following up app %s failed: %s", self._label, app_id, e)
                if app_id not in self._again or self._closing:
                    return
        finally:
            self._running.pop(app_id, None)
            self._again.discard(app_id)

    async def wait_idle(self) -> None:
        """Returns once no look is under way (nor asked for again meanwhile)."""
        while self._running:
            await asyncio.wait(list(self._running.values()))

    async def drain(self, grace: float) -> None:
        """Takes no more requests and waits (at most ``grace`` seconds) for the looks under way."""
        self._closing = True
        pending = list(self._running.values())
        if pending:
            await asyncio.wait(pending, timeout=grace)


async def finish_shielded(tasks: TaskSupervisor, coro: Coroutine[Any, Any, T], name: str) -> T:
    """Runs ``coro`` to its end even if the caller is cancelled meanwhile, and returns its result.

    It runs as a task of ``tasks`` awaited through ``await_shielded`` (an anyio shield alone does
    not hold off ``Task.cancel()``); once ``tasks`` is closed, in the caller under a shield.
    """
    if tasks.closed:
        with anyio.CancelScope(shield=True):
            return await coro
    return await await_shielded(tasks.spawn(coro, name=name))


class CallsUnderWay:
    """Counts a backend's calls under way (its submits) so that ``close`` can let them finish."""

    def __init__(self) -> None:
        self._count = 0
        self._none = asyncio.Event()
        self._none.set()

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        """Counts the calls made inside."""
        self._count += 1
        self._none.clear()
        try:
            yield
        finally:
            self._count -= 1
            if not self._count:
                self._none.set()

    async def finished(self, limit: float) -> None:
        """Waits until no call is under way, at most ``limit`` seconds."""
        with anyio.move_on_after(limit):
            await self._none.wait()
