# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""The local_docker backend when the engine fails under it: frozen, or unreachable for a while.

The real engine is reached through ``EngineForwarder`` (``_docker_proxy.py``), which a test switches
to drop every request (an engine restarting) or to answer none (a frozen dockerd). Skipped without
an engine, failed in CI (``ASYNCTORCHX_REQUIRE_ENGINES=1``), like ``test_docker_engine.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import anyio
import pytest
from _docker_env import (  # noqa: F401 - pytest fixtures
    busybox_image,
    docker_engine,
    docker_session,
    purge_session,
    sh,
)
from _docker_proxy import EngineForwarder, Mode, outage_scheduler  # noqa: F401 - a fixture

from asynctorchx.schedulers._docker import engine as engine_module
from asynctorchx.schedulers._docker.engine import DockerEngine
from asynctorchx.schedulers.docker import DockerEngineUnavailableError, DockerScheduler
from asynctorchx.specs import AppDef

pytestmark = pytest.mark.docker

#: log requests dropped that a followed log must outlast: a read used to give up after 6 failed
#: attempts, which aiohttp makes 12 requests (it sends a GET again once when the server hangs up)
OUTLASTED_REQUESTS = 13


@pytest.fixture
def forwarder(docker_engine: None) -> Iterator[EngineForwarder]:
    """A forwarder to the real engine, forwarding (see ``_docker_proxy.py``)."""
    with EngineForwarder() as fw:
        yield fw


async def _first(
    task: asyncio.Future[object], *parts: str, count: int, fw: EngineForwarder
) -> None:
    """Waits until ``fw`` has seen ``count`` requests with ``parts``, or ``task`` has ended."""
    arrival = asyncio.ensure_future(fw.arrived(*parts, count=count))
    try:
        await asyncio.wait([task, arrival], return_when=asyncio.FIRST_COMPLETED)
    finally:
        arrival.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await arrival


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["describe", "cancel", "list"])
async def test_a_frozen_engine_gives_an_error_naming_it_within_the_read_bound(
    forwarder: EngineForwarder,
    docker_session: str,
    monkeypatch: pytest.MonkeyPatch,
    call: str,
) -> None:
    """An engine that accepts connections but never answers: describe, cancel and list raise
    DockerEngineUnavailableError once ``READ_TIMEOUT`` has gone by (they used to wait forever)."""
    monkeypatch.setattr(engine_module, "READ_TIMEOUT", 2.0, raising=False)
    forwarder.set_mode(Mode.STALL)
    scheduler = DockerScheduler(docker_session, docker_host=forwarder.url, watch_events=False)
    calls = {
        "describe": lambda: scheduler.describe("frozen-abc"),
        "cancel": lambda: scheduler.cancel("frozen-abc"),
        "list": scheduler.list,
    }
    try:
        with anyio.fail_after(20), pytest.raises(DockerEngineUnavailableError) as caught:
            await calls[call]()
        assert "Docker engine did not answer in time" in str(caught.value)
        assert forwarder.lines(), "the request never reached the forwarder"
    finally:
        forwarder.set_mode(Mode.FORWARD)
        with anyio.fail_after(20):
            await scheduler.close()


@pytest.mark.timeout(60)
async def test_a_stop_on_a_frozen_engine_is_bounded_by_its_timeout_and_margin(
    forwarder: EngineForwarder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop request waits for the container to stop, so it has its own bound (its stop timeout
    plus ``STOP_READ_MARGIN``), not the request bound; it used to have none."""
    monkeypatch.setattr(engine_module, "READ_TIMEOUT", 300.0, raising=False)
    monkeypatch.setattr(engine_module, "STOP_READ_MARGIN", 1.0, raising=False)
    engine = DockerEngine(docker_host=forwarder.url)
    try:
        await engine.list_containers("asynctorchx.test=none")  # the API version is known now
        forwarder.set_mode(Mode.STALL)
        with anyio.fail_after(20), pytest.raises(DockerEngineUnavailableError) as caught:
            await engine.stop_container("0123456789ab", timeout=1)
        assert "stopping container 0123456789ab" in str(caught.value)
        assert forwarder.lines("POST", "/containers/0123456789ab/stop")
    finally:
        forwarder.set_mode(Mode.FORWARD)
        await engine.close()


@pytest.mark.timeout(60)
async def test_a_followed_log_resumes_after_a_long_engine_outage(
    outage_scheduler: DockerScheduler, forwarder: EngineForwarder, busybox_image: str
) -> None:
    """The engine drops every request while a log is followed, for more attempts than a read used
    to make: once it answers again, the follow goes on without losing or repeating a line."""
    n = 60
    script = f"i=0; while [ $i -lt {n} ]; do i=$((i+1)); echo line$i; sleep 0.1; done"
    app_id = await outage_scheduler.submit(AppDef("outage", [sh(busybox_image, script)]), {})
    got: list[str] = []
    ten = asyncio.Event()

    async def follow() -> None:
        async for line in outage_scheduler.log_iter(app_id, "main", 0, should_tail=True):
            got.append(line.rstrip("\n"))
            if len(got) == 10:
                ten.set()

    reader = asyncio.ensure_future(follow())
    try:
        with anyio.fail_after(25):
            await ten.wait()
            forwarder.set_mode(Mode.DROP)
            dropped = len(forwarder.lines("/logs"))
            await _first(reader, "/logs", count=dropped + OUTLASTED_REQUESTS, fw=forwarder)
            assert not reader.done(), f"the follow ended during the outage: {reader!r}"
            forwarder.set_mode(Mode.FORWARD)
            await reader
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    assert got == [f"line{i}" for i in range(1, n + 1)]


@pytest.mark.timeout(60)
async def test_a_followed_log_waits_out_an_outage_between_attempts_listings(
    outage_scheduler: DockerScheduler, forwarder: EngineForwarder, busybox_image: str
) -> None:
    """The followed replica's container ended while the app goes on: the follow lists the app
    again on each event (or each second); an outage then is waited out, not raised."""
    app = AppDef(
        "relist",
        [
            sh(busybox_image, "echo a1; echo a2; echo a3", name="a"),
            sh(busybox_image, "sleep 60", name="b"),
        ],
    )
    app_id = await outage_scheduler.submit(app, {"stop_timeout": 1})
    got: list[str] = []
    three = asyncio.Event()

    async def follow() -> None:
        async for line in outage_scheduler.log_iter(app_id, "a", 0, should_tail=True):
            got.append(line.rstrip("\n"))
            if len(got) == 3:
                three.set()

    reader = asyncio.ensure_future(follow())
    try:
        with anyio.fail_after(25):
            await three.wait()
            # the engine fails the app's listings only: the reads of the container, which the
            # follow makes again before each listing, go through
            forwarder.set_mode(Mode.DROP, only="/containers/json")
            listed = len(forwarder.lines("/containers/json", app_id))
            await _first(reader, "/containers/json", app_id, count=listed + 3, fw=forwarder)
            assert not reader.done(), f"the follow ended during the outage: {reader!r}"
            forwarder.set_mode(Mode.FORWARD)
            await outage_scheduler.cancel(app_id)
            await reader
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    assert got == ["a1", "a2", "a3"]
