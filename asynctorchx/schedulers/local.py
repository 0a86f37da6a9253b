"""The local backends: ``local_cwd`` (image = the current directory) and ``local_dir`` (image = a directory).

Each replica is a child process in its own session and process group, with its stdout and stderr
pumped into log files (``asynctorchx.logs``) under ``{log root}/{session}/{app_id}/{role}/{replica}/``.
Exits are learnt from pidfds watched by the event loop (no threads, no polling), and every change is
pushed to subscribers (``pushes_changes``). Each app has a record on disk (``_local.records``), so
another process with the same state root can describe, list, read the logs of and cancel it; changes
to the records of apps other processes launched are pushed too (inotify on the records directory).

A replica's environment is the launcher's, then the role's ``env`` (macros substituted), then
``TORCHX_RANK0_HOST=localhost``, and unless the role sets them ``TORCHELASTIC_ERROR_FILE`` (in the
replica's log directory; its contents become the structured error of a failed replica),
``PET_LOG_DIR``, ``TORCHX_JOB_ID`` (the app handle) and ``PYTHONUNBUFFERED``; last comes the marker
``ASYNCTORCHX_REPLICA={app_id}/{role}/{k}``, which the role cannot override. ``PATH`` is the role's
``PATH``, then the launcher's, with the image directory last (first with ``prepend_cwd``). Linux only
(pidfds, ``/proc``).

Containment (``_local/contain.py``): every descendant of a replica stays within reach, those that
call ``setsid`` or double-fork included. Where the machine offers a writable cgroup v2 directory,
each replica attempt runs in a cgroup of its own; otherwise its descendants are found by the marker.

Stopping a replica sends exactly one SIGTERM to its process group, waits the grace period (run
option ``cancel_grace_period``, at most an hour; ``close()`` waits at most ``CLOSE_MAX_GRACE``), then
SIGKILLs everything it contains. When a replica's main process exits, what is left of it is killed
at once (as when a container's main process exits), and the replica ends only once that is gone and
its output is read. Closing the scheduler stops the apps it launched (CANCELLED); if the launching
process dies, even by SIGKILL, a watchdog process (``_local/watchdog.py``), which knows every app
before its first replica starts and every replica right after its spawn, stops them and records
them FAILED ("the launcher (pid N) died"): nobody asked for that stop, so it is not a cancel. If the
watchdog itself dies, the launcher starts a new one at once and registers everything again.

Retries follow ``Role.max_retries`` (a budget per role) and ``Role.retry_policy``: REPLICA restarts the
failed replica, ROLE every replica of its role, APPLICATION every replica of the app. A replica that
fails with no retries left fails the app, and its other replicas are stopped.

Before an app starts, the file descriptors it needs (``FDS_PER_REPLICA`` per replica in this
process) are checked against ``RLIMIT_NOFILE`` (raised to the hard limit first). A launch that fails
for any reason stops what it started and removes the app's directory and record. Log bytes that
cannot be written (a full disk) are counted, reported in the app's status message and marked at the
end of the affected log files; a record that cannot be written is retried until it is.

The state root is ``local_root=`` (scheduler argument), else ``$ASYNCTORCHX_LOCAL_ROOT``, else
``{temp dir}/asynctorchx-{uid}``; records live in ``{state root}/.apps`` and logs in the state root
unless the ``log_dir`` run option puts them elsewhere.

Workspaces (``_local/workspace.py``): on ``local_cwd`` the workspace directory is every replica's
working directory; on ``local_dir`` the first role runs from a snapshot taken at submit time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import resource
import shutil
import signal
import subprocess
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.logs import ReplicaLogWriter, iter_log_lines
from asynctorchx.logs._inotify import (
    IN_CLOSE_WRITE,
    IN_DELETE_SELF,
    IN_MOVE_SELF,
    IN_MOVED_TO,
    IN_ONLYDIR,
    Watch,
)
from asynctorchx.logs._inotify import watch as watch_directory
from asynctorchx.schedulers._local import contain, protocol
from asynctorchx.schedulers._local import watchdog as watchdog_script
from asynctorchx.schedulers._local import workspace as local_workspace
from asynctorchx.schedulers._local.guard import (
    Containment,
    Reaper,
    RecordWriter,
    Watchdog,
    start_escalator,
)
from asynctorchx.schedulers._local.procs import (
    FD_ERRNOS,
    SPEC_ERRNOS,
    LaunchError,
    LaunchSpecError,
    check_cwd,
    fd_exhaustion_message,
    kill_and_reap_now,
    kill_group,
    pid_alive,
    proc_start_ticks,
    reap,
    resolve_executable,
    spawn,
)
from asynctorchx.schedulers._local.records import (
    AppRecord,
    Owner,
    RecordStore,
    ReplicaRecord,
    appdef_from_json,
    appdef_to_json,
    default_root,
)
from asynctorchx.schedulers._local.request import (
    DEFAULT_GRACE_PERIOD,
    MAX_GRACE_PERIOD,
    LocalRequest,
    ReplicaRequest,
    build_request,
    format_request,
)
from asynctorchx.schedulers.api import (
    ChangeCallback,
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    Stream,
    check_replica,
    check_time_window,
    compile_log_regex,
)
from asynctorchx.specs.api import (
    NONE,
    AppDef,
    AppDryRunInfo,
    AppState,
    CfgVal,
    RetryPolicy,
    Role,
    UnknownAppException,
    is_terminal,
    make_app_handle,
    make_unique,
    runopts,
)

if TYPE_CHECKING:
    from asynctorchx.schedulers.workspace import WorkspacePlan
    from asynctorchx.specs.workspace import Workspace

__all__ = [
    "LaunchError",
    "LaunchSpecError",
    "LocalScheduler",
    "create_cwd_scheduler",
    "create_dir_scheduler",
]

logger = logging.getLogger(__name__)

#: How long a replica's log pipes may stay open after everything it contains is gone (a process
#: that escaped containment may hold them) before the log writer stops waiting for them.
DRAIN_TIMEOUT = 2.0
#: How long the processes left in a replica may take to die after SIGKILL before it ends anyway.
CONTAIN_TIMEOUT = 5.0
#: The longest grace period ``close()`` gives an app between SIGTERM and SIGKILL.
CLOSE_MAX_GRACE = 30.0
#: Finished apps kept in memory (older ones are read back from their records).
FINISHED_CACHE = 4096
#: File descriptors a running replica holds in the launching process: two pipes, a pidfd, three
#: log files and the timing index (the last four opened before the others).
FDS_PER_REPLICA = 7
_FDS_FILES = 4
#: Descriptors an app's launch needs for a moment besides (a spawn's pipe write ends, records).
FDS_PER_LAUNCH = 4
#: Descriptors kept free for everything else in the process (the event loop, worker threads).
FD_SPARE = 32
_STREAMS = {s.value: s for s in Stream}
_CHUNK = 256  # exits handled between two yields to the event loop
_START_CHUNK = 16  # replicas started between two yields to the event loop
_RECORD_EVENTS = IN_MOVED_TO | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
_fd_reserved = 0  # descriptors promised to launches in progress (every scheduler of the process)

# an app this object launched: its record and its roles as submitted
_Own = tuple[AppRecord, list[Role]]


class _Countdown:
    """An event set once ``count`` replicas have exited."""

    __slots__ = ("count", "event")

    def __init__(self, count: int) -> None:
        self.count = count
        self.event = asyncio.Event()
        if count <= 0:
            self.event.set()

    def one_exited(self) -> None:
        self.count -= 1
        if self.count <= 0:
            self.event.set()


@dataclass(eq=False)
class _Replica:
    req: ReplicaRequest
    index: int
    marker: str
    executable: str = ""
    state: AppState = AppState.PENDING
    pid: int | None = None
    start_ticks: int | None = None
    pidfd: int = -1
    exit_code: int | None = None
    attempts: int = 0
    started_at: float | None = None
    ended_at: float | None = None
    writer: ReplicaLogWriter | None = None
    structured_error_msg: str = NONE
    cgroup: str | None = None  # the cgroup of its current attempt (None: found by its marker)
    term_sent: bool = False  # its group got the one SIGTERM of the current stop
    term_at: float = 0.0
    exit_pending: bool = False  # exited; the exit is not processed yet
    reaping: bool = False  # exited; being reaped in a worker thread
    leftovers: bool = False  # something it started outlived its main process
    stop_waiter: _Countdown | None = None
    lost_before: dict[str, int] = field(default_factory=dict)  # log bytes lost by closed writers

    @property
    def running(self) -> bool:
        return self.pidfd >= 0

    @property
    def label(self) -> str:
        return f"{self.req.role}[{self.req.replica_id}]"

    def lost_bytes(self) -> dict[str, int]:
        """Log bytes that could not be written, per file name."""
        lost = dict(self.lost_before)
        if self.writer is not None:
            for name, n in self.writer.lost_bytes.items():
                lost[name] = lost.get(name, 0) + n
        return lost

    def record(self) -> ReplicaRecord:
        return ReplicaRecord(
            role=self.req.role,
            id=self.req.replica_id,
            state=self.state,
            pid=self.pid,
            start_ticks=self.start_ticks,
            exit_code=self.exit_code,
            attempts=self.attempts,
            started_at=self.started_at,
            ended_at=self.ended_at,
            log_dir=self.req.log_dir,
            error_file=self.req.error_file,
            structured_error_msg=self.structured_error_msg,
        )


@dataclass(eq=False)
class _App:
    request: LocalRequest
    app_json: dict[str, Any]
    replicas: list[_Replica]
    retries_left: dict[str, int]
    policies: dict[str, RetryPolicy]
    submitted_at: float
    state: AppState = AppState.PENDING
    msg: str = ""
    structured_error_msg: str = NONE
    num_restarts: int = 0
    ended_at: float | None = None
    cancel_reason: str | None = None
    exited: list[_Replica] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    discard: bool = False
    cgroup: str | None = None
    stop_grace: float = DEFAULT_GRACE_PERIOD
    n_running: int = 0
    n_succeeded: int = 0
    log_loss: str = ""  # why log output was lost (empty: none was)
    _roles: list[Role] | None = None

    @property
    def app_id(self) -> str:
        return self.request.app_id

    @property
    def roles(self) -> list[Role]:
        # a copy of the submitted roles (parsed once), so callers cannot alias the user's AppDef
        if self._roles is None:
            self._roles = appdef_from_json(self.app_json).roles
        return self._roles

    def running(self) -> list[_Replica]:
        return [r for r in self.replicas if r.running]

    def set_state(self, rep: _Replica, state: AppState) -> None:
        """Sets a replica's state, keeping the count of succeeded replicas."""
        if rep.state == AppState.SUCCEEDED:
            self.n_succeeded -= 1
        rep.state = state
        if state == AppState.SUCCEEDED:
            self.n_succeeded += 1


class _ExitReaper:
    """Reaps replicas whose main process exited, in batches in a worker thread, and hands each
    result to ``on_reaped`` on the event loop.

    Reaping also SIGKILLs what is left of the replica's process group (while its leader is still a
    zombie, so the group id cannot have been reused) and of its cgroup.
    """

    MAX_BATCH = 512

    def __init__(
        self,
        supervisor: TaskSupervisor,
        on_reaped: Callable[[_App, _Replica, int | None, bool], None],
    ) -> None:
        self._supervisor = supervisor
        self._on_reaped = on_reaped
        self._queue: list[tuple[_App, _Replica]] = []
        self._inline = 0
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    #: Exits reaped on the event loop per iteration before the rest goes to the worker thread.
    INLINE = 4

    def busy(self) -> bool:
        """True when this exit should be reaped in the worker thread: one is busy already, or this
        loop iteration reaped ``INLINE`` exits inline."""
        if self._queue or (self._idle is not None and not self._idle.is_set()):
            return True
        if self._inline == 0:
            asyncio.get_running_loop().call_soon(self._reset_inline)
        self._inline += 1
        return self._inline > self.INLINE

    def _reset_inline(self) -> None:
        self._inline = 0

    def add(self, app: _App, rep: _Replica) -> None:
        self._queue.append((app, rep))
        if self._wake is None:
            self._wake = asyncio.Event()
            self._idle = asyncio.Event()
        assert self._idle is not None
        self._idle.clear()
        self._wake.set()
        if self._task is None:
            self._task = self._supervisor.spawn(self._run(), "exit-reaper")

    async def idle(self) -> None:
        """Waits until every exit queued so far was handed over."""
        if self._idle is not None and self._task is not None and not self._task.done():
            await self._idle.wait()

    async def _run(self) -> None:
        assert self._wake is not None and self._idle is not None
        while True:
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._queue[: self.MAX_BATCH]
            del self._queue[: self.MAX_BATCH]
            jobs = [(rep.pid or 0, rep.pidfd, rep.cgroup) for _, rep in batch]
            results = await anyio.to_thread.run_sync(_reap_batch, jobs)
            for (app, rep), (code, leftovers) in zip(batch, results, strict=True):
                self._on_reaped(app, rep, code, leftovers)


def _reap_batch(jobs: list[tuple[int, int, str | None]]) -> list[tuple[int | None, bool]]:
    out: list[tuple[int | None, bool]] = []
    for pid, pidfd, cgroup in jobs:
        code = reap(pid, pidfd)  # SIGKILLs what is left of its process group first
        leftovers = False
        if code is not None and cgroup is not None and contain.populated(cgroup):
            contain.kill(cgroup)
            leftovers = True
        out.append((code, leftovers))
    return out


class LocalScheduler(Scheduler[LocalRequest]):
    """Runs apps as local child processes; see the module docstring.

    Args:
        session_name: the session that owns the apps this object launches.
        backend: ``local_cwd`` (replicas run in the current directory, ``Role.image`` ignored) or
            ``local_dir`` (``Role.image`` is an absolute path to an existing directory).
        local_root: the state root (records, and logs unless ``log_dir`` is set).
        gpu_count: GPUs on this host for ``auto_set_cuda_visible_devices`` (detected when None).
    """

    pushes_changes = True
    supports_workspace = True

    def __init__(
        self,
        session_name: str,
        backend: str = "local_cwd",
        *,
        local_root: str | os.PathLike[str] | None = None,
        gpu_count: int | None = None,
    ) -> None:
        if backend not in ("local_cwd", "local_dir"):
            raise ValueError(f"backend must be 'local_cwd' or 'local_dir', got {backend!r}")
        if not hasattr(os, "pidfd_open"):
            raise RuntimeError(
                "the local backends need Linux >= 5.3 (os.pidfd_open) to watch their processes"
            )
        super().__init__(backend, session_name)
        root = (
            Path(os.path.abspath(os.path.expanduser(local_root))) if local_root else default_root()
        )
        self._root = root
        self._store = RecordStore(root)
        self._gpu_count = gpu_count
        self._supervisor = TaskSupervisor(f"{backend}:{session_name}")
        self._writer = RecordWriter(self._store, self._supervisor)
        self._contain = Containment(self._supervisor)
        self._watchdog = Watchdog(
            self._store.records_dir, self._registrations, self._on_watchdog_restart
        )
        self._apps: dict[str, _App] = {}
        self._starting: set[str] = set()
        self._finished: OrderedDict[str, _Own] = OrderedDict()
        self._stdin_fd = -1
        self._owner_ticks: int | None = None
        self._closing: asyncio.Task[None] | None = None
        self._reaper = Reaper()
        self._exe_cache: dict[tuple[str, str, str], str] = {}
        self._opts: runopts | None = None
        self._session_dirs: set[str] = set()
        self._prepare_lock = asyncio.Lock()
        self._notify_pending: dict[str, None] = {}
        self._exits = _ExitReaper(self._supervisor, self._on_reaped)
        self._records_watch: Watch | None = None

    @property
    def root(self) -> Path:
        """The state root."""
        return self._root

    @property
    def containment(self) -> str:
        """``"cgroup"`` or ``"marker"`` (see ``_local/contain.py``); ``"unknown"`` before the first
        launch."""
        if not self._contain._probed:
            return "unknown"
        return "cgroup" if self._contain.uses_cgroups else "marker"

    # -- options and dry runs ---------------------------------------------------------------------

    def _run_opts(self) -> runopts:
        if self._opts is None:
            self._opts = self._make_run_opts()
        return self._opts

    def _make_run_opts(self) -> runopts:
        opts = runopts()
        opts.add(
            "log_dir",
            type_=str,
            default=None,
            help="directory for the replicas' logs ({log_dir}/{session}/{app_id}/{role}/{replica}/); "
            f"default: the local state root ({self._root})",
        )
        opts.add(
            "prepend_cwd",
            type_=bool,
            default=False,
            help="put the image directory first on the replicas' PATH (it goes last otherwise), so its "
            "programs take precedence over those on PATH",
        )
        opts.add(
            "auto_set_cuda_visible_devices",
            type_=bool,
            default=False,
            help="give each replica of a role that asks for GPUs its own contiguous slice of the host's "
            "GPUs in CUDA_VISIBLE_DEVICES (left unset when the host has too few)",
        )
        opts.add(
            "cancel_grace_period",
            type_=float,
            default=DEFAULT_GRACE_PERIOD,
            help="seconds between SIGTERM and SIGKILL when replicas are stopped (cancel, failure of a "
            f"sibling, restart); at most {MAX_GRACE_PERIOD:g}. close() waits at most "
            f"{CLOSE_MAX_GRACE:g} s, the watchdog of a launcher that died at most 5 s",
        )
        return opts

    def _submit_dryrun(
        self,
        app: AppDef,
        cfg: Mapping[str, CfgVal],
        app_id: str | None = None,
        workdirs: Mapping[str, str] | None = None,
    ) -> AppDryRunInfo[LocalRequest]:
        request = build_request(
            app,
            cfg,
            backend=self.backend,
            session=self.session_name,
            log_root=self._root,
            gpu_count=self._gpu_count,
            parent_path=os.environ.get("PATH", os.defpath),
            app_id=app_id,
            workdirs=workdirs,
        )
        return AppDryRunInfo(request, format_request)

    # -- workspaces (asynctorchx.schedulers._local.workspace) -------------------------------------

    def plan_workspace(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """local_cwd: the workspace is the replicas' working directory; local_dir: the first role
        runs from a snapshot made at submit time (reads and hashes the workspace here)."""
        return local_workspace.plan_local(self.backend, app, workspace, self._root, cfg)

    def _submit_dryrun_workspace(
        self, app: AppDef, cfg: Mapping[str, CfgVal], plan: WorkspacePlan
    ) -> AppDryRunInfo[LocalRequest]:
        app_id = make_unique(app.name)
        dirs = local_workspace.workdirs(self.backend, plan, self._root, self.session_name, app_id)
        return self._submit_dryrun(app, cfg, app_id, dirs)

    async def _ship_workspace(self, dryrun_info: AppDryRunInfo[LocalRequest]) -> None:
        from asynctorchx.schedulers.workspace import current_progress

        plan = dryrun_info.workspace
        role = next(r for r in dryrun_info.request.roles if r.name == plan.roles[0])
        await local_workspace.ship(plan, role.replicas[0].cwd, current_progress())

    # -- submitting -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    async def schedule(self, dryrun_info: AppDryRunInfo[LocalRequest]) -> str:
        """Starts every replica of the app and returns its id once its record (RUNNING) is on disk.

        The app is registered with the watchdog before its first replica starts, with a minimal
        record the watchdog writes if this process dies before writing the real one.

        Raises:
            LaunchSpecError: the app cannot be launched as given (missing, non-executable or
                directory entrypoint, missing working directory, a log_dir that cannot be written).
            LaunchError: a resource ran out (file descriptors, disk space, processes).
            ValueError: this dry run was already scheduled.

        Whatever the error, even a cancellation, nothing of the app is left running or on disk.
        """
        self._check_open()
        request = dryrun_info.request
        if not isinstance(request, LocalRequest):
            raise TypeError(f"not a dry run of a local scheduler: {dryrun_info!r}")
        app_id = request.app_id
        if app_id in self._apps or app_id in self._finished or app_id in self._starting:
            raise ValueError(f"dry run of app {app_id!r} was already scheduled")
        self._starting.add(app_id)
        shipped = False
        try:
            if self._stdin_fd < 0:
                async with self._prepare_lock:
                    if self._stdin_fd < 0:
                        await self._prepare()
            if dryrun_info.workspace is not None:
                await self._ship_workspace(dryrun_info)
                shipped = True
            self._check_open()
            appdef = dryrun_info.app or AppDef(request.app_name)
            app = _App(
                request=request,
                app_json=appdef_to_json(appdef),
                replicas=[
                    _Replica(r, i, protocol.replica_marker(app_id, r.role, r.replica_id))
                    for i, r in enumerate(request.replicas)
                ],
                retries_left={r.name: r.max_retries for r in request.roles},
                policies={r.name: r.retry_policy for r in request.roles},
                submitted_at=time.time(),
                stop_grace=request.grace_period,
            )
            self._resolve(app)
            reserved = _reserve_fds(app_id, len(app.replicas))
            try:
                await self._make_app_dir(app)
                opened = _FDS_FILES * len(app.replicas)  # counted as open from now on
                _release_fds(opened)
                reserved -= opened
                try:
                    await self._start_app(app)
                except BaseException as e:
                    await self._undo(app)
                    if isinstance(e, OSError):
                        raise self._launch_error(app, e, "the app's record") from None
                    raise
            finally:
                _release_fds(reserved)
        except BaseException:
            if shipped:  # a bad entrypoint, say: the app's workspace directory goes too
                await anyio.to_thread.run_sync(
                    local_workspace.remove_workdir, self._root, self.session_name, app_id
                )
            raise
        finally:
            self._starting.discard(app_id)
        self._notify(app_id)
        return app_id

    async def _prepare(self) -> None:
        try:
            await anyio.to_thread.run_sync(self._prepare_blocking)
        except OSError as e:
            raise LaunchError(
                f"cannot use the local state root {str(self._root)!r}: {e} "
                "(set ASYNCTORCHX_LOCAL_ROOT or local_root= to a writable directory)"
            ) from None
        _raise_fd_limit()
        self._owner_ticks = proc_start_ticks(os.getpid())
        self._watchdog.base_cgroup = self._contain.base
        self._ensure_records_watch()
        self._stdin_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def _prepare_blocking(self) -> None:
        self._store.ensure()
        self._contain.probe()

    def _resolve(self, app: _App) -> None:
        """Checks the working directories and finds each replica's program (LaunchSpecError if
        missing).

        Lookups are cached per (entrypoint, PATH, cwd); a cached program is checked to still be
        executable.
        """
        checked: set[str] = set()
        cache = self._exe_cache
        for rep in app.replicas:
            req = rep.req
            if req.cwd not in checked:
                check_cwd(req.cwd, req.role)
                checked.add(req.cwd)
            key = (req.entrypoint, req.env.get("PATH", ""), req.cwd)
            exe = cache.get(key)
            if exe is None or not os.access(exe, os.X_OK):
                exe = resolve_executable(*key, role=req.role)
                if len(cache) > 256:
                    cache.clear()
                cache[key] = exe
            rep.executable = exe

    def _launch_error(self, app: _App, e: OSError, what: str) -> LaunchError:
        """The LaunchError that says why ``what`` of ``app`` could not be created or started."""
        why = e.strerror or str(e)
        if e.errno in FD_ERRNOS:
            return LaunchError(f"cannot start app {app.app_id!r}: {fd_exhaustion_message()}")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return LaunchError(
                f"cannot create {what} of app {app.app_id!r}: {why} (its file system is full)"
            )
        if what.startswith("the log") and e.errno in SPEC_ERRNOS:
            return LaunchSpecError(
                f"cannot create {what} of app {app.app_id!r}: {why} "
                "(set the log_dir run option to a writable directory)"
            )
        if what == "the app's record":
            return LaunchError(
                f"cannot write the record of app {app.app_id!r} under "
                f"{self._store.records_dir}: {why}"
            )
        return LaunchError(f"cannot create {what} of app {app.app_id!r}: {why}")

    async def _make_app_dir(self, app: _App) -> None:
        """Creates ``{app_dir}/{role}/{replica}/`` and each replica's log files (a few system calls
        per replica, on the event loop, which runs between chunks: a worker thread would only wait
        for the GIL meanwhile).

        Raises LaunchError (the app's directory removed) or ValueError (it exists already).
        """
        app_dir = app.request.app_dir
        session_dir = os.path.dirname(app_dir)
        try:
            if session_dir not in self._session_dirs:
                os.makedirs(session_dir, exist_ok=True)
                self._session_dirs.add(session_dir)
            try:
                os.mkdir(app_dir)
            except FileNotFoundError:  # the session directory was removed since
                os.makedirs(session_dir, exist_ok=True)
                os.mkdir(app_dir)
        except FileExistsError:
            raise ValueError(
                f"the log directory of app {app.app_id!r} already exists ({app_dir}); "
                "was this dry run already scheduled?"
            ) from None
        except OSError as e:
            raise self._launch_error(app, e, f"the log directory {app_dir!r}") from None
        try:
            for role_dir in dict.fromkeys(os.path.dirname(r.req.log_dir) for r in app.replicas):
                os.mkdir(role_dir)
            for i, rep in enumerate(app.replicas):
                if i and i % _START_CHUNK == 0:
                    await asyncio.sleep(0)
                rep.writer = self._new_writer(app, rep)
        except BaseException as e:
            self._close_writers(app)
            shutil.rmtree(app_dir, ignore_errors=True)
            if isinstance(e, OSError):
                raise self._launch_error(app, e, f"the log directory {app_dir!r}") from None
            raise

    def _new_writer(self, app: _App, rep: _Replica) -> ReplicaLogWriter:
        def on_loss(reason: str) -> None:
            if not app.log_loss:
                app.log_loss = reason
                self._changed(app)

        return ReplicaLogWriter(rep.req.log_dir, on_loss=on_loss)

    async def _start_app(self, app: _App) -> None:
        """Registers the app with the watchdog (with a minimal record to write if the launcher
        dies before the real one is), starts its replicas, and writes its record."""
        app_id = app.app_id
        app.cgroup = self._contain.app_dir(app_id)
        self._apps[app_id] = app
        self._watchdog.ensure_started()
        self._watchdog.send_now(self._app_line(app))
        await self._prepare_cgroups(app)
        self._check_open()
        if app.cancel_reason is None:  # else it was cancelled meanwhile: its task records that
            await self._start(app, app.replicas)
            app.state = AppState.RUNNING
        app.task = self._supervisor.spawn(self._supervise(app), f"app:{app_id}")
        await self._writer.write(app_id, lambda: self._snapshot(app).to_json())

    async def _prepare_cgroups(self, app: _App) -> None:
        if app.cgroup is None:
            return
        dirs = [app.cgroup]
        n = len(app.replicas)
        dirs += [self._contain.replica_dir(app.cgroup, r.index, 1, n) or "" for r in app.replicas]
        try:
            await self._contain.prepare(dirs)
        except OSError as e:
            logger.warning("cannot create the cgroups of app %s (%s); using markers", app.app_id, e)
            self._contain.remove_later(app.cgroup)
            app.cgroup = None

    async def _start(self, app: _App, replicas: Iterable[_Replica]) -> None:
        """Starts ``replicas`` (a few hundred microseconds each). Raises LaunchError.

        Each one is confined and registered with the watchdog before anything else happens; the
        event loop runs between chunks of ``_START_CHUNK`` spawns, and starting stops there if the
        app was cancelled meanwhile (RuntimeError if the scheduler was closed).
        """
        loop = asyncio.get_running_loop()
        base_env = dict(os.environ)
        app_id = app.app_id
        for i, rep in enumerate(replicas):
            if i and i % _START_CHUNK == 0:
                await asyncio.sleep(0)
                if app.cancel_reason is not None:
                    return
                self._check_open()
            req = rep.req
            env = {**base_env, **req.env}
            env.setdefault("PYTHONUNBUFFERED", "x")
            env[protocol.MARKER_ENV] = rep.marker
            writer = rep.writer
            if writer is None or writer.closed:
                if writer is not None:
                    rep.lost_before = rep.lost_bytes()
                try:
                    writer = rep.writer = self._new_writer(app, rep)
                except OSError as e:
                    what = f"the logs of {rep.label} ({req.log_dir})"
                    raise self._launch_error(app, e, what) from None
            cgroup = self._contain.replica_dir(
                app.cgroup, rep.index, rep.attempts + 1, len(app.replicas)
            )
            try:
                spawned = spawn(
                    rep.executable, [req.entrypoint, *req.args], env, req.cwd, self._stdin_fd
                )
            except OSError as e:
                if e.errno in FD_ERRNOS:
                    raise self._launch_error(app, e, f"the pipes of {rep.label}") from None
                error = LaunchSpecError if e.errno in SPEC_ERRNOS else LaunchError
                raise error(
                    f"role {req.role!r}: cannot start replica {req.replica_id} "
                    f"({rep.executable}): {e.strerror or e}"
                ) from None
            try:
                pidfd = os.pidfd_open(spawned.pid)
            except OSError as e:
                kill_and_reap_now(spawned.pid)
                os.close(spawned.stdout_fd)
                os.close(spawned.stderr_fd)
                if e.errno in FD_ERRNOS:
                    raise self._launch_error(app, e, f"the pidfd of {rep.label}") from None
                raise LaunchError(f"cannot watch {rep.label} (pid {spawned.pid}): {e}") from None
            rep.pid = spawned.pid
            rep.pidfd = pidfd
            rep.cgroup = self._contain.adopt(cgroup, spawned.pid)
            self._watchdog.send_now(protocol.start_line(app_id, spawned.pid))
            writer.attach(spawned.stdout_fd, Stream.STDOUT)
            writer.attach(spawned.stderr_fd, Stream.STDERR)
            rep.start_ticks = None  # the record writer looks it up, off the event loop
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
            loop.add_reader(pidfd, self._on_exit, app, rep)

    def _on_exit(self, app: _App, rep: _Replica) -> None:
        # the pidfd is readable: the main process exited. A few exits per loop iteration are
        # reaped here; when many come at once, reaping (waitid, which then contends with every
        # other exit for the kernel's task list) goes to a worker thread, in batches
        asyncio.get_running_loop().remove_reader(rep.pidfd)
        rep.reaping = True
        if self._exits.busy():
            self._exits.add(app, rep)
            return
        ((code, leftovers),) = _reap_batch([(rep.pid or 0, rep.pidfd, rep.cgroup)])
        self._on_reaped(app, rep, code, leftovers)

    def _on_reaped(self, app: _App, rep: _Replica, code: int | None, leftovers: bool) -> None:
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
        self._watchdog.send_later(protocol.exit_line(app.app_id, rep.pid or 0))
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

    async def _undo(self, app: _App) -> None:
        """Undoes a failed or cancelled start; runs to completion even if the caller is cancelled."""
        try:
            task = self._supervisor.spawn(self._discard(app), f"undo:{app.app_id}")
        except RuntimeError:  # closing: the scheduler's own clean-up is running
            await self._discard(app)
            return
        await asyncio.shield(task)

    async def _discard(self, app: _App) -> None:
        """Kills what started of the app and removes its directory, record and cgroups."""
        app.discard = True
        self._writer.forget(app.app_id)
        task = app.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        while any(r.reaping for r in app.replicas):
            await self._exits.idle()
        started = app.running()
        loop = asyncio.get_running_loop()
        for rep in started:
            loop.remove_reader(rep.pidfd)
            self._contain.kill(rep.cgroup, rep.pid or 0)

        def wait_all() -> None:
            for rep in started:
                with contextlib.suppress(ChildProcessError):
                    os.waitid(os.P_PIDFD, rep.pidfd, os.WEXITED)
                os.close(rep.pidfd)
                rep.pidfd = -1
            if app.cgroup is None:
                prefix = protocol.app_marker_prefix(app.app_id)
                found = contain.live_processes(protocol.MARKER_ENV_BYTES, [prefix])
                contain.kill_pids(p for p, _, _ in found)

        await anyio.to_thread.run_sync(wait_all)
        self._close_writers(app)
        self._apps.pop(app.app_id, None)
        # nothing runs any more: the watchdog must not record it (a record would be a ghost)
        self._watchdog.send_now(protocol.forget_line(app.app_id))
        await self._writer.flush()  # a write in flight must not land after the removal
        await anyio.to_thread.run_sync(
            self._remove_app_files, app.app_id, app.request.app_dir, app.cgroup
        )

    def _remove_app_files(self, app_id: str, app_dir: str, cgroup: str | None) -> None:
        shutil.rmtree(app_dir, ignore_errors=True)
        local_workspace.remove_workdir(self._root, self.session_name, app_id)
        self._store.remove(app_id)
        if cgroup is not None:
            deadline = time.monotonic() + CONTAIN_TIMEOUT
            while not contain.remove_tree(cgroup) and time.monotonic() < deadline:
                contain.kill(cgroup)
                time.sleep(0.01)

    @staticmethod
    def _close_writers(app: _App) -> None:
        for rep in app.replicas:
            if rep.writer is not None:
                rep.writer.close()

    # -- supervising an app -----------------------------------------------------------------------

    async def _supervise(self, app: _App) -> None:
        try:
            await self._supervise_inner(app)
        except asyncio.CancelledError:
            self._kill_now(app, "the scheduler's tasks were cancelled")
            raise
        except Exception as e:
            logger.exception("supervising app %s failed", app.app_id)
            self._kill_now(app, f"internal error while supervising the app: {e!r}")
            await self._finish(app, AppState.FAILED)

    async def _supervise_inner(self, app: _App) -> None:
        """Processes exits in batches: whatever exited while the last batch was handled is settled
        together, so a thousand replicas exiting at once cost a few passes, not a thousand."""
        while True:
            if app.cancel_reason is not None:
                await self._stop(app, app.running(), AppState.CANCELLED)
                app.msg = app.cancel_reason
                await self._finish(app, AppState.CANCELLED)
                return
            if not app.exited:
                app.wake.clear()
                if not app.exited and app.cancel_reason is None:
                    await app.wake.wait()
                continue
            batch, app.exited = app.exited, []
            batch = [r for r in batch if r.exit_pending]
            if not batch:
                continue
            await self._settle(batch)
            signalled = self._store.cancel_requested(app.app_id)
            if signalled is not None:
                for rep in batch:
                    if rep.exit_pending:
                        rep.exit_pending = False
                        ok = rep.exit_code == 0
                        app.set_state(rep, AppState.SUCCEEDED if ok else AppState.CANCELLED)
                self._request_stop(app, "cancelled by another process", signalled=signalled)
                continue
            for i, rep in enumerate(batch):
                if i and i % _CHUNK == 0:
                    await asyncio.sleep(0)  # let the loop breathe between chunks of a big batch
                if not rep.exit_pending:  # a restart's stop took it over
                    continue
                rep.exit_pending = False
                if rep.exit_code == 0:
                    app.set_state(rep, AppState.SUCCEEDED)
                    if rep.writer is not None:
                        rep.writer.close()  # now rather than all at once when the app ends
                    if app.n_succeeded == len(app.replicas):
                        await self._finish(app, AppState.SUCCEEDED)
                        return
                    continue
                if await self._failed(app, rep):
                    return
                if app.cancel_reason is not None:
                    break
            self._changed(app)

    async def _failed(self, app: _App, rep: _Replica) -> bool:
        """Handles a replica that failed: restart, or fail the app. True once the app is finished."""
        app.set_state(rep, AppState.FAILED)
        await self._read_error_file(rep)
        role = rep.req.role
        if app.retries_left[role] > 0:
            app.retries_left[role] -= 1
            app.num_restarts += 1
            targets = self._restart_targets(app, rep)
            await self._stop(app, [r for r in targets if r.running], AppState.PENDING)
            if app.cancel_reason is not None:
                return False
            app.msg = (
                f"restart {app.num_restarts} after {rep.label} {_describe_exit(rep.exit_code)}"
            )
            try:
                await self._restart(app, targets)
            except LaunchError as e:
                app.msg = f"restart failed: {e}"
                app.structured_error_msg = rep.structured_error_msg
                await self._stop(app, app.running(), AppState.CANCELLED)
                await self._finish(app, AppState.FAILED)
                return True
            self._changed(app)
            return False
        app.msg = f"{rep.label} {_describe_exit(rep.exit_code)}"
        app.structured_error_msg = rep.structured_error_msg
        self._changed(app)
        await self._stop(app, app.running(), AppState.CANCELLED)
        await self._finish(app, AppState.FAILED)
        return True

    @staticmethod
    def _restart_targets(app: _App, failed: _Replica) -> list[_Replica]:
        policy = app.policies[failed.req.role]
        if policy == RetryPolicy.REPLICA:
            return [failed]
        if policy == RetryPolicy.ROLE:
            return [r for r in app.replicas if r.req.role == failed.req.role]
        return list(app.replicas)

    async def _restart(self, app: _App, targets: list[_Replica]) -> None:
        pending = [r for r in targets if r.exit_pending]
        if pending:
            await self._settle(pending)
            for rep in pending:
                rep.exit_pending = False
        files = [r.req.error_file for r in targets]
        await anyio.to_thread.run_sync(_remove_files, files)
        if app.cgroup is not None:
            n = len(app.replicas)
            dirs = [
                self._contain.replica_dir(app.cgroup, r.index, r.attempts + 1, n) for r in targets
            ]
            try:
                await self._contain.prepare([d for d in dirs if d is not None])
            except OSError as e:
                raise LaunchError(
                    f"cannot create the cgroups of the restarted replicas: {e}"
                ) from None
        if app.cancel_reason is not None:
            return
        for rep in targets:
            app.set_state(rep, AppState.PENDING)
        await self._start(app, targets)

    async def _stop(self, app: _App, replicas: list[_Replica], final: AppState) -> None:
        """Stops ``replicas``: one SIGTERM to each group (unless it had it already), SIGKILL of
        everything they contain after the grace period; waits for all of it to be gone.

        Their exits are settled here (not by the main loop) and they end in state ``final``.
        """
        loop = asyncio.get_running_loop()
        now = loop.time()
        targets = [r for r in replicas if r.running]
        for rep in targets:
            if not rep.term_sent:
                kill_group(rep.pid or 0, signal.SIGTERM)
                rep.term_sent = True
                rep.term_at = now
        if targets:
            deadline = max(r.term_at for r in targets) + app.stop_grace
            await self._wait_exited(targets, deadline)
            for rep in targets:
                if rep.running:
                    self._contain.kill(rep.cgroup, rep.pid or 0)
            await self._wait_exited(targets, None)
        await self._settle([r for r in targets if r.exit_pending])
        for rep in targets:
            rep.exit_pending = False
            rep.term_sent = False
            app.set_state(rep, final)

    @staticmethod
    async def _wait_exited(replicas: list[_Replica], deadline: float | None) -> None:
        running = [r for r in replicas if r.running]
        if not running:
            return
        waiter = _Countdown(len(running))
        for rep in running:
            rep.stop_waiter = waiter
        try:
            if deadline is None:
                await waiter.event.wait()
            else:
                timeout = deadline - asyncio.get_running_loop().time()
                with anyio.move_on_after(max(timeout, 0.0)):
                    await waiter.event.wait()
        finally:
            for rep in running:
                if rep.stop_waiter is waiter:
                    rep.stop_waiter = None

    async def _settle(self, replicas: list[_Replica]) -> None:
        """Waits until nothing the replicas started is left (after their main process exited) and
        everything they wrote is in their log files, both boundedly."""
        if not replicas:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONTAIN_TIMEOUT
        swept = [r for r in replicas if r.leftovers and r.cgroup is None]
        waits: list[tuple[_Replica, asyncio.Future[None]]] = []
        if swept:
            fut = self._contain.sweep([r.marker for r in swept], min(r.pid or 0 for r in swept))
            waits += [(r, fut) for r in swept]
        for rep in replicas:
            if rep.leftovers and rep.cgroup is not None:
                waits.append((rep, self._contain.wait_empty(rep.cgroup)))
        for rep, fut in waits:
            if not fut.done():
                await asyncio.wait([fut], timeout=max(deadline - loop.time(), 0.0))
            if not fut.done():
                logger.warning(
                    "processes started by %s (pid %s) are still alive %.0f s after SIGKILL",
                    rep.label,
                    rep.pid,
                    CONTAIN_TIMEOUT,
                )
            rep.leftovers = False
        deadline = loop.time() + DRAIN_TIMEOUT
        for rep in replicas:
            writer = rep.writer
            if writer is None or not writer.attached:
                continue
            try:
                await asyncio.wait_for(writer.wait_drained(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                logger.warning(
                    "the output pipes of %s (pid %s) are still open after it and everything it "
                    "contains exited (a process that escaped holds them); stopped reading them",
                    rep.label,
                    rep.pid,
                )
                writer.close()

    @staticmethod
    async def _read_error_file(rep: _Replica) -> None:
        text = await anyio.to_thread.run_sync(_read_text, rep.req.error_file)
        rep.structured_error_msg = text if text else NONE

    def _request_stop(
        self,
        app: _App,
        reason: str,
        *,
        grace: float | None = None,
        signalled: Iterable[int] = (),
    ) -> None:
        """Starts stopping the app (one SIGTERM per group now; the app's task escalates).

        Idempotent. ``grace`` shortens the grace period; ``signalled`` lists the groups another
        process already sent SIGTERM.
        """
        if grace is not None:
            app.stop_grace = min(app.stop_grace, grace)
        if app.cancel_reason is not None or is_terminal(app.state):
            return
        app.cancel_reason = reason
        done = set(signalled)
        now = asyncio.get_running_loop().time()
        for rep in app.replicas:
            if rep.running and not rep.term_sent:
                if rep.pid not in done:
                    kill_group(rep.pid or 0, signal.SIGTERM)
                rep.term_sent = True
                rep.term_at = now
        app.wake.set()

    def _kill_now(self, app: _App, reason: str) -> None:
        """SIGKILLs and reaps every replica at once (used when the app's task cannot continue)."""
        loop = asyncio.get_running_loop()
        for rep in app.replicas:
            if rep.running:
                self._contain.kill(rep.cgroup, rep.pid or 0)
                if not rep.reaping:  # otherwise the exit reaper has it and closes its pidfd
                    loop.remove_reader(rep.pidfd)
                    with contextlib.suppress(ChildProcessError):
                        os.waitid(os.P_PIDFD, rep.pidfd, os.WEXITED)
                    os.close(rep.pidfd)
                    rep.pidfd = -1
                    app.n_running -= 1
                rep.exit_code = -signal.SIGKILL
                app.set_state(rep, AppState.CANCELLED)
                rep.ended_at = time.time()
            if rep.writer is not None:
                rep.writer.close()
        if app.cancel_reason is None:
            app.cancel_reason = reason
        app.msg = app.msg or reason

    async def _finish(self, app: _App, state: AppState) -> None:
        pending = [r for r in app.exited if r.exit_pending]
        app.exited = []
        await self._settle(pending)
        for rep in pending:
            rep.exit_pending = False
            if not is_terminal(rep.state):
                if rep.exit_code == 0:
                    app.set_state(rep, AppState.SUCCEEDED)
                else:
                    failed = AppState.CANCELLED if state == AppState.CANCELLED else AppState.FAILED
                    app.set_state(rep, failed)
        for rep in app.replicas:
            if rep.writer is not None:
                rep.writer.close()
            if not is_terminal(rep.state):
                app.set_state(rep, AppState.CANCELLED)
        app.state = state
        app.ended_at = time.time()
        snapshot = self._snapshot(app)
        app_id = app.app_id
        self._apps.pop(app_id, None)
        self._finished[app_id] = (snapshot, app.roles)
        while len(self._finished) > FINISHED_CACHE:
            self._finished.popitem(last=False)
        self._writer.put(
            app_id,
            snapshot.to_json(),
            on_written=lambda: self._watchdog.send_later(protocol.forget_line(app_id)),
        )
        self._contain.remove_later(app.cgroup)
        self._notify(app_id)

    def _changed(self, app: _App) -> None:
        """Queues the app's record (serialised once per write batch) and a change notification."""
        self._writer.put(app.app_id, lambda: self._snapshot(app).to_json(), urgent=False)
        self._notify_soon(app.app_id)

    def _notify_soon(self, app_id: str) -> None:
        """Notifies subscribers of ``app_id`` on the next loop iteration (once, however many calls)."""
        if not self._notify_pending:
            asyncio.get_running_loop().call_soon(self._flush_notifications)
        self._notify_pending[app_id] = None

    def _flush_notifications(self) -> None:
        pending, self._notify_pending = self._notify_pending, {}
        for app_id in pending:
            self._notify(app_id)

    def _snapshot(self, app: _App) -> AppRecord:
        req = app.request
        msg = app.msg
        if app.log_loss:
            msg = "; ".join(m for m in (msg, self._loss_note(app)) if m)
        return AppRecord(
            app_id=req.app_id,
            name=req.app_name,
            backend=req.backend,
            session=req.session,
            state=app.state,
            msg=msg,
            structured_error_msg=app.structured_error_msg,
            num_restarts=app.num_restarts,
            submitted_at=app.submitted_at,
            ended_at=app.ended_at,
            app_dir=req.app_dir,
            grace_period=req.grace_period,
            owner=Owner(
                pid=os.getpid(),
                start_ticks=self._owner_ticks,
                watchdog_pid=self._watchdog.pid,
                watchdog_start_ticks=self._watchdog.start_ticks,
            ),
            replicas=tuple(r.record() for r in app.replicas),
            app=app.app_json,
            cgroup=app.cgroup,
        )

    @staticmethod
    def _loss_note(app: _App) -> str:
        parts = []
        for rep in app.replicas:
            lost = rep.lost_bytes()
            if lost:
                files = ", ".join(f"{n} bytes of {name}" for name, n in sorted(lost.items()))
                parts.append(f"{rep.label} {files}")
        if not parts:
            return ""
        return f"log output lost ({app.log_loss}): " + "; ".join(parts)

    def _registrations(self) -> Iterable[bytes]:
        for app in self._apps.values():
            yield self._app_line(app)
            for rep in app.replicas:
                if rep.running:
                    yield protocol.start_line(app.app_id, rep.pid or 0)

    def _app_line(self, app: _App) -> bytes:
        req = app.request
        minimal = AppRecord(
            app_id=req.app_id,
            name=req.app_name,
            backend=req.backend,
            session=req.session,
            state=AppState.PENDING,
            msg="",
            structured_error_msg=NONE,
            num_restarts=0,
            submitted_at=app.submitted_at,
            ended_at=None,
            app_dir=req.app_dir,
            grace_period=req.grace_period,
            owner=Owner(pid=os.getpid(), start_ticks=self._owner_ticks),
            replicas=(),
            app={},
            cgroup=app.cgroup,
        )
        return protocol.app_line(app.app_id, req.grace_period, app.cgroup, minimal.to_json())

    def _on_watchdog_restart(self) -> None:
        for app in self._apps.values():  # their records name the new watchdog
            if not app.discard:
                self._changed(app)

    # -- describing -------------------------------------------------------------------------------

    def _own(self, app_id: str) -> _Own | None:
        app = self._apps.get(app_id)
        if app is not None:
            if app.discard:
                return None
            return self._snapshot(app), app.roles
        return self._finished.get(app_id)

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        """The app's state, replicas (pid, exit code, structured error) and roles; None if unknown."""
        own = self._own(app_id)
        if own is not None:
            return own[0].to_response(own[1])
        self._ensure_records_watch()
        record = await anyio.to_thread.run_sync(self._read_foreign, app_id)
        return None if record is None else record.to_response()

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        """``describe`` of many apps: the ones this object launched from memory, the others in one
        read of their records."""
        out: dict[str, DescribeAppResponse | None] = {}
        foreign = []
        for app_id in dict.fromkeys(app_ids):
            own = self._own(app_id)
            if own is not None:
                out[app_id] = own[0].to_response(own[1])
            else:
                foreign.append(app_id)
        if foreign:
            self._ensure_records_watch()
            records = await anyio.to_thread.run_sync(self._read_foreign_many, foreign)
            for app_id, record in records.items():
                out[app_id] = None if record is None else record.to_response()
        return out

    def _read_foreign(self, app_id: str) -> AppRecord | None:
        record = self._store.read(app_id)
        return None if record is None else _check_lost(record)

    def _read_foreign_many(self, app_ids: list[str]) -> dict[str, AppRecord | None]:
        return {app_id: self._read_foreign(app_id) for app_id in app_ids}

    async def list(self) -> list[ListAppResponse]:
        """Every app of this backend in the state root, whichever session or process launched it."""

        def read_all() -> list[AppRecord]:
            ids = self._store.list_ids()
            return [r for r in self._read_foreign_many(ids).values() if r is not None]

        records = {r.app_id: r for r in await anyio.to_thread.run_sync(read_all)}
        for app_id in list(records):
            own = self._own(app_id)
            if own is not None:
                records[app_id] = own[0]
        for app in self._apps.values():
            if not app.discard:
                records.setdefault(app.app_id, self._snapshot(app))
        ordered = sorted(records.values(), key=lambda r: (r.submitted_at, r.app_id))
        return [
            ListAppResponse(
                app_id=r.app_id,
                state=r.state,
                app_handle=make_app_handle(r.backend, r.session, r.app_id),
                name=r.name,
            )
            for r in ordered
            if r.backend == self.backend
        ]

    # -- changes made by other processes ------------------------------------------------------------

    def subscribe(self, callback: ChangeCallback) -> Callable[[], None]:
        """Registers ``callback(app_id)``; also called when the record of an app that another process
        launched changes (inotify on the records directory, where available)."""
        unsubscribe = super().subscribe(callback)
        with contextlib.suppress(RuntimeError):  # no running loop: set up at the first describe
            self._ensure_records_watch()
        return unsubscribe

    def _ensure_records_watch(self) -> None:
        if self._records_watch is not None and self._records_watch.active:
            return
        if self._closed:
            return
        try:
            # the log follower's inotify hub (one instance per loop) carries this watch too;
            # records and cancel markers are renamed into place (or rewritten in place)
            self._records_watch = watch_directory(
                str(self._store.records_dir), self._on_records_event, _RECORD_EVENTS
            )
        except FileNotFoundError:
            self._records_watch = None

    def _on_records_event(self, name: str, mask: int) -> None:
        if name.endswith(".json") and not name.startswith("."):
            app_id = name[:-5]
            if app_id not in self._apps and app_id not in self._finished:
                self._notify(app_id)
        elif name.endswith(".cancel"):
            app = self._apps.get(name[:-7])
            if app is not None and not app.discard and app.cancel_reason is None:
                signalled = self._store.cancel_requested(app.app_id)
                if signalled is not None:
                    self._request_stop(app, "cancelled by another process", signalled=signalled)
                    self._changed(app)

    # -- cancelling -------------------------------------------------------------------------------

    async def cancel(self, app_id: str) -> None:
        """Stops the app: SIGTERM now, SIGKILL after the grace period. Returns without waiting.

        Works for apps launched by other processes too (a detached helper delivers the SIGKILL).
        Cancelling an unknown or finished app does nothing.
        """
        app = self._apps.get(app_id)
        if app is not None:
            if app.cancel_reason is None and not is_terminal(app.state) and not app.discard:
                self._request_stop(app, "cancelled")
                app.msg = "cancelling"
                self._changed(app)
            return
        if app_id in self._finished or app_id in self._starting:
            return
        record = await anyio.to_thread.run_sync(self._store.read, app_id)
        if record is not None and not is_terminal(record.state):
            await self._cancel_existing(app_id)

    async def _cancel_existing(self, app_id: str) -> None:
        if app_id in self._apps:
            await self.cancel(app_id)
            return
        escalator = await anyio.to_thread.run_sync(self._cancel_foreign, app_id)
        if escalator is not None:
            self._reaper.add(escalator)

    def _cancel_foreign(self, app_id: str) -> subprocess.Popen[bytes] | None:
        record = self._store.read(app_id)
        if record is None or is_terminal(record.state):
            return None
        live = [
            (rep.pid, rep.start_ticks)
            for rep in record.replicas
            if rep.pid and not is_terminal(rep.state) and pid_alive(rep.pid, rep.start_ticks)
        ]
        groups = [f"{pid}:{ticks or 0}" for pid, ticks in live]
        # the marker lists the groups first, so the launcher does not send them a second SIGTERM
        if not self._store.mark_cancel(app_id, groups):
            return None
        for pid, _ in live:
            kill_group(pid, signal.SIGTERM)
        if groups or record.cgroup:
            return start_escalator(
                self._store.records_dir, app_id, record.grace_period, record.cgroup, groups
            )
        watchdog_script.finish_record(
            str(self._store.records_dir),
            app_id,
            "cancelled by another process",
            only_if_owner_gone=True,
        )
        return None

    # -- logs -------------------------------------------------------------------------------------

    def log_iter(
        self,
        app_id: str,
        role_name: str,
        k: int = 0,
        regex: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
    ) -> AsyncIterator[str]:
        """The lines replica ``k`` of ``role_name`` wrote (combined stdout and stderr by default).

        Every error is raised by this call, before iterating (for an app another process launched,
        that means reading its small record file here).

        Raises:
            ValueError: an unsupported stream, an invalid regex, or ``since`` after ``until``.
            UnknownAppException: no such app.
            UnknownRoleException: no such role, or ``k`` is out of range.
        """
        stream = _parse_stream(streams)
        pattern = compile_log_regex(regex)
        lo, hi = check_time_window(since, until)
        own = self._own(app_id)
        record = own[0] if own is not None else self._store.read(app_id)
        if record is None:
            raise UnknownAppException(
                make_app_handle(self.backend, self.session_name, app_id),
                f"no local app with id {app_id!r} under {self._root}",
            )
        check_replica(app_id, record.role_counts(), role_name, k)
        replica = record.replica(role_name, k)
        assert replica is not None
        # iter_log_lines' generator itself, not a wrapper: every layer of async generator between
        # the file and the caller costs as much again per line
        return iter_log_lines(
            Path(replica.log_dir),
            stream,
            regex=pattern,
            since=lo,
            until=hi,
            follow=should_tail,
            is_finished=lambda: self._is_finished(app_id),
        )

    async def _is_finished(self, app_id: str) -> bool:
        own = self._own(app_id)
        if own is not None:
            return is_terminal(own[0].state)
        record = await anyio.to_thread.run_sync(self._read_foreign, app_id)
        return record is None or is_terminal(record.state)

    # -- closing ----------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stops the apps this object launched (they end CANCELLED) and its background work.

        Each app gets at most ``CLOSE_MAX_GRACE`` seconds between SIGTERM and SIGKILL. Idempotent.
        The clean-up runs to completion even if the caller is cancelled.
        """
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        reason = (
            f"stopped because its scheduler ({self.backend}, session {self.session_name!r}) closed"
        )
        if self._records_watch is not None:
            self._records_watch.cancel()
            self._records_watch = None
        for app in list(self._apps.values()):
            self._request_stop(app, reason, grace=CLOSE_MAX_GRACE)
        tasks = [a.task for a in self._apps.values() if a.task is not None]
        if tasks:
            grace = max(a.stop_grace for a in self._apps.values())
            await asyncio.wait(tasks, timeout=grace + CONTAIN_TIMEOUT + DRAIN_TIMEOUT + 5.0)
        for app in list(self._apps.values()):
            if app.discard:
                continue
            # its task is stuck (it had the grace period and more): record the end here
            self._kill_now(app, reason)
            app.state = AppState.CANCELLED
            app.ended_at = time.time()
            self._apps.pop(app.app_id, None)
            self._writer.put(app.app_id, self._snapshot(app).to_json())
            self._contain.remove_later(app.cgroup)
            self._notify(app.app_id)
        if not await self._writer.flush(retry_for=2.0):
            logger.error(
                "the records of %d apps could not be written to %s; other processes may see "
                "them as lost",
                len(self._writer.failing),
                self._store.records_dir,
            )
        if self._watchdog.pid is not None:
            # the launcher did not die: whatever is still registered is not for the watchdog to
            # record as such (its record write failed, or it was undone), so forget it
            for app_id in self._writer.failing:
                self._watchdog.send_later(protocol.forget_line(app_id))
            await self._watchdog.aclose()
        await self._exits.idle()
        await self._contain.aclose()  # before its background tasks are cancelled
        await self._supervisor.aclose()
        await self._reaper.aclose()
        if self._stdin_fd >= 0:
            os.close(self._stdin_fd)
            self._stdin_fd = -1


def _check_lost(record: AppRecord) -> AppRecord:
    """``record``, or a FAILED copy when it is not terminal but its launcher, its watchdog and all
    its replicas are gone (nobody is left to record how it ended)."""
    if is_terminal(record.state):
        return record
    owner = record.owner
    if pid_alive(owner.pid, owner.start_ticks):
        return record
    if owner.watchdog_pid and pid_alive(owner.watchdog_pid, owner.watchdog_start_ticks):
        return record
    if any(r.pid and pid_alive(r.pid, r.start_ticks) for r in record.replicas):
        return record
    return dataclasses.replace(
        record,
        state=AppState.FAILED,
        msg=f"lost: its launching process (pid {owner.pid}) and watchdog exited without recording "
        "how it ended",
    )


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "ended"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _parse_stream(streams: Stream | str | None) -> Stream:
    if streams is None:
        return Stream.COMBINED
    value = streams.value if isinstance(streams, Stream) else streams
    stream = _STREAMS.get(value) if isinstance(value, str) else None
    if stream is None:
        raise ValueError(
            f"unsupported log stream {streams!r}; the local backends support "
            f"{', '.join(s.value for s in Stream)}"
        )
    return stream


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _remove_files(paths: list[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            os.unlink(p)


def _raise_fd_limit() -> None:
    """Raises the soft limit of open files to the hard limit (up to 65536): each running replica
    holds ``FDS_PER_REPLICA`` descriptors (pipes, pidfd, log files)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        pass


def _reserve_fds(app_id: str, replicas: int) -> int:
    """Promises the descriptors an app of ``replicas`` replicas needs, or raises LaunchError when
    they do not fit under RLIMIT_NOFILE with what is open and promised already."""
    global _fd_reserved
    need = FDS_PER_REPLICA * replicas + FDS_PER_LAUNCH
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return 0
    free = soft - FD_SPARE - contain.open_fds() - _fd_reserved
    if need > free:
        raise LaunchError(
            f"not enough file descriptors to start app {app_id!r}: its {replicas} replicas need "
            f"{need} in this process ({FDS_PER_REPLICA} each for their output pipes, pidfd and "
            f"log files), and only {max(free, 0)} of its limit of {soft} are free "
            "(RLIMIT_NOFILE: raise it with `ulimit -n`, or run fewer replicas at once)"
        )
    _fd_reserved += need
    return need


def _release_fds(reserved: int) -> None:
    global _fd_reserved
    _fd_reserved -= reserved


def create_cwd_scheduler(session_name: str, **kwargs: Any) -> LocalScheduler:
    """The ``local_cwd`` scheduler: replicas run in the current directory (``Role.image`` ignored).

    Keyword arguments ``local_root`` and ``gpu_count`` are used; others are ignored.
    """
    return LocalScheduler(
        session_name,
        "local_cwd",
        local_root=kwargs.get("local_root"),
        gpu_count=kwargs.get("gpu_count"),
    )


def create_dir_scheduler(session_name: str, **kwargs: Any) -> LocalScheduler:
    """The ``local_dir`` scheduler: ``Role.image`` is an absolute path to an existing directory.

    Keyword arguments ``local_root`` and ``gpu_count`` are used; others are ignored.
    """
    return LocalScheduler(
        session_name,
        "local_dir",
        local_root=kwargs.get("local_root"),
        gpu_count=kwargs.get("gpu_count"),
    )
