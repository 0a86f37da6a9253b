"""local_docker: an app network that nothing of its app uses is removed by the next scheduler.

Found by a kill-at-random-points sweep of launchers against a slow engine: a launcher SIGKILLed
while its ``POST /networks/create`` was still with the engine left a network that landed after the
process clearing the dead launch had looked for it, and after the claim that named the app was
gone: the network stayed for good (Docker's address pools run out of networks). Here the network
such a create leaves is made directly, beside one of an app whose launch is under way (its claim
exists), and a new scheduler's first look at the engine is awaited.
"""

from __future__ import annotations

import uuid

import pytest
from _docker_env import docker_engine  # noqa: F401 - pytest fixture

from asynctorchx.schedulers._docker.engine import DockerEngine
from asynctorchx.schedulers._docker.request import LABEL_APP_ID
from asynctorchx.schedulers.docker import DockerScheduler

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


async def _networks(engine: DockerEngine, app_id: str) -> list[str]:
    return [str(n["Id"]) for n in await engine.list_networks(label=f"{LABEL_APP_ID}={app_id}")]


async def test_a_network_nothing_of_its_app_uses_is_removed_by_the_next_scheduler(
    docker_engine: None,  # noqa: F811 - the fixture
) -> None:
    """A network of app A (no container, no claim: its launcher died before the engine made it)
    is removed at a new scheduler's first look at the engine; the network of app B, whose claim
    exists (its launch is under way in another process), is kept."""
    orphan, launching = (f"orphan-net-{uuid.uuid4().hex[:8]}" for _ in range(2))
    engine = DockerEngine()
    claim = f"asynctorchx-test-claim-{launching}"
    try:
        for app_id in (orphan, launching):
            await engine.create_network(
                {"Name": f"asynctorchx-{app_id}", "Labels": {LABEL_APP_ID: app_id}}
            )
        client = await engine.client()
        await client.volumes.create({"Name": claim, "Labels": {LABEL_APP_ID: launching}})
        scheduler = DockerScheduler(f"s-{uuid.uuid4().hex[:8]}")
        try:
            await scheduler._events.connected()  # its first look at the engine
            await scheduler._events.caught_up()
        finally:
            await scheduler.close()
        assert await _networks(engine, orphan) == []
        assert len(await _networks(engine, launching)) == 1
    finally:
        for app_id in (orphan, launching):
            for nid in await _networks(engine, app_id):
                await engine.remove_network(nid)
        client = await engine.client()
        await (await client.volumes.get(claim)).delete()
        await engine.close()
