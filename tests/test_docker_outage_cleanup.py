# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""The local_docker backend's clean-up when the engine fails under it, and a retry it refuses.

- A submit cut off by an outage (at a container's create or start) leaves nothing once the engine
  is back, and its app never reads PENDING meanwhile.
- A ROLE retry the engine refuses (the app's network was removed behind our back) fails the app,
  saying why, for every process, and its other replicas are stopped.
- A cancel whose stop was cut off by an outage is finished once the engine is back (by the second
  cancel, or before it), with one SIGTERM per container.
- A ROLE retry cut off by an outage at its first container's start (its create went through) is
  made once the engine is back: that container is started, the replicas it had not got to made.

The real engine is reached through ``EngineForwarder`` (``_docker_proxy.py``), which goes down at
a chosen request (``TrippingForwarder``). Skipped without an engine, failed in CI
(``ASYNCTORCHX_REQUIRE_ENGINES=1``), like ``test_docker_engine.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
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
from _docker_proxy import EngineForwarder, Mode, outage_scheduler  # noqa: F401 - a fixture

from asynctorchx.schedulers._docker.request import LABEL_APP_ID, LABEL_SESSION, network_name_for
from asynctorchx.schedulers.docker import DockerEngineUnavailableError, DockerScheduler
from asynctorchx.specs import AppDef, AppState, BindMount, RetryPolicy

pytestmark = pytest.mark.docker

NOTHING: dict[str, list[str]] = {"containers": [], "networks": [], "volumes": []}


class TrippingForwarder(EngineForwarder):
    """An ``EngineForwarder`` that goes down (``Mode.DROP`` for every request) at the first
    request whose line contains every part given to ``trip_at``: that request is dropped too, so
    the engine never sees it, and so is every later one until the mode is set back."""

    _trip: tuple[str, ...] = ()

    def trip_at(self, *parts: str) -> None:
        self._trip = parts

    async def _hold(self, data: bytes) -> bool:
        # runs in the forwarder's own loop, before the request is noted and forwarded
        line = data.split(b"\r\n", 1)[0].decode("latin-1")
        if self._trip and all(p in line for p in self._trip):
            self._trip = ()
            await self._set_mode(Mode.DROP, "")
        return await super()._hold(data)


@pytest.fixture
def forwarder(docker_engine: None) -> Iterator[TrippingForwarder]:
    """A forwarder to the real engine, forwarding until it trips (see ``TrippingForwarder``)."""
    with TrippingForwarder() as fw:
        yield fw


async def _leftovers(session: str) -> dict[str, list[str]]:
    """The containers, networks and volumes of ``session`` (asked of the engine directly)."""
    label = f"{LABEL_SESSION}={session}"
    async with aiodocker.Docker() as client:
        containers = await client.containers.list(all=True, filters=json.dumps({"label": [label]}))
        networks = await client.networks.list(filters={"label": [label]})
        volumes = (await client.volumes.list(filters={"label": [label]})).get("Volumes") or []
    return {
        "containers": sorted(f"{c['Names'][0]} {c['State']}" for c in containers),
        "networks": sorted(n["Name"] for n in networks),
        "volumes": sorted(v["Name"] for v in volumes),
    }


async def _until_nothing_is_left(session: str, seconds: float) -> dict[str, list[str]]:
    """Polls the engine until ``session`` has nothing left, at most ``seconds``; returns what
    is left then."""
    left = await _leftovers(session)
    with anyio.move_on_after(seconds):
        while left != NOTHING:
            await asyncio.sleep(0.2)
            left = await _leftovers(session)
    return left


async def _running(app_id: str) -> list[str]:
    """The names of the app's containers the engine has running (asked directly)."""
    label = json.dumps({"label": [f"{LABEL_APP_ID}={app_id}"]})
    async with aiodocker.Docker() as client:
        listed = await client.containers.list(all=True, filters=label)
    return [c["Names"][0].lstrip("/") for c in listed if c["State"] == "running"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("trip", ["/containers/create?", "/start HTTP"])
async def test_a_submit_cut_off_by_an_outage_leaves_nothing_once_the_engine_is_back(
    outage_scheduler: DockerScheduler,
    forwarder: TrippingForwarder,
    busybox_image: str,
    docker_session: str,
    trip: str,
) -> None:
    """The engine goes down at a container's create (or start) in a submit: the submit raises
    DockerEngineUnavailableError and cannot remove what it made (its network, its launch claim,
    maybe containers). Once the engine is back, that is removed, and the app reads unknown, as
    a failed submit does; it used to be left, reading PENDING "being submitted" for ever."""
    info = outage_scheduler.submit_dryrun(
        AppDef("outage", [sh(busybox_image, "exec sleep 300", n=2)]), {}
    )
    app_id = info.request.app_id
    forwarder.trip_at("POST", trip)
    with anyio.fail_after(30), pytest.raises(DockerEngineUnavailableError) as caught:
        await outage_scheduler.schedule(info)
    assert "Docker engine" in str(caught.value)
    left = await _leftovers(docker_session)
    assert left["networks"], f"the outage left nothing to clean up: {left}"
    forwarder.set_mode(Mode.FORWARD)  # the engine is back

    seen = await outage_scheduler.describe(app_id)
    exists = await outage_scheduler.exists(app_id)
    left = await _until_nothing_is_left(docker_session, 20)
    assert left == NOTHING, f"still left after 20 s: {left}; describe said {seen}"
    assert seen is None and not exists
    assert await outage_scheduler.describe(app_id) is None
    other = DockerScheduler("someone-else", watch_events=False)
    try:
        assert await other.describe(app_id) is None
    finally:
        await other.close()


@pytest.mark.timeout(90)
async def test_a_retry_the_engine_refuses_fails_the_app_and_stops_its_other_replicas(
    docker_scheduler: DockerScheduler, busybox_image: str, docker_session: str, tmp_path: Path
) -> None:
    """The app's own network is removed behind our back, then a replica with a ROLE retry left
    fails: the engine refuses the retry's container (its network is gone). The app ends FAILED,
    saying why, for every process, and its other replica is stopped; it used to read RUNNING
    "retrying" for good, the other replica running."""
    gate = tmp_path / "gate"
    gate.mkdir()
    worker = sh(
        busybox_image,
        "while [ ! -f /gate/go ]; do sleep 0.1; done; exit 3",
        name="w",
        max_retries=1,
        retry_policy=RetryPolicy.ROLE,
        mounts=[BindMount(str(gate), "/gate")],
    )
    app = AppDef("net", [sh(busybox_image, "exec sleep 300"), worker])
    app_id = await docker_scheduler.submit(app, {"stop_timeout": 1})
    await wait_for(docker_scheduler, app_id, lambda r: r.state == AppState.RUNNING)
    async with aiodocker.Docker() as client:
        network = await client.networks.get(network_name_for(app_id))
        for name in (f"{app_id}-main-0", f"{app_id}-w-0"):
            await network.disconnect({"Container": name, "Force": True})
        await network.delete()
    await anyio.Path(gate / "go").touch()

    resp = await wait_for(docker_scheduler, app_id, timeout=30)
    assert resp.state == AppState.FAILED, resp
    assert "retry attempt 1 (role 'w') could not be made" in resp.msg, resp.msg
    assert "not found" in resp.msg, resp.msg  # the engine's reason: the network
    with anyio.fail_after(20):  # the survivor's stop: SIGKILL after the 1 s stop_timeout
        while await _running(app_id):
            await asyncio.sleep(0.2)
    other = DockerScheduler("someone-else", watch_events=False)
    try:
        seen = await other.describe(app_id)
    finally:
        await other.close()
    assert seen is not None and seen.state == AppState.FAILED and seen.msg == resp.msg


@pytest.mark.timeout(90)
async def test_a_cancel_cut_off_by_an_outage_is_finished_once_the_engine_is_back(
    outage_scheduler: DockerScheduler, forwarder: TrippingForwarder, busybox_image: str
) -> None:
    """The engine goes down at a cancel's stop request (after its marker): the cancel raises
    DockerEngineUnavailableError. Once the engine is back, a second cancel from the same
    scheduler finishes the stop (it used to do nothing: the marker named this process as the
    canceller) and the app ends CANCELLED, its container signalled once."""
    script = "trap 'echo term' TERM; echo up; while :; do sleep 0.001; done"
    app_id = await outage_scheduler.submit(
        AppDef("cx", [sh(busybox_image, script)]), {"stop_timeout": 2}
    )
    with anyio.fail_after(30):
        async with contextlib.aclosing(
            outage_scheduler.log_iter(app_id, "main", should_tail=True)  # type: ignore[type-var]
        ) as tail:
            async for line in tail:
                assert line == "up\n"
                break
    forwarder.trip_at("POST", "/stop")
    with anyio.fail_after(30), pytest.raises(DockerEngineUnavailableError) as caught:
        await outage_scheduler.cancel(app_id)
    assert "Docker engine" in str(caught.value)
    assert forwarder.lines("POST", "/stop")
    forwarder.set_mode(Mode.FORWARD)  # the engine is back; the user cancels again

    with anyio.fail_after(30):
        await outage_scheduler.cancel(app_id)
        resp = await wait_for(outage_scheduler, app_id, timeout=25)
    assert resp.state == AppState.CANCELLED, resp
    assert await collect(outage_scheduler.log_iter(app_id, "main")) == ["up\n", "term\n"]


async def _states(app_id: str) -> dict[str, str]:
    """The engine's state of each container of the app, by name (asked directly)."""
    label = json.dumps({"label": [f"{LABEL_APP_ID}={app_id}"]})
    async with aiodocker.Docker() as client:
        listed = await client.containers.list(all=True, filters=label)
    return {c["Names"][0].lstrip("/"): c["State"] for c in listed}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [1, 2])
async def test_a_retry_cut_off_by_an_outage_is_made_once_the_engine_is_back(
    outage_scheduler: DockerScheduler,
    forwarder: TrippingForwarder,
    busybox_image: str,
    tmp_path: Path,
    n: int,
) -> None:
    """The engine goes down at the start of a ROLE retry's first container (its create went
    through; with 2 replicas, the second's was never made). Once the engine is back, the retry is
    made (that container started, the other made) and the app, whose attempt 1 exits 0,
    SUCCEEDS. It read PENDING for good: the created container was the replica's current one, so
    nothing asked for the retry any more (and its create, exist_ok, would have skipped the start)."""
    gate = tmp_path / "gate"
    gate.mkdir()
    script = (
        "if [ -f /gate/failed-once ]; then exit 0; fi; "
        "while [ ! -f /gate/go ]; do sleep 0.1; done; touch /gate/failed-once; exit 3"
    )
    worker = sh(
        busybox_image,
        script,
        name="w",
        n=n,
        max_retries=1,
        retry_policy=RetryPolicy.ROLE,
        mounts=[BindMount(str(gate), "/gate")],
    )
    app_id = await outage_scheduler.submit(AppDef("rt", [worker]), {"stop_timeout": 1})
    await wait_for(outage_scheduler, app_id, lambda r: r.state == AppState.RUNNING)
    forwarder.trip_at("POST", "/start HTTP")
    await anyio.Path(gate / "go").touch()
    with anyio.fail_after(30):  # the retry's first create went through, its start was cut off
        while forwarder.mode != Mode.DROP:
            await asyncio.sleep(0.1)
    with anyio.move_on_after(10):
        while len(await _states(app_id)) < n + 1:
            await asyncio.sleep(0.1)
    states = await _states(app_id)
    assert states.get(f"{app_id}-w-0-r1") == "created" and len(states) == n + 1, states
    await asyncio.sleep(1)  # (the scenario: the engine stays down a second)
    forwarder.set_mode(Mode.FORWARD)  # the engine is back

    try:
        resp = await wait_for(outage_scheduler, app_id, timeout=30)
    except TimeoutError as e:
        pytest.fail(f"{e}; the engine has {await _states(app_id)}")
    assert resp.state == AppState.SUCCEEDED and resp.num_restarts == 1, resp
    finished = {f"{app_id}-w-{k}{r}": "exited" for k in range(n) for r in ("", "-r1")}
    with anyio.move_on_after(10):  # the events may tell of an exit before a listing shows it
        while await _states(app_id) != finished:
            await asyncio.sleep(0.1)
    assert await _states(app_id) == finished


@pytest.mark.timeout(90)
async def test_a_retry_cut_off_by_an_outage_then_cancelled_ends_cancelled(
    outage_scheduler: DockerScheduler,
    forwarder: TrippingForwarder,
    busybox_image: str,
    tmp_path: Path,
) -> None:
    """As above, but the app is cancelled (through a connection the outage does not cut) while
    the engine is down for the retrier: the cut-off retry is dropped, and the container it had
    created and not started is removed once the engine is back, so the app ends CANCELLED (a
    created, never-started replica of a live process keeps a cancelled app "cancelling")."""
    gate = tmp_path / "gate"
    gate.mkdir()
    script = "while [ ! -f /gate/go ]; do sleep 0.1; done; exit 3"
    worker = sh(
        busybox_image,
        script,
        name="w",
        max_retries=1,
        retry_policy=RetryPolicy.ROLE,
        mounts=[BindMount(str(gate), "/gate")],
    )
    app_id = await outage_scheduler.submit(AppDef("rc", [worker]), {"stop_timeout": 1})
    await wait_for(outage_scheduler, app_id, lambda r: r.state == AppState.RUNNING)
    forwarder.trip_at("POST", "/start HTTP")
    await anyio.Path(gate / "go").touch()
    with anyio.fail_after(30):
        while forwarder.mode != Mode.DROP:
            await asyncio.sleep(0.1)
    with anyio.move_on_after(10):
        while len(await _states(app_id)) < 2:
            await asyncio.sleep(0.1)
    assert (await _states(app_id)).get(f"{app_id}-w-0-r1") == "created"
    canceller = DockerScheduler(outage_scheduler.session_name, watch_events=False)
    try:
        await canceller.cancel(app_id)
        r = await canceller.describe(app_id)
        assert r is not None and r.msg == "cancelling", r  # the retry's replica may yet start
        forwarder.set_mode(Mode.FORWARD)  # the engine is back for the retrier
        with anyio.fail_after(30):
            while (r := await canceller.describe(app_id)) is None or r.state != AppState.CANCELLED:
                await asyncio.sleep(0.2)
    finally:
        await canceller.close()
    assert f"{app_id}-w-0-r1" not in await _states(app_id)
    assert await _running(app_id) == []
