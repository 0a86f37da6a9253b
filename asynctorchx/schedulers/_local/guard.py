"""The launcher's guards: its watchdog, the containment of its replicas, the detached cancel
escalator, and batched record writes."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import select
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor, await_shielded, in_thread_shielded
from asynctorchx.schedulers._local import contain, protocol
from asynctorchx.schedulers._local.procs import proc_start_ticks
from asynctorchx.schedulers._local.records import RecordStore
from asynctorchx.schedulers._local.spares import CHUNK as SPARES_CHUNK

logger = logging.getLogger(__name__)

WATCHDOG_SCRIPT = Path(__file__).with_name("watchdog.py")
#: The watchdog never waits longer than this between SIGTERM and SIGKILL.
WATCHDOG_MAX_GRACE = 5.0
#: How long a registration may wait for room in a full pipe before the watchdog counts as stuck
#: (it is then replaced, and the new one gets every registration).
SEND_TIMEOUT = 5.0
_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)

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
    """Starts, feeds and keeps alive the per-scheduler watchdog process (see ``watchdog.py``).

    The watchdog holds the read end of a pipe whose only writer is this object: when the launcher
    closes it or dies, the watchdog stops every app still registered. ``send_now`` writes through
    before returning (registrations: no replica may exist that the watchdog does not know); a full
    pipe is waited on, boundedly. The watchdog's pidfd is watched by the event loop: if it dies it is
    reaped and replaced at once, and the new one gets ``registrations()`` (everything live).

    Args:
        records_dir: where app records live (the watchdog records the apps it stops).
        registrations: the lines that describe everything currently registered (for a restart).
        on_restart: called after a replacement watchdog was started (its pid changed).
    """

    def __init__(
        self,
        records_dir: Path,
        registrations: Callable[[], Iterable[bytes]],
        on_restart: Callable[[], None] = lambda: None,
    ) -> None:
        self._records_dir = records_dir
        self._registrations = registrations
        self._on_restart = on_restart
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd = -1
        self._pidfd = -1
        self._buf = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_scheduled = False
        self._closing = False
        self.base_cgroup: str | None = None
        #: descriptors the watchdog inherits: the lock of the launcher's claims (``protocol.py``),
        #: which it keeps until it exits, so no claim is taken over while it may still act on it
        self.keep_fds: tuple[int, ...] = ()
        self.start_ticks: int | None = None
        self.restarts = 0
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
        """Starts the watchdog unless it runs. Blocks for about a millisecond (one spawn)."""
        if self._fd >= 0 or self._closing:
            return
        self._loop = asyncio.get_running_loop()
        self._adopt(*self._spawn())

    def _spawn(self) -> tuple[subprocess.Popen[bytes], int]:
        """A new watchdog process and the (non-blocking) write end of its pipe."""
        read_fd, write_fd = os.pipe()
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(write_fd, _F_SETPIPE_SZ, _PIPE_SIZE)
            proc = subprocess.Popen(
                _script_argv(
                    "watch",
                    str(self._records_dir),
                    str(os.getpid()),
                    str(WATCHDOG_MAX_GRACE),
                    self.base_cgroup or "-",
                ),
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=self.keep_fds,
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        os.set_blocking(write_fd, False)
        return proc, write_fd

    def _adopt(self, proc: subprocess.Popen[bytes], write_fd: int) -> None:
        """Makes ``proc`` the watchdog (its pipe's write end ``write_fd``) and registers
        everything with it."""
        assert self._loop is not None
        self._proc = proc
        self._fd = write_fd
        self.start_ticks = proc_start_ticks(proc.pid)
        try:
            self._pidfd = os.pidfd_open(proc.pid)
            self._loop.add_reader(self._pidfd, self._on_died)
        except OSError as e:  # no pidfd: a dead watchdog is then noticed at the next write
            logger.warning("cannot watch the local watchdog (pid %d): %s", proc.pid, e)
            self._pidfd = -1
        self._buf = bytearray(b"".join(self._registrations()))
        self._write_through()

    def send_now(self, line: bytes) -> None:
        """Writes ``line`` (and anything queued before it) to the watchdog before returning."""
        self._buf += line
        if self._fd < 0:
            self._replace("it was not running")
            return
        self._write_through()

    def send_later(self, line: bytes) -> None:
        """Queues ``line``; queued lines go out together on the event loop's next iteration."""
        self._buf += line
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_queued)

    def restart(self, why: str) -> None:
        """Replaces a running watchdog by a new one (which gets every registration), e.g. to give
        it new ``keep_fds``."""
        if self._proc is not None:
            self._replace(why, kill=True)

    def _flush_queued(self) -> None:
        self._flush_scheduled = False
        if self._buf and not self._closing:
            if self._fd < 0:
                self._replace("it was not running")
            else:
                self._write_through()

    def _write_through(self) -> None:
        deadline: float | None = None
        while self._buf:
            try:
                n = os.write(self._fd, self._buf)
            except BlockingIOError:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + SEND_TIMEOUT
                if now >= deadline:
                    self._replace(f"its pipe stayed full for {SEND_TIMEOUT:g} s", kill=True)
                    return
                poller = select.poll()
                poller.register(self._fd, select.POLLOUT)
                poller.poll(max(1, int((deadline - now) * 1000)))
                continue
            except OSError as e:
                self._replace(f"writing to it failed: {e}")
                return
            del self._buf[:n]

    def _on_died(self) -> None:
        if self._closing or self._proc is None or self._proc.poll() is None:
            return
        self._replace(f"it exited with status {self._proc.returncode}")

    def _replace(self, why: str, kill: bool = False) -> None:
        """Replaces the watchdog: reaps (or kills) the old one, starts a new one, replays.

        A watchdog that still runs (``kill``) is replaced only once its successor has started: if
        none can be (no memory or pids left), it stays and keeps guarding the apps, and the
        OSError is raised (the launch that asked fails; the replacement is tried again at the
        next ``restart`` or stuck write). It is SIGKILLed before its pipe is closed: the end of
        its input would have it stop every app.
        """
        if self._closing:
            return
        old = self._proc
        logger.warning(
            "the local watchdog%s is gone (%s); starting a new one",
            f" (pid {old.pid})" if old is not None else "",
            why,
        )
        successor = None
        if kill and old is not None and self._fd >= 0:
            try:
                successor = self._spawn()
            except OSError as e:
                logger.warning(
                    "cannot start a new local watchdog (%s); the one running (pid %d) stays",
                    e,
                    old.pid,
                )
                raise
        self._detach_pidfd()
        if old is not None:
            if kill:
                with contextlib.suppress(OSError):
                    old.kill()
            try:
                old.wait(1.0)
            except subprocess.TimeoutExpired:
                logger.warning("the old local watchdog (pid %d) did not exit", old.pid)
                old.returncode = -1
        self._forget_fd()
        self._proc = None
        self.restarts += 1
        if successor is None:
            self.ensure_started()
        else:
            self._adopt(*successor)
        self._on_restart()

    def _detach_pidfd(self) -> None:
        if self._pidfd >= 0:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._pidfd)
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = -1

    def __del__(self) -> None:
        # collected unclosed: its event loop ended without the scheduler's close(). Closing the
        # pipe has the watchdog stop and record what is still registered, then exit (it would
        # otherwise wait for this process's death, and the descriptors would stay open meanwhile)
        if self._closing or (self._fd < 0 and self._pidfd < 0):
            return
        self._closing = True
        loop = self._loop
        if self._pidfd >= 0 and loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):  # (another thread's loop, or one shutting down)
                loop.remove_reader(self._pidfd)
        for fd in (self._pidfd, self._fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._pidfd = self._fd = -1

    async def aclose(self) -> None:
        """Sends what is queued, closes the pipe and waits (up to five seconds) for the watchdog.

        Call it once every app was stopped and forgotten, or the watchdog will stop what is left.
        """
        if self._buf and self._fd >= 0:
            self._write_through()
        self._closing = True
        self._detach_pidfd()
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
    records_dir: Path, app_id: str, grace: float, cgroup: str | None, groups: Iterable[str]
) -> subprocess.Popen[bytes]:
    """Starts a detached process that SIGKILLs what is left of an app after ``grace`` seconds.

    It finishes a cancel started by a process that did not launch the app and may exit at once. The
    script forks at once and its first process exits: reap the returned process (it ends quickly).
    """
    return subprocess.Popen(
        _script_argv(
            "escalate", str(records_dir), app_id, repr(float(grace)), cgroup or "-", *groups
        ),
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


# -- batching work into worker threads ------------------------------------------------------------


class Batcher:
    """Runs ``work(items)`` in a worker thread for the items put since the last run, one run at a
    time, so that a burst of requests costs one thread hop.

    Args:
        supervisor: owns the task that drives the runs.
        name: the task's name.
        work: the blocking function (it must not raise; its exceptions are logged).
    """

    def __init__(
        self, supervisor: TaskSupervisor, name: str, work: Callable[[list[Any]], None]
    ) -> None:
        self._supervisor = supervisor
        self._name = name
        self._work = work
        self._items: list[Any] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._running: list[asyncio.Future[None]] = []

    def put(self, item: Any) -> asyncio.Future[None]:
        """Queues ``item``; the future resolves once a run that included it has finished."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._items.append(item)
        self._waiters.append(fut)
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None and not self._supervisor.closed:
            self._task = self._supervisor.spawn(self._run(), self._name)
        self._wake.set()
        return fut

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._items:
                continue
            items, self._items = self._items, []
            self._running, self._waiters = self._waiters, []
            try:
                await anyio.to_thread.run_sync(self._work, items)
            except Exception:
                logger.exception("%s failed", self._name)
            finally:
                for fut in self._running:
                    if not fut.done():
                        fut.set_result(None)
                self._running = []

    async def flush(self) -> None:
        """Waits until everything queued so far was processed."""
        pending = [f for f in (*self._running, *self._waiters) if not f.done()]
        if pending:
            await asyncio.wait(pending)


# -- containment ------------------------------------------------------------------------------------


@dataclass(eq=False)
class MoveJob:
    """A just-spawned replica to move into its cgroup in a worker thread (``CgroupMover``);
    ``result`` is where it is confined (None: found by its marker)."""

    cgroup: str
    pid: int
    marker: str
    #: the replica's pidfd (-1: unknown), to tell a process that has exited already
    pidfd: int = -1
    result: str | None = None
    done: bool = False
    #: it was reaped before its move: it must not be moved (its pid may be reused)
    cancelled: bool = False


class CgroupMover:
    """Moves just-spawned replicas into their cgroups in a worker thread, the moves asked for
    meanwhile in one batch.

    A move waits for an RCU grace period of the kernel (5-20 ms here) when no migration happened
    in the last few milliseconds. A launch that finds the lock cold hands its moves to this thread
    instead of waiting: ``run()`` returns as soon as its replicas are spawned and recorded, and the
    caller watches a replica's exit only once its move is done, so a replica is never reaped (and
    its pid reused) under its move. Until then a replica is found by its marker and its process
    group, as in marker mode, and what it starts meanwhile is moved with it (``contain.adopt``).

    Args:
        supervisor: owns the task that hands the batches to the thread.
        containment: does each move (``Containment.adopt``).
    """

    def __init__(self, supervisor: TaskSupervisor, containment: Containment) -> None:
        self._supervisor = supervisor
        self._containment = containment
        self._queue: list[tuple[list[MoveJob], asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    def put(self, jobs: list[MoveJob]) -> asyncio.Future[None]:
        """Queues ``jobs``; the future resolves once all of them are done (it never fails). When
        the scheduler is closing they are done at once, on the calling thread."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._task is None:
            try:
                self._task = self._supervisor.spawn(self._run(), "cgroup-moves")
            except RuntimeError:  # closing
                self._move(jobs)
                fut.set_result(None)
                return fut
        self._queue.append((jobs, fut))
        return fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list[tuple[list[MoveJob], asyncio.Future[None]]] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                jobs = [job for group, _ in batch for job in group]
                await await_shielded(loop.run_in_executor(None, self._move, jobs))
                _resolve(batch)
                batch = []
        finally:
            self._task = None
            left, self._queue = batch + self._queue, []
            if left:  # cancelled (closing): what the thread did not do is done here
                self._move([job for group, _ in left for job in group if not job.done])
                _resolve(left)

    def _move(self, jobs: list[MoveJob]) -> None:
        todo = [job for job in jobs if not job.cancelled and not job.done]
        # a replica that exited already (a zombie until the loop reaps it, after this) is not
        # moved: the kernel skips an exiting process, after waiting for the migration lock all the
        # same (0.1-0.3 ms a move in a burst, 5-15 ms cold); what it left is found by the sweep
        exited = [has_exited(job.pidfd) for job in todo]
        if not all(exited):
            self._containment.warm_up()
        self._containment.adopt_jobs(todo, exited, siblings={job.pid for job in jobs})
        for job in jobs:
            job.done = True


def has_exited(pidfd: int) -> bool:
    """True when the child process of ``pidfd`` has exited (it is not reaped: ``WNOWAIT``)."""
    if pidfd < 0:
        return False
    try:
        return os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except OSError:
        return False


def _resolve(batch: list[tuple[list[MoveJob], asyncio.Future[None]]]) -> None:
    for _, fut in batch:
        if not fut.done():
            fut.set_result(None)


class Containment:
    """Where a scheduler's replicas are confined (``contain.py``), and the asynchronous parts of it.

    ``probe`` (blocking, once) picks cgroup mode or marker mode. In cgroup mode every app gets
    ``{base}/{app_id}`` and every replica attempt ``{app}/{index}.{attempt}`` (``replica_dir``);
    they are created just before the replicas are spawned (``prepare``). A replica is moved into
    its own right after its spawn (``adopt``): on the event loop while the kernel's migration lock
    is warm (a move happened in the last ``WARM_FOR`` seconds), else in a worker thread (``mover``),
    so that a launch never waits for the lock's grace period. Emptied cgroups are removed in
    batches in a worker thread.

    Args:
        supervisor: owns the background tasks (removals, marker sweeps).
    """

    def __init__(self, supervisor: TaskSupervisor) -> None:
        self._supervisor = supervisor
        contain.keep_reserve()  # (a kill must be possible with no descriptor left)
        self.base: str | None = None
        self._parent: str | None = None
        self._own_path: str | None = None
        self._probed = False
        self._warm_until = 0.0
        self.mover = CgroupMover(supervisor, self)
        self._remover = Batcher(supervisor, "cgroup-removal", self._remove_all)
        self._sweeper = Batcher(supervisor, "marker-sweep", self._sweep_all)
        self._epoll: select.epoll | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._empty_waits: dict[int, tuple[str, asyncio.Future[None]]] = {}
        #: moves made on the event loop, and how many of them took more than a millisecond
        self.moves = 0
        self.slow_moves = 0

    @property
    def uses_cgroups(self) -> bool:
        """True in cgroup mode."""
        return self.base is not None

    def probe(self) -> None:
        """Picks the mode (blocking: call it in a worker thread). Idempotent."""
        if self._probed:
            return
        self._probed = True
        self.base = contain.make_base()
        self._parent = os.path.dirname(self.base) if self.base else None
        self._own_path = contain.own_cgroup_path()
        logger.debug(
            "local containment: %s", f"cgroup v2 under {self.base}" if self.base else "marker"
        )

    def app_dir(self, app_id: str) -> str | None:
        """The cgroup of an app (None in marker mode)."""
        return None if self.base is None else os.path.join(self.base, app_id)

    @staticmethod
    def replica_dir(app_dir: str | None, index: int, attempt: int, replicas: int) -> str | None:
        """The cgroup of attempt ``attempt`` (from 1) of the replica at ``index`` of an app of
        ``replicas`` replicas: ``{app}/{index}.{attempt}``, except the first attempt of a
        single-replica app, which runs in the app's cgroup itself (one directory less to create
        and remove for the most common app)."""
        if app_dir is None:
            return None
        if replicas == 1 and attempt == 1:
            return app_dir
        return os.path.join(app_dir, f"{index}.{attempt}")

    #: How long after a migration the next one counts as fast (the lock stays in its fast state
    #: for about a grace period after its last writer).
    WARM_FOR = 0.003
    #: Apps with more cgroups than this create them in a worker thread.
    SYNC_DIRS = 16

    @property
    def warm(self) -> bool:
        """True when a migration happened just now (the next one will not wait)."""
        return time.monotonic() < self._warm_until

    async def prepare(self, dirs: list[str]) -> None:
        """Creates ``dirs`` (parents first): a handful on the event loop (~50 us each), more in a
        worker thread, which then readies the kernel for fast moves (the app's replicas are moved
        on the loop).

        Raises:
            OSError: a directory could not be created.
        """
        if self.base is None:
            return
        if len(dirs) <= self.SYNC_DIRS:
            self._make_dirs(dirs)
        else:
            await anyio.to_thread.run_sync(self._prepare, dirs)

    @staticmethod
    def _make_dirs(dirs: list[str]) -> None:
        # parents come first, so one mkdir each (makedirs would stat every one first)
        for d in dirs:
            try:
                os.mkdir(d)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
            except FileNotFoundError:  # a parent is missing (the base was removed)
                os.makedirs(d, exist_ok=True)

    def _prepare(self, dirs: list[str]) -> None:
        self._make_dirs(dirs)
        self._warm()

    def _warm(self) -> None:
        # a no-op move of this process into the cgroup it is in pays the grace-period wait of the
        # migration lock here, rather than in the first move on the event loop
        if self._parent is not None and contain.own_cgroup_path() == self._own_path:
            with contextlib.suppress(OSError):
                contain.move(self._parent, os.getpid())
        self._warm_until = time.monotonic() + self.WARM_FOR

    def warm_up(self) -> None:
        """Readies the kernel for fast moves unless a move happened just now (blocking): a no-op
        move of this process first makes the next real move take ~0.15 ms instead of the lock's
        grace period (measured: 0.06 ms for the no-op, against 5-15 ms for a cold real move)."""
        if not self.warm:
            self._warm()

    def adopt(
        self, cgroup: str | None, pid: int, marker: str = "", siblings: Collection[int] = ()
    ) -> str | None:
        """Moves a just-spawned replica (whose ``marker`` is given) into ``cgroup``, with what it
        started already; returns where it is confined (None: marker mode for this replica, e.g.
        when the move failed). ``siblings``: other replicas spawned and not moved yet (they are no
        strays of this one)."""
        if cgroup is None:
            return None
        job = MoveJob(cgroup, pid, marker)
        self.adopt_jobs([job], [False], siblings)
        return job.result

    def adopt_jobs(
        self, jobs: list[MoveJob], exited: list[bool], siblings: Collection[int] = ()
    ) -> None:
        """``adopt`` of each job (its ``result``), with one sweep for what they started before
        their moves; the ones whose main process has ``exited`` are not moved themselves."""
        adoptions = [
            contain.Adoption(
                job.cgroup,
                job.pid,
                protocol.MARKER_ENV_BYTES + b"=" + job.marker.encode() if job.marker else b"",
                gone,
            )
            for job, gone in zip(jobs, exited, strict=True)
        ]
        start = time.perf_counter()
        contain.adopt_all(adoptions, self._parent, siblings)
        took = time.perf_counter() - start
        moved = 0
        for job, a in zip(jobs, adoptions, strict=True):
            if a.error is not None:
                logger.warning(
                    "cannot move pid %d into %s (%s); finding it by its marker",
                    job.pid,
                    job.cgroup,
                    a.error,
                )
                job.result = None
            else:
                job.result = job.cgroup
                moved += not a.exited
        if moved:  # (a zombie left alone is no migration: the lock is no warmer)
            self.moves += moved
            if took > 0.001 * moved:
                self.slow_moves += 1
            self._warm_until = time.monotonic() + self.WARM_FOR

    @staticmethod
    def kill(cgroup: str | None, pgid: int) -> None:
        """SIGKILLs the whole replica: its cgroup (if it has one) and its process group."""
        if cgroup is not None:
            contain.kill(cgroup)
        contain.kill_groups([pgid], signal.SIGKILL)

    def wait_empty(self, cgroup: str) -> asyncio.Future[None]:
        """A future that resolves once no process is left in ``cgroup`` (cgroup.events, no polling)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        try:
            fd = contain.open_reserved(os.path.join(cgroup, "cgroup.events"), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            fut.set_result(None)
            return fut
        except OSError:  # (no descriptor to be told with): looked at every EMPTY_POLL seconds
            _poll_until_empty(loop, cgroup, fut)
            return fut
        try:
            if self._epoll is None:
                self._epoll = select.epoll()
                self._loop = loop
                loop.add_reader(self._epoll.fileno(), self._on_events)
            self._epoll.register(fd, select.EPOLLPRI)
        except OSError:  # (no descriptor for the epoll, or no room in it): polled, as above
            os.close(fd)
            contain.keep_reserve()  # (the events file may have taken the reserve's place)
            _poll_until_empty(loop, cgroup, fut)
            return fut
        self._empty_waits[fd] = (cgroup, fut)
        self._check_empty(fd)
        return fut

    def _on_events(self) -> None:
        assert self._epoll is not None
        for fd, _ in self._epoll.poll(0):
            self._check_empty(fd)

    def _check_empty(self, fd: int) -> None:
        try:
            data = os.pread(fd, 256, 0)
        except OSError:
            data = b""
        if b"populated 1" in data:
            return
        _, fut = self._empty_waits.pop(fd)
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        os.close(fd)
        if not fut.done():
            fut.set_result(None)

    def sweep(self, markers: Iterable[str], min_pid: int) -> asyncio.Future[None]:
        """SIGKILLs the processes (not zombies) carrying one of ``markers`` until none is left
        (worker thread; requests made meanwhile are served by one scan)."""
        return self._sweeper.put((frozenset(markers), min_pid))

    @staticmethod
    def _sweep_all(requests: list[tuple[frozenset[str], int]]) -> None:
        markers = frozenset().union(*(m for m, _ in requests))
        min_pid = min(p for _, p in requests)
        deadline = time.monotonic() + 2.0
        while True:
            found = contain.live_processes(
                protocol.MARKER_ENV_BYTES, exact=markers, min_pid=min_pid
            )
            if not found:
                return
            if time.monotonic() > deadline:
                logger.warning("%d marked processes survive SIGKILL: %s", len(found), found[:5])
                return
            contain.kill_pids(p for p, _, _ in found)
            time.sleep(0.005)

    def remove_later(self, cgroup: str | None) -> None:
        """Removes ``cgroup`` and what is below it once empty (worker thread, batched)."""
        if cgroup is not None:
            self._remover.put(cgroup)

    @staticmethod
    def _remove_all(cgroups: list[str]) -> None:
        for cg in cgroups:
            contain.remove_tree(cg)

    async def aclose(self) -> None:
        """Finishes the pending removals, stops waiting for cgroups, removes the base directory."""
        await self._remover.flush()
        await self._sweeper.flush()
        for fd, (_, fut) in list(self._empty_waits.items()):
            with contextlib.suppress(OSError):
                os.close(fd)
            if not fut.done():
                fut.set_result(None)
        self._empty_waits.clear()
        if self._epoll is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._epoll.fileno())
            self._epoll.close()
            self._epoll = None
        if self.base is not None:
            await anyio.to_thread.run_sync(contain.remove_tree, self.base)


# -- records ------------------------------------------------------------------------------------------

_Doc = dict[str, Any]
_DocSource = _Doc | Callable[[], _Doc]


class RecordWriter:
    """Writes app records in batches from a worker thread: the latest document per app wins.

    A document may be given as a function: it is called once, on the event loop, when its batch is
    taken, so a burst of changes to one app costs one serialisation; a batch of such non-urgent
    documents waits up to ``LINGER`` seconds for more (terminal records and writes someone awaits
    are urgent and go at once). A write that fails is retried
    (0.1 s, then up to every 5 s) until it succeeds or a newer document replaces it; the records are
    the only view other processes have, so they must converge on the truth.

    Args:
        store: the record store.
        supervisor: owns the writing task.
    """

    LINGER = 0.05

    def __init__(self, store: RecordStore, supervisor: TaskSupervisor) -> None:
        self._store = store
        self._supervisor = supervisor
        self._urgent: asyncio.Event | None = None
        self._pending: dict[str, _DocSource] = {}
        self._written: dict[str, list[Callable[[], None]]] = {}
        self._failing: dict[str, tuple[_Doc, float]] = {}
        self._backoff = 0.1
        self._batch: asyncio.Future[dict[str, BaseException]] | None = None
        self._in_flight: asyncio.Future[dict[str, BaseException]] | None = None
        self._in_flight_ids: Collection[str] = ()
        #: apps forgotten while their version was in the thread: not retried if it failed
        self._forgotten: set[str] = set()
        #: apps whose submit was undone (``forget``), most recent last: what is put for them is
        #: dropped until a new first record of theirs (``write``)
        self._undone: dict[str, None] = {}
        #: apps whose write ``write`` awaits: its failure is raised to the caller, not warned of
        self._awaited: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._filler: asyncio.Task[None] | None = None
        self._spares_retry_at = 0.0
        self._holders_dropped = False
        self._last_put = float("-inf")

    @property
    def failing(self) -> list[str]:
        """The apps whose latest record could not be written yet."""
        return list(self._failing)

    def put(
        self,
        app_id: str,
        doc: _DocSource,
        on_written: Callable[[], None] | None = None,
        *,
        urgent: bool = True,
    ) -> asyncio.Future[dict[str, BaseException]]:
        """Queues ``doc`` as the record of ``app_id``; the future resolves after the next attempt.

        Its result maps the app ids whose write failed (this time) to their error. ``on_written``
        is called once this document or a later one is on disk.

        Nothing is queued for an app whose submit was undone (``forget``): the task of an app being
        undone may record its end as it is cancelled, and that record would be a ghost (the
        returned future is done then).
        """
        if app_id in self._undone:
            dropped: asyncio.Future[dict[str, BaseException]]
            dropped = asyncio.get_running_loop().create_future()
            dropped.set_result({})
            return dropped
        self._pending[app_id] = doc
        self._last_put = time.monotonic()
        self._failing.pop(app_id, None)
        if on_written is not None:
            self._written.setdefault(app_id, []).append(on_written)
        if self._batch is None:
            self._batch = asyncio.get_running_loop().create_future()
        self._ensure_task()
        assert self._wake is not None and self._urgent is not None
        self._wake.set()
        if urgent:
            self._urgent.set()
        return self._batch

    #: Undone submits remembered by ``forget`` (the oldest are forgotten beyond this: by then
    #: their undoing is long over).
    UNDONE_KEPT = 1024

    def forget(self, app_id: str) -> None:
        """Drops what is queued or being retried for ``app_id`` (an undone submit), and what is put
        for it from now on until its next first record (``write``); a version being written by the
        thread is not retried if it fails (``flush`` waits for it)."""
        self._undone[app_id] = None
        if len(self._undone) > self.UNDONE_KEPT:
            del self._undone[next(iter(self._undone))]
        self._pending.pop(app_id, None)
        self._failing.pop(app_id, None)
        self._written.pop(app_id, None)
        if app_id in self._in_flight_ids:
            self._forgotten.add(app_id)

    def _ensure_task(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
            self._urgent = asyncio.Event()
        if self._task is None:
            self._task = self._supervisor.spawn(self._run(), "record-writer")

    async def write(self, app_id: str, doc: _DocSource) -> None:
        """Queues ``doc`` and waits for its first attempt; a new app's first record is written at
        once when a spare file is at hand (``write_first``).

        Raises:
            OSError: it could not be written (it stays queued for retries; ``forget`` drops it).
                Raised, not also logged: the caller says it (a launch refused with its error).
        """
        self._undone.pop(app_id, None)  # (the app id submitted again)
        document = doc() if callable(doc) else doc
        if self.write_first(app_id, document):
            return
        self._awaited.add(app_id)
        try:
            errors = await asyncio.shield(self.put(app_id, document))
        finally:
            self._awaited.discard(app_id)
        if app_id in errors:
            raise errors[app_id]

    def write_now(self, app_id: str, document: _Doc) -> None:
        """Writes ``document`` as the record of ``app_id`` now, on the calling thread (blocking),
        for when the writing task may never run again (the event loop ending); if it fails, it
        is queued as ``put`` would. A version being written by the thread is left to land first
        (this one is queued behind it)."""
        if app_id in self._in_flight_ids:
            self._pending[app_id] = document
            return
        self._pending.pop(app_id, None)
        if app_id in self._store.write_many({app_id: document}):
            self._pending[app_id] = document
            return
        self._failing.pop(app_id, None)
        self._written.pop(app_id, None)

    #: The most replicas an app may have for its first record to be written on the event loop
    #: (each running replica's start time is read from ``/proc``, 60-90 us a replica here).
    FIRST_INLINE_REPLICAS = 16

    def write_first(self, app_id: str, document: _Doc) -> bool:
        """Writes the first record of ``app_id`` now, on the event loop, when the store has a spare
        file to make it from; False (nothing done) otherwise, or when it fails (queue it then).

        Made from a spare, a record costs the writing of one small file that exists and a link
        (~0.1 ms, like the claim's link on the loop), where a hop to the writer's thread and back
        costs a launch a millisecond or more on a busy loop: the launch a service makes beside
        running apps waits for it (``run()`` returns once other processes see the app). Without a
        spare, creating the file can cost ~0.5 ms of a busy file system's time: it goes to the
        thread, as does the record of an app of more than ``FIRST_INLINE_REPLICAS`` replicas. A
        version queued for the app is replaced (this one is newer); one being written by the
        thread must land first, so the app waits for it.
        """
        if not len(self._store.spares) or app_id in self._in_flight_ids or app_id in self._failing:
            return False
        if len(document.get("replicas") or ()) > self.FIRST_INLINE_REPLICAS:
            return False
        self._pending.pop(app_id, None)
        errors = self._store.write_many({app_id: document})
        if app_id in errors:
            return False
        self._last_put = time.monotonic()
        for callback in self._written.pop(app_id, ()):
            try:
                callback()
            except Exception:
                logger.exception("record-written callback of app %s failed", app_id)
        return True

    async def _run(self) -> None:
        assert self._wake is not None and self._urgent is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                timeout = None
                if self._failing:
                    timeout = max(0.0, min(t for _, t in self._failing.values()) - loop.time())
                with anyio.move_on_after(timeout if timeout is not None else float("inf")):
                    await self._wake.wait()
                self._wake.clear()
            if self._pending and not self._urgent.is_set():
                with anyio.move_on_after(self.LINGER):
                    await self._urgent.wait()
            self._urgent.clear()
            now = loop.time()
            due = {a: d for a, (d, t) in self._failing.items() if t <= now}
            for app_id in due:
                del self._failing[app_id]
            if not self._pending and not due:
                # what was queued was forgotten (undone submits): its waiters have nothing to wait
                # for, and a flush() must not wait for the next put
                idle, self._batch = self._batch, None
                if idle is not None and not idle.done():
                    idle.set_result({})
                continue
            batch: dict[str, _Doc] = dict(due)
            for app_id, source in self._pending.items():
                batch[app_id] = source() if callable(source) else source
            self._pending = {}
            # the callbacks of these versions (and older ones): those of versions queued while
            # this batch is in the thread wait for them
            callbacks = {a: self._written.pop(a) for a in batch if a in self._written}
            done, self._batch = self._batch, None
            self._in_flight, self._in_flight_ids = done, batch.keys()
            try:
                errors = await anyio.to_thread.run_sync(self._store.write_many, batch)
            except Exception as e:
                logger.exception("writing %d app records failed", len(batch))
                errors = dict.fromkeys(batch, e)
            finally:
                self._in_flight, self._in_flight_ids = None, ()
            self._after_batch(batch, errors, loop.time(), callbacks)
            if done is not None and not done.done():
                done.set_result(errors)
            self.make_spares()

    #: Seconds without a new record (or a change to one) before spares are made: in the lull after a
    #: burst of launches, not during it (they would take the burst's processor time).
    SPARES_LULL = 0.05
    #: The shorter lull after which a pool with less than a chunk of spares left gets one chunk: a
    #: service launching an app every few tens of milliseconds never pauses for ``SPARES_LULL``,
    #: and once its first spares were used every record it launches would be created in the
    #: writer's thread (a hop the caller of ``run()`` waits for); a burst's records come faster.
    SPARES_LOW_LULL = 0.01
    #: Seconds before spares are tried again after they could not be made.
    SPARES_RETRY = 30.0

    def make_spares(self) -> None:
        """Has the spare files the store lacks made in a worker thread once no record was queued
        for ``SPARES_LULL`` seconds (``spares.py``; a record written meanwhile is created the usual
        way). On the event loop."""
        if (
            self._filler is None
            and self._store.spares.wanted
            and not self._supervisor.closed
            and time.monotonic() >= self._spares_retry_at
        ):
            self._filler = self._supervisor.spawn(self._make_spares(), "record-spares")

    async def _make_spares(self) -> None:
        spares = self._store.spares
        try:
            if not self._holders_dropped:  # (the other lull work of the state root: once)
                self._holders_dropped = True
                await in_thread_shielded(self._store.drop_dead_holders)
            while spares.wanted:
                quiet = time.monotonic() - self._last_put
                lull = self.SPARES_LOW_LULL if len(spares) < SPARES_CHUNK else self.SPARES_LULL
                if quiet < lull or self._in_flight is not None:
                    await asyncio.sleep(max(lull - quiet, 0.005))
                    continue
                # a chunk at a time: a burst that starts meanwhile, or closing, waits for one at most
                # (waited for when cancelled: the pool is released on closing, after this)
                await in_thread_shielded(spares.fill_some)
        except OSError as e:
            logger.debug("cannot make spare record files (%s); records are created as usual", e)
            self._spares_retry_at = time.monotonic() + self.SPARES_RETRY
        finally:
            self._filler = None

    def _after_batch(
        self,
        batch: dict[str, _Doc],
        errors: dict[str, Any],
        now: float,
        callbacks: dict[str, list[Callable[[], None]]],
    ) -> None:
        if errors:
            retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, 5.0)
        else:
            self._backoff = 0.1
        forgotten, self._forgotten = self._forgotten, set()
        for app_id, doc in batch.items():
            if app_id in forgotten:
                continue  # (undone meanwhile: neither called back nor retried)
            err = errors.get(app_id)
            if err is None:
                for callback in callbacks.get(app_id, ()):
                    try:
                        callback()
                    except Exception:
                        logger.exception("record-written callback of app %s failed", app_id)
                continue
            if app_id in callbacks:  # (called once this version or a later one is written)
                self._written[app_id] = callbacks[app_id] + self._written.get(app_id, [])
            if app_id not in self._pending:
                # (a failed write that ``write`` awaits is raised to its caller, who says it)
                if app_id not in self._failing and app_id not in self._awaited:
                    logger.warning(
                        "cannot write the record of app %s (will retry): %s", app_id, err
                    )
                self._failing[app_id] = (doc, retry_at)

    async def flush(self, retry_for: float | None = None) -> bool:
        """Waits until everything queued so far was attempted, and, for up to ``retry_for``
        seconds, until the failing writes succeeded. Returns True when nothing is left to write."""
        if self._urgent is not None:
            self._urgent.set()
        for fut in (self._in_flight, self._batch):
            if fut is not None:
                await asyncio.shield(fut)
        if retry_for is not None and self._failing:
            with anyio.move_on_after(retry_for):
                # (a retry being written is no longer failing, and not written yet either)
                while self._failing or self._pending or self._in_flight_ids:
                    if self._wake is not None:
                        self._wake.set()
                    await asyncio.sleep(0.05)
        return not self._failing and not self._pending and not self._in_flight_ids


#: How often (seconds) a cgroup whose events cannot be watched is looked at until it is empty.
EMPTY_POLL = 0.1


def _poll_until_empty(
    loop: asyncio.AbstractEventLoop, cgroup: str, fut: asyncio.Future[None]
) -> None:
    def look() -> None:
        if fut.done():
            return
        if contain.populated(cgroup):
            loop.call_later(EMPTY_POLL, look)
        else:
            fut.set_result(None)

    loop.call_later(EMPTY_POLL, look)
