"""The local backends: ``local_cwd`` (image = the current directory) and ``local_dir`` (image = a directory).

Each replica is a child process in its own session and process group, with its stdout and stderr
pumped into log files (``asynctorchx.logs``) under ``{log root}/{session}/{app_id}/{role}/{replica}/``.
Exits are learnt from pidfds watched by the event loop (no threads, no polling), and every change is
pushed to subscribers (``pushes_changes``). Each app has a record on disk (``_local.records``), so
another process with the same state root can describe, list, read the logs of and cancel it; changes
to the records of apps other processes launched are pushed too (inotify on the records directory).
Before its record, an app's id is claimed (``schedule``): while it is being submitted (a long
``local_dir`` ship, say) every process sees it PENDING, "being submitted", and a cancel leaves it
CANCELLED with nothing started.

A replica's environment is the launcher's, then the role's ``env`` (macros substituted), then
``TORCHX_RANK0_HOST=localhost``, and unless the role sets them ``TORCHELASTIC_ERROR_FILE``
(``{session log dir}/.errors/{app_id}.{role}.{k}.error.json``; its contents become the structured
error of a failed replica),
``PET_LOG_DIR``, ``TORCHX_JOB_ID`` (the app handle) and ``PYTHONUNBUFFERED``; last comes the marker
``ASYNCTORCHX_REPLICA={app_id}/{role}/{k}``, which the role cannot override. ``PATH`` is the role's
``PATH``, then the image directory, then the launcher's (TorchX's order: its programs win over the
launcher's); with ``prepend_cwd`` the image directory comes first. Linux only (pidfds, ``/proc``).

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

Retries follow ``Role.max_retries`` and ``Role.retry_policy``: REPLICA restarts the failed replica
(each replica has ``max_retries`` of its own, as a container's restart policy on ``local_docker``
and an index's backoff limit on Kubernetes), ROLE every replica of its role, APPLICATION every
replica of the app (a budget per role, spent by any of its replicas' failures). A replica that
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

The parts (``_local/``): ``request.py`` builds the dry run (pure); ``state.py`` judges what the
processes did (pure: app and replica states, restarts, stops); ``spawn.py``, ``launch.py`` and
``supervise.py`` start, watch and stop the processes (with ``procs.py``, ``contain.py``, the
watchdog's ``guard.py``/``watchdog.py``/``protocol.py``); ``logsource.py`` reads the logs;
``records.py`` is what other processes see. This class only ties them together.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import subprocess
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor, await_shielded, in_thread_shielded
from asynctorchx.logs import LogQuery
from asynctorchx.logs._cursor import Position
from asynctorchx.logs._inotify import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE_SELF,
    IN_MOVE_SELF,
    IN_MOVED_TO,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    Watch,
)
from asynctorchx.logs._inotify import watch as watch_directory
from asynctorchx.schedulers._local import protocol, recordfile
from asynctorchx.schedulers._local import workspace as local_workspace
from asynctorchx.schedulers._local.guard import start_escalator
from asynctorchx.schedulers._local.launch import AppLauncher
from asynctorchx.schedulers._local.logsource import LocalLogSource
from asynctorchx.schedulers._local.procs import (
    LaunchError,
    LaunchSpecError,
    kill_group,
    pid_alive,
)
from asynctorchx.schedulers._local.records import AppRecord, RecordStore, default_root
from asynctorchx.schedulers._local.request import (
    DEFAULT_GRACE_PERIOD,
    MAX_GRACE_PERIOD,
    LocalRequest,
    build_request,
    format_request,
)
from asynctorchx.schedulers._local.runtime import BEING_SUBMITTED, LocalRuntime
from asynctorchx.schedulers._local.spawn import Spawner
from asynctorchx.schedulers._local.supervise import (
    CONTAIN_TIMEOUT,
    DRAIN_TIMEOUT,
    AppSupervision,
)
from asynctorchx.schedulers.api import (
    ChangeCallback,
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
)
from asynctorchx.specs.api import (
    AppDef,
    AppDryRunInfo,
    AppState,
    CfgVal,
    is_terminal,
    make_app_handle,
    make_unique,
    runopts,
)

if TYPE_CHECKING:
    from asynctorchx.schedulers._local.live import LiveApp, Replica
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

#: The longest grace period ``close()`` gives an app between SIGTERM and SIGKILL.
CLOSE_MAX_GRACE = 30.0
#: Without inotify on the records directory, how often (seconds) the live apps' cancel markers
#: are looked for (a cancel from another process is otherwise heard only at a replica's exit).
MARKER_POLL = 1.0
_RECORD_EVENTS = (
    IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
)


#: How long the launcher's own cancel waits for its cancel marker before it signals regardless.
MARK_WAIT = 1.0
#: errno values of a state root that takes no more writes (full, over quota or read-only): a
#: cancel from another process then signals the app without leaving its cancel marker
UNWRITABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


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
    log_cursor_kind = "file"
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
        self._gpu_count = gpu_count
        self._runtime = rt = LocalRuntime(
            root,
            f"{backend}:{session_name}",
            self._notify,
            {"backend": backend, "session": session_name},
        )
        self._spawner = Spawner(rt, self._check_open)
        self._supervision = AppSupervision(rt, self._spawner, self._records_watched)
        self._launcher = AppLauncher(
            rt,
            self._spawner,
            self._supervision,
            session_name,
            self._ensure_records_watch,
            self._check_open,
        )
        self._logs = LocalLogSource(rt, backend, session_name)
        self._opts: runopts | None = None
        self._records_watch: Watch | None = None
        self._marker_poll: asyncio.Task[None] | None = None
        self._closer = TaskSupervisor(f"{backend}:{session_name}:close")
        self._closing: asyncio.Task[None] | None = None

    @property
    def root(self) -> Path:
        """The state root."""
        return self._root

    @property
    def watchdog_pid(self) -> int | None:
        """The pid of this scheduler's watchdog process (None before the first launch)."""
        return self._runtime.watchdog.pid

    @property
    def containment(self) -> str:
        """``"cgroup"`` or ``"marker"`` (see ``_local/contain.py``); ``"unknown"`` before the first
        launch."""
        contain = self._runtime.contain
        if not contain._probed:
            return "unknown"
        return "cgroup" if contain.uses_cgroups else "marker"

    # -- options and dry runs ---------------------------------------------------------------------

    def _run_opts(self) -> runopts:
        if self._opts is None:
            self._opts = _run_options(self._root)
        return self._opts

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

        The app's id is claimed first, by a hard link that fails when it exists, so a dry run
        scheduled twice at once, even by two processes, starts once; the app is then registered
        with the watchdog, with a minimal record the watchdog writes if this process dies before
        writing the real one. A claim without a record whose launcher and watchdog are gone (the
        launcher was killed between the two) is taken over.

        Raises:
            LaunchSpecError: the app cannot be launched as given (missing, non-executable or
                directory entrypoint, missing working directory, a log_dir that cannot be written).
            LaunchError: a resource ran out (file descriptors, disk space, processes).
            ValueError: this dry run was already scheduled (or is being, by a process that
                lives), processes of an earlier launch of it whose launcher died are left, its
                request names an id that cannot be a local app's, or its claim was removed
                during the submit and another launcher claimed it (nothing is touched then).

        Whatever the error, even a cancellation, nothing of the app is left running or on disk.
        """
        self._check_open()
        request = dryrun_info.request
        if not isinstance(request, LocalRequest):
            raise TypeError(f"not a dry run of a local scheduler: {dryrun_info!r}")
        app_id = request.app_id
        rt = self._runtime
        if app_id in rt.apps or app_id in rt.finished or app_id in rt.starting:
            raise ValueError(f"dry run of app {app_id!r} was already scheduled")
        rt.starting[app_id] = asyncio.get_running_loop().create_future()
        shipped = False
        app = None
        try:
            await self._launcher.prepare()
            # (claimed first: the workspace directory of an app id is its claimant's)
            app = await self._launcher.claim(request, dryrun_info.app or AppDef(request.app_name))
            if dryrun_info.workspace is not None:
                # (a ship that fails or is cancelled removes what it made itself, once its thread
                # has stopped, and it alone knows whether the directory was there before: another
                # launcher's, which the removal below must not take)
                await self._ship_workspace(dryrun_info)
                shipped = True
            await self._launcher.launch(app)
        except BaseException:
            if shipped and app is not None and app.claimed:
                # a bad entrypoint, say: the app's workspace directory goes too (unless another
                # launcher claimed the app meanwhile: it may be that launcher's)
                await in_thread_shielded(
                    local_workspace.remove_workdir, self._root, self.session_name, app_id
                )
            if app is not None:
                await self._launcher.release(app)
            raise
        finally:
            rt.starting.pop(app_id).set_result(None)
        self._notify(app_id)
        return app_id

    # -- describing -------------------------------------------------------------------------------

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        """The app's state, replicas (pid, exit code, structured error) and roles; None if unknown.

        An app another process is submitting (its id claimed, by a launcher or watchdog that
        lives, and no record yet: a long ``local_dir`` ship, say) is PENDING, "being submitted".
        """
        own = self._runtime.own(app_id)
        if own is not None:
            # answered from memory, yet a point where other tasks run: a caller polling
            # ``status`` in a loop without a sleep must not starve the event loop
            await asyncio.sleep(0)
            own = self._runtime.own(app_id) or own  # (as it is after the pause)
            return own.record.to_response(own.roles)
        self._ensure_records_watch()
        return (await self._describe_foreign([app_id]))[app_id]

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        """``describe`` of many apps: the ones this object launched from memory, the others in one
        read of their records."""
        out: dict[str, DescribeAppResponse | None] = {}
        foreign = []
        for app_id in dict.fromkeys(app_ids):
            own = self._runtime.own(app_id)
            if own is not None:
                out[app_id] = own.record.to_response(own.roles)
            else:
                foreign.append(app_id)
        if foreign:
            self._ensure_records_watch()
            out.update(await self._describe_foreign(foreign))
        return out

    async def _describe_foreign(self, app_ids: list[str]) -> dict[str, DescribeAppResponse | None]:
        store = self._runtime.store

        def read() -> dict[str, AppRecord | bool | None]:
            found: dict[str, AppRecord | bool | None] = {}
            for app_id, record in store.read_checked_many(app_ids).items():
                found[app_id] = store.recorded_or_gone(app_id) if record is None else record
            return found

        out: dict[str, DescribeAppResponse | None] = {}
        for app_id, found in (await anyio.to_thread.run_sync(read)).items():
            if isinstance(found, AppRecord):
                out[app_id] = _response(store, found)
            else:
                out[app_id] = _being_submitted(app_id) if found else None
        return out

    async def list(self) -> list[ListAppResponse]:
        """Every app of this backend in the state root, whichever session or process launched it;
        those being submitted (claimed, no record yet) last, PENDING."""
        rt = self._runtime

        def read_all() -> tuple[list[AppRecord], dict[str, dict[str, Any]]]:
            store = rt.store
            records = store.read_checked_many(store.list_ids())
            claims = store.held_claims({i for i, r in records.items() if r is not None})
            # an app claimed when the records were listed may have been recorded (and its claim
            # dropped) since: listed again, its record is read
            late = [i for i in store.list_ids() if i not in records]
            records.update(store.read_checked_many(late))
            return [r for r in records.values() if r is not None], claims

        found, claims = await anyio.to_thread.run_sync(read_all)
        records = {r.app_id: r for r in found}
        for app_id in list(records):
            own = rt.record_of(app_id)
            if own is not None:
                records[app_id] = own
        for app in [*rt.apps.values(), *rt.claimed.values()]:
            if not app.discard:
                records.setdefault(app.app_id, rt.snapshot(app))
        ordered = sorted(records.values(), key=lambda r: (r.submitted_at, r.app_id))
        out = [
            ListAppResponse(
                app_id=r.app_id,
                state=r.state,
                app_handle=make_app_handle(r.backend, r.session, r.app_id),
                name=r.name,
            )
            for r in ordered
            if r.backend == self.backend
        ]
        for app_id, launcher in sorted(claims.items()):
            session = launcher.get("session")
            if app_id in records or launcher.get("backend") != self.backend:
                continue
            if isinstance(session, str):
                handle = make_app_handle(self.backend, session, app_id)
                out.append(ListAppResponse(app_id, AppState.PENDING, handle))
        return out

    # -- changes made by other processes ------------------------------------------------------------

    def subscribe(self, callback: ChangeCallback) -> Callable[[], None]:
        """Registers ``callback(app_id)``; also called when the record of an app that another process
        launched changes (inotify on the records directory, where available)."""
        unsubscribe = super().subscribe(callback)
        try:
            self._ensure_records_watch()
        except RuntimeError:  # no running loop: set up at the first describe
            pass
        return unsubscribe

    def _records_watched(self) -> bool:
        return self._records_watch is not None and self._records_watch.active

    def _ensure_records_watch(self) -> None:
        if self._records_watched() or self._closed:
            return
        try:
            # the log follower's inotify hub (one instance per loop) carries this watch too;
            # a record's versions are appended (IN_CLOSE_WRITE) or, compacted, renamed into place
            # (IN_MOVED_TO); a new record made from a spare is linked into place, whole
            # (IN_CREATE: written under .spare, it makes no IN_CLOSE_WRITE here); cancel markers
            # are renamed into place
            self._records_watch = watch_directory(
                str(self._runtime.store.records_dir), self._on_records_event, _RECORD_EVENTS
            )
        except FileNotFoundError:
            self._records_watch = None
        if not self._records_watched() and self._marker_poll is None:
            with contextlib.suppress(RuntimeError):  # (closing)
                self._marker_poll = self._runtime.supervisor.spawn(
                    self._poll_markers(), "cancel-markers"
                )

    async def _poll_markers(self) -> None:
        """Looks for the cancel markers of the apps this object launches and runs, every
        ``MARKER_POLL`` seconds while it has some and the records directory is not watched."""
        rt = self._runtime
        try:
            while (rt.apps or rt.claimed) and not self._records_watched():
                await anyio.sleep(MARKER_POLL)
                live = [*rt.apps.values(), *rt.claimed.values()]
                ids = [a.app_id for a in live if not a.discard and a.cancel_reason is None]
                marked = await anyio.to_thread.run_sync(_marked, rt.store, ids)
                for app_id in marked:
                    self._on_records_event(f"{app_id}.cancel", 0)
                self._ensure_records_watch()  # (inotify may be usable again)
        finally:
            self._marker_poll = None

    def _on_records_event(self, name: str, mask: int) -> None:
        rt = self._runtime
        if name.endswith(".json") and not name.startswith("."):
            app_id = name[:-5]
            if app_id not in rt.apps and app_id not in rt.finished:
                self._notify(app_id)
        elif name.endswith(".cancel"):
            app = rt.apps.get(name[:-7])
            if app is not None:
                self._supervision.hear_foreign_cancel(app)
            elif (app := rt.claimed.get(name[:-7])) is not None:
                self._launcher.hear_foreign_cancel(app)
        elif mask & IN_Q_OVERFLOW:  # events were lost: look for cancel markers at the next exits
            for app in rt.apps.values():
                app.foreign_cancel = True

    # -- cancelling -------------------------------------------------------------------------------

    async def exists(self, app_id: str) -> bool:
        """True for an app under the state root (from memory for this object's apps), or being
        submitted by a process that lives (its id claimed, no record yet)."""
        rt = self._runtime
        if rt.state_of(app_id) is not None:
            return True
        if app_id in rt.apps or app_id in rt.starting:  # being undone or started: not yet
            return False
        store = rt.store
        return await anyio.to_thread.run_sync(
            lambda: store.read(app_id) is not None or store.claim_held(app_id)
        )

    async def _cancel_existing(self, app_id: str) -> None:
        """Stops the app: SIGTERM now, SIGKILL after the grace period; returns without waiting.

        Works for apps launched by other processes too (a detached helper delivers the SIGKILL).
        """
        rt = self._runtime
        app = rt.apps.get(app_id)
        if app is None and (app := rt.claimed.get(app_id)) is not None:
            # being submitted: it starts nothing (``AppLauncher.launch``), and ends CANCELLED
            if app.cancel_reason is None and not app.discard:
                self._supervision.request_stop(app, "cancelled")
                app.msg = "cancelling"
                rt.notify_soon(app_id)
            return
        if app is not None:
            if app.cancel_reason is None and not is_terminal(app.state) and not app.discard:
                owed = self._supervision.request_stop(app, "cancelled", defer=True)
                app.msg = "cancelling"
                rt.changed(app)
                await self._mark_then_signal(app, owed)
            return
        if app_id in rt.finished:
            return
        escalator = await anyio.to_thread.run_sync(self._cancel_foreign, app_id)
        if escalator is not None:
            rt.reaper.add(escalator)

    async def _mark_then_signal(self, app: LiveApp, owed: Sequence[Replica]) -> None:
        """Lists the app's signalled groups in its cancel marker, then sends the SIGTERMs owed
        (``owed``) to those no other process listed first.

        The marker says so to other processes: a cancel from one of them at the same moment then
        sends no second SIGTERM (whoever lists a group first, under the record's lock, signals
        it), and a watchdog finishing the app (this process killed while it stops) records it
        CANCELLED. Without a marker (it cannot be written), every owed group is signalled. The
        marking is a task of the scheduler's: the signals go out even if this caller is
        cancelled; if the marking takes longer than ``MARK_WAIT`` (or half the grace period: a
        slow or locked state root), the owed groups are signalled without waiting for it.
        """
        rt = self._runtime
        groups = {
            protocol.group_spec(rep.pid, rep.start_ticks): rep
            for rep in app.replicas
            if rep.term_sent and rep.pid and rep.running
        }
        owed_ids = {id(rep) for rep in owed}
        pending = {spec: (rep, rep.pid or 0) for spec, rep in groups.items() if id(rep) in owed_ids}

        def send(specs: Iterable[str]) -> None:
            terms = [pending.pop(spec) for spec in list(specs) if spec in pending]
            self._supervision.send_deferred_terms(terms)

        async def mark() -> None:
            try:
                marked = await anyio.to_thread.run_sync(
                    rt.store.mark_cancel, app.app_id, list(groups)
                )
            except OSError:  # (the stop is under way regardless)
                marked = None
            send(pending if marked is None else marked[0])

        try:
            task = rt.supervisor.spawn(mark(), f"cancel:{app.app_id}")
        except RuntimeError:  # (closing: no marker)
            send(pending)
            return
        done, _ = await asyncio.wait({task}, timeout=min(MARK_WAIT, app.stop_grace / 2))
        if not done:
            send(pending)

    def _cancel_foreign(self, app_id: str) -> subprocess.Popen[bytes] | None:
        """Cancels an app another process launched (in a worker thread): leaves its cancel marker,
        SIGTERMs the process groups no cancel under way signalled, and returns the escalator that
        SIGKILLs what is left after the grace period (None when none is needed).

        When the marker cannot be written because the state root is full or read-only
        (``UNWRITABLE_ERRNOS``), every live group is signalled and escalated all the same (a
        warning says the app may end FAILED: its launcher does not learn of the cancel).

        Raises:
            OSError: the marker could not be written otherwise, or the app is being submitted
                (then only the marker can stop it); the message names the marker's path.
        """
        store = self._runtime.store
        record = store.read(app_id)
        if record is None:
            # being submitted (its claim held; else nothing is done): its launcher finds the
            # marker before the app's first replica starts; without it, nothing stops the app
            try:
                store.mark_cancel(app_id, ())
            except OSError as e:
                raise self._marker_error(app_id, e) from e
            return None
        if is_terminal(record.state):
            return None
        live = [
            (rep.pid, rep.start_ticks)
            for rep in record.replicas
            if rep.pid and not is_terminal(rep.state) and pid_alive(rep.pid, rep.start_ticks)
        ]
        groups = {protocol.group_spec(pid, ticks): pid for pid, ticks in live}
        # the marker lists the groups first, so the launcher does not send them a second SIGTERM;
        # a cancel already under way signalled those it lists
        try:
            marked = store.mark_cancel(app_id, groups)
        except OSError as e:
            if e.errno not in UNWRITABLE_ERRNOS:
                raise self._marker_error(app_id, e) from e
            logger.warning(
                "the cancel marker %s of app %r could not be written (%s); its live processes "
                "are signalled all the same, but its launcher does not learn of the cancel: the "
                "app may then read FAILED rather than CANCELLED",
                protocol.cancel_path(str(store.records_dir), app_id),
                app_id,
                e.strerror or e,
            )
            # no marker: which groups a cancel under way signalled is unknown, and no other
            # process learns of this one, so it does all a first cancel does (a group may get a
            # second SIGTERM; a second escalator is harmless)
            marked = list(groups), True
        if marked is None:
            return None
        fresh, first = marked
        for spec in fresh:
            kill_group(groups[spec], signal.SIGTERM)
        if fresh or first:
            # (the first cancel of an app whose main processes have all exited too: what they
            # left, in its cgroup or carrying its marker, is SIGKILLed after the grace period,
            # and the record of an app whose launcher is gone says CANCELLED then)
            return start_escalator(
                store.records_dir, app_id, record.grace_period, record.cgroup, fresh
            )
        return None

    def _marker_error(self, app_id: str, e: OSError) -> OSError:
        """The error to raise when the cancel marker of ``app_id`` could not be written: ``e``'s
        errno (and so its subclass), with a message that names the marker's path."""
        marker = protocol.cancel_path(str(self._runtime.store.records_dir), app_id)
        msg = f"cannot cancel app {app_id!r}: cannot write its cancel marker {marker}: "
        if e.errno is None:
            return OSError(msg + str(e))
        return OSError(e.errno, msg + (e.strerror or str(e)))

    # -- logs -------------------------------------------------------------------------------------

    def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        """The lines of one replica: combined stdout and stderr by default (see ``LocalLogSource``)."""
        return self._logs.lines(query)

    def _log_entries(self, query: LogQuery) -> AsyncGenerator[tuple[Position, str], None]:
        """The lines with their byte offsets in the file read (see ``LocalLogSource.entries``)."""
        return self._logs.entries(query)

    # -- closing ----------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stops the apps this object launched (they end CANCELLED) and its background work.

        Each app gets at most ``CLOSE_MAX_GRACE`` seconds between SIGTERM and SIGKILL. Idempotent.
        The clean-up runs to completion even if the caller is cancelled (the cancellation is
        raised once it is done).
        """
        if self._closing is None:
            self._closed = True
            self._closing = self._closer.spawn(self._close(), "close")
        await await_shielded(self._closing)

    async def _close(self) -> None:
        rt = self._runtime
        reason = (
            f"stopped because its scheduler ({self.backend}, session {self.session_name!r}) closed"
        )
        if self._records_watch is not None:
            self._records_watch.cancel()
            self._records_watch = None
        for app in list(rt.apps.values()):
            self._supervision.request_stop(app, reason, grace=CLOSE_MAX_GRACE)
        # launches under way fail at their next step (the scheduler is closed) and undo what
        # they started: waited for too, so that their undoing is over before the watchdog goes
        tasks: list[asyncio.Future[None]] = [a.task for a in rt.apps.values() if a.task is not None]
        tasks += rt.starting.values()
        if tasks:
            grace = max((a.stop_grace for a in rt.apps.values()), default=0.0)
            await asyncio.wait(tasks, timeout=grace + CONTAIN_TIMEOUT + DRAIN_TIMEOUT + 5.0)
        for app in list(rt.apps.values()):
            if not app.discard:  # its task is stuck (it had the grace period and more)
                self._supervision.abandon(app, reason)
        await self._close_guards()

    async def _close_guards(self) -> None:
        rt = self._runtime
        if not await rt.writer.flush(retry_for=2.0):
            logger.error(
                "the records of %d apps could not be written to %s; other processes may see "
                "them as lost",
                len(rt.writer.failing),
                rt.store.records_dir,
            )
        if rt.watchdog.pid is not None:
            # the launcher did not die: whatever is still registered is not for the watchdog to
            # record as such (its record write failed, or it was undone), so forget it
            for app_id in rt.writer.failing:
                rt.watchdog.send_later(protocol.forget_line(app_id))
            await rt.watchdog.aclose()
        await self._spawner.exits.idle()
        await rt.contain.aclose()  # before its background tasks are cancelled
        await rt.supervisor.aclose()
        rt.store.spares.release()  # (no record is written, and no spare made, from now on)
        await rt.reaper.aclose()
        self._launcher.close()


def _marked(store: RecordStore, app_ids: list[str]) -> list[str]:
    return [app_id for app_id in app_ids if store.cancel_marked(app_id)]


def _response(store: RecordStore, record: AppRecord) -> DescribeAppResponse | None:
    """The response of another process's app, or None (with a warning naming the file) when the
    app its record holds cannot be read back (a corrupt record)."""
    try:
        return record.to_response()
    except recordfile.PARSE_ERRORS as e:
        recordfile.log_warning("ignoring corrupt app record %s: %r", store.path(record.app_id), e)
        return None


def _being_submitted(app_id: str) -> DescribeAppResponse:
    """What another process says of an app being submitted (its id claimed, no record yet)."""
    return DescribeAppResponse(app_id=app_id, state=AppState.PENDING, msg=BEING_SUBMITTED)


def _run_options(root: Path) -> runopts:
    opts = runopts()
    opts.add(
        "log_dir",
        type_=str,
        default=None,
        help="directory for the replicas' logs ({log_dir}/{session}/{app_id}/{role}/{replica}/); "
        f"default: the local state root ({root})",
    )
    opts.add(
        "prepend_cwd",
        type_=bool,
        default=False,
        help="put the image directory first on the replicas' PATH, so its programs take "
        "precedence over those on the role's PATH too (otherwise it comes after the role's PATH "
        "and before the launcher's, as in TorchX)",
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


def _create(session_name: str, backend: str, kwargs: Mapping[str, Any]) -> LocalScheduler:
    return LocalScheduler(
        session_name,
        backend,
        local_root=kwargs.get("local_root"),
        gpu_count=kwargs.get("gpu_count"),
    )


def create_cwd_scheduler(session_name: str, **kwargs: Any) -> LocalScheduler:
    """The ``local_cwd`` scheduler: replicas run in the current directory (``Role.image`` ignored).

    Keyword arguments ``local_root`` and ``gpu_count`` are used; others are ignored.
    """
    return _create(session_name, "local_cwd", kwargs)


def create_dir_scheduler(session_name: str, **kwargs: Any) -> LocalScheduler:
    """The ``local_dir`` scheduler: ``Role.image`` is an absolute path to an existing directory.

    Keyword arguments ``local_root`` and ``gpu_count`` are used; others are ignored.
    """
    return _create(session_name, "local_dir", kwargs)
