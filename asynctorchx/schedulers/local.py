"""The local backends: ``local_cwd`` (image = the current directory) and ``local_dir`` (image = a directory).

Each replica is a child process in its own session and process group, with its stdout and stderr
pumped into log files (``asynctorchx.logs``) under ``{log root}/{session}/{app_id}/{role}/{replica}/``.
Exits are learnt from pidfds watched by the event loop (no threads, no polling), and every change is
pushed to subscribers (``pushes_changes``). Each app has a record on disk (``_local.records``), so
another process with the same state root can describe, list, read the logs of and cancel it.

A replica's environment is the launcher's, then the role's ``env`` (macros substituted), then
``TORCHX_RANK0_HOST=localhost``, and unless the role sets them ``TORCHELASTIC_ERROR_FILE`` (in the
replica's log directory; its contents become the structured error of a failed replica),
``PET_LOG_DIR``, ``TORCHX_JOB_ID`` (the app handle) and ``PYTHONUNBUFFERED``. ``PATH`` is the role's
``PATH``, then the launcher's, with the image directory last (first with ``prepend_cwd``). Linux only
(pidfds, ``/proc``).

Stopping a replica sends SIGTERM to its process group, waits the grace period (run option
``cancel_grace_period``), then sends SIGKILL to the group. When a replica's main process exits, what
is left of its group is killed (as when a container's main process exits). Closing the scheduler
stops the apps it launched; if the launching process dies, even by SIGKILL, a watchdog process
(``_local/watchdog.py``) stops them and records why.

Retries follow ``Role.max_retries`` (a budget per role) and ``Role.retry_policy``: REPLICA restarts the
failed replica, ROLE every replica of its role, APPLICATION every replica of the app. A replica that
fails with no retries left fails the app, and its other replicas are stopped.

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
import logging
import os
import resource
import shutil
import signal
import subprocess
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.logs import ReplicaLogWriter, iter_log_lines
from asynctorchx.schedulers._local import watchdog as watchdog_script
from asynctorchx.schedulers._local import workspace as local_workspace
from asynctorchx.schedulers._local.guard import Reaper, RecordWriter, Watchdog, start_escalator
from asynctorchx.schedulers._local.procs import (
    LaunchError,
    check_cwd,
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
    LocalRequest,
    ReplicaRequest,
    build_request,
    format_request,
)
from asynctorchx.schedulers.api import (
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
    "LocalScheduler",
    "create_cwd_scheduler",
    "create_dir_scheduler",
]

logger = logging.getLogger(__name__)

#: How long a replica's log pipes may stay open after its process group is gone (a process that
#: left the group may hold them) before the log writer stops waiting for them.
DRAIN_TIMEOUT = 2.0
#: Finished apps kept in memory (older ones are read back from their records).
FINISHED_CACHE = 4096
_STREAMS = {s.value: s for s in Stream}

# an app this object launched: its record and its roles as submitted
_Own = tuple[AppRecord, list[Role]]


@dataclass(eq=False)
class _Replica:
    req: ReplicaRequest
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
    stopping: bool = False

    @property
    def running(self) -> bool:
        return self.pidfd >= 0

    @property
    def label(self) -> str:
        return f"{self.req.role}[{self.req.replica_id}]"

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
    exited: deque[_Replica] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    discard: bool = False
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
        self._watchdog = Watchdog(self._store.records_dir, self._registrations)
        self._apps: dict[str, _App] = {}
        self._finished: OrderedDict[str, _Own] = OrderedDict()
        self._stdin_fd = -1
        self._owner_ticks: int | None = None
        self._closing: asyncio.Task[None] | None = None
        self._reaper = Reaper()
        self._exe_cache: dict[tuple[str, str, str], str] = {}
        self._opts: runopts | None = None
        self._session_dirs: set[str] = set()
        self._prepare_lock = asyncio.Lock()

    @property
    def root(self) -> Path:
        """The state root."""
        return self._root

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
            "sibling, restart)",
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
        """Starts every replica of the app and returns its id once its record is written.

        Raises:
            LaunchError: a replica could not be started (missing or non-executable entrypoint,
                missing working directory, unwritable log directory); nothing is left running.
            ValueError: this dry run was already scheduled.
        """
        self._check_open()
        request = dryrun_info.request
        if not isinstance(request, LocalRequest):
            raise TypeError(f"not a dry run of a local scheduler: {dryrun_info!r}")
        if request.app_id in self._apps or request.app_id in self._finished:
            raise ValueError(f"dry run of app {request.app_id!r} was already scheduled")
        if self._stdin_fd < 0:
            async with self._prepare_lock:
                if self._stdin_fd < 0:
                    await self._prepare()
        if dryrun_info.workspace is not None:
            await self._ship_workspace(dryrun_info)
        appdef = dryrun_info.app or AppDef(request.app_name)
        app = _App(
            request=request,
            app_json=appdef_to_json(appdef),
            replicas=[_Replica(r) for r in request.replicas],
            retries_left={r.name: r.max_retries for r in request.roles},
            policies={r.name: r.retry_policy for r in request.roles},
            submitted_at=time.time(),
        )
        self._resolve(app)
        self._watchdog.ensure_started()
        try:
            self._make_app_dir(app)
        except OSError as e:
            raise LaunchError(
                f"cannot create the log directory {request.app_dir!r} of app {request.app_id!r}: "
                f"{e.strerror or e} (set the log_dir run option to a writable directory)"
            ) from None
        try:
            self._start(app, app.replicas)
        except LaunchError:
            await self._discard(app)
            raise
        app.state = AppState.RUNNING
        self._apps[app.app_id] = app
        app.task = self._supervisor.spawn(self._supervise(app), f"app:{app.app_id}")
        try:
            await self._writer.write(app.app_id, self._snapshot(app).to_json())
        except OSError as e:
            app.discard = True
            self._request_stop(app, "its record could not be written")
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(app.task)
            raise LaunchError(
                f"cannot write the record of app {app.app_id!r} under {self._store.records_dir}: {e}"
            ) from None
        self._notify(app.app_id)
        return app.app_id

    async def _prepare(self) -> None:
        try:
            await anyio.to_thread.run_sync(self._store.ensure)
        except OSError as e:
            raise LaunchError(
                f"cannot use the local state root {str(self._root)!r}: {e} "
                "(set ASYNCTORCHX_LOCAL_ROOT or local_root= to a writable directory)"
            ) from None
        _raise_fd_limit()
        self._owner_ticks = proc_start_ticks(os.getpid())
        self._stdin_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def _resolve(self, app: _App) -> None:
        """Checks the working directories and finds each replica's program (LaunchError if missing).

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

    def _make_app_dir(self, app: _App) -> None:
        """Creates ``{app_dir}/{role}/{replica}/`` and each replica's log files (a few system calls
        per replica, on the event loop: a worker thread would only wait for the GIL meanwhile)."""
        app_dir = app.request.app_dir
        session_dir = os.path.dirname(app_dir)
        if session_dir not in self._session_dirs:
            os.makedirs(session_dir, exist_ok=True)
            self._session_dirs.add(session_dir)
        try:
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
        try:
            for role_dir in dict.fromkeys(os.path.dirname(r.req.log_dir) for r in app.replicas):
                os.mkdir(role_dir)
            for rep in app.replicas:
                rep.writer = ReplicaLogWriter(rep.req.log_dir)
        except OSError:
            self._close_writers(app)
            shutil.rmtree(app_dir, ignore_errors=True)
            raise

    def _start(self, app: _App, replicas: Iterable[_Replica]) -> None:
        """Starts ``replicas`` (sync: a few hundred microseconds each). Raises LaunchError."""
        loop = asyncio.get_running_loop()
        base_env = dict(os.environ)
        grace = app.request.grace_period
        for rep in replicas:
            req = rep.req
            env = {**base_env, **req.env}
            env.setdefault("PYTHONUNBUFFERED", "x")
            if rep.writer is None or rep.writer.closed:
                try:
                    rep.writer = ReplicaLogWriter(Path(req.log_dir))
                except OSError as e:
                    raise LaunchError(
                        f"cannot write the logs of {rep.label} of app {app.app_id!r} to "
                        f"{req.log_dir!r}: {e.strerror or e}"
                    ) from None
            try:
                spawned = spawn(
                    rep.executable, [req.entrypoint, *req.args], env, req.cwd, self._stdin_fd
                )
            except OSError as e:
                raise LaunchError(
                    f"role {req.role!r}: cannot start replica {req.replica_id} "
                    f"({rep.executable}): {e.strerror or e}"
                ) from None
            try:
                pidfd = os.pidfd_open(spawned.pid)
            except OSError as e:
                kill_and_reap_now(spawned.pid)
                os.close(spawned.stdout_fd)
                os.close(spawned.stderr_fd)
                raise LaunchError(f"cannot watch {rep.label} (pid {spawned.pid}): {e}") from None
            rep.writer.attach(spawned.stdout_fd, Stream.STDOUT)
            rep.writer.attach(spawned.stderr_fd, Stream.STDERR)
            rep.pid = spawned.pid
            rep.start_ticks = None  # the record writer looks it up, off the event loop
            rep.pidfd = pidfd
            rep.exit_code = None
            rep.ended_at = None
            rep.started_at = time.time()
            rep.attempts += 1
            rep.state = AppState.RUNNING
            rep.stopping = False
            rep.structured_error_msg = NONE
            loop.add_reader(rep.pidfd, self._on_exit, app, rep)
            # queued: the lines of a burst of submits reach the watchdog in one write, at the end
            # of this loop iteration, before ``schedule`` can return
            self._watchdog.send(f"+ {app.app_id} {rep.pid} {grace}\n")

    def _on_exit(self, app: _App, rep: _Replica) -> None:
        code = reap(rep.pid or 0, rep.pidfd)
        if code is None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(rep.pidfd)
        os.close(rep.pidfd)
        rep.pidfd = -1
        rep.exit_code = code
        rep.ended_at = time.time()
        self._watchdog.send(f"- {app.app_id} {rep.pid}\n")
        app.exited.append(rep)
        app.wake.set()

    async def _discard(self, app: _App) -> None:
        """Undoes a failed start: kills what started, removes the app's directory and record."""
        started = [r for r in app.replicas if r.running]
        loop = asyncio.get_running_loop()
        for rep in started:
            loop.remove_reader(rep.pidfd)
            kill_group(rep.pid or 0, signal.SIGKILL)

        def wait_all() -> None:
            for rep in started:
                with contextlib.suppress(ChildProcessError):
                    os.waitid(os.P_PIDFD, rep.pidfd, os.WEXITED)
                os.close(rep.pidfd)
                rep.pidfd = -1

        await anyio.to_thread.run_sync(wait_all)
        for rep in started:
            self._watchdog.send(f"- {app.app_id} {rep.pid}\n")
        self._watchdog.send(f"x {app.app_id}\n")
        self._close_writers(app)
        await anyio.to_thread.run_sync(self._remove_app_files, app.app_id, app.request.app_dir)

    def _remove_app_files(self, app_id: str, app_dir: str) -> None:
        shutil.rmtree(app_dir, ignore_errors=True)
        local_workspace.remove_workdir(self._root, self.session_name, app_id)
        self._store.remove(app_id)

    @staticmethod
    def _close_writers(app: _App) -> None:
        for rep in app.replicas:
            if rep.writer is not None:
                rep.writer.close()
                rep.writer = None

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
            rep = app.exited.popleft()
            await self._settle(rep)
            if self._store.cancel_requested(app.app_id):
                rep.state = AppState.CANCELLED if rep.exit_code != 0 else AppState.SUCCEEDED
                self._request_stop(app, "cancelled by another process")
                continue
            if rep.exit_code == 0:
                rep.state = AppState.SUCCEEDED
                if all(r.state == AppState.SUCCEEDED for r in app.replicas):
                    await self._finish(app, AppState.SUCCEEDED)
                    return
                self._changed(app)
                continue
            rep.state = AppState.FAILED
            await self._read_error_file(rep)
            role = rep.req.role
            if app.retries_left[role] > 0:
                app.retries_left[role] -= 1
                app.num_restarts += 1
                targets = self._restart_targets(app, rep)
                await self._stop(app, [r for r in targets if r.running], AppState.PENDING)
                if app.cancel_reason is not None:
                    continue
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
                    return
                self._changed(app)
                continue
            app.msg = f"{rep.label} {_describe_exit(rep.exit_code)}"
            app.structured_error_msg = rep.structured_error_msg
            self._changed(app)
            await self._stop(app, app.running(), AppState.CANCELLED)
            await self._finish(app, AppState.FAILED)
            return

    @staticmethod
    def _restart_targets(app: _App, failed: _Replica) -> list[_Replica]:
        policy = app.policies[failed.req.role]
        if policy == RetryPolicy.REPLICA:
            return [failed]
        if policy == RetryPolicy.ROLE:
            return [r for r in app.replicas if r.req.role == failed.req.role]
        return list(app.replicas)

    async def _restart(self, app: _App, targets: list[_Replica]) -> None:
        files = [r.req.error_file for r in targets]
        await anyio.to_thread.run_sync(_remove_files, files)
        for rep in targets:
            rep.state = AppState.PENDING
        self._start(app, targets)

    async def _stop(self, app: _App, replicas: list[_Replica], final: AppState) -> None:
        """Stops ``replicas``: SIGTERM to their groups, SIGKILL after the grace period; waits for all.

        Their exits are settled here (not by the main loop) and they end in state ``final``.
        """
        for rep in replicas:
            rep.stopping = True
            kill_group(rep.pid or 0, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + app.request.grace_period
        await self._wait_exited(app, replicas, deadline)
        for rep in replicas:
            if rep.running:
                kill_group(rep.pid or 0, signal.SIGKILL)
        await self._wait_exited(app, replicas, None)
        for rep in replicas:
            with contextlib.suppress(ValueError):
                app.exited.remove(rep)
            await self._settle(rep)
            rep.state = final
            rep.stopping = False

    @staticmethod
    async def _wait_exited(app: _App, replicas: list[_Replica], deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        while any(r.running for r in replicas):
            app.wake.clear()
            if not any(r.running for r in replicas):
                return
            timeout = None if deadline is None else deadline - loop.time()
            if timeout is not None and timeout <= 0:
                return
            try:
                await asyncio.wait_for(app.wake.wait(), timeout)
            except asyncio.TimeoutError:
                return

    @staticmethod
    async def _settle(rep: _Replica) -> None:
        """Waits until everything the replica wrote is in its log files."""
        writer = rep.writer
        if writer is None or not writer.attached:
            return
        try:
            await asyncio.wait_for(writer.wait_drained(), DRAIN_TIMEOUT)
        except asyncio.TimeoutError:
            logger.warning(
                "the output pipes of %s (pid %s) are still open after it exited (a process that "
                "left its group holds them); stopped reading them",
                rep.label,
                rep.pid,
            )
            writer.close()
            rep.writer = None

    @staticmethod
    async def _read_error_file(rep: _Replica) -> None:
        text = await anyio.to_thread.run_sync(_read_text, rep.req.error_file)
        rep.structured_error_msg = text if text else NONE

    def _request_stop(self, app: _App, reason: str) -> None:
        """Starts stopping the app (SIGTERM now; the app's task escalates). Idempotent."""
        if app.cancel_reason is not None or is_terminal(app.state):
            return
        app.cancel_reason = reason
        for rep in app.running():
            rep.stopping = True
            kill_group(rep.pid or 0, signal.SIGTERM)
        app.wake.set()

    def _kill_now(self, app: _App, reason: str) -> None:
        """SIGKILLs and reaps every replica at once (used when the app's task cannot continue)."""
        loop = asyncio.get_running_loop()
        for rep in app.replicas:
            if rep.running:
                loop.remove_reader(rep.pidfd)
                kill_group(rep.pid or 0, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitid(os.P_PIDFD, rep.pidfd, os.WEXITED)
                os.close(rep.pidfd)
                rep.pidfd = -1
                rep.exit_code = -signal.SIGKILL
                rep.state = AppState.CANCELLED
                rep.ended_at = time.time()
            if rep.writer is not None:
                rep.writer.close()
                rep.writer = None
        if app.cancel_reason is None:
            app.cancel_reason = reason
        app.msg = app.msg or reason

    async def _finish(self, app: _App, state: AppState) -> None:
        while app.exited:
            rep = app.exited.popleft()
            await self._settle(rep)
            if not is_terminal(rep.state):
                if rep.exit_code == 0:
                    rep.state = AppState.SUCCEEDED
                else:
                    rep.state = (
                        AppState.CANCELLED if state == AppState.CANCELLED else AppState.FAILED
                    )
        for rep in app.replicas:
            if rep.writer is not None:
                rep.writer.close()
                rep.writer = None
            if not is_terminal(rep.state):
                rep.state = AppState.CANCELLED
        app.state = state
        app.ended_at = time.time()
        snapshot = self._snapshot(app)
        if app.discard:
            self._apps.pop(app.app_id, None)
            self._watchdog.send(f"x {app.app_id}\n")
            await anyio.to_thread.run_sync(self._remove_app_files, app.app_id, app.request.app_dir)
            return
        self._notify(app.app_id)
        await self._writer.write(app.app_id, snapshot.to_json())
        self._watchdog.send(f"x {app.app_id}\n")
        self._apps.pop(app.app_id, None)
        self._finished[app.app_id] = (snapshot, app.roles)
        while len(self._finished) > FINISHED_CACHE:
            self._finished.popitem(last=False)

    def _changed(self, app: _App) -> None:
        self._writer.put(app.app_id, self._snapshot(app).to_json())
        self._notify(app.app_id)

    def _snapshot(self, app: _App) -> AppRecord:
        req = app.request
        return AppRecord(
            app_id=req.app_id,
            name=req.app_name,
            backend=req.backend,
            session=req.session,
            state=app.state,
            msg=app.msg,
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
        )

    def _registrations(self) -> list[str]:
        lines = []
        for app in self._apps.values():
            for rep in app.running():
                lines.append(f"+ {app.app_id} {rep.pid} {app.request.grace_period}\n")
        return lines

    # -- describing -------------------------------------------------------------------------------

    def _own(self, app_id: str) -> _Own | None:
        app = self._apps.get(app_id)
        if app is not None:
            return self._snapshot(app), app.roles
        return self._finished.get(app_id)

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        """The app's state, replicas (pid, exit code, structured error) and roles; None if unknown."""
        own = self._own(app_id)
        if own is not None:
            return own[0].to_response(own[1])
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

    # -- cancelling -------------------------------------------------------------------------------

    async def cancel(self, app_id: str) -> None:
        """Stops the app: SIGTERM now, SIGKILL after the grace period. Returns without waiting.

        Works for apps launched by other processes too (a detached helper delivers the SIGKILL).
        Cancelling an unknown or finished app does nothing.
        """
        app = self._apps.get(app_id)
        if app is not None:
            if app.cancel_reason is None and not is_terminal(app.state):
                self._request_stop(app, "cancelled")
                app.msg = "cancelling"
                self._changed(app)
            return
        if app_id in self._finished:
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
        self._store.mark_cancel(app_id)
        groups = []
        for rep in record.replicas:
            if rep.pid and not is_terminal(rep.state) and pid_alive(rep.pid, rep.start_ticks):
                kill_group(rep.pid, signal.SIGTERM)
                groups.append(f"{rep.pid}:{rep.start_ticks or 0}")
        if groups:
            return start_escalator(self._store.records_dir, app_id, record.grace_period, groups)
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

        Idempotent. The clean-up runs to completion even if the caller is cancelled.
        """
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        reason = (
            f"stopped because its scheduler ({self.backend}, session {self.session_name!r}) closed"
        )
        for app in list(self._apps.values()):
            self._request_stop(app, reason)
        tasks = [a.task for a in self._apps.values() if a.task is not None]
        if tasks:
            grace = max(a.request.grace_period for a in self._apps.values())
            await asyncio.wait(tasks, timeout=grace + 10.0)
        for app in list(self._apps.values()):
            # its task is stuck (it had the grace period and more): record the end here
            self._kill_now(app, reason)
            app.state = AppState.CANCELLED
            app.ended_at = time.time()
            self._writer.put(app.app_id, self._snapshot(app).to_json())
            self._watchdog.send(f"x {app.app_id}\n")
            self._notify(app.app_id)
        await self._writer.flush()
        if self._watchdog.pid is not None:
            await self._watchdog.aclose()
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
    holds about eight descriptors (pipes, pidfd, log files)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        pass


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
