"""The log iterations a runner hands out, and how its ``close()`` ends them.

``log_lines``/``log_entries`` are async generators over a scheduler's ``log_iter``/``log_entries``
(the source). A tail on a backend whose apps outlive the runner (Slurm, Docker, Kubernetes) never
ends by itself, so ``close()`` ends every iteration still open, each where it stands:

- parked at a ``yield`` (its reader is in its loop body, or gone): a ``_Closing`` thrown in at
  once (synchronously, before its reader can resume it) parks it again, so that the reader's next
  step raises "the runner was closed while reading logs" without touching the source, which the
  close then closes (``aclose``);
- parked in an ``await`` of the source (a tail waiting for the next line): the task driving it is
  cancelled, and the iteration turns that cancellation into the same RuntimeError (the task is not
  left cancelled: ``Task.uncancel``); ``close()`` waits (bounded) until it has ended. A source
  whose clean-up hangs holds its reader no longer than ``close_timeout`` either: one still
  unwinding the cancellation then is cancelled again, and its close is bounded likewise.

Nothing is paid per line: the iteration is one plain async-generator layer (a 200 000-line read
costs what it did); the bookkeeping is done once per iteration, and the work at ``close()``.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import math
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Reading:
    """One iteration handed out: its generator (weakly: a reader may drop it) and its source."""

    __slots__ = (
        "__weakref__",
        "cancels",
        "closing",
        "driver",
        "ended",
        "gen",
        "source",
        "source_closing",
        "unwound",
    )

    def __init__(self) -> None:
        self.gen: weakref.ref[AsyncGenerator[Any, None]] | None = None
        self.source: AsyncIterator[Any] | None = None
        self.closing = False  # the runner is ending it
        self.source_closing = False  # the runner closes its source (the reader must not)
        self.driver: asyncio.Task[Any] | None = None  # the task the runner cancelled to end it
        self.cancels = 0  # how many times the runner cancelled it
        self.unwound = False  # out of its source (whatever ended it): no more cancellations
        self.ended = asyncio.Event()


class LogReadings:
    """The runner's open log iterations; ``aclose`` ends them all (see the module's docstring)."""

    def __init__(self) -> None:
        self._open: set[_Reading] = set()
        self._closed = False
        self._timeout = math.inf  # close_timeout, once aclose is called

    def __len__(self) -> int:
        return len(self._open)

    def read(
        self, open_source: Callable[[], Awaitable[AsyncIterator[T]]], what: str
    ) -> AsyncGenerator[T, None]:
        """An async generator over the source ``open_source()`` makes at its first step.

        Args:
            open_source: opens the scheduler's iterator (checks and rate limits included).
            what: the end of the RuntimeError a close raises: "the runner was closed while ...".
        """
        reading = _Reading()
        gen = self._iterate(reading, open_source, what)
        reading.gen = weakref.ref(gen)
        return gen

    async def _iterate(
        self,
        reading: _Reading,
        open_source: Callable[[], Awaitable[AsyncIterator[T]]],
        what: str,
    ) -> AsyncGenerator[T, None]:
        source = await open_source()
        reading.source = source
        if self._closed:  # closed while the source was being opened
            await _aclose(source)
            raise RuntimeError(f"the runner was closed while {what}")
        self._open.add(reading)
        try:
            # one plain async-generator layer: cheaper per line than any hand-written __anext__
            try:
                async for item in source:
                    try:
                        yield item
                    except _Closing:
                        # thrown in by the close (``_stop_at_yield``): this yield hands it back at
                        # once, and the reader's next step raises, without touching the source
                        yield None  # type: ignore[misc]
                        raise
                    del item  # not held while the next one is read (a huge line: one copy)
            except asyncio.CancelledError:
                if reading.driver is None or not _uncancel(reading.driver, reading.cancels):
                    raise
                raise RuntimeError(f"the runner was closed while {what}") from None
            except Exception:
                if not reading.closing:
                    raise
                # (the source was closed under it: "already running", or its own error)
                raise RuntimeError(f"the runner was closed while {what}") from None
            if reading.closing:  # the source ended as the close began (or swallowed its end)
                if reading.driver is not None:
                    _uncancel(reading.driver, reading.cancels)
                raise RuntimeError(f"the runner was closed while {what}")
        finally:
            reading.unwound = True
            self._open.discard(reading)
            try:
                if reading.closing and not reading.source_closing:
                    await self._aclose_ended(source)
                elif not reading.source_closing:
                    await _aclose(source)
            finally:
                reading.ended.set()

    async def _aclose_ended(self, source: AsyncIterator[Any]) -> None:
        """Closes the source of an iteration the runner's close ended, in the reader's task, for
        at most ``close_timeout``: a source whose close hangs must not hold its reader forever
        (the runner's close waits for it only that long)."""
        with anyio.move_on_after(self._timeout) as scope:
            await _aclose_logged(source)
        if scope.cancelled_caught:
            logger.warning(
                "a log iteration's source did not close within %.3g s of the runner's close "
                "(AsyncRunner close_timeout): abandoned",
                self._timeout,
            )

    async def aclose(self, timeout: float) -> None:  # noqa: ASYNC109
        """Ends every open iteration (see the module's docstring); at most ``timeout`` seconds.

        Every iteration is marked first, so that one whose source is slow to close cannot leave
        the others reading; the sources are closed concurrently.
        """
        self._closed = True
        self._timeout = timeout
        parked: list[_Reading] = []  # in an await: their tasks end them
        at_yield: list[AsyncIterator[Any]] = []  # their sources are closed from here
        for reading in list(self._open):
            reading.closing = True
            gen = None if reading.gen is None else reading.gen()
            if gen is None or reading.source is None:
                continue  # dropped by its reader: its finalizer closes the source
            if getattr(gen, "ag_running", False):
                parked.append(reading)
                continue
            # parked at a yield: stopped now (its reader may be about to resume it), and its
            # source, which nothing runs now, is closed from here
            reading.source_closing = True
            _stop_at_yield(gen)
            at_yield.append(reading.source)
        drivers = _drivers([r.gen for r in parked if r.gen is not None])
        for reading in parked:
            driver = drivers.get(id(reading.gen))
            if driver is None:
                logger.warning("a log iteration could not be stopped: its task was not found")
                continue
            reading.driver = driver
            reading.cancels += 1
            driver.cancel()
        with anyio.move_on_after(timeout) as scope:
            async with anyio.create_task_group() as tg:
                for source in at_yield:
                    tg.start_soon(_aclose_logged, source)
            for reading in parked:
                if reading.driver is not None:
                    await reading.ended.wait()
        if scope.cancelled_caught:
            for reading in parked:
                # a source still unwinding the first cancellation (a ``finally`` that hangs):
                # cancelled again, so that its reader is not held by it for good
                if reading.driver is not None and not reading.unwound:
                    reading.cancels += 1
                    reading.driver.cancel()
            logger.warning(
                "the log iterations did not all end within %.3g s of the runner's close "
                "(AsyncRunner close_timeout)",
                timeout,
            )


class _Closing(Exception):
    """Thrown by the runner's close into a log iteration parked at a yield."""


def _stop_at_yield(gen: AsyncGenerator[Any, None]) -> None:
    """Throws ``_Closing`` into ``gen`` (parked at a yield) and runs it, synchronously, to its
    next yield: from then on its reader's next step raises. Synchronously, because the reader may
    be the next to run: it would resume the source, which the close could then not close."""
    step = gen.athrow(_Closing())
    try:
        step.send(None)
    except StopIteration:
        return
    except BaseException:
        logger.exception("stopping a log iteration failed")
        return
    step.close()  # (cannot happen: the handler yields before any await)
    logger.error("a log iteration did not stop at once")


async def _aclose_logged(source: AsyncIterator[Any]) -> None:
    """Closes ``source``; what its close raises is logged (also a BaseException of the
    backend's own, which would abort the runner's close), but for a cancellation, a
    KeyboardInterrupt or a SystemExit."""
    try:
        await _aclose(source)
    except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
        raise
    except BaseException:
        logger.exception("closing a log iteration failed")


async def _aclose(source: AsyncIterator[Any]) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()


def _uncancel(task: asyncio.Task[Any], times: int) -> bool:
    """Takes back the runner's ``times`` cancellations of ``task`` (the current task); False when
    another cancellation is pending too (that one wins: the CancelledError goes on)."""
    if task is not asyncio.current_task():
        return False
    uncancel = getattr(task, "uncancel", None)  # Python 3.11+ (3.10 cannot tell: taken back)
    cancelling = getattr(task, "cancelling", None)
    if uncancel is None or cancelling is None:
        return True
    left: int = cancelling()
    for _ in range(min(times, left)):
        left = uncancel()
    return left == 0


def _drivers(
    gens: list[weakref.ref[AsyncGenerator[Any, None]]],
) -> dict[int, asyncio.Task[Any]]:
    """The tasks whose chain of awaits runs through each of ``gens`` (parked in an await), by
    ``id`` of the weak reference: one walk per task, however many generators are looked for."""
    wanted: dict[int, weakref.ref[AsyncGenerator[Any, None]]] = {}
    for ref in gens:
        gen = ref()
        if gen is not None:
            wanted[id(gen)] = ref
    found: dict[int, asyncio.Task[Any]] = {}
    if not wanted:
        return found
    for task in asyncio.all_tasks():
        for node in _await_chain(task.get_coro()):
            match = wanted.get(id(node))
            if match is not None and match() is node:
                found[id(match)] = task
    return found


def _await_chain(obj: object) -> Iterator[object]:
    """The objects a task's coroutine awaits, from the outside in (bounded)."""
    for _ in range(1000):
        yield obj
        nxt = (
            getattr(obj, "cr_await", None)
            or getattr(obj, "ag_await", None)
            or getattr(obj, "gi_yieldfrom", None)
        )
        if nxt is None:
            if inspect.iscoroutine(obj) or inspect.isasyncgen(obj) or inspect.isgenerator(obj):
                return
            # the awaitables of an async generator's step (``__anext__``, ``anext()``, ``athrow``)
            # name their generator only as a referent
            nxt = next(
                (
                    r
                    for r in gc.get_referents(obj)
                    if inspect.isasyncgen(r) or inspect.iscoroutine(r)
                ),
                None,
            )
            if nxt is None:
                return
        obj = nxt
