"""Doing the follow-ups ``state.follow_ups`` lists, through the engine wrapper.

``FollowUps.run`` is the ``local_docker`` backend's ``Reconciler`` work: it reads the app's
containers (listed afresh, unless the event feed vouches for its last listing), assesses them and
does what is still owed: stop containers, recreate the replicas of a retry, remove a finished app's
network or (``remove_finished``) its containers. Each action is
idempotent; a retry, a removal and a network removal are remembered once done, so that events that
keep coming for an app (its containers being removed) do not repeat them.

A retry the engine refuses (not an outage: the app's network was removed behind our back, its
image is gone...) cannot be made by anyone: it is recorded on the engine
(``request.retry_failed_record``), which fails the app for every process, and the app's other
replicas are stopped. A retry cut off by an outage is left owed, and made once the engine answers:
the follow-up fails (the scheduler asks for it again once the engine answers), and this process
remembers the retry, since the app's containers may no longer ask for it (a replica whose new
attempt was created but not started reads PENDING). The next follow-up makes it again: the
containers of the attempt already there are left as they are, but started if they are still
``created`` by this process (their launcher label), which nobody else would start.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from asynctorchx.logs._timestamps import parse_rfc3339_ns
from asynctorchx.schedulers._docker.engine import (
    DockerEngine,
    DockerEngineUnavailableError,
    DockerSchedulerError,
)
from asynctorchx.schedulers._docker.processes import process_identity
from asynctorchx.schedulers._docker.request import (
    LABEL_APP_ID,
    LABEL_ATTEMPT,
    LABEL_LAUNCHER,
    marker_name,
    retry_failed_record,
)
from asynctorchx.schedulers._docker.state import (
    Action,
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
from asynctorchx.specs.api import AppState, is_terminal

logger = logging.getLogger(__name__)

_REMEMBERED_APPS = 1000


class RetryRefusedError(DockerSchedulerError):
    """Raised when the engine refuses a ROLE/APPLICATION retry (not an outage): it cannot be made."""


class FollowUps:
    """The follow-ups of ``local_docker`` apps, and the final state of the apps it removed.

    Args:
        engine: the engine to act through.
        list_app: lists one app's containers (the event feed's listing).
        inspect: adds to an assessment what only an inspect says (the scheduler's status read
            does: OOM kills, Docker's restart counts), for the final description of an app whose
            containers are removed; by default the assessment is kept as listed.
    """

    def __init__(
        self,
        engine: DockerEngine,
        list_app: Callable[[str], Awaitable[list[ContainerInfo]]],
        inspect: Callable[[Assessment], Awaitable[Assessment]] | None = None,
    ) -> None:
        self._engine = engine
        self._list_app = list_app
        self._inspect = inspect
        self._done: OrderedDict[tuple[str, ...], None] = OrderedDict()
        self._removed: OrderedDict[str, DescribeAppResponse] = OrderedDict()
        self._cut_off: OrderedDict[str, RetryReplicas] = OrderedDict()  # retries owed, by app
        self._survivors: OrderedDict[str, None] = OrderedDict()  # stopped: another failed first

    def stops_owed(self, a: Assessment) -> list[str]:
        """The live containers of app ``a`` its follow-up stops: none for a cancelled app (the
        canceller's and the launches', see ``started_after``); for a failed app its survivors,
        remembered as this process's (``stopped_survivor``)."""
        if any(c.is_marker for c in a.containers):
            return []
        stops = [x.container_id for x in a.actions if isinstance(x, StopContainer)]
        if a.response.state == AppState.FAILED:
            for cid in stops:  # the survivors of the failure (or attempts a retry superseded)
                self._survivors[cid] = None
                self._survivors.move_to_end(cid)
            while len(self._survivors) > 4 * _REMEMBERED_APPS:
                self._survivors.popitem(last=False)
        return stops

    def stopped_survivor(self, cid: str) -> bool:
        """True for a container this process stopped because another replica had failed its app
        (its exit, a 137 or whatever its SIGTERM handler gives, is not a failure of its own)."""
        return cid in self._survivors

    def removed(self, app_id: str) -> DescribeAppResponse | None:
        """The final description of an app whose containers this process removed, if any."""
        response = self._removed.get(app_id)
        return copy.deepcopy(response) if response is not None else None

    async def run(self, app_id: str) -> Assessment | None:
        """Does what app ``app_id`` is owed now (the ``Reconciler``'s work for it); returns the
        assessment it acted on (None: the app has no container).

        The live containers of a cancelled app are not stopped here: each has one stopper (see
        ``started_after``), and a stop from every process that follows the app's events would
        signal it again and again.
        """
        a = assess(app_id, await self._list_app(app_id))
        if a is None:
            return None
        stops = self.stops_owed(a)
        errors = [
            r
            for r in await asyncio.gather(
                *(self._engine.stop_container(cid) for cid in stops), return_exceptions=True
            )
            if isinstance(r, Exception)
        ]
        owed = self._cut_off.get(app_id)
        if owed is not None and any(c.is_marker for c in a.containers):
            await self._remove_unstarted_own(a, owed)
        for action in self._with_retry_owed(a):
            if isinstance(action, RetryReplicas):
                try:
                    await self._once(("retry", app_id, str(action.attempt)), self._retry(a, action))
                except RetryRefusedError as e:
                    self._cut_off.pop(app_id, None)
                    await self._fail_retry(a, action, e)
                    break  # the app has failed: nothing else it was owed holds
                except DockerEngineUnavailableError:
                    self._remember_cut_off(app_id, action)
                    raise
                self._cut_off.pop(app_id, None)
            elif isinstance(action, RemoveApp):
                final = await self._inspect(a) if self._inspect is not None else a
                self._remember_removed(final.response)
                await self._once(("remove", app_id), self._remove_app(app_id, action))
            elif isinstance(action, RemoveNetwork):
                await self._once(("network", app_id), self._remove_network(app_id, action))
        if errors:
            raise errors[0]
        return a

    def _with_retry_owed(self, a: Assessment) -> list[Action]:
        """``a``'s actions, with the retry an outage cut off here (``_cut_off``) made again while
        the app still runs and nothing supersedes it: merged into the retry of the same attempt
        the containers ask for (the replicas it had not got to), else added. Its replicas are
        those of the listing now (a kill of theirs may have been cut off too)."""
        actions = list(a.actions)
        app_id = a.response.app_id
        owed = self._cut_off.get(app_id)
        if owed is None:
            return actions
        asked = next((x for x in actions if isinstance(x, RetryReplicas)), None)
        if (
            is_terminal(a.response.state)
            or any(c.is_record for c in a.containers)  # cancelled, or a retry failed
            or (asked is not None and asked.attempt > owed.attempt)
        ):
            del self._cut_off[app_id]
            return actions
        listed = {c.id: c for c in a.containers}
        olds = [listed.get(c.id, c) for c in owed.olds]
        if asked is None:
            retry = RetryReplicas(owed.attempt, tuple(olds))
            stops = [i for i, x in enumerate(actions) if isinstance(x, StopContainer)]
            actions.insert(stops[-1] + 1 if stops else 0, retry)
            return actions
        if asked.attempt == owed.attempt:
            keys = {(c.role, c.replica_id) for c in asked.olds}
            more = tuple(c for c in olds if (c.role, c.replica_id) not in keys)
            actions[actions.index(asked)] = RetryReplicas(asked.attempt, asked.olds + more)
        return actions

    async def _remove_unstarted_own(self, a: Assessment, owed: RetryReplicas) -> None:
        """Removes the containers of the retry ``owed`` that an outage cut off here before their
        start, now that the app is cancelled (the retry is dropped, ``_with_retry_owed``): a
        replica created and not started by a live process keeps a cancelled app "cancelling"
        (``state._verdict``), and nothing would start or remove them any more."""
        me = process_identity()
        unstarted = [
            c.id
            for c in a.containers
            if c.state == "created"
            and not c.is_record
            and c.attempt == owed.attempt
            and c.labels.get(LABEL_LAUNCHER) == me
        ]
        await asyncio.gather(
            *(self._engine.remove_container(c) for c in unstarted), return_exceptions=True
        )

    def _remember_cut_off(self, app_id: str, retry: RetryReplicas) -> None:
        self._cut_off[app_id] = retry
        self._cut_off.move_to_end(app_id)
        while len(self._cut_off) > _REMEMBERED_APPS:
            self._cut_off.popitem(last=False)

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
        round) is left as it is, unless this process made it and has not started it (an outage
        cut its start off): then it is started now.

        Raises:
            RetryRefusedError: the engine refused it (the containers it made but could not start
                are removed first); an outage raises DockerEngineUnavailableError instead.
        """
        await asyncio.gather(
            *(self._kill_quietly(c.id) for c in retry.olds if c.alive), return_exceptions=True
        )
        configs = []
        for old in retry.olds:
            info = await self._engine.inspect_container(old.id)
            if info is None:
                raise RetryRefusedError(f"container {old.name} of the retried replica is gone")
            config = recreate_config(info, retry.attempt)
            config["Labels"][LABEL_LAUNCHER] = process_identity()  # it starts them, not the first
            configs.append((old, config))
        started: list[str] = []
        unstarted: list[str] = []
        try:
            for old, config in configs:
                what = f"retrying role {old.role!r} replica {old.replica_id}"
                name = f"{old.hostname}-r{retry.attempt}"
                cid = await self._engine.create_container(config, name, what=what, exist_ok=True)
                if cid is None:  # there already: started here, unless it is ours and unstarted
                    cid = await self._unstarted_own(name, a.response.app_id, retry.attempt)
                if cid is not None:
                    unstarted.append(cid)
                    await self._engine.start_container(cid, what=what)
                    unstarted.remove(cid)
                    started.append(cid)
        except DockerEngineUnavailableError:
            raise
        except DockerSchedulerError as e:
            # Never to be started: a created replica of a live launcher would read PENDING.
            await asyncio.gather(
                *(self._engine.remove_container(c) for c in unstarted), return_exceptions=True
            )
            raise RetryRefusedError(str(e)) from None
        logger.info(
            "app %s: retry attempt %d started %d replica(s)",
            a.response.app_id,
            retry.attempt,
            len(started),
        )
        # Like a launch: a cancel made meanwhile leaves the containers started since to us.
        marker = marker_name(a.response.app_id)
        if started and await self._engine.inspect_container(marker) is not None:
            late = await started_since(self._engine, marker, started)
            await asyncio.gather(*(self._engine.stop_container(c) for c in late))

    async def _unstarted_own(self, name: str, app_id: str, attempt: int) -> str | None:
        """The id of container ``name`` when it is attempt ``attempt`` of app ``app_id`` that
        this process created and has not started (its start was cut off); else None."""
        info = await self._engine.inspect_container(name)
        if info is None:
            return None
        labels = (info.get("Config") or {}).get("Labels") or {}
        if (
            (info.get("State") or {}).get("Status") != "created"
            or labels.get(LABEL_APP_ID) != app_id
            or labels.get(LABEL_ATTEMPT) != str(attempt)
            or labels.get(LABEL_LAUNCHER) != process_identity()
        ):
            return None
        return str(info.get("Id") or "") or None

    async def _fail_retry(self, a: Assessment, retry: RetryReplicas, err: Exception) -> None:
        """Records a retry the engine refused (the app reads FAILED, saying why, from then on in
        every process) and stops the app's replicas still alive; a cancel made meanwhile leaves
        the stops to its canceller.

        Raises:
            DockerSchedulerError: the record or a stop failed (the follow-up is asked again).
        """
        app_id = a.response.app_id
        roles = ", ".join(dict.fromkeys(repr(old.role) for old in retry.olds)) or "?"
        reason = f"retry attempt {retry.attempt} (role {roles}) could not be made: {err}"
        image = await self._image_of(a, retry)
        record = retry_failed_record(app_id, a.name, a.session, image, reason=reason)
        what = f"recording the failed retry of {app_id}"
        if await self._engine.create_container(
            record.config, record.name, what=what, exist_ok=True
        ):
            logger.warning("app %s failed: %s", app_id, reason)
        if await self._engine.inspect_container(marker_name(app_id)) is not None:
            return  # cancelled: its canceller stops them
        alive = [c.id for c in a.containers if c.alive and not c.is_record]
        await asyncio.gather(*(self._engine.stop_container(c) for c in alive))

    async def _image_of(self, a: Assessment, retry: RetryReplicas) -> str:
        """An image to make app ``a``'s failed-retry record from: the id of the image a replica
        was made from (there as long as the replica is, even if its tag was removed, which may
        be why the retry was refused), else the image it names."""
        for c in [*retry.olds, *(c for c in a.containers if not c.is_record)]:
            info = await self._engine.inspect_container(c.id)
            if info is not None and info.get("Image"):
                return str(info["Image"])
        return a.containers[0].image

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


async def started_after(engine: DockerEngine, marker: str, cids: list[str]) -> list[bool | None]:
    """For each of ``cids`` (live containers of a cancelled app): whether it started after the
    app's cancel marker (id or name) was made; None when a time cannot be read.

    This splits the stops between the canceller and the launch: the canceller lists the app after
    making the marker and stops the containers started before it (they were running when it
    listed), the launch (or a retry) looks for the marker after its starts and stops those started
    after it. Each container is signalled once: a second stop would run its SIGTERM handler again.
    Both times are the engine's own.

    A container Docker's restart policy has restarted (REPLICA retries) counts as started
    before: its ``StartedAt`` is its last restart's, and no launch stops a restart the engine
    made on its own (judged by that time, a replica restarted after the marker was nobody's to
    stop, and went on restarting). Its first start may have come after the marker, in a launch
    that then stops it too: a second SIGTERM beats a replica that never stops.
    """
    infos = await asyncio.gather(
        *(engine.inspect_container(c) for c in [marker, *cids]), return_exceptions=True
    )
    marked = _engine_time(infos[0], "Created")
    out: list[bool | None] = []
    for info in infos[1:]:
        restarts = info.get("RestartCount") if isinstance(info, dict) else None
        if isinstance(restarts, int) and restarts > 0:
            out.append(False)
            continue
        started = _engine_time(info, "State", "StartedAt")
        out.append(None if marked is None or started is None else started > marked)
    return out


async def started_since(engine: DockerEngine, marker: str, cids: list[str]) -> list[str]:
    """Those of ``cids`` that started after the marker, or may have (see ``started_after``)."""
    return [
        c
        for c, a in zip(cids, await started_after(engine, marker, cids), strict=True)
        if a is not False
    ]


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
