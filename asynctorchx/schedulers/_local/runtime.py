"""What a local scheduler runs, shared by its parts: its live and recently finished apps, the
background work that owns them (tasks, record writes, containment, watchdog) and the change
notifications it pushes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._local import protocol
from asynctorchx.schedulers._local.guard import Containment, Reaper, RecordWriter, Watchdog
from asynctorchx.schedulers._local.live import LiveApp, OwnApp
from asynctorchx.schedulers._local.records import AppRecord, Owner, RecordStore
from asynctorchx.specs.api import AppState

#: Finished apps kept in memory (older ones are read back from their records).
FINISHED_CACHE = 4096
#: The message of an app claimed and not started yet (its workspace being shipped, say), in this
#: process and in others (``LocalScheduler.describe``).
BEING_SUBMITTED = "being submitted"


class LocalRuntime:
    """The state of one local scheduler's apps and the guards around them.

    Args:
        root: the state root.
        name: a label for task names (``{backend}:{session}``).
        notify: tells the scheduler's subscribers that an app changed.
        launcher: what the launcher says of itself to other processes (``RecordStore``).
    """

    def __init__(
        self,
        root: Path,
        name: str,
        notify: Callable[[str], None],
        launcher: Mapping[str, str] | None = None,
    ) -> None:
        self.root = root
        self.store = RecordStore(root, launcher)
        self.supervisor = TaskSupervisor(name)
        self.writer = RecordWriter(self.store, self.supervisor)
        self.contain = Containment(self.supervisor)
        self.watchdog = Watchdog(self.store.records_dir, self._registrations, self._resend_records)
        self.reaper = Reaper()
        self.apps: dict[str, LiveApp] = {}
        #: apps being scheduled, each with what resolves once its ``schedule`` has returned
        self.starting: dict[str, asyncio.Future[None]] = {}
        #: apps claimed and registered with the watchdog, not yet started (``apps`` then)
        self.claimed: dict[str, LiveApp] = {}
        self.finished: OrderedDict[str, OwnApp] = OrderedDict()
        self.owner_ticks: int | None = None
        self.closed = False
        self._notify = notify
        self._notify_pending: dict[str, None] = {}

    # -- reading ------------------------------------------------------------------------------

    def own(self, app_id: str) -> OwnApp | None:
        """An app this scheduler launched (live, being submitted, or finished recently), or
        None."""
        app = self.apps.get(app_id) or self.claimed.get(app_id)
        if app is not None:
            return None if app.discard else OwnApp(self.snapshot(app), app.roles)
        return self.finished.get(app_id)

    def record_of(self, app_id: str) -> AppRecord | None:
        """The record of an app this scheduler launched (or is submitting), or None (no copy of
        its roles)."""
        app = self.apps.get(app_id) or self.claimed.get(app_id)
        if app is not None:
            return None if app.discard else self.snapshot(app)
        own = self.finished.get(app_id)
        return None if own is None else own.record

    def state_of(self, app_id: str) -> AppState | None:
        """The state of an app this scheduler launched (or is submitting), or None (in O(1): no
        record is made)."""
        app = self.apps.get(app_id) or self.claimed.get(app_id)
        if app is not None:
            return None if app.discard else app.state
        own = self.finished.get(app_id)
        return None if own is None else own.record.state

    def owner(self) -> Owner:
        """This launcher and its watchdog, as records name them."""
        return Owner(
            pid=os.getpid(),
            start_ticks=self.owner_ticks,
            watchdog_pid=self.watchdog.pid,
            watchdog_start_ticks=self.watchdog.start_ticks,
        )

    def snapshot(self, app: LiveApp) -> AppRecord:
        """The record of a live app as it stands (one being submitted says so)."""
        record = app.snapshot(self.owner())
        if not record.msg and self.claimed.get(app.app_id) is app:
            record = dataclasses.replace(record, msg=BEING_SUBMITTED)
        return record

    def registration(self, app: LiveApp) -> bytes:
        """The watchdog's registration of an app about to start."""
        return app.registration(Owner(pid=os.getpid(), start_ticks=self.owner_ticks))

    # -- changes ------------------------------------------------------------------------------

    def changed(self, app: LiveApp) -> None:
        """Queues the app's record (serialised once per write batch) and a change notification.

        Nothing for an app whose start is being undone (``discard``): its record is forgotten and
        removed, and one written now (a log loss reported as its logs close) would be a ghost."""
        if app.discard:
            return
        self.writer.put(app.app_id, lambda: self.snapshot(app).to_json(), urgent=False)
        self.notify_soon(app.app_id)

    def notify(self, app_id: str) -> None:
        """Tells the subscribers now."""
        self._notify(app_id)

    def notify_soon(self, app_id: str) -> None:
        """Notifies subscribers of ``app_id`` on the next loop iteration (once, however many calls)."""
        if not self._notify_pending:
            asyncio.get_running_loop().call_soon(self._flush_notifications)
        self._notify_pending[app_id] = None

    def _flush_notifications(self) -> None:
        pending, self._notify_pending = self._notify_pending, {}
        for app_id in pending:
            self._notify(app_id)

    def finished_app(self, app: LiveApp) -> AppRecord:
        """Moves an app that ended from the live apps to the finished ones; returns its record."""
        snapshot = self.snapshot(app)
        app_id = app.app_id
        self.apps.pop(app_id, None)
        self.finished[app_id] = OwnApp(snapshot, app.roles)
        while len(self.finished) > FINISHED_CACHE:
            self.finished.popitem(last=False)
        return snapshot

    def record_end(self, app: LiveApp) -> None:
        """Writes the terminal record of an app that ended, then forgets it in the watchdog."""
        app_id = app.app_id
        self.writer.put(
            app_id,
            self.finished_app(app).to_json(),
            on_written=lambda: self.watchdog.send_later(protocol.forget_line(app_id)),
        )
        self.contain.remove_later(app.cgroup)
        self.notify(app_id)

    # -- the watchdog -------------------------------------------------------------------------

    def _registrations(self) -> Iterable[bytes]:
        owner = Owner(pid=os.getpid(), start_ticks=self.owner_ticks)
        for app in self.claimed.values():  # (a long workspace ship, say: still the watchdog's)
            yield app.registration(owner)
        for app in self.apps.values():
            yield from app.registrations(owner)

    def _resend_records(self) -> None:
        for app in self.apps.values():  # their records name the new watchdog
            if not app.discard:
                self.changed(app)
