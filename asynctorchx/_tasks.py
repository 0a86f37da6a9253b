"""Owned background tasks.

Every background task in asynctorchx belongs to a ``TaskSupervisor`` whose owner (a scheduler, the
runner's StatusHub) closes it: closing cancels every task still running and waits for them. No task is
created bare, so none outlives its owner or loses its exception silently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TaskSupervisor:
    """A set of background tasks owned by one object and cancelled together by ``aclose``.

    Args:
        name: a label used in task names and log messages.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once ``aclose`` has been called."""
        return self._closed

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(
        self, coro: Coroutine[Any, Any, T], name: str | None = None, *, observed: bool = False
    ) -> asyncio.Task[T]:
        """Starts ``coro`` as a task owned by this supervisor. Its failure is logged as an error,
        unless ``observed``: a caller awaits its result and handles the exception itself.

        Raises:
            RuntimeError: the supervisor is closed (the coroutine is closed, not leaked).
        """
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self._name}: cannot start a task after close()")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self._name}:{name or 'task'}")
        self._tasks.add(task)
        task.add_done_callback(self._on_observed if observed else self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("background task %s failed", task.get_name(), exc_info=exc)

    def _on_observed(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.debug("task %s failed (its caller has the error): %r", task.get_name(), exc)

    async def join(self) -> None:
        """Waits until every task started so far, and every task those start, has finished."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def aclose(self) -> None:
        """Cancels every task still running and waits until they have all finished. Idempotent."""
        self._closed = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def in_thread_shielded(func: Callable[..., T], *args: Any) -> T:
    """Runs ``func(*args)`` in a worker thread and waits for it even if the caller is cancelled
    meanwhile (``await_shielded``): clean-up such as removing what a failed launch made.

    Not ``anyio.to_thread.run_sync`` under a shield: it checks for cancellation before it starts
    the thread, so in a cancelled scope the clean-up would never run.
    """
    return await await_shielded(asyncio.get_running_loop().run_in_executor(None, func, *args))


async def await_shielded(task: asyncio.Future[T]) -> T:
    """Waits until ``task`` has finished, even if the caller is cancelled meanwhile.

    Clean-up that must not be cut short runs as a task and is awaited through this. Both kinds of
    cancellation are held off: an anyio cancel scope's (through a shield) and ``Task.cancel()``
    (which an anyio shield alone lets through on asyncio). A cancellation that arrived meanwhile is
    raised once the task has finished; otherwise the task's result is returned or its exception
    raised.
    """
    cancelled = await wait_held(task)
    if cancelled is not None:
        raise cancelled
    return task.result()


async def wait_held(task: asyncio.Future[Any]) -> BaseException | None:
    """Waits until ``task`` has finished with both kinds of cancellation held off (see
    ``await_shielded``); returns the cancellation that arrived meanwhile, if any, for the caller
    to raise once it has dealt with the task's outcome."""
    cancelled: BaseException | None = None
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError as e:
                cancelled = e
    return cancelled
