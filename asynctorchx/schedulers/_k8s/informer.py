"""One list/watch of the backend's Services, Jobs and Pods in a namespace, kept as a local cache.

For each kind: list (by the backend's ``managed-by`` label), then watch from the list's
``resourceVersion``; every event updates the cache and reports the app it belongs to. A watch that
ends (server timeout, dropped connection) resumes from the last version seen (events and
``BOOKMARK`` s both advance it); a ``410 Gone`` (the version was compacted away) relists and diffs
the new list against the cache, so changes missed in between are still reported. Errors back off
exponentially (50 ms to 5 s) and never end the loop: only cancelling ``run`` does.

The scheduler runs one ``Informer.run`` per namespace (``Informers``) as a single task owned by its
supervisor, and turns the reported apps into ``Scheduler._notify`` calls and follow-ups: N waiters on N apps cost one watch per kind,
not N polls.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import anyio

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._k8s import names as n
from asynctorchx.schedulers._k8s.client import KINDS, KubeApi, KubeApiError

logger = logging.getLogger(__name__)

MANAGED_SELECTOR = f"{n.LABEL_MANAGED_BY}={n.MANAGED_BY}"

Obj = dict[str, Any]


def _meta(obj: Obj) -> dict[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, dict) else {}


def _app_of(obj: Obj) -> str | None:
    return (_meta(obj).get("labels") or {}).get(n.LABEL_APP_ID)


class Informer:
    """A watched cache of one namespace's Services, Jobs and Pods created by the backend.

    Args:
        api: the client.
        namespace: the namespace to watch.
        on_change: called (on the event loop, must not block) with an app's name whenever one of its
            objects was added, changed or deleted.
        watch_timeout: seconds after which the server ends each watch (it is then resumed).
    """

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        on_change: Callable[[str], None],
        *,
        watch_timeout: int = 300,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self._on_change = on_change
        self.watch_timeout = watch_timeout
        self._cache: dict[str, dict[str, Obj]] = {k: {} for k in KINDS}
        self._by_app: dict[str, dict[str, set[str]]] = {k: defaultdict(set) for k in KINDS}
        self._synced_kinds: set[str] = set()
        self._synced = asyncio.Event()
        self._app_events: dict[str, asyncio.Event] = {}
        self.lists = 0
        self.relists = 0
        self.watches = 0

    # -- reading the cache -----------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        """True once every kind has been listed (the cache is complete from then on)."""
        return self._synced.is_set()

    async def wait_synced(self) -> None:
        """Returns once the cache is complete."""
        await self._synced.wait()

    def app_objects(self, app: str) -> tuple[Obj | None, list[Obj], list[Obj]]:
        """``(service, jobs, pods)`` of an app from the cache."""
        svc = self._cache["services"].get(app)
        jobs = [self._cache["jobs"][name] for name in self._by_app["jobs"].get(app, ())]
        pods = [self._cache["pods"][name] for name in self._by_app["pods"].get(app, ())]
        return svc, jobs, pods

    def apps(self) -> list[str]:
        """The names of the apps (Services) in the cache."""
        return sorted(self._cache["services"])

    def change_event(self, app: str) -> asyncio.Event:
        """An event set at the next change of ``app`` (a fresh one after each change)."""
        ev = self._app_events.get(app)
        if ev is None:
            ev = self._app_events[app] = asyncio.Event()
        return ev

    # -- updating it -----------------------------------------------------------------------------

    def _changed(self, app: str | None) -> None:
        if not app:
            return
        ev = self._app_events.pop(app, None)
        if ev is not None:
            ev.set()
        try:
            self._on_change(app)
        except Exception:
            logger.exception("change callback failed for app %s", app)

    def _put(self, kind: str, obj: Obj) -> None:
        name = _meta(obj).get("name")
        if not name:
            return
        old = self._cache[kind].get(name)
        if old is not None:
            old_app = _app_of(old)
            if old_app:
                self._by_app[kind][old_app].discard(name)
        self._cache[kind][name] = obj
        app = _app_of(obj)
        if app:
            self._by_app[kind][app].add(name)
        if old is not None and _app_of(old) != app:
            self._changed(_app_of(old))
        self._changed(app)

    def _drop(self, kind: str, obj: Obj) -> None:
        name = _meta(obj).get("name")
        old = self._cache[kind].pop(name, None) if name else None
        app = _app_of(old or obj)
        if app and name:
            self._by_app[kind][app].discard(name)
            if not self._by_app[kind][app]:
                del self._by_app[kind][app]
        self._changed(app)

    def _replace(self, kind: str, items: list[Obj]) -> None:
        """Replaces the cache of ``kind`` with a fresh list, reporting what differs."""
        fresh: dict[str, Obj] = {str(_meta(o)["name"]): o for o in items if _meta(o).get("name")}
        for name, cached in list(self._cache[kind].items()):
            if name not in fresh:
                self._drop(kind, cached)
        for name, obj in fresh.items():
            previous = self._cache[kind].get(name)
            if previous is None or _meta(previous).get("resourceVersion") != _meta(obj).get(
                "resourceVersion"
            ):
                self._put(kind, obj)

    # -- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Lists and watches every kind until cancelled."""
        async with anyio.create_task_group() as tg:
            for kind in KINDS:
                tg.start_soon(self._run_kind, kind)

    async def _run_kind(self, kind: str) -> None:
        backoff = 0.05
        rv: str | None = None
        loop = asyncio.get_running_loop()
        while True:
            try:
                if rv is None:
                    rv = await self._list_kind(kind)
                opened = loop.time()
                rv, events = await self._watch_kind(kind, rv)
                if rv is not None and events == 0 and loop.time() - opened < 1.0:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                else:
                    backoff = 0.05
            except KubeApiError as e:
                if e.status == 410:
                    rv = None
                    self.relists += 1
                    continue
                logger.warning(
                    "watching %s in namespace %s failed (retrying in %.2fs): %s",
                    kind,
                    self.namespace,
                    backoff,
                    e,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _list_kind(self, kind: str) -> str:
        """Lists ``kind`` into the cache; returns the list's resourceVersion."""
        listing = await self.api.list(kind, self.namespace, MANAGED_SELECTOR)
        self.lists += 1
        self._replace(kind, list(listing.get("items") or []))
        self._synced_kinds.add(kind)
        if len(self._synced_kinds) == len(KINDS):
            self._synced.set()
        return str(_meta(listing).get("resourceVersion") or "0")

    async def _watch_kind(self, kind: str, rv: str) -> tuple[str | None, int]:
        """Watches ``kind`` from ``rv`` until the stream ends; returns the last version seen (None
        when it expired: relist) and how many events came."""
        self.watches += 1
        events = 0
        stream = self.api.watch(kind, self.namespace, MANAGED_SELECTOR, rv, self.watch_timeout)
        async with aclosing(stream):
            async for ev in stream:
                etype = ev.get("type")
                obj = ev.get("object") or {}
                if etype == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        logger.debug(
                            "%s watch in %s expired at %s: relisting", kind, self.namespace, rv
                        )
                        self.relists += 1
                        return None, events
                    raise KubeApiError(
                        int(code or 0),
                        str(obj.get("reason", "")),
                        str(obj.get("message", "")),
                        f"watching {kind} in namespace {self.namespace}",
                    )
                new_rv = _meta(obj).get("resourceVersion")
                if new_rv:
                    rv = str(new_rv)
                if etype == "BOOKMARK":
                    continue
                events += 1
                if etype in ("ADDED", "MODIFIED"):
                    self._put(kind, obj)
                elif etype == "DELETED":
                    self._drop(kind, obj)
        return rv, events


class Informers:
    """One ``Informer`` per namespace, each run as a task of the scheduler's supervisor.

    Args:
        tasks: the scheduler's supervisor.
        on_change: called with ``(namespace, app name)`` at every change of an app's objects.
        watch_timeout: seconds after which the server ends each watch (it is then resumed).
    """

    def __init__(
        self,
        tasks: TaskSupervisor,
        on_change: Callable[[str, str], None],
        *,
        watch_timeout: int = 300,
    ) -> None:
        self._tasks = tasks
        self._on_change = on_change
        self._watch_timeout = watch_timeout
        self._informers: dict[str, Informer] = {}
        self._runs: dict[str, asyncio.Task[None]] = {}

    def start(self, api: KubeApi, namespace: str) -> Informer:
        """The namespace's informer, started if it does not run."""
        inf = self._informers.get(namespace)
        if inf is None:
            inf = Informer(
                api,
                namespace,
                functools.partial(self._on_change, namespace),
                watch_timeout=self._watch_timeout,
            )
            self._informers[namespace] = inf
        run = self._runs.get(namespace)
        if run is None or run.done():
            self._runs[namespace] = self._tasks.spawn(inf.run(), name=f"watch:{namespace}")
        return inf

    def synced(self, namespace: str) -> Informer | None:
        """The namespace's informer once its cache is complete, else None."""
        inf = self._informers.get(namespace)
        return inf if inf is not None and inf.synced else None

    def clear(self) -> None:
        """Forgets the informers (their tasks were stopped with the supervisor)."""
        self._informers.clear()
        self._runs.clear()

    def stats(self) -> dict[str, int]:
        """Counts of lists, relists and watches opened, over every namespace."""
        out = {"lists": 0, "relists": 0, "watches": 0}
        for inf in self._informers.values():
            out["lists"] += inf.lists
            out["relists"] += inf.relists
            out["watches"] += inf.watches
        return out
