# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""``local_docker`` cancel returns once the stops are under way, not once the stop timeout is over.

Against the real engine: a replica whose SIGTERM handler keeps it running is killed by the engine
after the app's ``stop_timeout``; ``cancel`` returns long before that (the bounds below are half
the stop timeout: a behaviour, not a speed), the app reads "cancelling" for every process at
once, and CANCELLED (exit 137) once its container is gone. The wait for the stop goes on in a
task of the scheduler, which ``close`` lets finish; a canceller that exits at once leaves the stop
to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
import time
from pathlib import Path

import aiodocker
import anyio
import pytest
from _docker_env import (  # noqa: F401 - pytest fixtures
    busybox_image,
    collect,
    docker_engine,
    docker_scheduler,
    docker_session,
    purge_session,
    sh,
    wait_for,
)

from asynctorchx.runner import AsyncRunner
from asynctorchx.schedulers.docker import DockerScheduler
from asynctorchx.specs import AppDef, AppState, parse_app_handle

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parents[1]

#: A replica whose SIGTERM handler logs "term" and keeps it running (until SIGKILL).
TERM_LOGGER = "trap 'echo term' TERM; echo up; while :; do sleep 0.1; done"


async def _up(scheduler: DockerScheduler, app_id: str) -> None:
    """Returns once the replica has logged "up" (its SIGTERM handler is in place)."""
    async with contextlib.aclosing(
        scheduler.log_iter(app_id, "main", should_tail=True)  # type: ignore[type-var]
    ) as tail:
        async for line in tail:
            assert line == "up\n"
            return


async def _submitted(scheduler: DockerScheduler, image: str, stop_timeout: int) -> str:
    app_id = await scheduler.submit(
        AppDef("stubborn", [sh(image, TERM_LOGGER)]), {"stop_timeout": stop_timeout}
    )
    await _up(scheduler, app_id)
    return app_id


async def _running(app_id: str) -> bool:
    """True while the app's replica container runs (asked of the engine directly)."""
    async with aiodocker.Docker() as client:
        info = await client.containers.container(f"{app_id}-main-0").show()
    return bool(info["State"]["Running"])


async def _cancel_timed(scheduler: DockerScheduler, app_id: str) -> float:
    started = time.monotonic()
    await scheduler.cancel(app_id)
    return time.monotonic() - started


@pytest.mark.timeout(120)
async def test_a_cancel_returns_before_the_stop_timeout_and_the_app_ends_cancelled(
    docker_session: str, busybox_image: str
) -> None:
    """runner.cancel of a replica that ignores SIGTERM (stop_timeout 6 s) returns at once; the
    replica is still running, the app reads "cancelling" for this process and another, and
    ``wait()`` returns CANCELLED once the engine has killed it (exit 137), its handler run once.
    It used to return only once the container had been killed (the whole stop timeout)."""
    stop_timeout = 6
    try:
        async with AsyncRunner(name=docker_session) as runner:
            handle = await runner.run(
                AppDef("stubborn", [sh(busybox_image, TERM_LOGGER)]),
                "local_docker",
                {"stop_timeout": stop_timeout},
            )
            app_id = parse_app_handle(handle).app_id
            with anyio.fail_after(30):
                async for line in runner.log_lines(handle, "main", should_tail=True):
                    assert line == "up\n"
                    break
            started = time.monotonic()
            await runner.cancel(handle)
            took = time.monotonic() - started
            assert took < stop_timeout / 2, f"cancel waited {took:.1f} s for the stop"
            assert await _running(app_id)  # in its stop timeout: the engine kills it later
            here = await runner.status(handle)
            assert here is not None and here.state == AppState.RUNNING and here.msg == "cancelling"
            other = DockerScheduler("someone-else", watch_events=False)
            try:
                seen = await other.describe(app_id)
            finally:
                await other.close()
            assert seen is not None and seen.msg == "cancelling", seen
            await runner.cancel(handle)  # idempotent: no second SIGTERM, returns at once
            final = await runner.wait(handle, timeout=stop_timeout + 30)
            assert final is not None and final.state == AppState.CANCELLED, final
            other = DockerScheduler("someone-else", watch_events=False)
            try:
                resp = await other.describe(app_id)
            finally:
                await other.close()
            assert resp is not None and resp.state == AppState.CANCELLED
            assert resp.roles_statuses[0].replicas[0].exit_code == 137  # SIGKILL
            lines = [line async for line in runner.log_lines(handle, "main")]
            assert lines == ["up\n", "term\n"]
    finally:
        await purge_session(docker_session)


@pytest.mark.timeout(120)
async def test_close_right_after_a_cancel_leaves_no_cancelled_container_running(
    docker_session: str, busybox_image: str
) -> None:
    """cancel() returns at once; close() right after it lets the stop finish: once close returns,
    the replica that ignored SIGTERM has been killed (it used to be the cancel that waited)."""
    stop_timeout = 6
    scheduler = DockerScheduler(docker_session)
    try:
        app_id = await _submitted(scheduler, busybox_image, stop_timeout)
        took = await _cancel_timed(scheduler, app_id)
        assert took < stop_timeout / 2, f"cancel waited {took:.1f} s for the stop"
        with anyio.fail_after(stop_timeout + 30):
            await scheduler.close()
        assert not await _running(app_id), "close left the cancelled container running"
        other = DockerScheduler("someone-else", watch_events=False)
        try:
            seen = await other.describe(app_id)
        finally:
            await other.close()
        assert seen is not None and seen.state == AppState.CANCELLED, seen
        assert seen.roles_statuses[0].replicas[0].exit_code == 137
    finally:
        await scheduler.close()
        await purge_session(docker_session)


#: Cancels ``argv[1]`` through a scheduler of its own, prints how long the cancel took, and
#: exits at once (no close: nothing of the process goes on after the cancel returned).
QUICK_EXIT = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from asynctorchx.schedulers.docker import DockerScheduler

    async def main():
        s = DockerScheduler("someone-else")
        started = time.monotonic()
        await s.cancel(sys.argv[1])
        print(f"{time.monotonic() - started:.3f}", flush=True)
        os._exit(0)

    asyncio.run(main())
    """
)


@pytest.mark.timeout(120)
async def test_a_canceller_that_exits_as_soon_as_cancel_returns_leaves_the_stop_to_the_engine(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """Another process cancels (returning before the stop timeout) and exits at once: every
    process reads the cancel at once (the marker), and the engine goes on with the stop it was
    asked for: SIGKILL after the stop timeout, one SIGTERM in all, the app CANCELLED."""
    stop_timeout = 6
    app_id = await _submitted(docker_scheduler, busybox_image, stop_timeout)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", QUICK_EXIT, app_id, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    with anyio.fail_after(60):
        out, _ = await proc.communicate()
    assert proc.returncode == 0
    took = float(out.decode().strip())
    assert took < stop_timeout / 2, f"cancel waited {took:.1f} s for the stop"
    fresh = DockerScheduler("a-third-process", watch_events=False)
    try:
        seen = await fresh.describe(app_id)
    finally:
        await fresh.close()
    assert seen is not None and seen.msg in ("cancelling", "cancelled"), seen
    resp = await wait_for(docker_scheduler, app_id, timeout=stop_timeout + 30)
    assert resp.state == AppState.CANCELLED, resp
    assert resp.roles_statuses[0].replicas[0].exit_code == 137
    assert await collect(docker_scheduler.log_iter(app_id, "main")) == ["up\n", "term\n"]


@pytest.mark.timeout(120)
async def test_two_cancels_at_once_both_return_before_the_stop_timeout_with_one_sigterm(
    docker_scheduler: DockerScheduler, busybox_image: str
) -> None:
    """Two cancels of one app at the same time in one process (and a third, from another
    scheduler) return before the stop timeout; the replica gets one SIGTERM."""
    stop_timeout = 6
    app_id = await _submitted(docker_scheduler, busybox_image, stop_timeout)
    other = DockerScheduler("someone-else")
    try:
        took = await asyncio.gather(
            _cancel_timed(docker_scheduler, app_id),
            _cancel_timed(docker_scheduler, app_id),
            _cancel_timed(other, app_id),
        )
        assert max(took) < stop_timeout / 2, f"the cancels took {took}"
        resp = await wait_for(docker_scheduler, app_id, timeout=stop_timeout + 30)
    finally:
        await other.close()
    assert resp.state == AppState.CANCELLED, resp
    assert await collect(docker_scheduler.log_iter(app_id, "main")) == ["up\n", "term\n"]
