"""Doing the follow-ups ``state.follow_ups`` lists, through the engine wrapper.

``FollowUps.run`` is the ``local_docker`` backend's ``Reconciler`` work: it reads the app's
containers (listed afresh, unless the event feed vouches for its last listing), assesses them and
does what is still owed: stop containers, recreate the replicas of a retry, remove a finished app's
network or (``remove_finished``) its containers. Each action is
idempotent; a retry, a removal and a network removal are remembered once done, so that events that
keep coming for an app (its containers being removed) do not repeat them.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from asynctorchx.logs._timestamps import parse_rfc3339_ns
from asynctorchx.schedulers._docker.engine import DockerEngine, DockerSchedulerError
from asynctorchx.schedulers._docker.request import LABEL_APP_ID
from asynctorchx.schedulers._docker.state import (
    Assessment,
    ContainerInfo,
    RemoveApp,
    RemoveNetwork,
    RetryReplicas,
    StopContainer,
    assess,
    recreate_config,
)
from asynctorchx.schedulers.api import DescribeAppResponse

logger = logging.getLogger(__name__)

_REMEMBERED_APPS = 1000


class FollowUps:
    """The follow-ups of ``local_docker`` apps, and the final state of the apps it removed.

    Args:
        engine: the engine to act through.
        list_app: lists one app's containers (the event feed's listing).
    """

    def __init__(
        self, engine: DockerEngine, list_app: Callable[[str], Awaitable[list[ContainerInfo]]]
    ) -> None:
        self._engine = engine
        self._list_app = list_app
        self._done: OrderedDict[tuple[str, ...], None] = OrderedDict()
        self._removed: OrderedDict[str, DescribeAppResponse] = OrderedDict()

    def removed(self, app_id: str) -> DescribeAppResponse | None:
        """The final description of an app whose containers this process removed, if any."""
        response = self._removed.get(app_id)
        return copy.deepcopy(response) if response is not None else None

    async def run(self, app_id: str) -> None:
        """Does what app ``app_id`` is owed now (the ``Reconciler``'s work for it).

        Of a cancelled app, only the containers started after the cancel are stopped here (see
        ``_started_since``).
        """
        a = assess(app_id, await self._list_app(app_id))
        if a is None:
            return
        stops = [x.container_id for x in a.actions if isinstance(x, StopContainer)]
        marker = next((c for c in a.containers if c.is_marker), None)
        if marker is not None and stops:
            stops = await self._started_since(marker.id, stops)
        errors = [
            r
            for r in await asyncio.gather(
                *(self._engine.stop_container(cid) for cid in stops), return_exceptions=True
            )
            if isinstance(r, Exception)
        ]
        for action in a.actions:
            if isinstance(action, RetryReplicas):
                await self._once(("retry", app_id, str(action.attempt)), self._retry(a, action))
            elif isinstance(action, RemoveApp):
                self._remember_removed(a.response)
                await self._once(("remove", app_id), self._remove_app(app_id, action))
            elif isinstance(action, RemoveNetwork):
                await self._once(("network", app_id), self._remove_network(app_id, action))
        if errors:
            raise errors[0]

    async def _started_since(self, marker_id: str, cids: list[str]) -> list[str]:
        """Those of ``cids`` (live containers of a cancelled app) that started after its cancel
        marker was made (or whose times cannot be read).

        The others are the canceller's to stop: it lists the app's containers after making the
        marker and stops those alive, and a second stop would signal them again (their SIGTERM
        handler would run twice). Both times are the engine's own.
        """
        infos = await asyncio.gather(
            *(self._engine.inspect_container(c) for c in [marker_id, *cids]),
            return_exceptions=True,
        )
        marked = _engine_time(infos[0], "Created")
        if marked is None:
            return cids
        out = []
        for cid, info in zip(cids, infos[1:], strict=True):
            started = _engine_time(info, "State", "StartedAt")
            if started is None or started > marked:
                out.append(cid)
        return out

    async def _once(self, key: tuple[str, ...], work: Awaitable[None]) -> None:
        """Does ``work`` unless the action ``key`` was done before; remembers it once done."""
        if key in self._done:
            if asyncio.iscoroutine(work):
                work.close()
            return
        await work
        self._done[key] = None
        while len(self._done) > 4 * _REMEMBERED_APPS:
            self._done.popitem(last=False)

    async def _retry(self, a: Assessment, retry: RetryReplicas) -> None:
        """Recreates the replicas of a ROLE/APPLICATION retry as attempt ``retry.attempt``.

        A container of that attempt that exists already (made by another process, or an earlier
        round) is left as it is.
        """
        await asyncio.gather(
            *(self._kill_quietly(c.id) for c in retry.olds if c.alive), return_exceptions=True
        )
        configs = []
        for old in retry.olds:
            info = await self._engine.inspect_container(old.id)
            if info is None:
                raise DockerSchedulerError(f"container {old.name} of the retried replica is gone")
            configs.append((old, recreate_config(info, retry.attempt)))
        started = 0
        for old, config in configs:
            what = f"retrying role {old.role!r} replica {old.replica_id}"
            name = f"{old.hostname}-r{retry.attempt}"
            cid = await self._engine.create_container(config, name, what=what, exist_ok=True)
            if cid is not None:
                await self._engine.start_container(cid, what=what)
                started += 1
        logger.info(
            "app %s: retry attempt %d started %d replica(s)",
            a.response.app_id,
            retry.attempt,
            started,
        )

    async def _kill_quietly(self, cid: str) -> None:
        with contextlib.suppress(DockerSchedulerError):
            await self._engine.stop_container(cid, timeout=0)

    async def _remove_app(self, app_id: str, action: RemoveApp) -> None:
        await asyncio.gather(*(self._engine.remove_container(c) for c in action.container_ids))
        if action.network:
            await remove_networks(self._engine, app_id)
        logger.info("removed the containers of finished app %s", app_id)

    async def _remove_network(self, app_id: str, action: RemoveNetwork) -> None:
        """Removes the app's own network once the engine has let go of its containers."""
        await asyncio.gather(
            *(self._engine.inspect_container(c) for c in action.container_ids),
            return_exceptions=True,
        )
        await remove_networks(self._engine, app_id)

    def _remember_removed(self, response: DescribeAppResponse) -> None:
        self._removed[response.app_id] = response
        self._removed.move_to_end(response.app_id)
        while len(self._removed) > _REMEMBERED_APPS:
            self._removed.popitem(last=False)


def _engine_time(info: object, *path: str) -> int | None:
    """A time of an ``inspect`` answer (``path`` of keys), in nanoseconds; None if unreadable."""
    value: object = info
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    try:
        return parse_rfc3339_ns(str(value)) if value else None
    except ValueError:
        return None


async def remove_networks(engine: DockerEngine, app_id: str) -> None:
    """Removes the networks made for ``app_id`` (normally one; duplicates of a race too)."""
    for n in await engine.list_networks(label=f"{LABEL_APP_ID}={app_id}"):
        await engine.remove_network(str(n["Id"]))
