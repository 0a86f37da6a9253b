"""The launcher's side of the watchdog, the detached cancel escalator, and batched record writes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._local.procs import proc_start_ticks
from asynctorchx.schedulers._local.records import RecordStore

logger = logging.getLogger(__name__)

WATCHDOG_SCRIPT = Path(__file__).with_name("watchdog.py")
#: The watchdog never waits longer than this between SIGTERM and SIGKILL.
WATCHDOG_MAX_GRACE = 5.0

_clients: weakref.WeakSet[Watchdog] = weakref.WeakSet()


def _close_in_forked_child() -> None:
    # a fork of the launcher must not keep the watchdog's pipe open, or the launcher's death would
    # go unnoticed while the fork lives
    for client in list(_clients):
        client._forget_fd()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


def _script_argv(*args: str) -> list[str]:
    return [sys.executable, "-I", "-S", str(WATCHDOG_SCRIPT), *args]


class Watchdog:
    """Starts and feeds the per-scheduler watchdog process (see ``watchdog.py``).

    The watchdog holds the read end of a pipe whose only writer is this object: when the launcher
    closes it or dies, the watchdog stops every process group still registered. Writes never block
    the event loop (the pipe is non-blocking; what does not fit waits for the loop's writer
    callback). If the watchdog dies, the next write starts a new one and replays ``registrations()``.

    Args:
        records_dir: where app records live (the watchdog marks the apps it stops).
        registrations: the lines that describe everything currently registered (for a restart).
    """

    def __init__(self, records_dir: Path, registrations: Callable[[], Iterable[str]]) -> None:
        self._records_dir = records_dir
        self._registrations = registrations
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd = -1
        self._buf = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer_armed = False
        self._flush_scheduled = False
        self.start_ticks: int | None = None
        _clients.add(self)

    @property
    def pid(self) -> int | None:
        """The watchdog's pid, once started."""
        return None if self._proc is None else self._proc.pid

    def _forget_fd(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def ensure_started(self) -> None:
        """Starts the watchdog unless it is running. Blocks for about a millisecond (one spawn)."""
        if self._fd >= 0:
            return
        self._loop = asyncio.get_running_loop()
        if self._proc is not None:
            self._proc.poll()  # reap a dead predecessor
        read_fd, write_fd = os.pipe()
        try:
            self._proc = subprocess.Popen(
                _script_argv(
                    "watch", str(self._records_dir), str(os.getpid()), str(WATCHDOG_MAX_GRACE)
                ),
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        os.set_blocking(write_fd, False)
        self._fd = write_fd
        self.start_ticks = proc_start_ticks(self._proc.pid)
        self._buf.clear()
        replay = "".join(self._registrations())
        if replay:
            self._buf += replay.encode()
            self._flush()

    def send(self, line: str) -> None:
        """Queues one protocol line (with its ``\\n``); queued lines go out together, at the latest
        on the event loop's next iteration (or at ``flush``)."""
        if self._fd < 0:
            self.ensure_started()
            # the replay already covers the state this line reports
            return
        self._buf += line.encode()
        if not self._flush_scheduled and not self._writer_armed and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Writes the queued lines now (what the pipe cannot take goes out when it can)."""
        self._flush_scheduled = False
        if not self._writer_armed:
            self._flush()

    def _flush(self) -> None:
        while self._buf and self._fd >= 0:
            try:
                n = os.write(self._fd, self._buf)
            except BlockingIOError:
                if not self._writer_armed and self._loop is not None:
                    self._loop.add_writer(self._fd, self._flush)
                    self._writer_armed = True
                return
            except (BrokenPipeError, OSError) as e:
                logger.warning("the local watchdog went away (%s); starting a new one", e)
                self._disarm()
                self._forget_fd()
                self.ensure_started()
                return
            del self._buf[:n]
        self._disarm()

    def _disarm(self) -> None:
        if self._writer_armed and self._loop is not None and self._fd >= 0:
            self._loop.remove_writer(self._fd)
        self._writer_armed = False

    async def aclose(self) -> None:
        """Sends what is queued, closes the pipe and waits (up to ten seconds) for the watchdog to exit.

        Call it once every app was stopped and forgotten, or the watchdog will stop what is left.
        """
        with anyio.move_on_after(5.0):
            while self._buf and self._fd >= 0:
                self._flush()
                if self._buf:
                    await asyncio.sleep(0.005)
        self._disarm()
        self._forget_fd()
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                await anyio.to_thread.run_sync(proc.wait, 5.0)
            except subprocess.TimeoutExpired:
                logger.warning("the local watchdog (pid %d) did not exit; leaving it", proc.pid)
                proc.returncode = -1
        _clients.discard(self)


def start_escalator(
    records_dir: Path, app_id: str, grace: float, groups: Iterable[str]
) -> subprocess.Popen[bytes]:
    """Starts a detached process that SIGKILLs ``groups`` after ``grace`` seconds.

    It finishes a cancel started by a process that did not launch the app and may exit at once. The
    script forks at once and its first process exits: reap the returned process (it ends quickly).
    """
    return subprocess.Popen(
        _script_argv("escalate", str(records_dir), app_id, repr(float(grace)), *groups),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


class Reaper:
    """Reaps short-lived helper processes from the event loop (through their pidfds)."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def add(self, proc: subprocess.Popen[bytes]) -> None:
        """Reaps ``proc`` once it exits."""
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(proc.pid)
        self._procs[pidfd] = proc

        def on_exit() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self._procs.pop(pidfd, None)
            proc.wait()

        loop.add_reader(pidfd, on_exit)

    async def aclose(self) -> None:
        """Waits (a few seconds at most) for the helpers still running."""
        loop = asyncio.get_running_loop()
        procs, self._procs = self._procs, {}
        for pidfd, proc in procs.items():
            loop.remove_reader(pidfd)
            os.close(pidfd)
            try:
                await anyio.to_thread.run_sync(proc.wait, 5.0)
            except subprocess.TimeoutExpired:
                proc.returncode = -1


class RecordWriter:
    """Writes app records in batches from a worker thread: the latest document per app wins.

    Args:
        store: the record store.
        supervisor: owns the writing task.
    """

    def __init__(self, store: RecordStore, supervisor: TaskSupervisor) -> None:
        self._store = store
        self._supervisor = supervisor
        self._pending: dict[str, dict[str, Any]] = {}
        self._batch: asyncio.Future[dict[str, BaseException]] | None = None
        self._in_flight: asyncio.Future[dict[str, BaseException]] | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def put(self, app_id: str, doc: dict[str, Any]) -> asyncio.Future[dict[str, BaseException]]:
        """Queues ``doc`` as the record of ``app_id``; the future resolves once it is written.

        The future's result maps the app ids whose write failed to their error.
        """
        self._pending[app_id] = doc
        if self._batch is None:
            self._batch = asyncio.get_running_loop().create_future()
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None:
            self._task = self._supervisor.spawn(self._run(), "record-writer")
        self._wake.set()
        return self._batch

    async def write(self, app_id: str, doc: dict[str, Any]) -> None:
        """Queues ``doc`` and waits until it is on disk.

        Raises:
            OSError: it could not be written.
        """
        errors = await asyncio.shield(self.put(app_id, doc))
        if app_id in errors:
            raise errors[app_id]

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending:
                continue
            batch, self._pending = self._pending, {}
            done, self._batch = self._batch, None
            self._in_flight = done
            try:
                errors = await anyio.to_thread.run_sync(self._store.write_many, batch)
            except Exception as e:
                logger.exception("writing %d app records failed", len(batch))
                errors = dict.fromkeys(batch, e)
            finally:
                self._in_flight = None
            for app_id, err in errors.items():
                logger.warning("cannot write the record of app %s: %s", app_id, err)
            if done is not None and not done.done():
                done.set_result(errors)

    async def flush(self) -> None:
        """Waits until everything queued so far is written."""
        for fut in (self._in_flight, self._batch):
            if fut is not None:
                await asyncio.shield(fut)
