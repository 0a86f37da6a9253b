"""Ctrl+C handling for one CLI command, installed on the command's own event loop.

The first SIGINT (or SIGTERM/SIGHUP) either cancels the command (the default: the runner closes and
stops the local apps it owns), or, inside ``Interrupts.race``, ends the race so that the command can
decide what to do (``run`` cancels a local app, or detaches from one that outlives the CLI). A second
signal exits at once with 128 + the signal number (130 for Ctrl+C); local apps left behind are
stopped by the local backend's watchdog, which sees its launcher go.

Only the CLI installs these handlers, for its own process; library code never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

#: After a first signal has cancelled the command, how long its clean-up may take before the user is
#: told that it is under way and how to skip it (a cancel waiting for an engine to stop a container
#: that ignores SIGTERM: its stop timeout, silent)
SLOW_FINISH = 0.5

_SIGNALS = tuple(
    s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None
)


class Interrupted(Exception):
    """Raised by ``Interrupts.race`` when a signal arrived before the raced coroutine finished."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


class Interrupts:
    """Signal handling of one command, bound to the running loop and its main task."""

    def __init__(self) -> None:
        self.count = 0
        self.signum: int | None = None
        self._event = asyncio.Event()
        self._racing = 0
        self._absorbed = 0
        self._main: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def exit_code(self) -> int:
        """128 + the first signal's number (130 for SIGINT)."""
        return 128 + (self.signum or signal.SIGINT)

    @property
    def interrupted(self) -> bool:
        """True once a signal has arrived."""
        return self.count > 0

    def install(self) -> None:
        """Handles the signals on the running loop; call from the command's main task."""
        self._loop = asyncio.get_running_loop()
        self._main = asyncio.current_task()
        for signum in _SIGNALS:
            try:
                self._loop.add_signal_handler(signum, self._on_signal, signum)
            except (NotImplementedError, RuntimeError, ValueError):
                pass

    def uninstall(self) -> None:
        """Restores the default handlers."""
        if self._loop is None or self._loop.is_closed():
            return
        for signum in _SIGNALS:
            try:
                self._loop.remove_signal_handler(signum)
            except (NotImplementedError, RuntimeError, ValueError):
                pass

    def _on_signal(self, signum: int) -> None:
        if self._absorbed:
            self._absorbed -= 1
            return
        self.count += 1
        if self.count > 1:
            self._exit_now(signum)
            return
        self.signum = signum
        self._event.set()
        if not self._racing and self._main is not None:
            self._main.cancel()
            if self._loop is not None:
                self._loop.call_later(SLOW_FINISH, self._still_finishing)

    def _still_finishing(self) -> None:
        if self.count != 1:  # (a second signal exits at once)
            return
        try:
            print(
                "\nasynctorchx: interrupted; finishing what is under way (waiting for the "
                "scheduler); Ctrl+C again to exit now",
                file=sys.stderr,
                flush=True,
            )
        except (OSError, ValueError):
            pass

    def _exit_now(self, signum: int) -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        try:
            print("\nasynctorchx: interrupted again, exiting now", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        os._exit(128 + (self.signum or signum))

    @contextlib.contextmanager
    def while_blocking(self) -> Iterator[None]:
        """Makes a signal interrupt the synchronous code run inside (e.g. a component file's import).

        Such code blocks the event loop, which therefore never runs the handlers ``install`` set: a
        file that loops at import ignored every Ctrl+C. Inside this block a signal raises
        ``asyncio.CancelledError`` in that code instead, as the loop's handler would have cancelled
        the command; outside it, the loop's handlers are back.
        """
        if self._loop is None or threading.current_thread() is not threading.main_thread():
            yield
            return

        def interrupt(signum: int, frame: object) -> None:
            self._absorbed += 1  # the loop hears of it too (its wakeup fd), later: not twice
            self.count += 1
            self.signum = self.signum or signum
            self._event.set()
            raise asyncio.CancelledError

        previous = {signum: signal.getsignal(signum) for signum in _SIGNALS}
        for signum in _SIGNALS:
            signal.signal(signum, interrupt)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    async def race(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` until it finishes or a first signal arrives.

        Returns:
            What ``coro`` returned.

        Raises:
            Interrupted: a signal arrived first; ``coro`` has been cancelled and awaited.
        """
        if self._event.is_set():
            coro.close()
            raise Interrupted(self.signum or signal.SIGINT)
        task = asyncio.ensure_future(coro)
        waiter = asyncio.ensure_future(self._event.wait())
        self._racing += 1
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._racing -= 1
            waiter.cancel()
            if not task.done():
                task.cancel()
            await asyncio.gather(task, waiter, return_exceptions=True)
        if task.cancelled():
            raise Interrupted(self.signum or signal.SIGINT)
        return task.result()
