"""Launching a local app: from its dry run (``request.py``) to running replicas with a record on
disk, or to nothing at all.

The state root is prepared once; the app's id is claimed, by a hard link that fails if it exists
(``claim``: a dry run is scheduled once, even by two processes at once; a claim left by a launcher
killed before the registration is taken over), and the app registered with the watchdog (with a
minimal record for the watchdog to write if the launcher dies first); its programs and working directories are checked, the file descriptors it needs are promised
(``procs.reserve_fds``), and its log directory is checked not to exist before its first replica
starts. A launch that fails for any reason, a cancellation included, stops what it started and
removes the app's directory, record, claim and cgroups.

Log directories and files are made lazily, on a replica's first output, in a worker thread
(``LogDirMaker``): a replica that writes nothing costs no file-system creation at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor, await_shielded, in_thread_shielded, wait_held
from asynctorchx.logs import ReplicaLogWriter
from asynctorchx.schedulers._local import contain, protocol
from asynctorchx.schedulers._local import workspace as local_workspace
from asynctorchx.schedulers._local.live import LiveApp
from asynctorchx.schedulers._local.procs import (
    FDS_PER_REPLICA_FILES,
    LaunchError,
    check_cwd,
    launch_error,
    proc_start_ticks,
    raise_fd_limit,
    release_fds,
    reserve_fds,
    resolve_executable,
)
from asynctorchx.schedulers._local.recordfile import MAX_APP_ID, is_app_id
from asynctorchx.schedulers._local.records import RecordStore, appdef_to_json
from asynctorchx.schedulers._local.request import (
    SPACE_RESERVE_SIZE,
    LocalRequest,
    errors_dir_of,
    space_reserve_of,
)
from asynctorchx.schedulers._local.runtime import LocalRuntime
from asynctorchx.schedulers._local.spares import MIN_TARGET
from asynctorchx.schedulers._local.spawn import START_CHUNK, Spawner
from asynctorchx.schedulers._local.supervise import (
    CONTAIN_TIMEOUT,
    FOREIGN_CANCEL,
    AppSupervision,
)
from asynctorchx.schedulers.workspace import remove_tree
from asynctorchx.specs.api import AppDef, AppState, copy_app, is_terminal

logger = logging.getLogger(__name__)


#: What a ``stat`` of a path told: ``(device, inode, mode, ctime_ns)``.
_Stamp = tuple[int, int, int, int]


def _stamp(path: str) -> _Stamp | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_mode, st.st_ctime_ns)


@dataclass(frozen=True)
class _Lookup:
    """A cached lookup of a replica's program (``procs.resolve_executable``) and how to tell that
    it is stale.

    A shell, ``exec`` and TorchX's ``Popen`` search PATH at every start, so a program that appears
    in a PATH directory before the one found (a new virtualenv's ``python``, a tool installed in
    ``~/.local/bin``) is run from then on. Looking up again at every launch costs ~0.1 ms (a
    ``which`` through PATH), and a sweep launches thousands of apps; so the lookup is kept with
    what every path it passed over (``{dir}/{name}`` in each directory before the hit) was, and is
    redone when one of them changed or the program found is no longer executable. Checked once per
    app: an ``access`` of each path that was missing (it fails at once, ~0.5 us) and a stat of
    each one that was there but was not the program (rare: a directory, a file not executable).

    The paths themselves are checked, not their directories' mtimes: a file created in the same
    clock tick as the cached lookup leaves its directory's mtime as it was, a directory of PATH
    that does not exist yet has none, and a chmod that makes a file executable does not change it.

    Args:
        exe: the absolute path of the program found.
        missing: the paths passed over that did not exist (or could not be reached).
        present: the paths passed over that existed, with their ``_stamp`` (none of them is
            executable, or it would have been found).
    """

    exe: str
    missing: tuple[str, ...]
    present: tuple[tuple[str, _Stamp], ...]

    @classmethod
    def of(cls, entrypoint: str, path: str, cwd: str, role: str) -> _Lookup:
        """Looks ``entrypoint`` up (LaunchSpecError if missing) and notes what it passed over
        (nothing for a name with a ``/``, which PATH does not affect)."""
        candidates: list[str] = []
        if "/" not in entrypoint:
            # the paths resolve_executable tries, in its order
            for d in path.split(os.pathsep):
                if d:
                    base = d if os.path.isabs(d) else os.path.join(cwd, d)
                    candidates.append(os.path.join(base, entrypoint))
        # stat'ed before the search, so that a program that appears during it is seen as a change
        stamps = [_stamp(c) for c in candidates]
        exe = resolve_executable(entrypoint, path, cwd, role=role)
        missing: list[str] = []
        present: list[tuple[str, _Stamp]] = []
        for candidate, stamp in zip(candidates, stamps, strict=True):
            if os.path.abspath(candidate) == exe:
                break
            if stamp is None:
                missing.append(candidate)
            else:
                present.append((candidate, stamp))
        return cls(exe, tuple(missing), tuple(present))

    def still_valid(self) -> bool:
        """True when the program found is still executable and nothing it passed over changed.

        (Calls that return at once for local paths, made on the event loop as the working
        directories' checks are: a hop to a thread would cost more than all of them.)"""
        if not os.access(self.exe, os.X_OK):
            return False
        if any(os.access(c, os.F_OK) for c in self.missing):
            return False
        return all(_stamp(c) == seen for c, seen in self.present)


class AppLauncher:
    """Starts apps (``launch``) and undoes a failed start.

    Args:
        runtime: the scheduler's apps and guards.
        spawner: starts the replicas.
        supervision: runs each app's task.
        session: the session the apps belong to.
        on_prepared: called once the state root is ready (the scheduler watches its records).
        check_open: raises RuntimeError once the scheduler is closed.
    """

    def __init__(
        self,
        runtime: LocalRuntime,
        spawner: Spawner,
        supervision: AppSupervision,
        session: str,
        on_prepared: Callable[[], None],
        check_open: Callable[[], None],
    ) -> None:
        self._rt = runtime
        self._spawner = spawner
        self._supervision = supervision
        self._session = session
        self._on_prepared = on_prepared
        self._check_open = check_open
        self._prepared = False
        self._prepare_lock = asyncio.Lock()
        self._exe_cache: dict[tuple[str, str, str], _Lookup] = {}
        self._dirs = LogDirMaker(runtime.supervisor)
        self._session_dirs: set[str] = set()
        self._reserve_retry: dict[str, float] = {}  # when to try a session's space reserve again
        spawner.log_opener = self._dirs.request

    async def prepare(self) -> None:
        """Makes the state root ready (once; the first launch does it)."""
        if not self._prepared:
            async with self._prepare_lock:
                if not self._prepared:
                    await self._prepare()

    async def claim(self, request: LocalRequest, appdef: AppDef) -> LiveApp:
        """Claims the id of the app of ``request`` (``appdef`` as submitted) and registers it with
        the watchdog, once ``prepare`` was awaited.

        Two schedulers or processes scheduling one dry run at once both found no record, then
        both started the app; the claim (``RecordStore.claim``: a hard link, ~12 us, here) is made
        by one of them only. The watchdog learns of the app right after, so a launcher killed
        from then on leaves a FAILED record ("the launcher died") and no claim. One killed between
        the two system calls leaves a claim without a record that nobody holds any more (its
        watchdog exits knowing nothing of it): scheduling the dry run again takes it over
        (``_take_over``, the slow path of a claim that exists).

        Returns:
            the app, claimed: ``launch`` starts it, or ``release`` gives its id up.

        Raises:
            ValueError: the app is claimed or recorded already (a dry run scheduled twice, maybe
                by another process), or processes of an earlier launch of it are left, or its id
                cannot be a local app's; nothing was made.
            LaunchError: the claim cannot be made, or no watchdog can be started to learn of the
                app (nothing is left of it then).
        """
        self._check_open()
        rt = self._rt
        if not is_app_id(request.app_id):  # (a request made by hand: it would name other files)
            raise ValueError(
                f"app id {request.app_id!r} of the dry run is not a local app id (letters, digits, "
                f"'_', '.' and '-', starting with a letter or digit, at most {MAX_APP_ID} "
                "characters); make the dry run with submit_dryrun"
            )
        app = LiveApp.create(request, appdef_to_json(appdef), copy_app(appdef).roles, time.time())
        app_id = app.app_id
        app.cgroup = rt.contain.app_dir(app_id)
        try:
            rt.watchdog.ensure_started()
        except OSError as e:
            raise launch_error(app_id, e, "the watchdog", rt.store.records_dir) from None
        registration = rt.registration(app)  # (made first: sent right after the claim)
        try:
            claimed = rt.store.claim(app_id)
        except OSError as e:
            raise launch_error(app_id, e, "the app's claim", rt.store.records_dir) from None
        if not claimed:
            await self._take_over(app_id)
        app.claimed = True
        try:
            self._watchdog_holds_claims()
            rt.claimed[app_id] = app
            rt.watchdog.send_now(registration)
        except BaseException as e:
            # no watchdog could be started to learn of the app: it is given up (its claim, left,
            # would refuse the dry run while this process lives, and a watchdog started later,
            # told of it, would record it FAILED when this process dies: it never ran)
            rt.claimed.pop(app_id, None)
            rt.watchdog.send_later(protocol.forget_line(app_id))
            app.claimed = False
            protocol.drop_claim(str(rt.store.records_dir), app_id)
            if isinstance(e, OSError):
                raise launch_error(app_id, e, "the watchdog", rt.store.records_dir) from None
            raise
        return app

    def _watchdog_holds_claims(self) -> None:
        """Restarts the watchdog if the store's holder file was made again (it was removed): the
        watchdog must hold its lock too. Raises OSError when no watchdog can be started."""
        rt = self._rt
        if rt.store.holder_fd not in rt.watchdog.keep_fds and rt.store.holder_fd >= 0:
            rt.watchdog.keep_fds = rt.store.lock_fds()
            rt.watchdog.restart("the launcher's claims file was made again")

    def _confirm_claim(self, app: LiveApp) -> None:
        """Checks that the app's claim is still this launcher's (``RecordStore.confirm_claim``:
        one ``lstat``), and makes it again if it was removed (``rm -r .apps``, say) while the app
        was being submitted.

        Raises:
            ValueError: another launcher claimed the app meanwhile (``app.claimed`` is then
                False: nothing of it may be removed, it may be that launcher's).
            LaunchError: the claim cannot be made again, or no watchdog can be started to hold
                it.
        """
        rt = self._rt
        records = rt.store.records_dir
        holder_fd = rt.store.holder_fd
        try:
            mine = rt.store.confirm_claim(app.app_id)
            if mine and rt.store.holder_fd != holder_fd:  # (made again, with its holder)
                self._watchdog_holds_claims()
        except OSError as e:
            raise launch_error(app.app_id, e, "the app's claim", records) from None
        if not mine:
            app.claimed = False
            raise ValueError(
                f"app {app.app_id!r} was claimed by another launcher while it was being submitted "
                f"(its claim, in {records}, was removed meanwhile), or recorded already; was this "
                "dry run scheduled twice?"
            )

    async def _take_over(self, app_id: str) -> None:
        """Takes over the claim of ``app_id`` that its launcher left when it died before its
        watchdog knew of the app (nothing of the app was started then); runs to completion even
        if the caller is cancelled (a claim taken is then given back).

        Raises:
            ValueError: the app is recorded, claimed by a launcher or watchdog that lives or
                cannot be checked, or processes of it are left (their pids given).
            LaunchError: the claim cannot be checked.
        """
        rt = self._rt
        records = rt.store.records_dir
        future = asyncio.get_running_loop().run_in_executor(None, _take_stale, rt.store, app_id)
        try:
            outcome, left = await await_shielded(future)
        except OSError as e:
            raise launch_error(app_id, e, "the app's claim", records) from None
        except BaseException:
            if (
                not future.cancelled()
                and future.exception() is None
                and future.result()[0] == protocol.TAKEN
            ):
                await in_thread_shielded(protocol.drop_claim, str(records), app_id)
            raise
        path = protocol.claim_path(str(records), app_id)
        if outcome == protocol.TAKEN:
            return
        if left:
            pids = " ".join(str(p) for p in left)
            raise ValueError(
                f"app {app_id!r} was scheduled before by a launcher that died, and processes of "
                f"it are left (pids {pids}); stop them (kill -9 {pids}) and schedule the dry run "
                "again"
            )
        if outcome == protocol.UNKNOWN:
            raise ValueError(
                f"app {app_id!r} is claimed ({path}) by a launcher that cannot be checked (an "
                "older version, or a file system without hard links or locks); if no launcher of "
                f"this dry run is running, remove {path} and schedule it again"
            )
        if outcome == protocol.HELD:
            raise ValueError(
                f"app {app_id!r} is claimed by a launcher or its watchdog that is still running "
                f"({path}); was this dry run already scheduled? (the watchdog of a launcher that "
                "was killed exits within seconds: schedule it again then)"
            )
        raise ValueError(
            f"app {app_id!r} is claimed or recorded already (in {records}); "
            "was this dry run already scheduled?"
        )

    def hear_foreign_cancel(self, app: LiveApp) -> None:
        """Another process left a cancel marker for an app claimed and not started yet (inotify
        said so): it is read in a worker thread and the app stopped (it then starts nothing and
        ends CANCELLED); one started meanwhile is the supervision's."""
        with contextlib.suppress(RuntimeError):  # closing: nothing of it starts any more
            self._rt.supervisor.spawn(self._stop_claimed(app), f"cancel-marker:{app.app_id}")

    async def _stop_claimed(self, app: LiveApp) -> None:
        rt = self._rt
        signalled = await anyio.to_thread.run_sync(rt.store.cancel_requested, app.app_id)
        if signalled is None or app.discard or app.cancel_reason is not None:
            return
        if rt.claimed.get(app.app_id) is app:
            self._supervision.request_stop(app, FOREIGN_CANCEL)
            rt.notify_soon(app.app_id)
        elif rt.apps.get(app.app_id) is app:
            self._supervision.hear_foreign_cancel(app)

    async def release(self, app: LiveApp) -> None:
        """Gives up an app that was claimed but not launched: the watchdog forgets it and its
        claim is removed, if it is still this launcher's (``RecordStore.release_claim``); runs to
        completion even if the caller is cancelled."""
        self._rt.claimed.pop(app.app_id, None)
        self._rt.watchdog.send_now(protocol.forget_line(app.app_id))
        if app.claimed:
            app.claimed = False
            await in_thread_shielded(self._rt.store.release_claim, app.app_id)

    async def launch(self, app: LiveApp) -> None:
        """Starts a claimed app; see ``LocalScheduler.schedule``.

        Raises:
            LaunchSpecError, LaunchError: as ``schedule`` documents; nothing of the app is left
                but its claim (``release``).
            ValueError: the app's claim was removed meanwhile and another launcher claimed it
                (``app.claimed`` is then False); nothing was touched.
        """
        self._check_open()
        self._confirm_claim(app)
        self._resolve(app)
        reserved = reserve_fds(app.app_id, len(app.replicas))
        # a lazy writer keeps the descriptors of its files promised until it has them (they are
        # opened after this launch returns, and must not be taken by the launches that follow)
        files_fds = FDS_PER_REPLICA_FILES if reserved and self._spawner.lazy_files else 0
        # what the logs lose before the app is known to have started (its disk full, say) is
        # said once it is: a launch undone takes its logs with it, and its error says why
        writers: list[ReplicaLogWriter] = []
        try:
            await self._check_new(app)
            try:
                for i, rep in enumerate(app.replicas):
                    if i and i % (8 * START_CHUNK) == 0:
                        await asyncio.sleep(0)
                    rep.writer = writer = self._spawner.new_writer(app, rep, files_fds)
                    writer.hold_loss_report()
                    writers.append(writer)
                    reserved -= files_fds
            except BaseException:
                app.close_logs()  # lazy: no file of theirs exists yet
                await in_thread_shielded(remove_tree, app.request.app_dir)
                raise
            try:
                await self._start_app(app)
            except BaseException as e:
                await self.undo(app)
                if isinstance(e, OSError):
                    records = self._rt.store.records_dir
                    raise launch_error(app.app_id, e, "the app's record", records) from None
                raise
        finally:
            release_fds(reserved)
        for writer in writers:
            writer.release_loss_report()

    async def _prepare(self) -> None:
        rt = self._rt
        try:
            await anyio.to_thread.run_sync(self._prepare_blocking)
        except OSError as e:
            raise LaunchError(
                f"cannot use the local state root {str(rt.root)!r}: {e} "
                "(set ASYNCTORCHX_LOCAL_ROOT or local_root= to a writable directory)"
            ) from None
        raise_fd_limit()
        rt.owner_ticks = proc_start_ticks(os.getpid())
        rt.watchdog.base_cgroup = rt.contain.base
        rt.watchdog.keep_fds = rt.store.lock_fds()
        self._on_prepared()
        self._spawner.stdin_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._prepared = True
        rt.writer.make_spares()

    def _prepare_blocking(self) -> None:
        store = self._rt.store
        store.hold()
        self._rt.contain.probe()
        # The first spares, made (or adopted from processes that are gone) before the first
        # launch rather than in a lull after it: a burst that follows the first app at once (a
        # service's first requests, a driver's first trials) then writes its records on the event
        # loop instead of creating them in the writer's thread while it launches. Bounded in time
        # (a creation costs ~0.3 ms on a churned ext4, more on NFS: the first launch waits for
        # this); spares are an optimisation, so an error here is left to the lull's fills.
        with contextlib.suppress(OSError):
            store.spares.fill_some(MIN_TARGET, until=time.monotonic() + FIRST_SPARES_TIME)

    def close(self) -> None:
        """Releases what ``launch`` kept open."""
        if self._spawner.stdin_fd >= 0:
            os.close(self._spawner.stdin_fd)
            self._spawner.stdin_fd = -1
        self._rt.store.release_holder()

    def __del__(self) -> None:
        # collected unclosed: its event loop ended without the scheduler's close() (its apps were
        # killed and recorded as their tasks were cancelled); the descriptors go as close() lets
        # them go, not at the process's exit
        with contextlib.suppress(Exception):  # (at interpreter shutdown, modules may be gone)
            self.close()

    def _resolve(self, app: LiveApp) -> None:
        """Checks the working directories and finds each replica's program (LaunchSpecError if
        missing).

        Lookups are cached per (entrypoint, PATH, cwd) and checked once per app (``_Lookup``):
        a cached program is used while it is still executable and nothing has appeared on PATH
        before it.
        """
        checked: set[str] = set()
        cache = self._exe_cache
        found: dict[tuple[str, str, str], str] = {}  # (checked for this app: once, not per replica)
        for rep in app.replicas:
            req = rep.req
            if req.cwd not in checked:
                check_cwd(req.cwd, req.role)
                checked.add(req.cwd)
            key = (req.entrypoint, req.env.get("PATH", ""), req.cwd)
            exe = found.get(key)
            if exe is None:
                lookup = cache.get(key)
                if lookup is None or not lookup.still_valid():
                    lookup = _Lookup.of(*key, role=req.role)
                    if len(cache) > 256:
                        cache.clear()
                    cache[key] = lookup
                exe = found[key] = lookup.exe
            rep.executable = exe

    async def _check_new(self, app: LiveApp) -> None:
        """Checks that the app's log directory was not made already and can be made, and makes the
        directories its replicas are told to write into before they start.

        A replica's log directory and files are made on its first output (``LogDirMaker``), but
        its torchelastic error file (``TORCHELASTIC_ERROR_FILE``) is written by the replica
        itself, which needs its directory to exist. By default it is in the session's ``.errors``
        directory (``request.errors_dir_of``), made with the session's log directory, once, and
        again if it was removed; so nothing is made per app (the session's directory is made
        before the first launch, so that a ``log_dir`` that cannot be written fails it cleanly) and
        the app's directory is looked up (its record by ``claim``). A role whose error file is
        set under the app's directory gets that directory made now, in a worker thread with the
        other launches of the moment (``LogDirMaker.make``; creating the app's directory is then
        the check); the session's directories are still made first for the app's other roles,
        whose error files are there.

        Raises:
            LaunchSpecError, LaunchError: a directory cannot be made.
            ValueError: the app's directory exists already (a dry run scheduled before, whose
                record was removed).
        """
        app_dir = app.request.app_dir
        inside = app_dir + os.sep
        errors_dir = errors_dir_of(app_dir)
        dirs = list(
            dict.fromkeys(
                os.path.dirname(r.req.error_file)
                for r in app.replicas
                if r.req.error_file.startswith(inside)
            )
        )
        if not dirs or any(os.path.dirname(r.req.error_file) == errors_dir for r in app.replicas):
            session_dir = os.path.dirname(app_dir)
            # (a lookup in a directory just used is a few microseconds: done here, not in a thread;
            # the space reserve is in the errors directory: there, so is the directory)
            reserve = space_reserve_of(app_dir)
            if session_dir not in self._session_dirs or self._remake(session_dir, reserve):
                try:
                    await anyio.to_thread.run_sync(
                        _make_session_dir, session_dir, errors_dir, reserve
                    )
                except OSError as e:
                    what = f"the log directory {app_dir!r}"
                    raise launch_error(app.app_id, e, what, "") from None
                self._session_dirs.add(session_dir)
                if not _exists(reserve):
                    self._reserve_retry[session_dir] = time.monotonic() + RESERVE_RETRY
        if dirs:  # (a role's error file under the app's directory)
            await self._dirs.make(app.app_id, app_dir, dirs)
            return
        if _exists(app_dir):
            raise ValueError(
                f"the log directory of app {app.app_id!r} already exists ({app_dir}); "
                "was this dry run already scheduled?"
            )

    def _remake(self, session_dir: str, reserve: str) -> bool:
        """Whether a session's directories are to be made again: its space reserve is gone (and
        so, maybe, its errors directory), unless it found no room a while ago (then it is tried
        again every ``RESERVE_RETRY`` seconds only: not in a worker thread at each launch)."""
        if _exists(reserve):
            return False
        return not _exists(os.path.dirname(reserve)) or time.monotonic() >= self._reserve_retry.get(
            session_dir, 0.0
        )

    async def _start_app(self, app: LiveApp) -> None:
        """Starts the app's replicas (it is registered with the watchdog, with a minimal record
        to write if the launcher dies before the real one is: ``claim``), and writes its
        record."""
        rt = self._rt
        app_id = app.app_id
        rt.apps[app_id] = app
        rt.claimed.pop(app_id, None)
        await self._prepare_cgroups(app)
        self._check_open()
        if app.cancel_reason is None and rt.store.cancel_marked(app_id):
            # cancelled by another process while it was being submitted (one lookup here: the
            # marker's inotify event may not have been read yet)
            self._supervision.request_stop(app, FOREIGN_CANCEL)
        if app.cancel_reason is None:  # else it was cancelled meanwhile: its task records that
            await self._spawner.start(app, app.replicas)
            app.set_app_state(AppState.RUNNING, time.time())
            asyncio.get_running_loop().call_later(EARLY_LOG_FILES, _log_files_early, app)
        app.task = rt.supervisor.spawn(self._supervision.run(app), f"app:{app_id}")
        await rt.writer.write(app_id, lambda: rt.snapshot(app).to_json())

    async def _prepare_cgroups(self, app: LiveApp) -> None:
        if app.cgroup is None:
            return
        contain = self._rt.contain
        n = len(app.replicas)
        # a single replica's first attempt runs in the app's cgroup itself: one directory
        dirs = list(
            dict.fromkeys(
                [app.cgroup]
                + [contain.replica_dir(app.cgroup, r.index, 1, n) or "" for r in app.replicas]
            )
        )
        try:
            await contain.prepare(dirs)
        except OSError as e:
            logger.warning("cannot create the cgroups of app %s (%s); using markers", app.app_id, e)
            contain.remove_later(app.cgroup)
            app.cgroup = None

    # -- undoing a start ----------------------------------------------------------------------

    async def undo(self, app: LiveApp) -> None:
        """Undoes a failed or cancelled start; runs to completion even if the caller is cancelled."""
        try:
            task = self._rt.supervisor.spawn(self._discard(app), f"undo:{app.app_id}")
        except RuntimeError:  # closing: the scheduler's own clean-up is running
            await self._discard(app)
            return
        await await_shielded(task)

    async def _discard(self, app: LiveApp) -> None:
        """Kills what started of the app and removes its directory, record and cgroups."""
        rt = self._rt
        app.discard = True
        rt.writer.forget(app.app_id)
        task = app.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        moving = {r.moved for r in app.replicas if r.moved is not None}
        if moving:  # (their moves are short; the thread never waits for the loop)
            await asyncio.wait(moving)  # (their exits are watched from then on)
        # exits heard before, or while the moves finished, are the exit reaper's to finish
        while any(r.reaping for r in app.replicas):
            await self._spawner.exits.idle()
        started = app.running()  # (no await since: none of these is being reaped)
        loop = asyncio.get_running_loop()
        for rep in started:
            loop.remove_reader(rep.pidfd)
            rt.contain.kill(rep.cgroup, rep.pid or 0)
        await anyio.to_thread.run_sync(_wait_all_gone, app)
        app.close_logs()
        rt.apps.pop(app.app_id, None)
        # nothing runs any more: the watchdog must not record it (a record would be a ghost)
        rt.watchdog.send_now(protocol.forget_line(app.app_id))
        await rt.writer.flush()  # a write in flight must not land after the removal
        app.claimed = False  # (its claim goes with its files)
        errors_dir = errors_dir_of(app.request.app_dir)  # (a role's own error file is left alone)
        error_files = [
            r.req.error_file
            for r in app.replicas
            if os.path.dirname(r.req.error_file) == errors_dir
        ]
        await anyio.to_thread.run_sync(
            self._remove_app_files, app.app_id, app.request.app_dir, app.cgroup, error_files
        )

    def _remove_app_files(
        self, app_id: str, app_dir: str, cgroup: str | None, error_files: list[str]
    ) -> None:
        remove_tree(app_dir)
        for path in error_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        local_workspace.remove_workdir(self._rt.root, self._session, app_id)
        self._rt.store.remove(app_id)
        if cgroup is not None:
            deadline = time.monotonic() + CONTAIN_TIMEOUT
            while not contain.remove_tree(cgroup) and time.monotonic() < deadline:
                contain.kill(cgroup)
                time.sleep(0.01)


def _take_stale(store: RecordStore, app_id: str) -> tuple[str, list[int]]:
    """``RecordStore.take_stale_claim``, unless processes of the app (marked as its replicas) are
    left, which a launcher and watchdog both killed may leave: their pids then, and the claim
    stays as it was."""
    prefix = protocol.app_marker_prefix(app_id)
    left: list[int] = []

    def nothing_left() -> bool:
        found = contain.live_processes(protocol.MARKER_ENV_BYTES, [prefix])
        left.extend(sorted(p for p, _, _ in found))
        return not left

    return store.take_stale_claim(app_id, nothing_left), left


def _make_session_dir(session_dir: str, errors_dir: str, reserve: str) -> None:
    """Makes a session's log directory, its directory of error files and the space reserve of its
    logs' loss markers (if it can: a disk full already has none to give); PermissionError when
    this user cannot write in them."""
    os.makedirs(errors_dir, exist_ok=True)
    for path in (session_dir, errors_dir):
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", path)
    _make_space_reserve(reserve)


def _make_space_reserve(path: str) -> None:
    """Sets ``SPACE_RESERVE_SIZE`` bytes of the disk aside in ``path`` (allocated, not sparse);
    nothing when there is not that much room (or the file exists)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.posix_fallocate(fd, 0, SPACE_RESERVE_SIZE)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
    finally:
        os.close(fd)


def _exists(path: str) -> bool:
    """True when ``path`` exists (one lookup, no creation: a few microseconds on the loop)."""
    return os.path.lexists(path)


#: Seconds before a session's space reserve for loss markers that found no room is tried again.
RESERVE_RETRY = 60.0
#: How long the scheduler's preparation (before its first launch) may spend making spare record
#: files (``spares.py``); up to ``spares.MIN_TARGET`` are made within it.
FIRST_SPARES_TIME = 0.005

#: Seconds after its start when a replica that is still running and has not written anything yet
#: gets its log files anyway (in the worker thread). A replica that ends sooner without output never
#: makes any (a fan-out of instant apps, a sweep's short trials); one that runs longer has them
#: before its first output, which may come just before it exits and would otherwise wait for them.
EARLY_LOG_FILES = 0.1


def _log_files_early(app: LiveApp) -> None:
    if app.discard or is_terminal(app.state):
        return
    for rep in app.replicas:
        writer = rep.writer
        if rep.running and writer is not None and writer.attached:
            writer.make_files_soon()


def _wait_all_gone(app: LiveApp) -> None:
    """Reaps the replicas of an undone start (and, in marker mode, kills what they left)."""
    for rep in app.running():
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PIDFD, rep.pidfd, os.WEXITED)
        os.close(rep.pidfd)
        rep.pidfd = -1
    if app.cgroup is None:
        prefix = protocol.app_marker_prefix(app.app_id)
        found = contain.live_processes(protocol.MARKER_ENV_BYTES, [prefix])
        contain.kill_pids(p for p, _, _ in found)


@dataclass(eq=False)
class _DirJob:
    """One app's directories to make before it starts, and what came of it (set by the worker
    thread)."""

    app_id: str
    app_dir: str
    dirs: list[str]
    future: asyncio.Future[None]
    error: BaseException | None = None
    #: ``app_dir`` was made by this job (so it is this job's to remove)
    created: bool = False
    #: the result was handed over (``abandoned``: to nobody, the launch no longer waited)
    delivered: bool = False
    abandoned: bool = False
    #: an abandoned job's directories are removed (``settled``: what its cancelled launch waits
    #: on for that, if it came first)
    removed: bool = False
    settled: asyncio.Future[None] | None = None


class LogDirMaker:
    """Makes log directories and files in a worker thread, a batch at a time: the directories a
    replica is told to write into before it starts (``make``), and a replica's log files on its
    first output (``request``, the ``opener`` of a lazy ``ReplicaLogWriter``).

    Creating a file or directory costs from 20 µs to over 0.5 ms of kernel time on a local file
    system (on ext4 without a journal, each creation skips the inodes freed in the last minutes).
    In a worker thread, which holds no GIL while in the kernel, they run on another core while the
    event loop goes on. Everything asked while a batch is being made forms the next one, so a
    burst costs a few thread hand-overs, not one per app or replica; each is handed over as soon
    as it is made. When a batch takes more than ``SLOW_BATCH`` seconds (a churned ext4: 4.7 ms a
    replica here, this thread then the bottleneck of a sweep), a second one is made beside it from
    what queued meanwhile: a worker thread takes the GIL back from a busy loop slowly after each of
    its system calls (half of its time there), so two overlap those waits and their kernel time.
    Fast batches (tmpfs: 0.08 ms a replica) stay one at a time: more, smaller batches would cost
    the loop more hand-overs.

    A launch cancelled while its directories are being made leaves nothing, and its cancellation
    goes on only once they are removed (so the same dry run can be scheduled again at once). When
    the scheduler closes, the writers still waiting get their files made on the event loop (their
    ``close`` would make them anyway), and the launches still waiting fail: no writer is left
    paused, no launch left waiting, even if a worker was cancelled before it ran.

    Args:
        supervisor: owns the task that hands the batches to the thread.
    """

    #: Batches made at once at most (each in a worker thread).
    WORKERS = 2
    #: Seconds a batch runs before what queued meanwhile gets a worker of its own.
    SLOW_BATCH = 0.002

    def __init__(self, supervisor: TaskSupervisor) -> None:
        self._supervisor = supervisor
        self._jobs: list[_DirJob | ReplicaLogWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: dict[asyncio.Task[None] | None, float] = {}  # batch -> started (monotonic)
        self._timer: asyncio.TimerHandle | None = None  # when the running batch turns slow
        self._session_dirs: set[str] = set()

    async def make(self, app_id: str, app_dir: str, dirs: list[str]) -> None:
        """Creates ``app_dir`` (it must not exist) and ``dirs`` below it (with their parents).

        Raises:
            ValueError: ``app_dir`` exists already.
            LaunchError: something cannot be created (nothing of it is left).
            RuntimeError: the scheduler is closing.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        job = _DirJob(app_id, app_dir, dirs, future)
        self._ensure_task()  # RuntimeError: closed
        self._jobs.append(job)
        self._more_workers()
        try:
            await future
        except asyncio.CancelledError:
            if future.cancelled():
                # cancelled while queued or being made: the job is abandoned when the batch hands
                # it over, and what it made removed; that is waited for
                if not job.removed:
                    job.settled = future.get_loop().create_future()
                    await wait_held(job.settled)
            elif future.done() and future.exception() is None:
                # made, but this launch was cancelled before it resumed
                await in_thread_shielded(_discard_jobs, [job])
            raise

    def request(self, writer: ReplicaLogWriter) -> None:
        """Has ``writer``'s files made (``make_files`` in the thread, then ``files_made`` on the
        event loop). Does not block; on the event loop."""
        try:
            self._ensure_task()
        except RuntimeError:  # closing: made here, now
            writer.make_files()
            writer.files_made()
            return
        self._jobs.append(writer)
        self._more_workers()

    def _ensure_task(self) -> None:
        if not self._tasks:
            self._add_worker()

    def _add_worker(self) -> None:
        task = self._supervisor.spawn(self._run(), "log-dirs")
        self._tasks.add(task)
        task.add_done_callback(self._worker_done)

    def _worker_done(self, task: asyncio.Task[None]) -> None:
        """A worker ended. One cancelled before it ran (the scheduler closing in the iteration
        that started it) never ran its ``finally``: what queued is given up here, unless another
        worker is left to do it."""
        if task not in self._tasks:
            return  # its ``finally`` ran
        self._tasks.discard(task)
        self._running.pop(task, None)
        if not self._tasks:
            left, self._jobs = self._jobs, []
            _give_up(left)

    def _more_workers(self) -> None:
        """Adds a worker for the queue when the batches being made are slow; if they are not slow
        yet, looks again when the oldest turns slow (nothing else may be asked meanwhile)."""
        busy = self._running
        if not busy or len(busy) != len(self._tasks) or len(busy) >= self.WORKERS:
            return
        slow_at = min(busy.values()) + self.SLOW_BATCH
        now = time.monotonic()
        if now >= slow_at:
            self._add_worker()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(slow_at - now, self._look_again)

    def _look_again(self) -> None:
        self._timer = None
        if self._jobs and not self._supervisor.closed:
            self._more_workers()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        batch: list[_DirJob | ReplicaLogWriter] = []
        try:
            await asyncio.sleep(0)  # what is asked in this loop iteration joins the first batch
            while self._jobs:
                idle = len(self._tasks) - len(self._running)  # (this one included)
                take = -(-len(self._jobs) // idle)  # the others idle take the rest
                batch, self._jobs = self._jobs[:take], self._jobs[take:]
                self._running[me] = time.monotonic()
                # waited for even when cancelled (closing): what the thread makes must be known
                await await_shielded(loop.run_in_executor(None, self._make_batch, batch, loop))
                del self._running[me]
                abandoned = [j for j in batch if isinstance(j, _DirJob) and j.abandoned]
                # (kept in ``batch`` until settled, for the ``finally`` if this is cancelled)
                batch = list(abandoned)
                if abandoned:
                    # removed even if the scheduler closes meanwhile
                    await in_thread_shielded(_discard_jobs, abandoned)
                    _settle(abandoned)
                batch = []
        finally:
            self._running.pop(me, None)
            self._tasks.discard(me)
            left = batch + self._jobs
            self._jobs = []
            # closing (the thread has finished): nothing of these launches is left, and every
            # waiting writer gets its files (one whose files were handed over ignores this)
            _give_up(left)

    def _deliver(self, job: _DirJob) -> None:
        """Hands what was made to the launch (on the event loop), or marks it to be removed when
        the launch no longer waits or the scheduler is closing."""
        job.delivered = True
        if job.future.done() or self._supervisor.closed:
            job.abandoned = True
        elif job.error is not None:
            job.future.set_exception(job.error)
        else:
            job.future.set_result(None)

    def _make_batch(
        self, batch: list[_DirJob | ReplicaLogWriter], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Makes each job's directories or writer's files and hands it over at once."""
        for job in batch:
            if isinstance(job, ReplicaLogWriter):
                job.make_files()
                loop.call_soon_threadsafe(job.files_made)
                continue
            if not job.future.cancelled():  # read across threads: at worst it is made, then removed
                try:
                    self._make_one(job)
                except BaseException as e:
                    job.error = e
            loop.call_soon_threadsafe(self._deliver, job)

    def _make_one(self, job: _DirJob) -> None:
        app_dir = job.app_dir
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
            job.created = True
        except FileExistsError:
            raise ValueError(
                f"the log directory of app {job.app_id!r} already exists ({app_dir}); "
                "was this dry run already scheduled?"
            ) from None
        except OSError as e:
            raise launch_error(job.app_id, e, f"the log directory {app_dir!r}", "") from None
        try:
            for d in job.dirs:
                os.makedirs(d, exist_ok=True)
        except BaseException as e:
            remove_tree(app_dir)
            job.created = False
            if isinstance(e, OSError):
                what = f"the log directory {app_dir!r}"
                raise launch_error(job.app_id, e, what, "") from None
            raise


def _discard_jobs(jobs: list[_DirJob]) -> None:
    """Removes what was made for launches that no longer wait for it."""
    for job in jobs:
        if job.created:
            remove_tree(job.app_dir)
            job.created = False


def _settle(jobs: list[_DirJob]) -> None:
    """Tells the cancelled launches waiting for these jobs' removal that it is done."""
    for job in jobs:
        job.removed = True
        if job.settled is not None and not job.settled.done():
            job.settled.set_result(None)


def _give_up(left: list[_DirJob | ReplicaLogWriter]) -> None:
    """What was asked of workers that are gone (the scheduler is closing): launches fail and leave
    nothing, writers get their files made here, on the event loop."""
    jobs = [j for j in left if isinstance(j, _DirJob) and (j.abandoned or not j.delivered)]
    if jobs:
        _discard_jobs(jobs)
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the local scheduler is closing"))
        _settle(jobs)
    for writer in left:
        if isinstance(writer, ReplicaLogWriter):
            writer.make_files()
            writer.files_made()
