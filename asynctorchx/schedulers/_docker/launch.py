"""Submitting a ``DockerJob``: checks first, then the network, the containers, and the starts.

Everything is checked before anything is created (images, pulled when missing; named volumes; an
existing network; the CPUs asked for against the engine's), so bad input leaves nothing behind. A
failure after that removes whatever was created for the app (``purge``), shielded from the caller's
cancellation: a failed submit leaves nothing running. A purge the engine's outage cut off is owed
by the scheduler, which does it again once the engine answers (see ``DockerScheduler``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar, cast

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers._docker.actions import remove_networks, started_since
from asynctorchx.schedulers._docker.engine import DockerEngine, DockerSchedulerError
from asynctorchx.schedulers._docker.events import EventFeed
from asynctorchx.schedulers._docker.processes import dead_launches, process_identity
from asynctorchx.schedulers._docker.request import (
    LABEL_APP_ID,
    LABEL_APP_NAME,
    LABEL_LAUNCH_TOKEN,
    LABEL_LAUNCHER,
    LABEL_SESSION,
    ContainerRequest,
    DockerJob,
    NetworkRequest,
    cancel_marker,
    cancel_record_name,
    claim_name,
    claim_request,
    marker_name,
)
from asynctorchx.schedulers._docker.stops import stop_all
from asynctorchx.schedulers._reconcile import finish_shielded

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClaimTakenError(DockerSchedulerError):
    """Raised when another launch of the same dry run holds the app's launch claim."""


class CancelWatch:
    """Whether the app a submit is launching has been cancelled meanwhile.

    A cancel from this process sets ``requested``. Until the launch has created the app's
    containers, another process finds the app by its launch claim (a volume, see
    ``claim_name``) and cancels it by removing the claim; the launch removes it itself once its
    containers exist (``commit``), and the one that removes it decides. After that, a cancel from
    another process leaves the app's cancel marker (a container), which ``cancelled`` looks for.
    A canceller makes the marker before it lists the containers to stop, and the launch looks for
    the marker after its starts: so either the canceller sees a started container and stops it,
    or the launch sees the marker.

    Args:
        engine: the engine the app is launched on.
        app_id: the app.
    """

    def __init__(self, engine: DockerEngine, app_id: str) -> None:
        self._engine = engine
        self.app_id = app_id
        self.requested = False
        self.launching = False  # past the checks: creating things
        self.committed = False  # the claim is removed: the app's containers name it now
        self.done = asyncio.Event()  # the submit has ended
        # a cancel waiting for the launch may return: the submit has ended, or, cancelled, it
        # has marked the app and the stops of what it started are under way (``abandon``)
        self.released = asyncio.Event()

    async def commit(self) -> bool:
        """Removes the launch claim once the app's containers exist; False when a cancel (here,
        or by removing the claim first) came before."""
        if not self.requested:
            self.committed = True
            self.requested = not await self._engine.remove_volume(claim_name(self.app_id))
        return not self.requested

    async def cancelled(self) -> bool:
        """True once a cancel of the app was asked here or (after ``commit``) its marker exists."""
        if not self.requested and self.committed:
            marker = await self._engine.inspect_container(marker_name(self.app_id))
            self.requested = marker is not None
        return self.requested


class Launcher:
    """Creates and starts apps on one engine.

    Args:
        engine: the engine to submit to.
        tasks: owns each create request, which runs to its end even if the submit is cancelled
            (the engine finishes a create whose client went away, so the clean-up would miss it).
        feed: the scheduler's event feed, which tells when the stops of a cancelled launch are
            under way (``stop_all``); None: once they have ended.
    """

    def __init__(
        self, engine: DockerEngine, tasks: TaskSupervisor, feed: EventFeed | None = None
    ) -> None:
        self._engine = engine
        self._tasks = tasks
        self._feed = feed
        self._network_locks: dict[str, asyncio.Lock] = {}

    async def preflight(self, job: DockerJob) -> None:
        """Checks, before creating anything, that the app is new and its images, volumes and
        network exist (a missing image is pulled), and that the engine has the CPUs asked for.

        The questions are independent, so they are asked at once (a submit waits for the slowest
        one rather than their sum); the answers are judged in a fixed order, and missing images
        are pulled only once every other check has passed (bad input never costs a pull).

        Raises:
            DockerSchedulerError: what is missing or wrong (names the role and the value).
        """
        images = list(job.images.items())
        volumes = list(job.volumes.items())
        wanted = _cpus_wanted(job)
        shared = job.network_request is None and job.network not in ("bridge", "host", "none")
        existing, ncpu, network_found, *found = await _gather_all(
            [
                self._engine.list_containers(f"{LABEL_APP_ID}={job.app_id}"),
                self._engine.cpu_count() if wanted else _answer(None),
                self._engine.network_exists(job.network) if shared else _answer(True),
                *(self._has_image(image, role) for image, role in images),
                *(self._engine.volume_exists(volume) for volume, _ in volumes),
            ]
        )
        if existing:
            raise DockerSchedulerError(
                f"app {job.app_id!r} already exists; a dry run can be scheduled only once"
            )
        for (volume, role), present in zip(volumes, found[len(images) :], strict=True):
            if not present:
                raise DockerSchedulerError(
                    f"role {role!r}: volume {volume!r} does not exist; create it first "
                    f"(docker volume create {volume})"
                )
        if not network_found:
            raise DockerSchedulerError(
                f"network {job.network!r} (run option 'network') does not exist; create it "
                f"first (docker network create {job.network}) or leave the option unset"
            )
        for role, cpus in wanted:
            if ncpu is not None and cpus > ncpu:
                raise DockerSchedulerError(
                    f"role {role!r}: resource.cpu={cpus:g} is more than the {ncpu:g} CPUs "
                    "of the Docker host"
                )
        missing = [
            (image, role) for (image, role), ok in zip(images, found, strict=False) if not ok
        ]
        await _gather_all([self._pull(image, role) for image, role in missing])

    async def _has_image(self, image: str, role: str) -> bool:
        try:
            return await self._engine.inspect_image(image) is not None
        except DockerSchedulerError as e:
            raise type(e)(f"role {role!r}: {e}") from None

    async def _pull(self, image: str, role: str) -> None:
        logger.info("image %s is not present locally; pulling it", image)
        try:
            await self._engine.pull_image(image)
        except DockerSchedulerError as e:
            raise type(e)(f"role {role!r}: {e}") from None

    async def launch(self, job: DockerJob, watch: CancelWatch) -> bool:
        """Creates the app's network and containers, then starts them (rank 0 first, see
        ``_start_all``); returns False when the app was cancelled meanwhile (``watch``).

        A cancel is looked for before the containers are started (``commit``: a cancel that
        removed the launch claim), between rank 0 and the others, and after the last start; once
        seen, nothing more is created or started, and the app is left CANCELLED (``abandon``).

        Raises:
            DockerSchedulerError: the engine refused something (names the role and replica); what
                was created is left for ``purge``.
        """
        watch.launching = True
        if watch.requested:  # cancelled during the checks: nothing was created
            return await self.abandon(job, watch)
        network_id = None
        if job.network_request is not None:
            request = job.network_request
            labels = {**request.config["Labels"], LABEL_APP_NAME: job.app_name}
            request = NetworkRequest(request.name, {**request.config, "Labels": labels})
            network_id = await self._to_the_end(
                self.create_network(request), f"network:{job.app_id}"
            )
        created = await _gather_all([self._create(c, network_id) for c in job.containers])
        if not await watch.commit():
            return await self.abandon(job, watch)
        pairs = list(zip(job.containers, created, strict=True))
        if not await self._start_all(pairs, network_id or job.network, watch):
            return await self.abandon(job, watch)
        if await watch.cancelled():
            return await self.abandon(job, watch)
        return True

    async def claim(self, job: DockerJob, token: str) -> None:
        """Makes the launch claim that names the app until its containers exist (see
        ``CancelWatch``).

        Raises:
            ClaimTakenError: another launch of the same dry run holds the claim.
        """
        # Finished even if the submit is cancelled meanwhile, as the creates of ``launch`` are:
        # the engine makes a volume whose client went away, so a clean-up (``unclaim``) that ran
        # before its answer would find nothing, and the claim left would name the app as being
        # submitted for as long as this process lives.
        request = self._engine.create_volume(claim_request(job, process_identity(), token))
        claim = await self._to_the_end(request, f"claim:{job.app_id}")
        if (claim.get("Labels") or {}).get(LABEL_LAUNCH_TOKEN) != token:
            raise ClaimTakenError(
                f"app {job.app_id!r} is being submitted already; a dry run can be scheduled only once"
            )

    async def unclaim(self, job: DockerJob) -> None:
        """Removes the launch claim of a submit that failed (if it is still there), or the
        record of a cancel that removed it."""
        await asyncio.gather(
            self._engine.remove_volume(claim_name(job.app_id)),
            self._engine.remove_volume(cancel_record_name(job.app_id)),
        )

    async def clear_dead(self, app_id: str, *, has_containers: bool) -> bool:
        """Removes what a launch of ``app_id`` killed before it had removed its launch claim
        left: the claim (or the record of a cancel that removed it), and the app's own network
        when the app has no container (else the app's follow-up removes it once the app has
        ended). Returns False when no such launch left anything (its launcher lives, say).
        """
        volumes = await self._engine.list_volumes(f"{LABEL_APP_ID}={app_id}")
        names = [
            n
            for n in dead_launches(volumes).get(app_id, [])
            if n in (claim_name(app_id), cancel_record_name(app_id))
        ]
        if not names:
            return False
        if not has_containers:
            await remove_networks(self._engine, app_id)
        await _gather_all([self._engine.remove_volume(n) for n in names])
        logger.info("removed what the killed launch of %s left", app_id)
        return True

    async def abandon(self, job: DockerJob, watch: CancelWatch | None = None) -> bool:
        """Leaves a launch the app's cancel interrupted CANCELLED: marks it (for every process),
        stops what it started, removes what it never started (and its network when nothing of
        the app remains on it). Returns False, for ``launch``. ``watch.released`` is set once the
        marker exists and the stops are under way in the engine (a cancel waiting for the launch
        returns then, not once the stop timeout is over).

        When another process made the marker, it stops the containers it saw alive after
        making it; only those started since are stopped here (each container gets one SIGTERM).
        """
        marker = cancel_marker(
            job.app_id,
            job.app_name,
            str(job.containers[0].config["Labels"].get(LABEL_SESSION, "")),
            _marker_image(job),
            canceller=process_identity(),
        )
        what = f"marking {job.app_id} as cancelled"
        made = await self._engine.create_container(
            marker.config, marker.name, what=what, exist_ok=True
        )
        replicas = [
            c
            for c in await self._engine.list_containers(f"{LABEL_APP_ID}={job.app_id}")
            if str(c.get("Id")) and (c.get("Names") or [""])[0].lstrip("/") != marker.name
        ]
        never_started = [c for c in replicas if c.get("State") == "created"]
        started = [str(c["Id"]) for c in replicas if c not in never_started]
        if made is None and started:  # marked by another process
            started = await started_since(self._engine, marker.name, started)
        under_way = watch.released.set if watch is not None else _nothing
        outcomes: list[Any] = await asyncio.gather(
            _gather_all([self._engine.remove_container(str(c["Id"])) for c in never_started]),
            stop_all(self._engine, self._feed, self._tasks, started, under_way),
            return_exceptions=True,
        )
        removed, stopped = outcomes
        for outcome in (removed, *(stopped if isinstance(stopped, list) else [stopped])):
            if isinstance(outcome, BaseException):
                raise outcome
        if job.network_request is not None and len(never_started) == len(replicas):
            await remove_networks(self._engine, job.app_id)
        await asyncio.gather(  # cancelled before the commit: the marker says it from now on
            self._engine.remove_volume(claim_name(job.app_id)),
            self._engine.remove_volume(cancel_record_name(job.app_id)),
        )
        logger.info("the launch of %s stopped: the app was cancelled", job.app_id)
        return False

    async def _start_all(
        self, pairs: list[tuple[ContainerRequest, str]], network: str, watch: CancelWatch
    ) -> bool:
        """Starts rank 0, then the other replicas at once as soon as rank 0 has joined the
        network, so the others never look for a TORCHX_RANK0_HOST that does not resolve yet;
        returns False, having started only rank 0, when the app was cancelled meanwhile.

        Docker announces the join (the network's ``connect`` event) once rank 0's endpoint is in
        the network, about 10-70 ms into a start that takes 0.2-0.4 s here (the rest is the runtime
        starting the process), so the others' starts overlap rank 0's instead of following it.
        Without that announcement (the events cannot be followed, or the stream ends) the others
        wait for rank 0's start to return, as they always did. A failed start of rank 0 before it
        joined starts nothing else; any failure is raised once every start has ended, and the
        caller then removes everything (``purge``).
        """
        (first, first_id), rest = pairs[0], pairs[1:]
        if not rest:
            await self._start(first, first_id)
            return True
        async with contextlib.AsyncExitStack() as stack:
            try:
                joins: AsyncIterator[str] | None = await stack.enter_async_context(
                    self._engine.network_joins(network)
                )
            except DockerSchedulerError as e:
                logger.debug("not following joins of network %s (%s)", network, e)
                joins = None
            # Owned here: awaited (or cancelled and awaited) before this method returns.
            rank0 = asyncio.ensure_future(self._start(first, first_id))
            try:
                await _until_joined(rank0, joins, first_id)
            except BaseException:
                rank0.cancel()
                await asyncio.gather(rank0, return_exceptions=True)
                raise
        if rank0.done() and rank0.exception() is not None:
            await rank0  # rank 0 failed before it joined: nothing else was started
        try:
            stop = await watch.cancelled()
        except BaseException:
            await asyncio.gather(rank0, return_exceptions=True)
            raise
        if stop:
            await rank0
            return False
        await _gather_all([rank0, *(self._start(c, cid) for c, cid in rest)])
        return True

    async def create_network(self, request: NetworkRequest) -> str:
        """Creates the app's network and returns its id; idempotent and safe under races.

        Docker does not enforce unique network names under concurrent creates, so after creating,
        the networks of that name and app are listed and the oldest wins; a duplicate made here is
        removed again, and containers join the winner by id.
        """
        app_id = request.config["Labels"][LABEL_APP_ID]
        lock = self._network_locks.setdefault(request.name, asyncio.Lock())
        async with lock:
            mine = await self._engine.create_network(request.config)
            ours = [
                n
                for n in await self._engine.list_networks(name=request.name)
                if n.get("Name") == request.name
                and (n.get("Labels") or {}).get(LABEL_APP_ID) == app_id
            ]
            if not ours:
                raise DockerSchedulerError(
                    f"network {request.name!r} already exists and belongs to something else"
                )
            winner = str(min(ours, key=lambda n: (str(n.get("Created", "")), str(n["Id"])))["Id"])
            if mine is not None and mine != winner:
                try:
                    await self._engine.remove_network(mine)
                except DockerSchedulerError as e:
                    logger.debug("removing the duplicate network %s failed: %s", mine[:12], e)
        if not lock.locked():
            self._network_locks.pop(request.name, None)
        return winner

    async def _create(self, request: ContainerRequest, network_id: str | None) -> str:
        # Names this process, so that others can tell a container it will never start (it died).
        labels = {**request.config["Labels"], LABEL_LAUNCHER: process_identity()}
        config = {**request.config, "Labels": labels}
        if network_id is not None:
            # Join the app's network by id: a duplicate of its name cannot make it ambiguous.
            config = copy.deepcopy(config)
            config["HostConfig"]["NetworkMode"] = network_id
            endpoints = config.get("NetworkingConfig", {}).get("EndpointsConfig", {})
            endpoint: dict[str, Any] = next(iter(endpoints.values()), {})
            config["NetworkingConfig"] = {"EndpointsConfig": {network_id: endpoint}}
        what = f"role {request.role!r} replica {request.replica_id}: Docker refused the container"
        create = self._engine.create_container(config, request.name, what=what)
        cid = await self._to_the_end(create, f"create:{request.name}")
        assert cid is not None  # not exist_ok: a taken name raises
        return cid

    async def _to_the_end(self, request: Awaitable[T], name: str) -> T:
        """``request``'s result, the request finished even if the caller is cancelled meanwhile
        (its error is raised here, not logged as a failed background task)."""

        async def outcome() -> tuple[T | None, Exception | None]:
            try:
                return await request, None
            except Exception as e:
                return None, e

        result, error = await finish_shielded(self._tasks, outcome(), name)
        if error is not None:
            raise error
        return cast(T, result)  # None only with an error

    async def _start(self, request: ContainerRequest, cid: str) -> None:
        what = f"role {request.role!r} replica {request.replica_id}: the container did not start"
        await self._engine.start_container(cid, what=what)

    async def purge(self, app_id: str, network: NetworkRequest | None) -> None:
        """Removes every container of the app (its own network, its launch claim). Idempotent.

        Raises:
            DockerSchedulerError: something could not be removed (the engine cannot be reached,
                say); what could be was removed, and doing it again finishes the rest.
        """
        containers = await self._engine.list_containers(f"{LABEL_APP_ID}={app_id}")
        removed = await asyncio.gather(
            *(self._engine.remove_container(str(c.get("Id", ""))) for c in containers),
            return_exceptions=True,
        )
        failures = [r for r in removed if isinstance(r, Exception)]
        if network is not None and not failures:  # else containers may still hold it
            await remove_networks(self._engine, app_id)
        await _gather_all(
            [
                self._engine.remove_volume(claim_name(app_id)),
                self._engine.remove_volume(cancel_record_name(app_id)),
            ]
        )
        if failures:
            raise failures[0]


async def _until_joined(
    started: asyncio.Future[None], joins: AsyncIterator[str] | None, cid: str
) -> None:
    """Returns once container ``cid`` has joined (``joins`` says so) or its start has ended."""

    async def joined() -> None:
        if joins is not None:
            try:
                async for joiner in joins:
                    if joiner == cid:
                        return
            except DockerSchedulerError as e:
                logger.debug("following network joins failed (%s)", e)
        await asyncio.wait({started})

    watcher = asyncio.ensure_future(joined())
    try:
        await asyncio.wait({started, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


def _marker_image(job: DockerJob) -> str:
    """An image the app's cancel marker can be made from (the launch has it locally)."""
    return str(job.containers[0].config["Image"])


def _cpus_wanted(job: DockerJob) -> list[tuple[str, float]]:
    """The roles that ask for CPUs, with how many (one entry per replica)."""
    return [
        (c.role, c.config["HostConfig"]["NanoCpus"] / 1e9)
        for c in job.containers
        if c.config["HostConfig"].get("NanoCpus")
    ]


async def _answer(value: Any) -> Any:
    """``value``, as the answer of a question that needs no engine."""
    return value


def _nothing() -> None:
    pass


async def _gather_all(coros: list[Any]) -> list[Any]:
    """Runs ``coros`` concurrently; returns their results, or raises the first failure once all
    have ended (so that nothing is still being created when the clean-up starts)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)
