"""The ``local_docker`` backend: every replica a Docker container, driven through aiodocker.

How an app maps onto Docker:

- Each replica is a container named (and hostnamed) ``{app_id}-{role}-{replica}``. An app with more
  than one container gets a network of its own, ``asynctorchx-{app_id}``, on which every replica
  reaches the others by hostname; ``TORCHX_RANK0_HOST`` holds the hostname of rank 0. A
  single-container app runs on Docker's default bridge (the ``network`` run option picks an
  existing network instead).
- Labels on the containers carry the app's id, session, shape and retry settings, so that any
  process (not only the launcher) can describe, list, cancel and read the logs of any app: apps
  outlive the process that launched them. An app id Docker has no container for is unknown
  (``describe`` returns None); it is never reported as SUCCEEDED.
- Status is one container listing by label for any number of apps; changes are pushed by one
  subscription to Docker's ``/events`` stream (filtered to our label), which calls ``_notify``.
  Docker announces an exit (``die``, with the exit code) ~0.1 s before its listing shows it, so
  the exit is taken from the event; while the stream stays connected, an app whose only news is
  an exit is described from its last listing, without a round trip.
- Retries: a REPLICA retry policy is Docker's own ``on-failure`` restart policy; ROLE and
  APPLICATION retries are done by the backend, which recreates the role's (or app's) containers as
  a new attempt, under the same hostnames. A replica failing with no retry left fails the app, and
  the backend stops the app's other replicas.
- Cancel stops every container (SIGTERM, then SIGKILL after the app's ``stop_timeout``) and leaves
  a never-started marker container, so that every process sees the app as CANCELLED.
- Logs come from the Docker API (``since``/``until`` applied by the engine), stdout and stderr
  kept apart, long lines joined back, a dropped follow stream resumed from its last timestamp.

Requires the ``docker`` extra: ``pip install 'asynctorchx[docker]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping, Sequence
from datetime import datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._docker.engine import (
    DockerEngine,
    DockerEngineUnavailableError,
    DockerSchedulerError,
)
from asynctorchx.schedulers._docker.engine import engine_error as _engine_error
from asynctorchx.schedulers._docker.engine import is_docker_error as _is_docker_error
from asynctorchx.schedulers._docker.engine import message_of as _message_of
from asynctorchx.schedulers._docker.engine import status_of as _status_of
from asynctorchx.schedulers._docker.image import ensure_image, plan_image
from asynctorchx.schedulers._docker.logs import (
    FrameDecoder,
    LineAssembler,
    LogLine,
    format_api_time,
)
from asynctorchx.schedulers._docker.request import (
    DEFAULT_STOP_TIMEOUT,
    KIND_CANCEL_MARKER,
    LABEL_APP_ID,
    LABEL_APP_NAME,
    LABEL_ATTEMPT,
    LABEL_KIND,
    LABEL_MAX_RETRIES,
    LABEL_RETRY_POLICY,
    LABEL_SESSION,
    LABEL_VERSION,
    ContainerRequest,
    DockerJob,
    NetworkRequest,
    build_job,
)
from asynctorchx.schedulers._docker.state import (
    Assessment,
    ContainerInfo,
    Retry,
    assess,
    group_by_app,
)
from asynctorchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    Stream,
    check_replica,
    check_time_window,
    compile_log_regex,
    role_replica_counts,
)
from asynctorchx.schedulers.workspace import SingleFlight, WorkspacePlan, current_progress
from asynctorchx.specs.api import (
    AppDef,
    AppDryRunInfo,
    CfgVal,
    RetryPolicy,
    UnknownAppException,
    is_terminal,
    make_app_handle,
    make_unique,
    runopts,
)
from asynctorchx.specs.workspace import Workspace
from asynctorchx.version import __version__

if TYPE_CHECKING:
    import aiodocker

__all__ = [
    "DockerEngineUnavailableError",
    "DockerJob",
    "DockerScheduler",
    "DockerSchedulerError",
    "create_scheduler",
]

logger = logging.getLogger(__name__)

_STATE_ACTIONS = frozenset(
    {"create", "start", "restart", "die", "stop", "kill", "destroy", "pause", "unpause", "oom"}
)
_FOLLOW_UP_ACTIONS = frozenset({"die", "destroy", "oom"})
_REMEMBERED_APPS = 1000
_EVENTS_CONNECT_WAIT = 2.0
_CLOSE_GRACE = 30.0
_ENGINE_RETRIES = 5
_DIED_MEMORY = 60.0
_SNAPSHOT_MAX_AGE = 30.0


class DockerScheduler(Scheduler[DockerJob]):
    """Runs apps as Docker containers on one Docker engine.

    Args:
        session_name: the session (runner name) the apps are launched for.
        client: an ``aiodocker.Docker`` (or a fake with the same interface) to use; the scheduler
            then does not close it. By default one is created on first use and closed by ``close``.
        docker_host: the engine's address (e.g. ``unix:///var/run/docker.sock``) when no client is
            given; defaults to aiodocker's resolution (``DOCKER_HOST``, then the local socket).
        watch_events: follow Docker's event stream to push changes (turn off only for tests).
    """

    pushes_changes = True
    supports_workspace = True

    def __init__(
        self,
        session_name: str,
        client: aiodocker.Docker | Any | None = None,
        *,
        docker_host: str | None = None,
        watch_events: bool = True,
    ) -> None:
        super().__init__("local_docker", session_name)
        self._engine = DockerEngine(client, docker_host=docker_host)
        self._watch_events = watch_events
        self._tasks = TaskSupervisor(f"local_docker:{session_name}")
        self._flights = SingleFlight(self._tasks)
        self._watch_task: asyncio.Task[None] | None = None
        self._events_ready: asyncio.Event | None = None
        self._app_waiters: dict[str, set[asyncio.Event]] = {}
        self._follow_ups: set[asyncio.Task[Any]] = set()
        self._inflight: set[tuple[str, ...]] = set()
        self._done: OrderedDict[tuple[str, ...], None] = OrderedDict()
        self._removed: OrderedDict[str, DescribeAppResponse] = OrderedDict()
        self._reconcile_again: set[str] = set()
        self._ncpu: float | None = None
        self._network_locks: dict[str, asyncio.Lock] = {}
        self._died: dict[str, tuple[int | None, float]] = {}
        self._snapshots: dict[str, tuple[list[ContainerInfo], float, int]] = {}
        self._last_event: OrderedDict[str, float] = OrderedDict()
        self._epoch = 0

    # -- options and dry runs (pure) ------------------------------------------------------------

    def _run_opts(self) -> runopts:
        opts = runopts()
        opts.add(
            "copy_env",
            list[str],
            "glob patterns of environment variables of the launching process to copy into every "
            "replica (e.g. FOO_*,BAR); the env run option and the role's env take precedence",
        )
        opts.add(
            "env",
            dict[str, str],
            "environment variables for every replica (KEY:VALUE pairs), over those of copy_env",
        )
        opts.add(
            "privileged", bool, "run the containers privileged (docker run --privileged)", False
        )
        opts.add(
            "network",
            str,
            "an existing Docker network to attach every container to, instead of a network of the "
            "app's own (created for apps with more than one container, removed when they end)",
        )
        opts.add(
            "remove_finished",
            bool,
            "remove the app's containers once it has finished (their logs go with them); by "
            "default they are kept, as TorchX does",
            False,
        )
        opts.add(
            "stop_timeout",
            int,
            "seconds a replica gets to exit after SIGTERM when the app is cancelled or stopped, "
            "before SIGKILL",
            DEFAULT_STOP_TIMEOUT,
        )
        return opts

    def _submit_dryrun(self, app: AppDef, cfg: Mapping[str, CfgVal]) -> AppDryRunInfo[DockerJob]:
        job = build_job(
            app,
            cfg,
            app_id=make_unique(app.name),
            session_name=self.session_name,
            environ=os.environ,
        )
        return AppDryRunInfo(job, str)

    # -- workspaces -------------------------------------------------------------------------------

    def plan_workspace(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """The workspace image of the first role (see ``asynctorchx.schedulers._docker.image``).

        Reads and hashes the workspace and asks the engine for the base image's id; builds
        nothing.
        """
        base_id = self._engine.image_id_blocking(app.roles[0].image)
        return plan_image(self.backend, app, workspace, base_id)

    async def plan_workspace_async(
        self, app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace
    ) -> WorkspacePlan:
        """``plan_workspace`` with the engine asked from the event loop, the files read in a
        worker thread."""
        base_id = await self._engine.image_id(app.roles[0].image)
        return await anyio.to_thread.run_sync(plan_image, self.backend, app, workspace, base_id)

    # -- the client and the event stream --------------------------------------------------------

    async def _docker(self) -> Any:
        if self._closed:
            raise RuntimeError("the local_docker scheduler is closed")
        return await self._engine.client()

    @property
    def engine(self) -> DockerEngine:
        """The Docker engine this scheduler drives."""
        return self._engine

    def subscribe(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Registers ``callback(app_id)``; starts following Docker's event stream if needed."""
        unsubscribe = super().subscribe(callback)
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            self._ensure_watcher()
        return unsubscribe

    def _ensure_watcher(self) -> None:
        if not self._watch_events or self._closed:
            return
        if self._events_ready is None:
            self._events_ready = asyncio.Event()
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = self._tasks.spawn(self._watch(), name="events")

    async def _watch(self) -> None:
        """Follows ``GET /events`` (our containers only) for as long as the scheduler is open."""
        assert self._events_ready is not None
        filters = json.dumps({"type": ["container"], "label": [LABEL_APP_ID]})
        since: str | None = None
        delay = 0.05
        warned = False
        aiohttp = _import_aiohttp()
        while True:
            try:
                client = await self._docker()
                params: dict[str, Any] = {"filters": filters}
                if since is not None:
                    params["since"] = since
                async with client._query(
                    "events", params=params, timeout=aiohttp.ClientTimeout()
                ) as resp:
                    try:
                        self._epoch += 1
                        self._events_ready.set()
                        warned = False
                        buf = b""
                        async for chunk in resp.content.iter_any():
                            buf += chunk
                            while b"\n" in buf:
                                line, buf = buf.split(b"\n", 1)
                                since = self._on_event(line) or since
                                delay = 0.05
                    finally:
                        resp.close()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not warned:
                    logger.warning("Docker event stream failed (%s); reconnecting", e)
                    warned = True
            self._events_ready.clear()
            self._epoch += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _on_event(self, line: bytes) -> str | None:
        """Handles one event; returns its time for resuming the stream."""
        try:
            event = json.loads(line)
        except ValueError:
            return None
        if not isinstance(event, dict):
            return None
        attrs = (event.get("Actor") or {}).get("Attributes") or {}
        app_id = attrs.get(LABEL_APP_ID)
        action = str(event.get("Action") or event.get("status") or "")
        time_nano = event.get("timeNano")
        resume = format_api_time(int(time_nano)) if isinstance(time_nano, int) else None
        if not app_id or action not in _STATE_ACTIONS:
            return resume
        cid = str(event.get("id") or (event.get("Actor") or {}).get("ID") or "")
        if action == "die":
            code = _int_or_none(attrs.get("exitCode"))
            self._died[cid] = (code, time.monotonic())
            if _may_restart(attrs, code):
                # Docker may restart it (REPLICA retries): wait for the engine to settle first.
                self._invalidate(app_id)
                self._spawn_follow_up(("settle", cid), self._settle(app_id, cid), remember=False)
                return resume
        else:
            self._invalidate(app_id)
            if action in ("start", "restart", "destroy"):
                self._died.pop(cid, None)
        self._changed(app_id, follow_up=action in _FOLLOW_UP_ACTIONS)
        return resume

    def _invalidate(self, app_id: str) -> None:
        """Notes news of the app that its snapshot may not show (see ``_snapshot``)."""
        self._last_event.pop(app_id, None)
        self._last_event[app_id] = time.monotonic()
        while len(self._last_event) > 4 * _REMEMBERED_APPS:
            self._last_event.popitem(last=False)

    def _changed(self, app_id: str, *, follow_up: bool) -> None:
        self._notify(app_id)
        for waiter in self._app_waiters.get(app_id, ()):
            waiter.set()
        if follow_up:
            self._reconcile_soon(app_id)

    async def _settle(self, app_id: str, cid: str) -> None:
        """Waits until the engine has finished handling a container's exit, then reports the change.

        Inspecting a container waits for the engine's lock on it, which it holds until the exit is
        fully recorded (and the container restarted, if its restart policy says so).
        """
        try:
            client = await self._docker()
            await client.containers.container(cid).show()
        except Exception as e:
            logger.debug("inspecting %s after its exit failed: %s", cid[:12], e)
        self._died.pop(cid, None)
        self._changed(app_id, follow_up=True)

    def _with_exits_seen(self, infos: list[ContainerInfo]) -> list[ContainerInfo]:
        """Applies exits announced by events that the engine's listing does not show yet.

        Docker emits ``die`` before its container listing catches up (by ~0.1 s); the event's exit
        code is authoritative unless the restart policy may restart the container.
        """
        if not self._died:
            return infos
        now = time.monotonic()
        out = []
        for c in infos:
            seen = self._died.get(c.id)
            if seen is not None and (not c.alive or now - seen[1] > _DIED_MEMORY):
                del self._died[c.id]
            elif seen is not None and not _may_restart(c.labels, seen[0]):
                c = dataclasses.replace(c, state="exited", exit_code=seen[0])
            out.append(c)
        return out

    async def _wait_app_event(self, app_id: str, seconds: float) -> None:
        """Returns on the next Docker event of ``app_id``, or after ``seconds``."""
        self._ensure_watcher()
        waiter = asyncio.Event()
        self._app_waiters.setdefault(app_id, set()).add(waiter)
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waiter.wait(), seconds)
        finally:
            waiters = self._app_waiters.get(app_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._app_waiters[app_id]

    async def _events_connected(self) -> None:
        """Starts the event stream and waits (bounded) until it is connected."""
        self._ensure_watcher()
        if self._events_ready is not None and not self._events_ready.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._events_ready.wait(), _EVENTS_CONNECT_WAIT)

    # -- submitting -----------------------------------------------------------------------------

    async def schedule(self, dryrun_info: AppDryRunInfo[DockerJob]) -> str:
        """Creates the app's network and containers, then starts them; returns the app id.

        A dry run made with a workspace first gets its image built (unless its tag exists).

        Raises:
            WorkspaceBuildError: the workspace image did not build (nothing was created).
            DockerSchedulerError: an image cannot be had, a volume or network does not exist, or
                Docker refused a container. Whatever was created for the app is removed first.
            DockerEngineUnavailableError: the engine cannot be reached.
        """
        job = dryrun_info.request
        client = await self._docker()
        if dryrun_info.workspace is not None:
            await ensure_image(
                self._engine, dryrun_info.workspace, self._flights, current_progress()
            )
        await self._preflight(client, job)
        await self._events_connected()
        try:
            network_id = None
            if job.network_request is not None:
                network_id = await self._create_network(client, job.network_request)
            created = await _gather_all(
                [self._create_container(client, c, network_id) for c in job.containers]
            )
            # Rank 0 first: once it has started, its hostname resolves on the app's network, so
            # the others never start looking for a TORCHX_RANK0_HOST that does not exist yet.
            pairs = list(zip(job.containers, created, strict=True))
            await self._start_container(client, *pairs[0])
            await _gather_all([self._start_container(client, c, cid) for c, cid in pairs[1:]])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._purge(job.app_id, job.network_request)
            raise
        logger.info("launched %s: %d container(s)", job.app_id, len(job.containers))
        return job.app_id

    async def _preflight(self, client: Any, job: DockerJob) -> None:
        """Checks, before creating anything, that images, volumes and the network exist."""
        if await self._list(job.app_id):
            raise DockerSchedulerError(
                f"app {job.app_id!r} already exists; a dry run can be scheduled only once"
            )
        for image, role in job.images.items():
            await self._ensure_image(client, image, role)
        for volume, role in job.volumes.items():
            try:
                await client.volumes.get(volume)
            except Exception as e:
                if _status_of(e) == 404:
                    raise DockerSchedulerError(
                        f"role {role!r}: volume {volume!r} does not exist; create it first "
                        f"(docker volume create {volume})"
                    ) from None
                raise _engine_error(f"role {role!r}: checking volume {volume!r}", e) from None
        if job.network_request is None and job.network not in ("bridge", "host", "none"):
            try:
                await client.networks.get(job.network)
            except Exception as e:
                if _status_of(e) == 404:
                    raise DockerSchedulerError(
                        f"network {job.network!r} (run option 'network') does not exist; create it "
                        f"first (docker network create {job.network}) or leave the option unset"
                    ) from None
                raise _engine_error(f"checking network {job.network!r}", e) from None
        await self._check_cpus(client, job)

    async def _ensure_image(self, client: Any, image: str, role: str) -> None:
        try:
            await client.images.inspect(image)
            return
        except Exception as e:
            if _status_of(e) != 404:
                raise _engine_error(f"role {role!r}: checking image {image!r}", e) from None
        logger.info("image %s is not present locally; pulling it", image)
        try:
            await client.images.pull(image)
            await client.images.inspect(image)
        except Exception as e:
            if _status_of(e) == 900:
                raise _engine_error(f"role {role!r}: pulling image {image!r}", e) from None
            raise DockerSchedulerError(
                f"role {role!r}: image {image!r} is not present locally and could not be pulled "
                f"({_message_of(e)}); build or load it first"
            ) from None

    async def _check_cpus(self, client: Any, job: DockerJob) -> None:
        wanted = [
            (c.role, c.config["HostConfig"]["NanoCpus"] / 1e9)
            for c in job.containers
            if c.config["HostConfig"].get("NanoCpus")
        ]
        if not wanted:
            return
        if self._ncpu is None:
            try:
                info = await client.system.info()
                self._ncpu = float(info.get("NCPU") or 0) or None
            except Exception:
                return
        if self._ncpu is None:
            return
        for role, cpus in wanted:
            if cpus > self._ncpu:
                raise DockerSchedulerError(
                    f"role {role!r}: resource.cpu={cpus:g} is more than the {self._ncpu:g} CPUs "
                    "of the Docker host"
                )

    async def _create_network(self, client: Any, request: NetworkRequest) -> str:
        """Creates the app's network and returns its id; idempotent and safe under races.

        Docker does not enforce unique network names under concurrent creates, so after creating,
        the networks of that name and app are listed and the oldest wins; a duplicate made here is
        removed again, and containers join the winner by id.
        """
        app_id = request.config["Labels"][LABEL_APP_ID]
        lock = self._network_locks.setdefault(request.name, asyncio.Lock())
        async with lock:
            mine: str | None = None
            try:
                mine = str((await client.networks.create(request.config)).id)
            except Exception as e:
                if _status_of(e) != 409:
                    raise _engine_error(f"creating network {request.name!r}", e) from None
            try:
                listed = await client.networks.list(filters={"name": [request.name]})
            except Exception as e:
                raise _engine_error(f"listing networks named {request.name!r}", e) from None
            ours = [
                n
                for n in listed
                if n.get("Name") == request.name
                and (n.get("Labels") or {}).get(LABEL_APP_ID) == app_id
            ]
            if not ours:
                raise DockerSchedulerError(
                    f"network {request.name!r} already exists and belongs to something else"
                )
            winner = str(min(ours, key=lambda n: (str(n.get("Created", "")), str(n["Id"])))["Id"])
            if mine is not None and mine != winner:
                with contextlib.suppress(Exception):
                    await (await client.networks.get(mine)).delete()
        if not lock.locked():
            self._network_locks.pop(request.name, None)
        return winner

    async def _create_container(
        self, client: Any, request: ContainerRequest, network_id: str | None
    ) -> str:
        config = request.config
        if network_id is not None:
            # Join the app's network by id: a duplicate of its name cannot make it ambiguous.
            config = copy.deepcopy(config)
            config["HostConfig"]["NetworkMode"] = network_id
            endpoints = config.get("NetworkingConfig", {}).get("EndpointsConfig", {})
            endpoint: dict[str, Any] = next(iter(endpoints.values()), {})
            config["NetworkingConfig"] = {"EndpointsConfig": {network_id: endpoint}}
        try:
            container = await client.containers.create(config, name=request.name)
        except Exception as e:
            if not _is_docker_error(e):
                raise
            raise _engine_error(
                f"role {request.role!r} replica {request.replica_id}: Docker refused the container",
                e,
            ) from None
        return str(container.id)

    async def _start_container(self, client: Any, request: ContainerRequest, cid: str) -> None:
        try:
            await client.containers.container(cid).start()
        except Exception as e:
            if not _is_docker_error(e):
                raise
            raise _engine_error(
                f"role {request.role!r} replica {request.replica_id}: the container did not start",
                e,
            ) from None

    async def _purge(self, app_id: str, network: NetworkRequest | None) -> None:
        """Removes every container of the app (and its own network). Errors are logged."""
        try:
            client = await self._docker()
            containers = await self._list(app_id)
            await asyncio.gather(
                *(self._delete(client, c.id) for c in containers), return_exceptions=True
            )
            if network is not None:
                await self._delete_networks(client, app_id)
        except Exception:
            logger.exception("cleaning up after the failed submit of %s", app_id)

    async def _delete(self, client: Any, cid: str) -> None:
        try:
            await client.containers.container(cid).delete(force=True)
        except Exception as e:
            if _status_of(e) not in (404, 409):
                raise

    async def _delete_networks(self, client: Any, app_id: str) -> None:
        """Removes the networks made for ``app_id`` (normally one; duplicates of a race too)."""
        listed = await client.networks.list(filters={"label": [f"{LABEL_APP_ID}={app_id}"]})
        for n in listed:
            try:
                await (await client.networks.get(n["Id"])).delete()
            except Exception as e:
                if _status_of(e) != 404:
                    raise

    # -- status ---------------------------------------------------------------------------------

    async def _list(
        self, app_id: str | None = None, *, for_apps: Sequence[str] = ()
    ) -> list[ContainerInfo]:
        """Our containers (of one app, or all of them) in one listing.

        While the event stream is connected, the listing is also kept as a snapshot of each app
        in ``for_apps`` (and of each app it shows), which events keep current (see ``_snapshot``).
        """
        client = await self._docker()
        label = f"{LABEL_APP_ID}={app_id}" if app_id else LABEL_APP_ID
        epoch = self._epoch if self._events_live() else None
        asked_at = time.monotonic()
        try:
            raw = await client.containers.list(all=True, filters=json.dumps({"label": [label]}))
        except Exception as e:
            if not _is_docker_error(e):
                raise
            raise _engine_error("listing containers", e) from None
        infos = [ContainerInfo.from_summary(_summary(c)) for c in raw]
        if epoch is not None and epoch == self._epoch:
            groups = group_by_app(infos)
            for app in {*for_apps, *groups}:
                if self._last_event.get(app, -1.0) >= asked_at:
                    continue  # news came while the engine answered: the listing may predate it
                self._snapshots.pop(app, None)  # re-insert: the dict's order is by freshness
                self._snapshots[app] = (groups.get(app, []), asked_at, epoch)
            while len(self._snapshots) > _REMEMBERED_APPS:
                del self._snapshots[next(iter(self._snapshots))]
        return self._with_exits_seen(infos)

    def _events_live(self) -> bool:
        return self._events_ready is not None and self._events_ready.is_set()

    def _snapshot(self, app_ids: Sequence[str]) -> dict[str, list[ContainerInfo]] | None:
        """The apps' containers without asking the engine, when events vouch for every one of them.

        A snapshot holds while the event stream has stayed connected since it was taken, no event
        other than a plain exit (``die``, applied from the event itself) came for the app, and it
        is younger than ``_SNAPSHOT_MAX_AGE`` seconds.
        """
        if not self._events_live():
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
            out[app_id] = self._with_exits_seen(list(snap[0]))
        return out

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        """The app's status from its containers; None when Docker has no container of it."""
        return (await self.describe_many([app_id]))[app_id]

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        """Describes many apps with one container listing (none when events vouch for them all)."""
        ids = list(dict.fromkeys(app_ids))
        if not ids:
            return {}
        groups = self._snapshot(ids)
        if groups is None:
            listed = await self._list(ids[0] if len(ids) == 1 else None, for_apps=ids)
            groups = group_by_app(listed)
        out: dict[str, DescribeAppResponse | None] = {}
        found: list[Assessment] = []
        for app_id in ids:
            assessment = assess(app_id, groups.get(app_id, []))
            if assessment is None:
                out[app_id] = self._removed.get(app_id)
            else:
                found.append(assessment)
        for assessment in await asyncio.gather(*(self._with_restart_counts(a) for a in found)):
            out[assessment.response.app_id] = assessment.response
            self._follow_up(assessment)
        return out

    async def _with_restart_counts(self, a: Assessment) -> Assessment:
        """Adds Docker's restart counts for replicas that Docker restarts itself (REPLICA policy)."""
        wanted = [
            c
            for c in a.current.values()
            if c.labels.get(LABEL_RETRY_POLICY) == RetryPolicy.REPLICA.value
            and c.labels.get(LABEL_MAX_RETRIES, "0") not in ("", "0")
        ]
        if not wanted:
            return a
        client = await self._docker()

        async def count(c: ContainerInfo) -> ContainerInfo:
            try:
                info = await client.containers.container(c.id).show()
            except Exception:
                return c
            return dataclasses.replace(c, restart_count=int(info.get("RestartCount") or 0))

        updated = {c.id: c for c in await asyncio.gather(*(count(c) for c in wanted))}
        containers = [updated.get(c.id, c) for c in a.containers]
        return assess(a.response.app_id, containers) or a

    async def list(self) -> list[ListAppResponse]:
        """Every app with containers on this engine (any session), from one listing."""
        groups = group_by_app(await self._list())
        out = []
        for app_id, containers in groups.items():
            a = assess(app_id, containers)
            if a is None:
                continue
            self._follow_up(a)
            out.append(
                ListAppResponse(
                    app_id=app_id,
                    state=a.response.state,
                    app_handle=make_app_handle(
                        self.backend, a.session or self.session_name, app_id
                    ),
                    name=a.name,
                )
            )
        return out

    # -- follow-ups: retries, stopping survivors, cleanup --------------------------------------

    def _reconcile_soon(self, app_id: str) -> None:
        key = ("reconcile", app_id)
        if key in self._inflight:
            self._reconcile_again.add(app_id)
            return

        async def run() -> None:
            while True:
                self._reconcile_again.discard(app_id)
                await self.describe_many([app_id])
                if app_id not in self._reconcile_again:
                    return

        self._spawn_follow_up(key, run(), remember=False)

    def _follow_up(self, a: Assessment) -> None:
        """Starts what the app still needs: a retry, stopping containers, removing things."""
        if self._closed:
            return
        app_id = a.response.app_id
        for c in a.to_stop:
            self._spawn_follow_up(("stop", c.id), self._stop(c.id), remember=False)
        if a.retry is not None:
            self._spawn_follow_up(
                ("retry", app_id, str(a.retry.attempt)), self._retry(a, a.retry), remember=True
            )
        if not is_terminal(a.response.state) or any(c.alive for c in a.containers):
            return
        if a.remove_finished:
            self._remember_removed(a.response)
            self._spawn_follow_up(("remove", app_id), self._remove_app(a), remember=True)
        elif a.network:
            self._spawn_follow_up(("network", app_id), self._remove_networks(app_id), remember=True)

    def _spawn_follow_up(
        self, key: tuple[str, ...], coro: Coroutine[Any, Any, None], *, remember: bool
    ) -> None:
        if key in self._inflight or key in self._done or self._tasks.closed:
            coro.close()
            return
        self._inflight.add(key)

        async def run() -> None:
            try:
                await coro
                if remember:
                    self._done[key] = None
                    while len(self._done) > 4 * _REMEMBERED_APPS:
                        self._done.popitem(last=False)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("local_docker: %s failed: %s", " ".join(key), e)
            finally:
                self._inflight.discard(key)

        task = self._tasks.spawn(run(), name=":".join(key))
        self._follow_ups.add(task)
        task.add_done_callback(self._follow_ups.discard)

    def _remember_removed(self, response: DescribeAppResponse) -> None:
        self._removed[response.app_id] = response
        self._removed.move_to_end(response.app_id)
        while len(self._removed) > _REMEMBERED_APPS:
            self._removed.popitem(last=False)

    async def _stop(self, cid: str) -> None:
        client = await self._docker()
        try:
            await client.containers.container(cid).stop()
        except Exception as e:
            if _status_of(e) not in (304, 404):
                raise

    async def _remove_networks(self, app_id: str) -> None:
        """Removes the app's own network once the engine has let go of its containers."""
        client = await self._docker()
        containers = await self._list(app_id)
        await asyncio.gather(
            *(client.containers.container(c.id).show() for c in containers),
            return_exceptions=True,
        )
        for attempt in range(5):
            try:
                await self._delete_networks(client, app_id)
                return
            except Exception as e:
                if _status_of(e) != 403 or attempt == 4:  # 403: endpoints still attached
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))

    async def _remove_app(self, a: Assessment) -> None:
        client = await self._docker()
        await asyncio.gather(*(self._delete(client, c.id) for c in a.containers))
        if a.network:
            await self._delete_networks(client, a.response.app_id)
        logger.info("removed the containers of finished app %s", a.response.app_id)

    async def _retry(self, a: Assessment, retry: Retry) -> None:
        """Recreates the replicas of a ROLE/APPLICATION retry as attempt ``retry.attempt``."""
        client = await self._docker()
        app_id = a.response.app_id
        olds = [a.current[k] for k in retry.replicas if k in a.current]
        await asyncio.gather(
            *(self._kill_quietly(client, c.id) for c in olds if c.alive), return_exceptions=True
        )
        configs = []
        for old in olds:
            info = await client.containers.container(old.id).show()
            configs.append((old, _recreate_config(info, retry.attempt)))
        started = 0
        for old, config in configs:
            name = f"{old.hostname}-r{retry.attempt}"
            try:
                container = await client.containers.create(config, name=name)
            except Exception as e:
                if _status_of(e) == 409:
                    continue  # another process (or an earlier round) made this attempt already
                raise
            await container.start()
            started += 1
        logger.info(
            "app %s: retry attempt %d started %d replica(s)", app_id, retry.attempt, started
        )

    async def _kill_quietly(self, client: Any, cid: str) -> None:
        with contextlib.suppress(Exception):
            await client.containers.container(cid).stop(t=0)

    # -- cancel ---------------------------------------------------------------------------------

    async def _cancel_existing(self, app_id: str) -> None:
        await self.cancel(app_id)

    async def cancel(self, app_id: str) -> None:
        """Stops every container of the app (SIGTERM, SIGKILL after its stop timeout).

        The app then reads CANCELLED from any process. Idempotent: cancelling an unknown or finished
        app does nothing. Returns once the containers have stopped (at most the app's
        ``stop_timeout`` seconds); the work is shielded from the caller's cancellation.
        """
        containers = await self._list(app_id)
        a = assess(app_id, containers)
        if a is None or is_terminal(a.response.state):
            return
        with anyio.CancelScope(shield=True):
            client = await self._docker()
            await self._mark_cancelled(client, a)
            alive = [c for c in containers if c.alive and not c.is_marker]
            results = await asyncio.gather(
                *(self._stop(c.id) for c in alive), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            # Inspecting waits until the engine has recorded each exit, so the listing shows it.
            await asyncio.gather(
                *(client.containers.container(c.id).show() for c in alive), return_exceptions=True
            )
            self._notify(app_id)
            after = assess(app_id, await self._list(app_id))
            if after is not None:
                self._follow_up(after)
        if errors:
            raise _engine_error(f"stopping the containers of {app_id}", errors[0])

    async def _mark_cancelled(self, client: Any, a: Assessment) -> None:
        """Leaves a never-started container labelled as the app's cancel marker (idempotent)."""
        app_id = a.response.app_id
        if any(c.is_marker for c in a.containers):
            return
        sample = next(c for c in a.containers if not c.is_marker)
        config = {
            "Image": sample.image,
            "Entrypoint": ["true"],
            "Cmd": [],
            "Labels": {
                LABEL_APP_ID: app_id,
                LABEL_APP_NAME: a.name,
                LABEL_SESSION: a.session,
                LABEL_KIND: KIND_CANCEL_MARKER,
                LABEL_VERSION: __version__,
            },
            "HostConfig": {"NetworkMode": "none"},
        }
        try:
            await client.containers.create(config, name=f"{app_id}-cancelled")
        except Exception as e:
            if _status_of(e) != 409:
                raise _engine_error(f"marking {app_id} as cancelled", e) from None

    # -- logs -----------------------------------------------------------------------------------

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
        """The log lines of replica ``k`` of ``role_name``, read from the Docker API.

        ``streams`` picks stdout, stderr or both (the default, in the order Docker received them).
        Lines of every attempt of the replica are returned, oldest first. With ``should_tail`` the
        log is followed until the app is terminal; a dropped stream is resumed from the last line's
        timestamp.

        Raises:
            ValueError: a bad ``streams``, ``regex`` or time window (at once).
            UnknownAppException: Docker has no container of the app (on iteration).
            UnknownRoleException: no such role or replica (on iteration).
        """
        stream = _check_streams(streams)
        pattern = compile_log_regex(regex)
        lo, hi = check_time_window(since, until)
        since_ns = None if lo is None else int(lo * 1e9)
        until_ns = None if hi is None else int(hi * 1e9)
        return self._log_lines(
            app_id, role_name, k, pattern, since_ns, until_ns, should_tail, stream
        )

    async def _log_lines(
        self,
        app_id: str,
        role_name: str,
        k: int,
        pattern: Any,
        since_ns: int | None,
        until_ns: int | None,
        should_tail: bool,
        stream: Stream,
    ) -> AsyncIterator[str]:
        containers = await self._list(app_id)
        a = assess(app_id, containers)
        if a is None:
            raise UnknownAppException(make_app_handle(self.backend, self.session_name, app_id))
        check_replica(app_id, role_replica_counts(a.response.roles), role_name, k)
        want_out = stream in (Stream.STDOUT, Stream.COMBINED)
        want_err = stream in (Stream.STDERR, Stream.COMBINED)
        cursors: dict[str, _Cursor] = {}
        finished: set[str] = set()  # containers read to the end that will not write again
        while True:
            final = not should_tail or a is None or is_terminal(a.response.state) or _past(until_ns)
            attempts = sorted(
                (
                    c
                    for c in containers
                    if not c.is_marker and c.role == role_name and c.replica_id == k
                ),
                key=lambda c: c.attempt,
            )
            for c in attempts:
                if c.id in finished:
                    continue
                latest = c is attempts[-1]
                cursor = cursors.setdefault(c.id, _Cursor(since_ns))
                lines = self._container_lines(
                    app_id, c.id, want_out, want_err, cursor, until_ns, follow=latest and not final
                )
                async with contextlib.aclosing(lines):
                    async for line in lines:
                        if pattern is None or pattern.search(line.text):
                            yield line.text
                if final or not latest:
                    finished.add(c.id)
            if final:
                return
            # The replica's latest container stopped while the app goes on: it may be restarted or
            # retried as a new attempt; look again on the app's next event (or in a second).
            await self._wait_app_event(app_id, 1.0)
            containers = await self._list(app_id)
            a = assess(app_id, containers)

    async def _container_lines(
        self,
        app_id: str,
        cid: str,
        want_out: bool,
        want_err: bool,
        cursor: _Cursor,
        until_ns: int | None,
        follow: bool,
    ) -> AsyncGenerator[LogLine, None]:
        """One container's lines after ``cursor``; with ``follow``, until the container stops.

        A stream that drops is resumed from the cursor (the last line's timestamp), skipping the
        lines of that timestamp already returned, so no line is lost or repeated.
        """
        client = await self._docker()
        failures = 0
        while True:
            assembler = LineAssembler()
            skip = cursor.at_last
            params: dict[str, Any] = {
                "stdout": want_out,
                "stderr": want_err,
                "timestamps": True,
                "follow": follow,
            }
            if cursor.last_ts > 0:
                params["since"] = format_api_time(cursor.last_ts)
            if until_ns is not None:
                params["until"] = format_api_time(until_ns)
            complete = False
            try:
                async for frame_stream, payload in self._log_frames(client, cid, params):
                    failures = 0  # the engine answers: only failures in a row count
                    line = assembler.feed(frame_stream, payload)
                    if line is None:
                        continue
                    if not cursor.admit(line.ts_ns, skip):
                        if line.ts_ns == cursor.last_ts:
                            skip = max(skip - 1, 0)
                        continue
                    if until_ns is not None and line.ts_ns > until_ns:
                        return
                    yield line
                complete = True
            except Exception as e:
                if _status_of(e) == 404:
                    return  # the container was removed
                if _status_of(e) is not None and _status_of(e) != 900:
                    raise _engine_error(f"reading the logs of container {cid[:12]}", e) from None
                failures += 1
                if failures > _ENGINE_RETRIES:
                    raise _engine_error(f"reading the logs of container {cid[:12]}", e) from None
                logger.info("log stream of %s dropped (%s); resuming", cid[:12], e)
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))
                continue
            if not follow:
                for line in assembler.flush():
                    if cursor.admit(line.ts_ns, skip):
                        yield line
                    elif line.ts_ns == cursor.last_ts:
                        skip = max(skip - 1, 0)
                return
            try:
                info = await client.containers.container(cid).show()
            except Exception as e:
                if _status_of(e) == 404:
                    return
                failures += 1
                if failures > _ENGINE_RETRIES:
                    raise _engine_error(f"inspecting container {cid[:12]}", e) from None
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))
                continue
            state = info.get("State") or {}
            if _past(until_ns):
                follow = False  # the window has closed: one last read, then done
            elif state.get("Running") or state.get("Restarting") or state.get("Paused"):
                if complete and (state.get("Restarting") or state.get("Paused")):
                    await self._wait_app_event(app_id, 0.5)
            else:
                follow = False  # the container stopped: drain what is left without following

    async def _log_frames(
        self, client: Any, cid: str, params: dict[str, Any]
    ) -> AsyncGenerator[tuple[int, bytes], None]:
        """The multiplexed frames of ``GET /containers/{id}/logs``."""
        aiohttp = _import_aiohttp()
        async with client._query(
            f"containers/{cid}/logs", params=params, timeout=aiohttp.ClientTimeout()
        ) as resp:
            try:
                decoder = FrameDecoder()
                async for chunk in resp.content.iter_any():
                    for frame in decoder.feed(chunk):
                        yield frame
            finally:
                resp.close()

    # -- lifecycle ------------------------------------------------------------------------------

    async def close(self) -> None:
        """Finishes pending clean-ups (bounded), stops the event stream, closes an owned client.

        Apps keep running: containers outlive the scheduler.
        """
        if self._closed:
            return
        self._closed = True
        pending = [t for t in self._follow_ups if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=_CLOSE_GRACE)
        await self._tasks.aclose()
        await self._engine.close()


class _Cursor:
    """Where a reader of one container's log is: the last line's time, and how many lines of
    exactly that time it has returned (several lines can share a timestamp)."""

    __slots__ = ("at_last", "last_ts")

    def __init__(self, since_ns: int | None) -> None:
        self.last_ts = since_ns if since_ns is not None else -1
        self.at_last = 0

    def admit(self, ts_ns: int, skip: int) -> bool:
        """Moves past a line of time ``ts_ns`` and returns True, or returns False for a line that
        was returned before (older, or one of the first ``skip`` lines of the last time)."""
        if ts_ns < 0:
            return True
        if ts_ns < self.last_ts:
            return False
        if ts_ns == self.last_ts:
            if skip > 0:
                return False
            self.at_last += 1
            return True
        self.last_ts, self.at_last = ts_ns, 1
        return True


def _import_aiohttp() -> ModuleType:
    import aiohttp

    return aiohttp


def _summary(container: Any) -> dict[str, Any]:
    """The listing entry of an ``aiodocker`` container (or a plain dict from a fake)."""
    if isinstance(container, Mapping):
        return dict(container)
    keys = ("Id", "Names", "Image", "Labels", "State", "Status", "Created")
    out: dict[str, Any] = {}
    for key in keys:
        try:
            out[key] = container[key]
        except (KeyError, TypeError):
            continue
    return out


def _recreate_config(info: Mapping[str, Any], attempt: int) -> dict[str, Any]:
    """The create request for a new attempt of the container ``info`` (from ``inspect``)."""
    config = dict(info.get("Config") or {})
    labels = dict(config.get("Labels") or {})
    labels[LABEL_ATTEMPT] = str(attempt)
    config["Labels"] = labels
    host = dict(info.get("HostConfig") or {})
    config["HostConfig"] = host
    network = str(host.get("NetworkMode") or "")
    hostname = str(config.get("Hostname") or "")
    if network and network not in ("default", "bridge", "host", "none") and hostname:
        config["NetworkingConfig"] = {"EndpointsConfig": {network: {"Aliases": [hostname]}}}
    return config


def _check_streams(streams: Stream | str | None) -> Stream:
    if streams is None:
        return Stream.COMBINED
    try:
        return Stream(streams)
    except ValueError:
        raise ValueError(
            f"streams must be one of {[s.value for s in Stream]} or None, got {streams!r}"
        ) from None


def _int_or_none(value: object) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def _may_restart(labels: Mapping[str, Any], exit_code: int | None) -> bool:
    """True when Docker's restart policy (our REPLICA retries) may restart a container that exited."""
    return (
        exit_code != 0
        and labels.get(LABEL_RETRY_POLICY) == RetryPolicy.REPLICA.value
        and labels.get(LABEL_MAX_RETRIES, "0") not in ("", "0")
    )


def _past(until_ns: int | None) -> bool:
    return until_ns is not None and time.time_ns() > until_ns


async def _gather_all(coros: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Runs ``coros`` concurrently; returns their results or raises the first failure once all ended."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)


def create_scheduler(
    session_name: str,
    client: aiodocker.Docker | Any | None = None,
    docker_host: str | None = None,
    **kwargs: Any,
) -> DockerScheduler:
    """Creates the ``local_docker`` scheduler (unknown keyword arguments are ignored).

    Args:
        session_name: the session the apps are launched for.
        client: an ``aiodocker.Docker`` to use instead of creating one.
        docker_host: the engine's address when no client is given.
    """
    watch_events = kwargs.get("watch_events", True)
    return DockerScheduler(
        session_name, client, docker_host=docker_host, watch_events=bool(watch_events)
    )
