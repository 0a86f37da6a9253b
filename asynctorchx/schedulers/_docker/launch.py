"""Submitting a ``DockerJob``: checks first, then the network, the containers, and the starts.

Everything is checked before anything is created (images, pulled when missing; named volumes; an
existing network; the CPUs asked for against the engine's), so bad input leaves nothing behind. A
failure after that removes whatever was created for the app (``purge``), shielded from the caller's
cancellation: a failed submit leaves nothing running.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

from asynctorchx.schedulers._docker.actions import remove_networks
from asynctorchx.schedulers._docker.engine import DockerEngine, DockerSchedulerError
from asynctorchx.schedulers._docker.request import (
    LABEL_APP_ID,
    ContainerRequest,
    DockerJob,
    NetworkRequest,
)

logger = logging.getLogger(__name__)


class Launcher:
    """Creates and starts apps on one engine.

    Args:
        engine: the engine to submit to.
    """

    def __init__(self, engine: DockerEngine) -> None:
        self._engine = engine
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

    async def launch(self, job: DockerJob) -> None:
        """Creates the app's network and containers, then starts them (rank 0 first).

        Raises:
            DockerSchedulerError: the engine refused something (names the role and replica); what
                was created is left for ``purge``.
        """
        network_id = None
        if job.network_request is not None:
            network_id = await self.create_network(job.network_request)
        created = await _gather_all([self._create(c, network_id) for c in job.containers])
        # Rank 0 first: once it has started, its hostname resolves on the app's network, so the
        # others never start looking for a TORCHX_RANK0_HOST that does not exist yet.
        pairs = list(zip(job.containers, created, strict=True))
        await self._start(*pairs[0])
        await _gather_all([self._start(c, cid) for c, cid in pairs[1:]])

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
        config = request.config
        if network_id is not None:
            # Join the app's network by id: a duplicate of its name cannot make it ambiguous.
            config = copy.deepcopy(config)
            config["HostConfig"]["NetworkMode"] = network_id
            endpoints = config.get("NetworkingConfig", {}).get("EndpointsConfig", {})
            endpoint: dict[str, Any] = next(iter(endpoints.values()), {})
            config["NetworkingConfig"] = {"EndpointsConfig": {network_id: endpoint}}
        what = f"role {request.role!r} replica {request.replica_id}: Docker refused the container"
        cid = await self._engine.create_container(config, request.name, what=what)
        assert cid is not None  # not exist_ok: a taken name raises
        return cid

    async def _start(self, request: ContainerRequest, cid: str) -> None:
        what = f"role {request.role!r} replica {request.replica_id}: the container did not start"
        await self._engine.start_container(cid, what=what)

    async def purge(self, app_id: str, network: NetworkRequest | None) -> None:
        """Removes every container of the app (and its own network). Errors are logged."""
        try:
            containers = await self._engine.list_containers(f"{LABEL_APP_ID}={app_id}")
            await asyncio.gather(
                *(self._engine.remove_container(str(c.get("Id", ""))) for c in containers),
                return_exceptions=True,
            )
            if network is not None:
                await remove_networks(self._engine, app_id)
        except Exception:
            logger.exception("cleaning up after the failed submit of %s", app_id)


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


async def _gather_all(coros: list[Any]) -> list[Any]:
    """Runs ``coros`` concurrently; returns their results, or raises the first failure once all
    have ended (so that nothing is still being created when the clean-up starts)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)
