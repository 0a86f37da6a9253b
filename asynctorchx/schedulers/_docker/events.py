"""Docker's event feed for ``local_docker``, and the container listings it vouches for.

``EventFeed`` follows ``GET /events`` for the containers carrying the backend's app label (of any
session) for as long as the scheduler is open, as one task of the scheduler's supervisor; a broken
stream is resumed from the last event's time, so no event is missed. Each event of an app:

- tells the scheduler's listeners (``on_change``: the runner's StatusHub re-describes the app) and
  wakes log readers waiting on the app (``wait_app``);
- for an exit, a removal, an OOM kill, or a start in an app that has had a failed exit, asks for
  the app's follow-up (``on_follow_up``: the backend's ``Reconciler``); so does the first
  connection, for every app that already owes one (it ended while nobody watched). Status reads
  never ask for follow-ups.

Each (re)connection also calls ``on_connect``: the engine answers again, so the clean-ups an
outage cut off (the scheduler's owed purges and stops) can be done now.

Docker announces an exit (``die``, with the exit code) ~0.1 s before its listing shows it, so the
exit is taken from the event (``with_exits_seen``). While the stream stays connected, the last
listing of an app whose only news since is an exit stands in for a new listing (``snapshot``): a
status round then costs no round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._docker.engine import DockerEngine, DockerSchedulerError
from asynctorchx.schedulers._docker.frames import format_api_time
from asynctorchx.schedulers._docker.processes import dead_launches, with_launchers_judged
from asynctorchx.schedulers._docker.request import (
    KIND_CANCEL_MARKER,
    KIND_RETRY_FAILED,
    LABEL_APP_ID,
    LABEL_KIND,
)
from asynctorchx.schedulers._docker.state import (
    ContainerInfo,
    assess,
    group_by_app,
    may_restart,
    with_exits,
)

logger = logging.getLogger(__name__)

_STATE_ACTIONS = frozenset(
    {"create", "start", "restart", "die", "stop", "kill", "destroy", "pause", "unpause", "oom"}
)
_FOLLOW_UP_ACTIONS = frozenset({"die", "destroy", "oom"})
# A start matters only in an app that has had a failure or a cancel: a replica that starts after
# its app failed or was cancelled (its launch still under way) is to be stopped.
_STARTS = frozenset({"start", "restart"})
_FILTERS = {"type": ["container"], "label": [LABEL_APP_ID]}
_REMEMBERED_APPS = 1000
_CONNECT_WAIT = 2.0
_DIED_MEMORY = 60.0
_SNAPSHOT_MAX_AGE = 30.0


class EventFeed:
    """One subscription to Docker's events, and what it says about the backend's containers.

    Args:
        engine: the engine to follow and list.
        tasks: the scheduler's supervisor (owns the feed's task and its short follow-up reads).
        on_change: called with an app id whenever Docker reports a change of one of its containers.
        on_follow_up: called with an app id that may owe a follow-up (an exit, a removal).
        on_connect: called each time the stream (re)connects: the engine answers (again).
        enabled: follow the events at all (off: listings only, and ``wait_app`` just sleeps).
    """

    def __init__(
        self,
        engine: DockerEngine,
        tasks: TaskSupervisor,
        *,
        on_change: Callable[[str], None],
        on_follow_up: Callable[[str], None],
        on_connect: Callable[[], None] | None = None,
        enabled: bool = True,
    ) -> None:
        self._engine = engine
        self._tasks = tasks
        self._on_change = on_change
        self._on_follow_up = on_follow_up
        self._on_connect = on_connect
        self._enabled = enabled
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Event | None = None
        self._epoch = 0
        self._caught_up = False
        self._caught_up_done = asyncio.Event()
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._kill_waiters: dict[str, set[asyncio.Event]] = {}  # by container id, see ``kills``
        self._settling: set[str] = set()
        self._settle_again: set[str] = set()  # containers that exited again while settling
        self._died: dict[str, tuple[int | None, float]] = {}
        self._last_event: OrderedDict[str, float] = OrderedDict()
        self._failed: OrderedDict[str, None] = OrderedDict()  # apps with a failure or cancel seen
        self._snapshots: dict[str, tuple[list[ContainerInfo], float, int]] = {}

    # -- the feed ---------------------------------------------------------------------------------

    def ensure_running(self) -> None:
        """Starts following the events (from the event loop), unless it runs or is disabled."""
        if not self._enabled or self._tasks.closed:
            return
        if self._ready is None:
            self._ready = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = self._tasks.spawn(self._follow(), name="events")

    async def connected(self) -> None:
        """Starts the feed and waits (at most ~2 s) until the engine has answered it."""
        self.ensure_running()
        if self._ready is not None and not self._ready.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ready.wait(), _CONNECT_WAIT)

    @property
    def live(self) -> bool:
        """True while the event stream is connected."""
        return self._ready is not None and self._ready.is_set()

    def _set_live(self, live: bool) -> None:
        if self._ready is None:
            self._ready = asyncio.Event()
        self._epoch += 1
        if live:
            self._ready.set()
        else:
            self._ready.clear()

    async def _follow(self) -> None:
        """Follows the events for as long as the scheduler is open, reconnecting with backoff."""
        since: str | None = None
        delay = 0.05
        warned = False
        while True:
            try:
                async with self._engine.events(_FILTERS, since) as events:
                    self._set_live(True)
                    warned = False
                    self._catch_up()
                    if self._on_connect is not None:
                        self._on_connect()
                    try:
                        async for event in events:
                            since = _resume_time(event) or since
                            delay = 0.05
                            self.handle(event)
                    finally:
                        self._set_live(False)
            except Exception as e:
                if not warned:
                    logger.warning("Docker event stream failed (%s); reconnecting", e)
                    warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _catch_up(self) -> None:
        """On the first connection, asks for the follow-ups of apps that ended unwatched."""
        if not self._caught_up:
            self._caught_up = True
            self._spawn(("catch-up",), self._catch_up_apps())

    async def _catch_up_apps(self) -> None:
        """Asks for the follow-ups of the apps that owe one, and of the apps whose launcher was
        killed before it made their containers (their claim and network are to be removed)."""
        try:
            for app_id, containers in group_by_app(await self.containers()).items():
                a = assess(app_id, containers)
                if a is not None and a.actions:
                    self._on_follow_up(app_id)
            for app_id in dead_launches(await self._engine.list_volumes(LABEL_APP_ID)):
                self._on_follow_up(app_id)
            await self._remove_orphan_networks()
        finally:
            self._caught_up_done.set()

    async def _remove_orphan_networks(self) -> None:
        """Removes the apps' networks that nothing of their app uses or will use: no container,
        and no volume of the app (a launch claim, a cancel's record).

        A launcher killed while the engine was still creating its app's network leaves a network
        that lands after whoever cleared the dead launch had looked for it, and no claim: nothing
        else would ever remove it (Docker's address pools run out of networks). Listed in this
        order, networks then volumes then containers, a network of a launch under way always shows
        its claim, or, once the claim is gone, its containers (made before the claim is removed).
        """
        networks = await self._engine.list_networks(label=LABEL_APP_ID)
        if not networks:
            return
        volumes = await self._engine.list_volumes(LABEL_APP_ID)
        containers = await self._engine.list_containers(LABEL_APP_ID)
        kept = {(item.get("Labels") or {}).get(LABEL_APP_ID) for item in [*volumes, *containers]}
        for network in networks:
            app_id = (network.get("Labels") or {}).get(LABEL_APP_ID)
            if app_id and app_id not in kept:
                try:
                    await self._engine.remove_network(str(network.get("Id", "")))
                except DockerSchedulerError as e:  # (a container joined it meanwhile: kept)
                    logger.debug("removing the orphan network of %s failed: %s", app_id, e)
                else:
                    logger.info("removed the network of %s, which nothing of it used", app_id)

    async def caught_up(self) -> None:
        """Returns once the first connection's look at every app has asked for their
        follow-ups (see ``_catch_up_apps``)."""
        await self._caught_up_done.wait()

    def handle(self, event: Mapping[str, Any]) -> None:
        """Takes in one event of the stream."""
        actor = event.get("Actor") or {}
        attrs = actor.get("Attributes") or {}
        app_id = attrs.get(LABEL_APP_ID)
        action = str(event.get("Action") or event.get("status") or "")
        if not app_id or action not in _STATE_ACTIONS:
            return
        cid = str(event.get("id") or actor.get("ID") or "")
        if action == "kill":  # a signal sent: a stop's SIGTERM is under way in the engine
            for waiter in self._kill_waiters.get(cid, ()):
                waiter.set()
        if action == "die":
            code = _int_or_none(attrs.get("exitCode"))
            self._remember_exit(app_id, cid, code)
            if may_restart(attrs, code):
                # Docker may restart it (REPLICA retries): wait for the engine to settle first.
                self._invalidate(app_id)
                if f"settle:{cid}" in self._settling:
                    # It exited again (a REPLICA retry's run) while the last exit settles: that
                    # inspect may have come back before this exit, so it must look once more.
                    self._settle_again.add(cid)
                else:
                    self._spawn(("settle", cid), self._settle(app_id, cid))
                return
        else:
            self._invalidate(app_id)
            if action in ("start", "restart", "destroy"):
                self._died.pop(cid, None)
        # A cancel, or a retry that could not be made: the app's live replicas are to be stopped.
        cancelled = action == "create" and attrs.get(LABEL_KIND) in (
            KIND_CANCEL_MARKER,
            KIND_RETRY_FAILED,
        )
        if cancelled:  # a replica that started before this event may still be alive
            self._note_failed(app_id)
        follow_up = (
            cancelled
            or action in _FOLLOW_UP_ACTIONS
            or (action in _STARTS and app_id in self._failed)
        )
        self._changed(app_id, follow_up=follow_up)

    def _changed(self, app_id: str, *, follow_up: bool) -> None:
        self._on_change(app_id)
        for waiter in self._waiters.get(app_id, ()):
            waiter.set()
        if follow_up:
            self._on_follow_up(app_id)

    async def _settle(self, app_id: str, cid: str) -> None:
        """Waits until the engine has handled a container's exit, then reports the change.

        Inspecting a container waits for the engine's lock on it, which it holds until the exit is
        fully recorded (and the container restarted, if its restart policy says so). An exit that
        comes while it inspects is settled by another inspect: without it, the listing that follows
        could show the container running after its last exit, and no event would come to say
        otherwise (a status stuck at RUNNING until the listing's snapshot grows old).
        """
        try:
            while True:
                self._settle_again.discard(cid)
                try:
                    await self._engine.inspect_container(cid)
                except DockerSchedulerError as e:
                    logger.debug("inspecting %s after its exit failed: %s", cid[:12], e)
                if cid not in self._settle_again:
                    break
        finally:
            self._settle_again.discard(cid)
        self._died.pop(cid, None)
        # A listing taken while it settled may show the container as it was before the exit: now
        # that the engine has recorded it, the next status lists again.
        self._invalidate(app_id)
        self._changed(app_id, follow_up=True)

    def _spawn(self, key: tuple[str, ...], coro: Any) -> None:
        name = ":".join(key)
        if name in self._settling or self._tasks.closed:
            coro.close()
            return
        self._settling.add(name)
        task = self._tasks.spawn(coro, name=name)
        task.add_done_callback(lambda _: self._settling.discard(name))

    async def wait_app(self, app_id: str, seconds: float) -> None:
        """Returns on the next event of ``app_id``, or after ``seconds``."""
        self.ensure_running()
        waiter = asyncio.Event()
        self._waiters.setdefault(app_id, set()).add(waiter)
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waiter.wait(), seconds)
        finally:
            waiters = self._waiters.get(app_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[app_id]

    @contextlib.contextmanager
    def kills(self, cids: Sequence[str]) -> Iterator[dict[str, asyncio.Event]]:
        """While inside: an event per container of ``cids`` (full ids), set when Docker reports a
        signal sent to it (its ``kill`` event, which a stop sends once its SIGTERM is delivered)
        from now on. Only the stream tells: while it is not connected (or is disabled) none is
        set, unless a reconnection resumes it past the signal."""
        seen = {cid: asyncio.Event() for cid in cids}
        for cid, waiter in seen.items():
            self._kill_waiters.setdefault(cid, set()).add(waiter)
        try:
            yield seen
        finally:
            for cid, waiter in seen.items():
                waiters = self._kill_waiters.get(cid)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._kill_waiters[cid]

    # -- listings ---------------------------------------------------------------------------------

    async def containers(
        self, app_id: str | None = None, *, for_apps: Sequence[str] = ()
    ) -> list[ContainerInfo]:
        """The backend's containers (of one app, or all of them) in one listing, exits seen applied.

        While the stream is connected, the listing is also kept as the snapshot of each app in
        ``for_apps`` and of each app it shows (see ``snapshot``).
        """
        epoch = self._epoch if self.live else None
        asked_at = time.monotonic()
        raw = await self._engine.list_containers(
            f"{LABEL_APP_ID}={app_id}" if app_id is not None else LABEL_APP_ID
        )
        infos = [ContainerInfo.from_summary(c) for c in raw]
        if epoch is not None and epoch == self._epoch:
            groups = group_by_app(infos)
            for app in {*for_apps, *groups}:
                if self._last_event.get(app, -1.0) >= asked_at:
                    continue  # news came while the engine answered: the listing may predate it
                self._snapshots.pop(app, None)  # re-insert: the dict's order is by freshness
                self._snapshots[app] = (groups.get(app, []), asked_at, epoch)
            while len(self._snapshots) > _REMEMBERED_APPS:
                del self._snapshots[next(iter(self._snapshots))]
        return self.with_exits_seen(infos)

    async def app_containers(self, app_id: str) -> list[ContainerInfo]:
        """One app's containers: from its snapshot when the events vouch for it, else listed."""
        snap = self.snapshot([app_id])
        return snap[app_id] if snap is not None else await self.containers(app_id)

    def snapshot(self, app_ids: Sequence[str]) -> dict[str, list[ContainerInfo]] | None:
        """The apps' containers without asking the engine, when events vouch for every one of them.

        A snapshot holds while the stream has stayed connected since it was taken, no event other
        than a plain exit (``die``, applied from the event itself) came for the app, and it is
        younger than 30 s.
        """
        if not self.live:
            return None
        now = time.monotonic()
        out: dict[str, list[ContainerInfo]] = {}
        for app_id in app_ids:
            snap = self._snapshots.get(app_id)
            if (
                snap is None
                or snap[2] != self._epoch
                or now - snap[1] > _SNAPSHOT_MAX_AGE
                or self._last_event.get(app_id, -1.0) >= snap[1]
            ):
                return None
            out[app_id] = self.with_exits_seen(list(snap[0]))
        return out

    def with_exits_seen(self, infos: list[ContainerInfo]) -> list[ContainerInfo]:
        """``infos`` with the exits announced by events that the listing does not show yet, and
        the never-started replicas of launchers that have exited marked so (no event says it)."""
        infos = with_launchers_judged(infos)
        if not self._died:
            return infos
        now = time.monotonic()
        for c in infos:
            seen = self._died.get(c.id)
            if seen is not None and (not c.alive or now - seen[1] > _DIED_MEMORY):
                del self._died[c.id]
        return with_exits(infos, {cid: code for cid, (code, _) in self._died.items()})

    def _remember_exit(self, app_id: str, cid: str, code: int | None) -> None:
        self._died.pop(cid, None)
        self._died[cid] = (code, time.monotonic())
        while len(self._died) > 4 * _REMEMBERED_APPS:
            del self._died[next(iter(self._died))]
        if code != 0:
            self._note_failed(app_id)

    def _note_failed(self, app_id: str) -> None:
        """Notes an app that failed or was cancelled: its replicas that start are to be stopped."""
        self._failed.pop(app_id, None)
        self._failed[app_id] = None
        while len(self._failed) > _REMEMBERED_APPS:
            self._failed.popitem(last=False)

    def _invalidate(self, app_id: str) -> None:
        """Notes news of the app that its snapshot may not show."""
        self._last_event.pop(app_id, None)
        self._last_event[app_id] = time.monotonic()
        while len(self._last_event) > 4 * _REMEMBERED_APPS:
            self._last_event.popitem(last=False)


def _resume_time(event: Mapping[str, Any]) -> str | None:
    time_nano = event.get("timeNano")
    return format_api_time(time_nano) if isinstance(time_nano, int) else None


def _int_or_none(value: object) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None
