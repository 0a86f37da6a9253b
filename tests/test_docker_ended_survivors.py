"""local_docker: an app that has failed while nothing followed it still has its survivors stopped.

A failed app's live replicas are stopped by the follow-up of a scheduler that follows the engine's
events. When none does (the launcher was killed as the app failed, and later processes only ran
``status`` and ``cancel``), the app reads FAILED while its other replicas run on: a reviewer saw
three such containers run for more than 30 s, and ``cancel`` did nothing, as the app had ended.
Here that state is made deterministic with schedulers that do not follow the events
(``watch_events=False``): replica 0 fails at once, replica 1 sleeps.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from _docker_env import busybox_image, docker_engine, purge_session, run_python, sh  # noqa: F401

from asynctorchx.schedulers.docker import DockerScheduler
from asynctorchx.specs import AppDef, AppState, is_terminal, macros

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


@pytest.fixture
async def blind_session(docker_engine: None) -> AsyncIterator[str]:  # noqa: F811 - the fixture
    """A session whose containers are removed afterwards."""
    session = f"pytest-{uuid.uuid4().hex[:10]}"
    try:
        yield session
    finally:
        await purge_session(session)


async def _failed_with_a_survivor(session: str, image: str) -> str:
    """Launches, with nothing following the engine's events, a 2-replica app whose replica 0 fails
    (exit 3) while replica 1 sleeps; returns once it reads FAILED with replica 1 still running."""
    launcher = DockerScheduler(session, watch_events=False)
    try:
        role = sh(image, f"[ {macros.replica_id} = 0 ] && exit 3; exec sleep 300", n=2)
        app_id = await launcher.schedule(
            launcher.submit_dryrun(AppDef("survivor", [role]), {"stop_timeout": 2})
        )
        with anyio.fail_after(30):
            while (r := await launcher.describe(app_id)) is None or r.state != AppState.FAILED:
                await asyncio.sleep(0.05)  # nothing to wait on: the events are not followed
    finally:
        await launcher.close()
    assert await _alive(session, app_id) == [1]
    return app_id


async def _alive(session: str, app_id: str) -> list[int]:
    """The replica ids of the app's running containers."""
    s = DockerScheduler(session, watch_events=False)
    try:
        return sorted(c.replica_id for c in await s._events.containers(app_id) if c.alive)
    finally:
        await s.close()


async def test_cancelling_a_failed_app_stops_its_survivor_and_keeps_it_failed(
    blind_session: str,
    busybox_image: str,  # noqa: F811 - the fixture
) -> None:
    """cancel() of the FAILED app (from a scheduler that does not follow the events either, so
    nothing else could stop the survivor) stops replica 1; the app still reads FAILED, with replica
    0's failure as its reason and replica 1 noted as stopped after it."""
    app_id = await _failed_with_a_survivor(blind_session, busybox_image)
    canceller = DockerScheduler(blind_session, watch_events=False)
    try:
        with anyio.fail_after(30):
            await canceller.cancel(app_id)
        with anyio.fail_after(30):
            while await _alive(blind_session, app_id):
                await asyncio.sleep(0.05)
        r = await canceller.describe(app_id)
        assert r is not None and r.state == AppState.FAILED, r
        assert "replica main/0 failed with exit code 3" in r.msg, r.msg
        survivor = r.roles_statuses[0].replicas[1]
        assert "stopped after replica main/0 failed" in survivor.structured_error_msg, survivor
    finally:
        await canceller.close()


async def test_the_cli_cancel_of_a_failed_app_stops_its_survivor(
    blind_session: str,
    busybox_image: str,  # noqa: F811 - the fixture
) -> None:
    """``asynctorchx cancel HANDLE`` of that app says it has ended (exit 0) and, by the time it
    exits, replica 1 is no longer running."""
    app_id = await _failed_with_a_survivor(blind_session, busybox_image)
    handle = f"local_docker://{blind_session}/{app_id}"
    done = await asyncio.to_thread(run_python, "-m", "asynctorchx", "cancel", handle)
    assert done.returncode == 0, done.stderr
    assert "has already ended" in done.stderr and "FAILED" in done.stderr, done.stderr
    assert await _alive(blind_session, app_id) == []


async def test_a_replica_started_after_the_cancel_by_a_starter_that_died_is_stopped_by_cancel(
    blind_session: str,
    busybox_image: str,  # noqa: F811 - the fixture
) -> None:
    """A container started after the app's cancel marker is its starter's to stop (the launch or
    a retry looks for the marker after its starts); one whose starter was killed before it could
    ran on, and every later cancel left it alone (RUNNING "cancelling" for good). Here a launcher
    process that has exited made the app, a canceller process that has exited cancelled it, and
    the container is started again behind their backs: a plain cancel now stops it."""
    launched = await asyncio.to_thread(
        run_python,
        "-c",
        "import asyncio\n"
        "from asynctorchx.schedulers.docker import DockerScheduler\n"
        "from asynctorchx.specs import AppDef, Role\n"
        "async def main():\n"
        f"    s = DockerScheduler({blind_session!r}, watch_events=False)\n"
        f"    role = Role('main', image={busybox_image!r}, entrypoint='sleep', args=['300'])\n"
        "    print(await s.schedule(s.submit_dryrun(AppDef('late', [role]), {'stop_timeout': 1})))\n"
        "    await s.close()\n"
        "asyncio.run(main())\n",
    )
    assert launched.returncode == 0, launched.stderr
    app_id = launched.stdout.strip().splitlines()[-1]
    handle = f"local_docker://{blind_session}/{app_id}"
    cancelled = await asyncio.to_thread(run_python, "-m", "asynctorchx", "cancel", "--wait", handle)
    assert cancelled.returncode == 0, cancelled.stderr
    assert await _alive(blind_session, app_id) == []
    s = DockerScheduler(blind_session, watch_events=False)
    try:
        (replica,) = [c for c in await s._events.containers(app_id) if not c.is_record]
        await s._engine.start_container(replica.id, what="starting it behind the cancel's back")
        assert await _alive(blind_session, app_id) == [0]
        with anyio.fail_after(30):
            await s.cancel(app_id)
            while await _alive(blind_session, app_id):
                await asyncio.sleep(0.1)
        r = await s.describe(app_id)
        assert r is not None and r.state == AppState.CANCELLED, r
    finally:
        await s.close()


async def test_a_cancelled_app_whose_launch_has_not_started_its_replica_is_not_over_yet(
    blind_session: str,
    busybox_image: str,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A launch has created its replica and not started it yet when another scheduler cancels the
    app: the app reads RUNNING "cancelling", not CANCELLED, until the launch has started and
    stopped it (it read CANCELLED, then RUNNING when the start came, then CANCELLED again)."""
    launcher = DockerScheduler(blind_session)
    release = asyncio.Event()
    held = asyncio.Event()
    real_start = launcher.engine.start_container

    async def held_start(cid: str, **kwargs: Any) -> None:
        held.set()
        await release.wait()
        await real_start(cid, **kwargs)

    monkeypatch.setattr(launcher.engine, "start_container", held_start)
    role = sh(busybox_image, "exec sleep 300")
    info = launcher.submit_dryrun(AppDef("held", [role]), {"stop_timeout": 1})
    app_id = info.request.app_id
    launch = asyncio.ensure_future(launcher.schedule(info))
    canceller = DockerScheduler(blind_session, watch_events=False)
    try:
        with anyio.fail_after(30):
            await held.wait()
            await canceller.cancel(app_id)
        r = await canceller.describe(app_id)
        assert r is not None and (r.state, r.msg) == (AppState.RUNNING, "cancelling"), r
        release.set()
        with anyio.fail_after(30):
            await launch
            while (r := await canceller.describe(app_id)) is None or r.state != AppState.CANCELLED:
                assert r is not None and not is_terminal(r.state), r
                await asyncio.sleep(0.05)
        assert await _alive(blind_session, app_id) == []
    finally:
        release.set()
        await asyncio.gather(launch, return_exceptions=True)
        await canceller.close()
        await launcher.close()
