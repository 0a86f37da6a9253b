"""What the ``kubernetes`` backend reads of its apps: their Service, Jobs and Pods.

From the namespace's watched cache once it is synced (no round trip), else with one list per kind
for up to 100 apps at a time. One exception: the Jobs and the pods come from two watches whose
events may arrive in either order, so when an app's Jobs have just finished, its cached pods can
lag them (a replacement pod that succeeded not seen yet, so no restart counted). Its pods are then
listed afresh once (``confirm``): pods listed after the Job was seen finished include every pod
that finished before it. Reads only: nothing here changes the cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from asynctorchx.schedulers._k8s import names as n
from asynctorchx.schedulers._k8s.client import KINDS, KubeConnection
from asynctorchx.schedulers._k8s.informer import MANAGED_SELECTOR, Informer, Informers
from asynctorchx.schedulers._k8s.status import job_finished, labels_of, meta, pod_index

Obj = dict[str, Any]
#: an app's ``(service or None, jobs, pods)``
AppObjects = tuple[Obj | None, list[Obj], list[Obj]]
_FinishedKey = tuple[tuple[str, str], ...]

_LIST_CHUNK = 100
_CONFIRMED_APPS = 10_000


def finished_jobs_key(jobs: Sequence[Mapping[str, Any]]) -> _FinishedKey:
    """Which of the app's Jobs have finished, by uid and resourceVersion (empty: none has)."""
    return tuple(
        sorted(
            (str(meta(j).get("uid", "")), str(meta(j).get("resourceVersion", "")))
            for j in jobs
            if job_finished(j)
        )
    )


class AppReader:
    """Reads apps' objects, from the watched caches of ``informers`` when they are synced.

    Args:
        connection: the API client.
        informers: the scheduler's watches.
    """

    def __init__(self, connection: KubeConnection, informers: Informers) -> None:
        self._connection = connection
        self._informers = informers
        self._confirmed: dict[tuple[str, str], _FinishedKey] = {}

    async def apps(self, namespace: str, names: Sequence[str]) -> dict[str, AppObjects]:
        """The objects of each named app of ``namespace`` (an unknown app has no Service)."""
        inf = self._informers.synced(namespace)
        out: dict[str, AppObjects] = {}
        missing: list[str] = []
        confirm: dict[str, _FinishedKey] = {}
        for name in names:
            objs = inf.app_objects(name) if inf is not None else None
            if objs is None or objs[0] is None:
                missing.append(name)
                continue
            key = finished_jobs_key(objs[1])
            if key and self._confirmed.get((namespace, name)) != key:
                confirm[name] = key
            else:
                out[name] = objs
        if confirm and inf is not None:
            out.update(await self._confirm(namespace, inf, confirm))
        for i in range(0, len(missing), _LIST_CHUNK):
            out.update(await self._fetch(namespace, missing[i : i + _LIST_CHUNK]))
        return out

    async def all_apps(self, namespace: str) -> dict[str, AppObjects]:
        """Every app of the backend in ``namespace`` (keyed by the Service's name)."""
        inf = self._informers.synced(namespace)
        if inf is not None:
            return {name: inf.app_objects(name) for name in inf.apps()}
        return await self._fetch(namespace, None)

    async def replica_pods(self, namespace: str, app: str, role_dns: str, k: int) -> list[Obj]:
        """The pods (old and new) of replica ``k`` of a role."""
        inf = self._informers.synced(namespace)
        if inf is not None:
            pods = inf.app_objects(app)[2]
        else:
            api = await self._connection.api()
            selector = f"{MANAGED_SELECTOR},{n.LABEL_APP_ID}={app},{n.LABEL_ROLE}={role_dns}"
            pods = (await api.list("pods", namespace, selector)).get("items") or []
        return [p for p in pods if labels_of(p).get(n.LABEL_ROLE) == role_dns and pod_index(p) == k]

    async def _confirm(
        self, namespace: str, inf: Informer, confirm: Mapping[str, _FinishedKey]
    ) -> dict[str, AppObjects]:
        """The apps' objects from the cache, with their pods listed afresh.

        If an app's Jobs changed meanwhile (a restart began), the cache answers and the
        confirmation waits for next time.
        """
        out: dict[str, AppObjects] = {}
        names = list(confirm)
        for i in range(0, len(names), _LIST_CHUNK):
            part = names[i : i + _LIST_CHUNK]
            fresh = await self._list(namespace, ("pods",), part)
            for name in part:
                svc, jobs, pods = inf.app_objects(name)
                if svc is not None and finished_jobs_key(jobs) == confirm[name]:
                    pods = fresh.get(name, (None, [], []))[2]
                    self._confirmed[(namespace, name)] = confirm[name]
                    while len(self._confirmed) > _CONFIRMED_APPS:
                        del self._confirmed[next(iter(self._confirmed))]
                out[name] = (svc, jobs, pods)
        return out

    async def _fetch(self, namespace: str, names: list[str] | None) -> dict[str, AppObjects]:
        """The named apps' objects (every app's, for None) with one list per kind."""
        found = await self._list(namespace, KINDS, names)
        if names is None:
            return {name: objs for name, objs in found.items() if objs[0] is not None}
        return {name: found.get(name, (None, [], [])) for name in names}

    async def _list(
        self, namespace: str, kinds: Sequence[str], names: list[str] | None
    ) -> dict[str, AppObjects]:
        api = await self._connection.api()
        selector = MANAGED_SELECTOR
        if names is not None and len(names) == 1:
            selector += f",{n.LABEL_APP_ID}={names[0]}"
        elif names is not None:
            selector += f",{n.LABEL_APP_ID} in ({','.join(names)})"
        listings = await asyncio.gather(*(api.list(kind, namespace, selector) for kind in kinds))
        out: dict[str, AppObjects] = {}
        for kind, listing in zip(kinds, listings, strict=True):
            for obj in listing.get("items") or []:
                app = labels_of(obj).get(n.LABEL_APP_ID)
                if not app or (names is not None and app not in names):
                    continue
                svc, jobs, pods = out.get(app, (None, [], []))
                if kind == "services":
                    out[app] = (obj, jobs, pods)
                else:
                    (jobs if kind == "jobs" else pods).append(obj)
                    out[app] = (svc, jobs, pods)
        return out
