"""Each local app's task: it judges its replicas' exits (``state.py``) and carries out the verdicts
(restart, stop, finish), so that every change of an app's state happens here.

Exits are judged in batches: whatever exited while the last batch was handled is settled together
(what the replicas left is killed and their output drained), so a thousand replicas exiting at
once cost a few passes, not a thousand.

Stopping a replica sends exactly one SIGTERM to its process group, waits the app's grace period,
then SIGKILLs everything it contains; a replica ends once its main process, everything it started
and its output are gone (each boundedly: ``CONTAIN_TIMEOUT``, ``DRAIN_TIMEOUT``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
import time
from collections.abc import Callable, Iterable

import anyio.to_thread

from asynctorchx.schedulers._local import state
from asynctorchx.schedulers._local.live import Countdown, LiveApp, Replica
from asynctorchx.schedulers._local.procs import LaunchError, kill_group
from asynctorchx.schedulers._local.runtime import LocalRuntime
from asynctorchx.schedulers._local.spawn import Spawner
from asynctorchx.specs.api import NONE, AppState, RetryPolicy, is_terminal

logger = logging.getLogger(__name__)

#: How long a replica's log pipes may stay open after everything it contains is gone (a process
#: that escaped containment may hold them) before the log writer stops waiting for them.
DRAIN_TIMEOUT = 2.0
#: How long the processes left in a replica may take to die after SIGKILL before it ends anyway.
CONTAIN_TIMEOUT = 5.0
#: Exits judged between two yields to the event loop.
JUDGE_CHUNK = 256
#: Why an app stops when another process cancelled it.
FOREIGN_CANCEL = "cancelled by another process"


class AppSupervision:
    """Runs the task of each app (``run``) and stops apps on request.

    Args:
        runtime: the scheduler's apps and guards.
        spawner: starts the replicas of a restart.
        inotify_active: tells whether changes to the records directory are watched (then a cancel
            marker left by another process is heard of; otherwise it is looked for at each exit).
    """

    def __init__(
        self, runtime: LocalRuntime, spawner: Spawner, inotify_active: Callable[[], bool]
    ) -> None:
        self._rt = runtime
        self._spawner = spawner
        self._watched = inotify_active

    # -- the app's task -----------------------------------------------------------------------

    async def run(self, app: LiveApp) -> None:
        """The app's task: judges exits until the app ends, then records its end."""
        try:
            await self._loop(app)
        except asyncio.CancelledError:
            self.kill_now(app, "the scheduler's tasks were cancelled")
            self._record_end_now(app)
            raise
        except Exception as e:
            logger.exception("supervising app %s failed", app.app_id)
            self.kill_now(app, f"internal error while supervising the app: {e!r}")
            try:
                await self._finish(app, AppState.FAILED)
            except Exception:  # (the same cause again): ended without waiting for its replicas
                logger.exception("ending app %s failed; it is recorded FAILED as is", app.app_id)
                self._end_now(app, AppState.FAILED)

    async def _loop(self, app: LiveApp) -> None:
        while True:
            if app.cancel_reason is not None:
                await self._apply(app, None, state.judge_cancel(app.cancel_reason))
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
            await self.settle(batch)
            if await self._check_cancel_marker(app, batch):
                continue
            if await self._judge_batch(app, batch):
                return
            self._rt.changed(app)

    def hear_foreign_cancel(self, app: LiveApp) -> None:
        """Another process left a cancel marker for the app (inotify said so): read it (in a
        worker thread) and stop the app; the exits judged meanwhile read it first."""
        if app.discard or app.cancel_reason is not None:
            return
        app.foreign_cancel = True
        with contextlib.suppress(RuntimeError):  # closing: the app is being stopped anyway
            self._rt.supervisor.spawn(self._stop_for_marker(app), f"cancel-marker:{app.app_id}")

    async def _stop_for_marker(self, app: LiveApp) -> None:
        signalled = await anyio.to_thread.run_sync(self._rt.store.cancel_requested, app.app_id)
        if signalled is not None and not app.discard and app.cancel_reason is None:
            self.request_stop(app, FOREIGN_CANCEL, signalled=signalled)
            self._rt.changed(app)

    async def _check_cancel_marker(self, app: LiveApp, batch: list[Replica]) -> bool:
        """Reads another process's cancel marker, if it may have left one; True when it did (the
        exited replicas are judged as stopped by that cancel, and the app is stopping)."""
        if not app.foreign_cancel and self._watched():
            return False  # inotify would have told (the marker is written before any signal)
        app.foreign_cancel = False
        store = self._rt.store
        signalled = await anyio.to_thread.run_sync(store.cancel_requested, app.app_id)
        if signalled is None:
            return False
        for rep in batch:
            if rep.exit_pending:
                rep.exit_pending = False
                app.set_state(rep, state.stopped_by_cancel(rep.exit_code))
        self.request_stop(app, FOREIGN_CANCEL, signalled=signalled)
        self._rt.changed(app)
        return True

    async def _judge_batch(self, app: LiveApp, batch: list[Replica]) -> bool:
        """Judges the exits of ``batch``; True once the app ended."""
        for i, rep in enumerate(batch):
            if i and i % JUDGE_CHUNK == 0:
                await asyncio.sleep(0)  # let the loop breathe between chunks of a big batch
            if not rep.exit_pending:  # a restart's stop took it over
                continue
            rep.exit_pending = False
            verdict = state.judge_exit(rep.as_exit(), app.progress(rep))
            if verdict.replica == AppState.FAILED:
                await self._read_error_file(rep)
            if await self._apply(app, rep, verdict):
                return True
            if app.cancel_reason is not None:
                break
        return False

    async def _apply(self, app: LiveApp, rep: Replica | None, verdict: state.Verdict) -> bool:
        """Carries out a verdict; True once the app ended."""
        if rep is not None and verdict.replica is not None:
            app.set_state(rep, verdict.replica)
            if verdict.replica == AppState.SUCCEEDED:
                rep.close_logs()  # now rather than all at once when the app ends
        if verdict.msg is not None and verdict.app == AppState.FAILED:
            app.msg = verdict.msg  # said while the others stop
        if verdict.takes_error and rep is not None:
            app.structured_error_msg = rep.structured_error_msg
        if rep is not None and verdict.uses_retry:
            return await self._restart(app, rep, verdict)
        if verdict.stop_others:
            if verdict.app == AppState.FAILED:
                self._rt.changed(app)
            await self.stop(app, app.running(), AppState.CANCELLED)
        if verdict.app is None:
            return False
        if verdict.msg is not None:
            app.msg = verdict.msg
        await self._finish(app, verdict.app)
        return True

    async def _restart(self, app: LiveApp, failed: Replica, verdict: state.Verdict) -> bool:
        """Spends a retry of the failed replica's role and restarts its scope; True when the
        restart could not start (the app then failed)."""
        assert verdict.restart is not None
        if verdict.restart == RetryPolicy.REPLICA:  # each replica has its own retries
            app.replica_retries[failed.index] = app.replica_retries.get(failed.index, 0) + 1
        else:
            app.retries_left[failed.req.role] -= 1
        app.num_restarts += 1
        app.msg = verdict.msg or app.msg
        roles = [r.req.role for r in app.replicas]
        targets = [
            app.replicas[i] for i in state.restart_scope(verdict.restart, failed.index, roles)
        ]
        # recorded now: stopping the scope's others can take their whole grace period
        self._rt.changed(app)
        await self.stop(app, [r for r in targets if r.running], AppState.PENDING)
        if app.cancel_reason is not None:
            return False
        # a replica outside the scope that failed for good while the scope stopped has failed the
        # app: judged now, before the scope would start again only to be stopped once more
        fatal = [
            r
            for r in app.exited
            if r.exit_pending
            and r not in targets
            and state.judge_exit(r.as_exit(), app.progress(r)).app == AppState.FAILED
        ]
        if fatal:
            app.exited = [r for r in app.exited if r not in fatal]
            for rep in targets:  # (stopped for a restart that will not come)
                if not rep.running and not is_terminal(rep.state):
                    app.set_state(rep, AppState.FAILED if rep is failed else AppState.CANCELLED)
            return await self._judge_batch(app, fatal)
        try:
            await self._start_again(app, targets)
        except LaunchError as e:
            if not failed.running:  # its new attempt never started: its own failure is its end
                app.set_state(failed, AppState.FAILED)
            return await self._apply(app, failed, state.judge_restart_failure(str(e)))
        self._rt.changed(app)
        return False

    async def _start_again(self, app: LiveApp, targets: list[Replica]) -> None:
        pending = [r for r in targets if r.exit_pending]
        if pending:
            await self.settle(pending)
            for rep in pending:
                rep.exit_pending = False
        files = [r.req.error_file for r in targets]
        await anyio.to_thread.run_sync(_remove_files, files)
        contain = self._rt.contain
        if app.cgroup is not None:
            n = len(app.replicas)
            dirs = [contain.replica_dir(app.cgroup, r.index, r.attempts + 1, n) for r in targets]
            try:
                await contain.prepare([d for d in dirs if d is not None])
            except OSError as e:
                raise LaunchError(
                    f"cannot create the cgroups of the restarted replicas: {e}"
                ) from None
        if app.cancel_reason is not None:
            return
        for rep in targets:
            app.set_state(rep, AppState.PENDING)
        await self._spawner.start(app, targets)

    async def _finish(self, app: LiveApp, final: AppState) -> None:
        """Ends the app ``final``: settles the exits not judged yet, gives every replica its end
        state, records the app."""
        pending = [r for r in app.exited if r.exit_pending]
        app.exited = []
        await self.settle(pending)
        for rep in app.replicas:
            unjudged = rep.exit_pending
            rep.exit_pending = False
            app.set_state(rep, state.final_state(final, rep.state, rep.exit_code, unjudged))
        self.end(app, final)

    def abandon(self, app: LiveApp, reason: str) -> None:
        """Ends an app whose task is stuck (it had its grace period and more): kills everything
        and records it CANCELLED."""
        self.kill_now(app, reason)
        self._end_now(app, AppState.CANCELLED)

    def _end_now(self, app: LiveApp, final: AppState) -> None:
        if is_terminal(app.state):
            return
        for rep in app.replicas:
            rep.exit_pending = False
            app.set_state(rep, state.final_state(final, rep.state, None, False))
        self.end(app, final)

    def _record_end_now(self, app: LiveApp) -> None:
        """Records the end of an app whose task was cancelled (its replicas killed), before the
        task ends: its event loop may be ending without the scheduler's ``close()`` (``asyncio.run``
        returning cancels every task), and then no record writer runs any more. Written here, on
        the event loop (blocking, once, on the way out), and starting no task (one started now
        would never end, and would keep the loop from being collected): otherwise the record said
        RUNNING for as long as this process lived (the watchdog records only the apps of a
        launcher that died)."""
        if app.discard or is_terminal(app.state):
            return
        for rep in app.replicas:
            rep.exit_pending = False
            app.set_state(rep, state.final_state(AppState.CANCELLED, rep.state, None, False))
        app.close_logs()
        app.set_app_state(AppState.CANCELLED, time.time())
        self._rt.writer.write_now(app.app_id, self._rt.finished_app(app).to_json())

    def end(self, app: LiveApp, final: AppState) -> None:
        """Records that the app ended ``final`` (its replicas already have their end states)."""
        app.close_logs()
        app.set_app_state(final, time.time())
        self._rt.record_end(app)

    # -- stopping -----------------------------------------------------------------------------

    def request_stop(
        self,
        app: LiveApp,
        reason: str,
        *,
        grace: float | None = None,
        signalled: Iterable[int] = (),
        defer: bool = False,
    ) -> list[Replica]:
        """Starts stopping the app (one SIGTERM per group now; the app's task escalates).

        Idempotent. ``grace`` shortens the grace period; ``signalled`` lists the groups another
        process already sent SIGTERM. With ``defer`` no signal is sent: the replicas owed one are
        returned (counted as signalled from now on) for the caller to signal once it has listed
        them in the cancel marker (``send_deferred_terms``).
        """
        if grace is not None:
            app.stop_grace = min(app.stop_grace, grace)
        if app.cancel_reason is not None or is_terminal(app.state):
            return []
        app.cancel_reason = reason
        done = set(signalled)
        owed: list[Replica] = []
        now = asyncio.get_running_loop().time()
        for rep in app.replicas:
            if rep.running and not rep.term_sent:
                if rep.pid in done:
                    pass
                elif defer:
                    owed.append(rep)
                else:
                    kill_group(rep.pid or 0, signal.SIGTERM)
                rep.term_sent = True
                rep.term_at = now
        app.wake.set()
        return owed

    @staticmethod
    def send_deferred_terms(owed: Iterable[tuple[Replica, int]]) -> None:
        """Sends the SIGTERMs ``request_stop(defer=True)`` left owed: ``(replica, pid)`` each,
        skipping a replica that is no longer that process or whose exit is being reaped (its
        group id could belong to another process by now; the reaping kills what is left)."""
        for rep, pid in owed:
            if rep.pid == pid and rep.pidfd >= 0 and not rep.reaping:
                kill_group(pid, signal.SIGTERM)

    async def stop(self, app: LiveApp, replicas: list[Replica], final: AppState) -> None:
        """Stops ``replicas``: one SIGTERM to each group (unless it had it already), SIGKILL of
        everything they contain after the grace period; waits for all of it to be gone.

        Their exits are settled here (not by the app's loop) and they end in state ``final``.
        """
        now = asyncio.get_running_loop().time()
        targets = [r for r in replicas if r.running]
        for rep in targets:
            if not rep.term_sent:
                kill_group(rep.pid or 0, signal.SIGTERM)
                rep.term_sent = True
                rep.term_at = now
        if targets:
            deadline = max(r.term_at for r in targets) + app.stop_grace
            await _wait_exited(targets, deadline)
            for rep in targets:
                if rep.running:
                    self._rt.contain.kill(rep.cgroup, rep.pid or 0)
            await _wait_exited(targets, None)
        await self.settle([r for r in targets if r.exit_pending])
        for rep in targets:
            rep.exit_pending = False
            rep.term_sent = False
            app.set_state(rep, final)

    def kill_now(self, app: LiveApp, reason: str) -> None:
        """SIGKILLs and reaps every replica at once (when the app's task cannot go on); they end
        CANCELLED. One whose move into its cgroup may be under way in the worker thread is reaped
        when the thread hands it back (its pid must not be freed, and maybe reused, before)."""
        loop = asyncio.get_running_loop()
        for rep in app.replicas:
            if rep.running:
                moving = rep.moving
                if moving is not None:  # not to be moved any more (if the thread has not begun)
                    moving.cancelled = True
                self._rt.contain.kill(rep.cgroup, rep.pid or 0)
                if moving is not None and not moving.done:
                    # its move may be under way in the worker thread: it is reaped once the
                    # thread hands it back (``Spawner._moved``), so that its pid is not freed
                    # (and maybe reused by another process, which the move would take) before
                    app.n_running -= 1
                elif not rep.reaping:  # otherwise the exit reaper has it and closes its pidfd
                    loop.remove_reader(rep.pidfd)
                    with contextlib.suppress(ChildProcessError):
                        os.waitid(os.P_PIDFD, rep.pidfd, os.WEXITED)
                    os.close(rep.pidfd)
                    rep.pidfd = -1
                    app.n_running -= 1
                rep.exit_code = -signal.SIGKILL
                app.set_state(rep, AppState.CANCELLED)
                rep.ended_at = time.time()
            rep.close_logs()
        if app.cancel_reason is None:
            app.cancel_reason = reason
        app.msg = app.msg or reason

    async def settle(self, replicas: list[Replica]) -> None:
        """Waits until nothing the replicas started is left (after their main process exited) and
        everything they wrote is in their log files, both boundedly."""
        if not replicas:
            return
        await self._contain_leftovers(replicas)
        loop = asyncio.get_running_loop()
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

    async def _contain_leftovers(self, replicas: list[Replica]) -> None:
        """Waits (at most ``CONTAIN_TIMEOUT``) until the processes the replicas left are gone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONTAIN_TIMEOUT
        contain = self._rt.contain
        swept = [r for r in replicas if r.leftovers and r.cgroup is None]
        waits: list[tuple[Replica, asyncio.Future[None]]] = []
        if swept:
            fut = contain.sweep([r.marker for r in swept], min(r.pid or 0 for r in swept))
            waits += [(r, fut) for r in swept]
        for rep in replicas:
            if rep.leftovers and rep.cgroup is not None:
                waits.append((rep, contain.wait_empty(rep.cgroup)))
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

    @staticmethod
    async def _read_error_file(rep: Replica) -> None:
        text = await anyio.to_thread.run_sync(_read_text, rep.req.error_file)
        rep.structured_error_msg = text if text else NONE


async def _wait_exited(replicas: list[Replica], deadline: float | None) -> None:
    running = [r for r in replicas if r.running]
    if not running:
        return
    waiter = Countdown(len(running))
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


#: The largest error file a replica's record keeps (bytes): a record is rewritten whole.
MAX_ERROR_FILE = 1 << 20


def _read_text(path: str) -> str:
    """A replica's error file, or "" when there is none. One that is not a regular file (a FIFO
    would block the read, and the app's end, for ever; a device may never end) or that is larger
    than ``MAX_ERROR_FILE`` is not read: the text says why."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return f"(the error file {path} is not a regular file: not read)"
            data = f.read(MAX_ERROR_FILE + 1)
        except OSError:
            return ""
    if len(data) > MAX_ERROR_FILE:
        return f"(the error file {path} holds more than {MAX_ERROR_FILE} bytes: not read)"
    return data.decode("utf-8", errors="replace")


def _remove_files(paths: list[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            os.unlink(p)
