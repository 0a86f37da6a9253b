"""Starting a local app's replicas and learning that they exited: the process part of the local
backend (``procs.py`` spawns, ``contain.py`` confines, the watchdog hears of each start and exit).

A replica is registered with the watchdog right after its spawn, before anything else happens on
the event loop, and moved into its cgroup: at once while the kernel's migration lock is warm, else
by a worker thread (``CgroupMover``: a launch never waits for the lock's grace period). Its exit is
learnt from its pidfd, watched once it is in its cgroup (so it is never reaped under its move), and
it is reaped on the loop (a few per iteration) or, when many exit at once, in batches in a worker
thread. The exit is then queued on its app (``LiveApp.exited``) for the app's task
(``supervise.py``) to judge.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import time
from collections.abc import Callable, Iterable

from asynctorchx._tasks import TaskSupervisor, wait_held
from asynctorchx.logs import ReplicaLogWriter, Stream
from asynctorchx.schedulers._local import contain, protocol
from asynctorchx.schedulers._local.guard import MoveJob
from asynctorchx.schedulers._local.live import LiveApp, Replica
from asynctorchx.schedulers._local.procs import (
    FD_ERRNOS,
    SPEC_ERRNOS,
    LaunchError,
    LaunchSpecError,
    kill_and_reap_now,
    launch_error,
    reap,
    release_fds,
    spawn,
)
from asynctorchx.schedulers._local.request import space_reserve_of
from asynctorchx.schedulers._local.runtime import LocalRuntime
from asynctorchx.specs.api import NONE, AppState, is_terminal

#: Replicas started between two yields to the event loop.
START_CHUNK = 16

_MARKER_KEY = os.fsencode(protocol.MARKER_ENV)


def environ_bytes() -> dict[bytes, bytes]:
    """A copy of this process's environment as bytes (what exec takes).

    CPython keeps ``os.environ`` as bytes underneath; copying that costs a microsecond, where
    ``dict(os.environ)`` decodes every variable (and the spawn encodes it again) for each app.
    """
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        return dict(data)
    return {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}


def reap_batch(jobs: list[tuple[int, int, str | None]]) -> list[tuple[int | None, bool]]:
    """Reaps ``(pid, pidfd, cgroup)`` each: ``(exit code or None, something was left)``.

    Reaping first SIGKILLs what is left of the replica's process group (while its leader is a
    zombie, so the group id cannot have been reused) and of its cgroup.
    """
    out: list[tuple[int | None, bool]] = []
    for pid, pidfd, cgroup in jobs:
        try:
            code = reap(pid, pidfd)  # SIGKILLs what is left of its process group first
        except OSError:  # (a pidfd closed under the reaping: one exit lost, not the others)
            out.append((-255, False))
            continue
        leftovers = False
        if code is not None and cgroup is not None and contain.populated(cgroup):
            contain.kill(cgroup)
            leftovers = True
        out.append((code, leftovers))
    return out


def _jobs(batch: list[tuple[LiveApp, Replica]]) -> list[tuple[int, int, str | None]]:
    """What ``reap_batch`` takes for these replicas."""
    return [(rep.pid or 0, rep.pidfd, rep.cgroup) for _, rep in batch]


class ExitReaper:
    """Reaps replicas whose main process exited, in batches in a worker thread, and hands each
    result to ``on_reaped`` on the event loop."""

    MAX_BATCH = 512
    #: Exits reaped on the event loop per iteration before the rest goes to the worker thread.
    INLINE = 4

    def __init__(
        self,
        supervisor: TaskSupervisor,
        on_reaped: Callable[[LiveApp, Replica, int | None, bool], None],
    ) -> None:
        self._supervisor = supervisor
        self._on_reaped = on_reaped
        self._queue: list[tuple[LiveApp, Replica]] = []
        self._inline = 0
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def busy(self) -> bool:
        """True when this exit should be reaped in the worker thread: this loop iteration reaped
        ``INLINE`` exits inline already.

        An exit that comes while the thread reaps a batch is still reaped inline if the iteration
        has room: queued behind the batch, it would wait for the thread's turns at the GIL, which a
        busy loop (a sweep launching replacements) hands over once per switch interval (5 ms) for
        each of the reaping's system calls (exit to reaped: 24 ms median in a sweep on tmpfs).
        """
        if self._inline == 0:
            asyncio.get_running_loop().call_soon(self._reset_inline)
        self._inline += 1
        return self._inline > self.INLINE

    def _reset_inline(self) -> None:
        self._inline = 0

    def add(self, app: LiveApp, rep: Replica) -> None:
        if self._task is None:
            try:
                self._task = self._supervisor.spawn(self._run(), "exit-reaper")
            except RuntimeError:  # closing: reaped here
                self._reap_now([(app, rep)])
                return
            self._task.add_done_callback(self._ended)
        if self._wake is None or self._idle is None:
            self._wake = asyncio.Event()
            self._idle = asyncio.Event()
        self._queue.append((app, rep))
        self._idle.clear()
        self._wake.set()

    async def idle(self) -> None:
        """Waits until every exit queued so far was handed over (at least one loop iteration, so
        that a caller polling ``reaping`` lets a worker that just ended hand its queue over)."""
        if self._idle is not None and self._task is not None and not self._task.done():
            await self._idle.wait()
        else:
            await asyncio.sleep(0)

    def _reap_now(self, batch: list[tuple[LiveApp, Replica]]) -> None:
        self._hand_over(batch, reap_batch(_jobs(batch)))

    def _hand_over(
        self, batch: list[tuple[LiveApp, Replica]], results: list[tuple[int | None, bool]]
    ) -> None:
        for (app, rep), (code, leftovers) in zip(batch, results, strict=True):
            self._on_reaped(app, rep, code, leftovers)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The worker's task ended (cancelled when the scheduler closes, maybe before it ran):
        what is still queued is reaped here, so that no replica is left reaping forever."""
        if self._task is task:
            self._task = None
        left, self._queue = self._queue, []
        if left:
            self._reap_now(left)
        if self._idle is not None:
            self._idle.set()

    async def _run(self) -> None:
        assert self._wake is not None and self._idle is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._queue[: self.MAX_BATCH]
            del self._queue[: self.MAX_BATCH]
            reaped = loop.run_in_executor(None, reap_batch, _jobs(batch))
            # waited for even when cancelled (closing): what the thread reaped is handed over
            cancelled = await wait_held(reaped)
            self._hand_over(batch, reaped.result())
            if cancelled is not None:
                raise cancelled


class Spawner:
    """Starts replicas and hears their exits.

    Args:
        runtime: the scheduler's apps and guards.
        check_open: raises RuntimeError once the scheduler is closed.
    """

    def __init__(self, runtime: LocalRuntime, check_open: Callable[[], None]) -> None:
        self._rt = runtime
        self._check_open = check_open
        self.exits = ExitReaper(runtime.supervisor, self._on_reaped)
        self.stdin_fd = -1
        #: makes log files on a replica's first output (``LogDirMaker.request``); None: at once
        self.log_opener: Callable[[ReplicaLogWriter], None] | None = None

    def new_writer(self, app: LiveApp, rep: Replica, files_fds: int = 0) -> ReplicaLogWriter:
        """A log writer for ``rep``: its directory and files are made on its first output (by
        ``log_opener``), or at once when there is none. Raises OSError (only then).

        ``files_fds``: descriptors promised (``reserve_fds``) for the files of a lazy writer; it
        gives them back (``release_fds``) once its files are open, failed, or will never be. The
        caller gives them back itself when the writer is not lazy (``lazy_files``)."""

        def on_loss(reason: str) -> None:
            if not app.log_loss:
                app.log_loss = reason
                self._rt.changed(app)

        on_files = None
        if files_fds and self.lazy_files:
            on_files = functools.partial(release_fds, files_fds)
        return ReplicaLogWriter(
            rep.req.log_dir,
            on_loss=on_loss,
            opener=self.log_opener,
            on_files=on_files,
            space_reserve=space_reserve_of(app.request.app_dir),
        )

    @property
    def lazy_files(self) -> bool:
        """Whether new writers make their files on the first output (else at once)."""
        return self.log_opener is not None

    async def start(self, app: LiveApp, replicas: Iterable[Replica]) -> None:
        """Starts ``replicas`` (a few hundred microseconds each). Raises LaunchError.

        The event loop runs between chunks of ``START_CHUNK`` spawns, and starting stops there if
        the app was cancelled meanwhile (RuntimeError if the scheduler was closed). Replicas whose
        moves went to the worker thread (the migration lock was cold) may still be outside their
        cgroups when this returns; their exits are watched once they are moved.
        """
        base_env = environ_bytes()
        later: list[Replica] = []  # spawned, to be moved by the worker thread
        try:
            for i, rep in enumerate(replicas):
                if i and i % START_CHUNK == 0:
                    self._move_later(app, later)
                    later = []
                    await asyncio.sleep(0)
                    if app.cancel_reason is not None:
                        return
                    self._check_open()
                if self._start_one(app, rep, base_env):
                    later.append(rep)
        finally:
            self._move_later(app, later)

    def _move_later(self, app: LiveApp, reps: list[Replica]) -> None:
        """Hands the moves of ``reps`` to the worker thread; each one's exit is watched once it is
        moved."""
        if not reps:
            return
        jobs = [rep.moving for rep in reps if rep.moving is not None]
        moved = self._rt.contain.mover.put(jobs)
        for rep in reps:
            rep.moved = moved
        moved.add_done_callback(lambda _: self._moved(app, reps))

    def _moved(self, app: LiveApp, reps: list[Replica]) -> None:
        """Applies the worker thread's moves (on the event loop) and starts watching the exits."""
        loop = asyncio.get_running_loop()
        for rep in reps:
            job, rep.moving, rep.moved = rep.moving, None, None
            if job is None:
                continue
            if job.cancelled:
                if rep.pidfd >= 0:  # killed during its move (``kill_now``): reaped now
                    with contextlib.suppress(ChildProcessError):
                        os.waitid(os.P_PIDFD, rep.pidfd, os.WEXITED)
                    os.close(rep.pidfd)
                    rep.pidfd = -1
                continue
            rep.cgroup = job.result
            if rep.pidfd >= 0:
                loop.add_reader(rep.pidfd, self._on_exit, app, rep)

    def _start_one(self, app: LiveApp, rep: Replica, base_env: dict[bytes, bytes]) -> bool:
        """Spawns ``rep``; True when its move into its cgroup is left to the worker thread (the
        caller hands it over; its exit is watched from then on)."""
        req = rep.req
        env = base_env.copy()
        for key, value in req.env.items():
            env[os.fsencode(key)] = os.fsencode(value)
        env.setdefault(b"PYTHONUNBUFFERED", b"x")
        env[_MARKER_KEY] = os.fsencode(rep.marker)
        writer = self._writer_for(app, rep)
        cgroup = self._rt.contain.replica_dir(
            app.cgroup, rep.index, rep.attempts + 1, len(app.replicas)
        )
        try:
            spawned = spawn(
                rep.executable, [req.entrypoint, *req.args], env, req.cwd, self.stdin_fd
            )
        except OSError as e:
            if e.errno in FD_ERRNOS:
                raise launch_error(app.app_id, e, f"the pipes of {rep.label}", "") from None
            error = LaunchSpecError if e.errno in SPEC_ERRNOS else LaunchError
            why = e.strerror or str(e)
            if e.errno == errno.EAGAIN:  # (fork refused: a limit on processes was reached)
                why += " (a limit on processes was reached: RLIMIT_NPROC, or the cgroup's pids.max)"
            raise error(
                f"role {req.role!r}: cannot start replica {req.replica_id} "
                f"({rep.executable}): {why}"
            ) from None
        try:
            pidfd = os.pidfd_open(spawned.pid)
        except OSError as e:
            kill_and_reap_now(spawned.pid)
            os.close(spawned.stdout_fd)
            os.close(spawned.stderr_fd)
            if e.errno in FD_ERRNOS:
                raise launch_error(app.app_id, e, f"the pidfd of {rep.label}", "") from None
            raise LaunchError(f"cannot watch {rep.label} (pid {spawned.pid}): {e}") from None
        try:
            self._rt.watchdog.send_now(protocol.start_line(app.app_id, spawned.pid))
        except OSError as e:  # no watchdog can be started (no process can be forked): stopped
            kill_and_reap_now(spawned.pid)
            for fd in (pidfd, spawned.stdout_fd, spawned.stderr_fd):
                os.close(fd)
            raise launch_error(app.app_id, e, "the watchdog", "") from None
        rep.pid = spawned.pid
        rep.pidfd = pidfd
        contain = self._rt.contain
        later = cgroup is not None and not contain.warm
        if later:
            assert cgroup is not None
            rep.cgroup = None  # until the worker thread has moved it
            rep.moving = MoveJob(cgroup, spawned.pid, rep.marker, pidfd)
        else:
            rep.cgroup = contain.adopt(cgroup, spawned.pid, rep.marker)
        writer.attach(spawned.stdout_fd, Stream.STDOUT)
        writer.attach(spawned.stderr_fd, Stream.STDERR)
        self._started(app, rep, spawned.start_ticks)
        if not later:
            asyncio.get_running_loop().add_reader(pidfd, self._on_exit, app, rep)
        return later

    def _writer_for(self, app: LiveApp, rep: Replica) -> ReplicaLogWriter:
        """The replica's log writer, opened again if a restart closed it."""
        writer = rep.writer
        if writer is not None and not writer.closed:
            return writer
        if writer is not None:
            rep.lost_before = rep.lost_bytes()
        try:
            rep.writer = self.new_writer(app, rep)
        except OSError as e:
            what = f"the logs of {rep.label} ({rep.req.log_dir})"
            raise launch_error(app.app_id, e, what, "") from None
        return rep.writer

    @staticmethod
    def _started(app: LiveApp, rep: Replica, start_ticks: int | None) -> None:
        # without a start time from the spawn, the record writer reads it from /proc
        rep.start_ticks = start_ticks
        rep.exit_code = None
        rep.ended_at = None
        rep.started_at = time.time()
        rep.attempts += 1
        app.set_state(rep, AppState.RUNNING)
        rep.term_sent = False
        rep.exit_pending = False
        rep.leftovers = False
        rep.structured_error_msg = NONE
        app.n_running += 1

    def _on_exit(self, app: LiveApp, rep: Replica) -> None:
        # the pidfd is readable: the main process exited. A few exits per loop iteration are
        # reaped here; when many come at once, reaping (waitid, which then contends with every
        # other exit for the kernel's task list) goes to a worker thread, in batches
        asyncio.get_running_loop().remove_reader(rep.pidfd)
        rep.reaping = True
        if self.exits.busy():
            self.exits.add(app, rep)
            return
        ((code, leftovers),) = reap_batch([(rep.pid or 0, rep.pidfd, rep.cgroup)])
        self._on_reaped(app, rep, code, leftovers)

    def _on_reaped(self, app: LiveApp, rep: Replica, code: int | None, leftovers: bool) -> None:
        """Applies the reaping of ``rep`` (on the event loop, after ``_on_exit``)."""
        rep.reaping = False
        if rep.pidfd < 0:
            return
        if code is None:  # a spurious wake-up: it has not exited
            asyncio.get_running_loop().add_reader(rep.pidfd, self._on_exit, app, rep)
            return
        os.close(rep.pidfd)
        rep.pidfd = -1
        rep.exit_code = code
        rep.ended_at = time.time()
        # in marker mode only a sweep can tell whether something it started is left
        rep.leftovers = leftovers or rep.cgroup is None
        self._rt.watchdog.send_later(protocol.exit_line(app.app_id, rep.pid or 0))
        app.n_running -= 1
        waiter = rep.stop_waiter
        if waiter is not None:
            rep.stop_waiter = None
            waiter.one_exited()
        if is_terminal(app.state):  # recorded already (its task was stopped)
            return
        rep.exit_pending = True
        app.exited.append(rep)
        app.wake.set()
