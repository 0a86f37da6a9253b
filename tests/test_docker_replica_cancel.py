# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""local_docker: a cancel stops a REPLICA-retried app that Docker keeps restarting.

Found by a review of "an app that reads ended has nothing of it running": the canceller stops the
containers started before its marker and leaves those started after it to their launch
(``started_after``), judged by ``State.StartedAt``, which Docker resets at each restart of its
restart policy. A crash-looping replica restarted after the marker was left to a launch that did
not exist: it went on restarting, and the app read RUNNING "cancelling" for good (about half of
the cancels, at any point of the loop). A container Docker restarted now counts as started
before the marker.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import anyio
import pytest
from _docker_env import busybox_image, docker_engine, purge_session, sh  # noqa: F401

from asynctorchx.schedulers.docker import DockerScheduler
from asynctorchx.specs import AppDef, AppState, RetryPolicy

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


@pytest.fixture
async def session(docker_engine: None) -> AsyncIterator[str]:
    name = f"pytest-{uuid.uuid4().hex[:10]}"
    try:
        yield name
    finally:
        await purge_session(name)


async def _running(session: str, app_id: str) -> list[str]:
    """The names of the app's containers that run or are about to restart."""
    s = DockerScheduler(session, watch_events=False)
    try:
        return [c.name for c in await s._events.containers(app_id) if c.alive]
    finally:
        await s.close()


@pytest.mark.parametrize("delay", [0.0, 0.4, 1.0, 2.5])
async def test_a_cancel_stops_replicas_docker_keeps_restarting(
    session: str, busybox_image: str, delay: float
) -> None:
    """Two replicas that fail 0.1 s after each start, REPLICA policy with 50 retries; a cancel
    from another scheduler ``delay`` s in: within 20 s nothing of the app runs or restarts, and
    it reads CANCELLED."""
    launcher = DockerScheduler(session)
    try:
        role = sh(
            busybox_image,
            "sleep 0.1; exit 3",
            n=2,
            retry_policy=RetryPolicy.REPLICA,
            max_retries=50,
        )
        info = launcher.submit_dryrun(AppDef("crashloop", [role]), {"stop_timeout": 2})
        app_id = await launcher.schedule(info)
        await asyncio.sleep(delay)
        canceller = DockerScheduler(session)
        try:
            await canceller.cancel(app_id)
        finally:
            await canceller.close()
        with anyio.fail_after(20):
            while await _running(session, app_id):
                await asyncio.sleep(0.1)
        reader = DockerScheduler(session, watch_events=False)
        try:
            r = await reader.describe(app_id)
        finally:
            await reader.close()
        assert r is not None and r.state == AppState.CANCELLED, r
    finally:
        await launcher.close()
