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

        Raises:
            DockerSchedulerError: what is missing or wrong (names the role and the value).
        """
        if await self._engine.list_containers(f"{LABEL_APP_ID}={job.app_id}"):
            raise DockerSchedulerError(
                f"app {job.app_id!r} already exists; a dry run can be scheduled only once"
            )
        for image, role in job.images.items():
            await self._ensure_image(image, role)
        for volume, role in job.volumes.items():
            if not await self._engine.volume_exists(volume):
                raise DockerSchedulerError(
                    f"role {role!r}: volume {volume!r} does not exist; create it first "
                    f"(docker volume create {volume})"
                )
        shared = job.network_request is None and job.network not in ("bridge", "host", "none")
        if shared and not await self._engine.network_exists(job.network):
            raise DockerSchedulerError(
                f"network {job.network!r} (run option 'network') does not exist; create it "
                f"first (docker network create {job.network}) or leave the option unset"
            )
        await self._check_cpus(job)

    async def _ensure_image(self, image: str, role: str) -> None:
        try:
            if await self._engine.inspect_image(image) is not None:
                return
            logger.info("image %s is not present locally; pulling it", image)
            await self._engine.pull_image(image)
        except DockerSchedulerError as e:
            raise type(e)(f"role {role!r}: {e}") from None

    async def _check_cpus(self, job: DockerJob) -> None:
        wanted = [
            (c.role, c.config["HostConfig"]["NanoCpus"] / 1e9)
            for c in job.containers
            if c.config["HostConfig"].get("NanoCpus")
        ]
        ncpu = await self._engine.cpu_count() if wanted else None
        for role, cpus in wanted:
            if ncpu is not None and cpus > ncpu:
                raise DockerSchedulerError(
                    f"role {role!r}: resource.cpu={cpus:g} is more than the {ncpu:g} CPUs "
                    "of the Docker host"
                )

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


async def _gather_all(coros: list[Any]) -> list[Any]:
    """Runs ``coros`` concurrently; returns their results, or raises the first failure once all
    have ended (so that nothing is still being created when the clean-up starts)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)
