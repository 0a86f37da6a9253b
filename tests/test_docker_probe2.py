# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""local_docker against the real engine: processes killed in the middle of a cancel or a submit.

The other processes are real Python children (a canceller, a launcher) held or killed at a chosen
step, synchronised through their stdout; the app is then looked at from this process.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from _docker_env import (  # noqa: F401 - pytest fixtures
    busybox_image,
    collect,
    docker_engine,
    docker_scheduler,
    docker_session,
    sh,
    wait_for,
)

from asynctorchx.schedulers.docker import DockerScheduler
from asynctorchx.specs import AppDef, AppState

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parents[1]

#: A replica whose SIGTERM handler logs "term" and keeps it running (until SIGKILL).
TERM_LOGGER = "trap 'echo term' TERM; echo up; while :; do sleep 0.001; done"

#: A process that cancels ``argv[1]`` through a scheduler of its own and prints "stopping" once
#: its stop requests are with the engine (it then waits for them, to be killed meanwhile).
STOPPING_CANCELLER = textwrap.dedent(
    """
    import asyncio, sys
    from asynctorchx.schedulers.docker import DockerScheduler

    async def main():
        async with DockerScheduler("someone-else") as s:
            real = s.engine.stop_container

            async def stop(cid, **kwargs):
                print("stopping", flush=True)
                return await real(cid, **kwargs)

            s.engine.stop_container = stop
            await s.cancel(sys.argv[1])

    asyncio.run(main())
    """
)


async def _python(script: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, *args, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )


async def _line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    return (await proc.stdout.readline()).decode().strip()


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


async def test_a_canceller_killed_while_its_stop_runs_leaves_one_sigterm(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """A canceller killed after its stop reached the engine (the replica is in its SIGTERM
    handler): the process that then finds it gone does not signal the replica again (the engine
    ends that stop), and the app ends CANCELLED with the handler run once."""
    with anyio.fail_after(60):
        app_id = await docker_scheduler.submit(
            AppDef("terms", [sh(busybox_image, TERM_LOGGER)]), {"stop_timeout": 3}
        )
        lines = docker_scheduler.log_iter(app_id, "main", should_tail=True)
        assert await anext(lines) == "up\n"
        proc = await _python(STOPPING_CANCELLER, app_id)
        try:
            assert await _line(proc) == "stopping"
            assert await anext(lines) == "term\n"  # the engine has sent the SIGTERM
        finally:
            await _kill(proc)
            await lines.aclose()  # type: ignore[attr-defined]
        resp = await wait_for(docker_scheduler, app_id)
    assert resp.state == AppState.CANCELLED
    assert await collect(docker_scheduler.log_iter(app_id, "main")) == ["up\n", "term\n"]


#: A process that submits a 2-replica busybox app in session ``argv[1]`` and prints its id once
#: its submit has done ``argv[2]`` ("network": made the app's network, "created": every container
#: too, "committed": the launch claim removed too), then waits for good (to be killed there).
HELD_LAUNCHER = textwrap.dedent(
    """
    import asyncio, sys
    from asynctorchx.schedulers.docker import DockerScheduler
    from asynctorchx.specs import AppDef, Role

    async def main():
        session, point, image = sys.argv[1:4]
        async with DockerScheduler(session) as s:
            role = Role("main", image, entrypoint="sh", args=["-c", "echo ran"], num_replicas=2)
            info = s.submit_dryrun(AppDef("held", [role]), {"stop_timeout": 1})
            made = 0
            real_create, real_start = s.engine.create_container, s.engine.start_container
            real_network = s.engine.create_network

            async def hold():
                print(info.request.app_id, flush=True)
                await asyncio.Event().wait()

            async def network(*args, **kwargs):
                nid = await real_network(*args, **kwargs)
                if point == "network":
                    await hold()
                return nid

            async def create(*args, **kwargs):
                nonlocal made
                cid = await real_create(*args, **kwargs)
                made += 1
                if point == "created" and made == 2:
                    await hold()
                return cid

            async def start(*args, **kwargs):
                await hold()

            s.engine.create_container, s.engine.start_container = create, start
            s.engine.create_network = network
            await s.schedule(info)

    asyncio.run(main())
    """
)


async def _networks_of(app_id: str) -> list[str]:
    """The names of the networks labelled with ``app_id`` (asked directly)."""
    import aiodocker

    from asynctorchx.schedulers._docker.request import LABEL_APP_ID

    async with aiodocker.Docker() as client:
        nets = await client.networks.list(filters={"label": [f"{LABEL_APP_ID}={app_id}"]})
    return [n["Name"] for n in nets]


@pytest.mark.parametrize("point", ["created", "committed"])
async def test_an_app_whose_launcher_died_before_starting_it_fails(
    docker_scheduler: DockerScheduler, docker_session: str, busybox_image: str, point: str
) -> None:
    """A launcher killed once it has created the app's containers (its launch claim still
    there, or removed) but started none: the app reads FAILED, its launcher having exited (it
    was PENDING for good: a wait never ended), and its network is removed."""
    with anyio.fail_after(60):
        proc = await _python(HELD_LAUNCHER, docker_session, point, busybox_image)
        try:
            app_id = await _line(proc)
            pending = await docker_scheduler.describe(app_id)
        finally:
            await _kill(proc)
        assert pending is not None and pending.state == AppState.PENDING
        resp = await wait_for(docker_scheduler, app_id)
        await docker_scheduler._reconciler.wait_idle()
    assert resp.state == AppState.FAILED
    assert "launcher" in resp.msg, resp.msg
    assert await _networks_of(app_id) == []
    assert await _volumes_of(app_id) == []


async def test_what_a_launcher_killed_before_its_containers_made_is_removed(
    docker_scheduler: DockerScheduler, docker_session: str, busybox_image: str
) -> None:
    """A launcher killed once it has made the app's network and launch claim, before any
    container: the app is unknown, and the network and the claim are removed by the process
    that finds the launcher gone (a describe of the app, or any scheduler's first look at the
    engine's events) instead of staying forever (Docker's address pools run out of networks)."""
    with anyio.fail_after(60):
        ids = []
        for _ in range(2):
            proc = await _python(HELD_LAUNCHER, docker_session, "network", busybox_image)
            try:
                ids.append(await _line(proc))
            finally:
                await _kill(proc)
        assert await docker_scheduler.describe(ids[0]) is None
        await docker_scheduler._reconciler.wait_idle()
        assert await _networks_of(ids[0]) == [] and await _volumes_of(ids[0]) == []
        assert await _networks_of(ids[1]) != []
        other = DockerScheduler("someone-else")
        try:
            await other._events.connected()  # its first look at the engine
            await other._events.caught_up()
            await other._reconciler.wait_idle()
        finally:
            await other.close()
    assert await _networks_of(ids[1]) == [] and await _volumes_of(ids[1]) == []


#: A process that submits a busybox app in session ``argv[1]``, prints its id once its launch
#: claim is made and its image check has begun, and holds that check until a line on stdin (as a
#: long pull would); it prints "scheduled" once ``schedule`` has returned.
CHECKING_LAUNCHER = textwrap.dedent(
    """
    import asyncio, sys
    from asynctorchx.schedulers.docker import DockerScheduler
    from asynctorchx.specs import AppDef, Role

    async def main():
        async with DockerScheduler(sys.argv[1]) as s:
            role = Role("main", sys.argv[2], entrypoint="sh", args=["-c", "exec sleep 300"])
            info = s.submit_dryrun(AppDef("checking", [role]), {"stop_timeout": 1})
            real_claim, real_inspect = s.engine.create_volume, s.engine.inspect_image
            claimed = asyncio.Event()

            async def claim(*args, **kwargs):
                try:
                    return await real_claim(*args, **kwargs)
                finally:
                    claimed.set()

            async def held_check(*args, **kwargs):
                await claimed.wait()
                print(info.request.app_id, flush=True)
                await asyncio.to_thread(sys.stdin.readline)
                return await real_inspect(*args, **kwargs)

            s.engine.create_volume, s.engine.inspect_image = claim, held_check
            await s.schedule(info)
            print("scheduled", flush=True)

    asyncio.run(main())
    """
)


async def test_an_app_cancelled_during_another_processs_checks_reads_cancelled_at_once(
    docker_scheduler: DockerScheduler, docker_session: str, busybox_image: str
) -> None:
    """A cancel from another process while the launcher still checks its image (a pull): right
    after the cancel returns, every process reads the app CANCELLED (it was unknown, ``exists``
    False, until the launch ended), and it stays CANCELLED once the launch has ended."""
    with anyio.fail_after(60):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CHECKING_LAUNCHER,
            docker_session,
            busybox_image,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            app_id = await _line(proc)
            other = DockerScheduler("someone-else")
            try:
                await other.cancel(app_id)
                seen_there, there = await other.describe(app_id), await other.exists(app_id)
            finally:
                await other.close()
            seen_here = await docker_scheduler.describe(app_id)
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
            assert await _line(proc) == "scheduled"
            assert await proc.wait() == 0
        finally:
            await _kill(proc)
        after = await docker_scheduler.describe(app_id)
    assert seen_there is not None and seen_there.state == AppState.CANCELLED and there
    assert seen_here is not None and seen_here.state == AppState.CANCELLED
    assert after is not None and after.state == AppState.CANCELLED
    assert await _volumes_of(app_id) == []


async def _volumes_of(app_id: str) -> list[str]:
    """The names of the volumes labelled with ``app_id`` (asked directly)."""
    import aiodocker

    from asynctorchx.schedulers._docker.request import LABEL_APP_ID

    async with aiodocker.Docker() as client:
        answer = await client.volumes.list(filters={"label": [f"{LABEL_APP_ID}={app_id}"]})
    return [v["Name"] for v in answer.get("Volumes") or []]


@pytest.mark.parametrize("call", ["describe", "cancel"])
async def test_a_launch_committing_between_the_listings_of_a_look_is_not_missed(
    docker_scheduler: DockerScheduler, busybox_image: str, call: str
) -> None:
    """A describe or cancel from another process that lists the app's containers before the
    launch has made them and its volumes after the launch has removed its claim: the app is
    still found (PENDING; cancelled, nothing left running), not unknown (a watcher took that
    for good as "the scheduler no longer knows this app", and the cancel did nothing)."""
    launch_engine = docker_scheduler.engine
    info = docker_scheduler.submit_dryrun(
        AppDef("between", [sh(busybox_image, "exec sleep 300", n=2)]), {"stop_timeout": 1}
    )
    app_id = info.request.app_id
    other = DockerScheduler("someone-else")
    listed, committed = asyncio.Event(), asyncio.Event()
    real_create, real_remove = launch_engine.create_container, launch_engine.remove_volume
    real_list, real_volumes = other.engine.list_containers, other.engine.list_volumes

    async def create_once_listed(*args: object, **kwargs: object) -> object:
        await listed.wait()
        return await real_create(*args, **kwargs)  # type: ignore[arg-type]

    async def remove_noted(name: str) -> bool:
        try:
            return await real_remove(name)
        finally:
            if name.startswith("asynctorchx-launch-"):
                committed.set()

    async def list_noted(label: str) -> list[dict[str, object]]:
        try:
            return await real_list(label)
        finally:
            listed.set()

    async def volumes_once_committed(label: str) -> list[dict[str, object]]:
        await committed.wait()
        return await real_volumes(label)

    launch_engine.create_container = create_once_listed  # type: ignore[method-assign]
    launch_engine.remove_volume = remove_noted  # type: ignore[method-assign]
    other.engine.list_containers = list_noted  # type: ignore[method-assign]
    other.engine.list_volumes = volumes_once_committed  # type: ignore[method-assign]
    try:
        with anyio.fail_after(60):
            submit = asyncio.ensure_future(docker_scheduler.schedule(info))
            if call == "describe":
                seen = await other.describe(app_id)
                await submit
                assert seen is not None, "the app was unknown"
                assert seen.state in (AppState.PENDING, AppState.RUNNING)
            else:
                await other.cancel(app_id)
                await submit
                resp = await wait_for(docker_scheduler, app_id)
                assert resp.state == AppState.CANCELLED
    finally:
        await other.close()
