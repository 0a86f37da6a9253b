"""Fixtures for the ``local_docker`` tests: the real engine, its local test images, and a fake client.

Tests import what they use: ``from _docker_env import docker_engine, busybox_image, ...``.

- ``docker_engine`` checks (once per session) that a Docker engine answers ``/_ping``; without one
  the test skips, or fails when ``ASYNCTORCHX_REQUIRE_ENGINES=1`` (CI), like every engine-backed
  test. ``scripts/engines/docker.sh`` installs and starts the engine and builds the images.
- ``busybox_image``, ``python_image`` and ``torch_image`` name the images that script builds,
  after checking they exist.
- ``docker_scheduler`` is a ``DockerScheduler`` with a session name unique to the test; every
  container and network of that session is removed afterwards.
- ``FakeDocker`` imitates the few aiodocker calls the backend makes, for unit tests of error paths
  (a refused create, a failed pull, a race on a network) that a real engine cannot be made to show.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from aiodocker.exceptions import DockerError
from conftest import engine_missing

if TYPE_CHECKING:
    from asynctorchx.specs import Role

BUSYBOX_IMAGE = "asynctorchx-test/busybox:latest"
PYTHON_IMAGE = "asynctorchx-test/python:3.11"
TORCH_IMAGE = "asynctorchx-test/torch:2.13"
SETUP_HINT = "run `bash scripts/engines/docker.sh`"


def _socket_path() -> str:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    return host[len("unix://") :] if host.startswith("unix://") else ""


def _engine_get(path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """A plain HTTP GET on the engine's unix socket: (status, body); (0, b"") when unreachable."""
    sock_path = _socket_path()
    if not sock_path:
        return 0, b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(sock_path)
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: docker\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return 0, b""
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0, b""
    return status, body


@functools.cache
def engine_answers() -> bool:
    """True when the engine answers ``/_ping`` (asked once per test session)."""
    status, body = _engine_get("/_ping")
    return status == 200 and body.strip() == b"OK"


@pytest.fixture
def docker_engine() -> None:
    """A Docker engine answers on DOCKER_HOST (or /var/run/docker.sock); else skip/fail."""
    if not engine_answers():
        engine_missing(f"a running Docker engine ({SETUP_HINT})")


def _require_image(name: str) -> str:
    status, _ = _engine_get(f"/images/{name}/json")
    if status != 200:
        engine_missing(f"the local Docker image {name} ({SETUP_HINT})")
    return name


@pytest.fixture
def busybox_image(docker_engine: None) -> str:
    """The busybox test image (2 MB; sh, nc, sleep...)."""
    return _require_image(BUSYBOX_IMAGE)


@pytest.fixture
def python_image(docker_engine: None) -> str:
    """The Python 3.11 test image (Debian's python3.11 and busybox)."""
    return _require_image(PYTHON_IMAGE)


@pytest.fixture
def torch_image(docker_engine: None) -> str:
    """The Python 3.11 + CPU torch 2.13 test image."""
    return _require_image(TORCH_IMAGE)


@pytest.fixture
def docker_session() -> str:
    """A session name no other test uses (containers are labelled with it)."""
    return f"pytest-{uuid.uuid4().hex[:10]}"


async def purge_session(session: str) -> None:
    """Removes every container, network and volume (launch claims) labelled with ``session``."""
    from asynctorchx.schedulers._docker.request import LABEL_SESSION

    await _purge(f"{LABEL_SESSION}={session}")


async def purge_app(app_id: str) -> None:
    """Removes every container, network and volume of app ``app_id`` (an app of a session the
    test does not own, such as the CLI's default one)."""
    from asynctorchx.schedulers._docker.request import LABEL_APP_ID

    await _purge(f"{LABEL_APP_ID}={app_id}")


async def _purge(label: str) -> None:
    import aiodocker

    async with aiodocker.Docker() as client:
        for c in await client.containers.list(all=True, filters=json.dumps({"label": [label]})):
            with contextlib.suppress(DockerError):
                await c.delete(force=True)
        for n in await client.networks.list(filters={"label": [label]}):
            with contextlib.suppress(DockerError):
                await (await client.networks.get(n["Id"])).delete()
        volumes = await client.volumes.list(filters={"label": [label]})
        for v in volumes.get("Volumes") or []:
            with contextlib.suppress(DockerError):
                await (await client.volumes.get(v["Name"])).delete()


@pytest.fixture
async def docker_scheduler(docker_engine: None, docker_session: str) -> AsyncIterator[Any]:
    """A DockerScheduler for a fresh session; its containers and networks are removed afterwards."""
    from asynctorchx.schedulers.docker import DockerScheduler

    scheduler = DockerScheduler(docker_session)
    try:
        yield scheduler
    finally:
        await scheduler.close()
        await purge_session(docker_session)


# -- helpers for engine tests ---------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def sh(image: str, script: str, *, name: str = "main", n: int = 1, **kwargs: Any) -> Role:
    """A role running ``script`` with busybox sh."""
    from asynctorchx.specs import Role

    return Role(
        name=name, image=image, entrypoint="sh", args=["-c", script], num_replicas=n, **kwargs
    )


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs a new Python process with ``args`` (from the repository, output captured)."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )


async def wait_for(
    scheduler: Any,
    app_id: str,
    done: Any = None,
    timeout: float = 30.0,
) -> Any:
    """Describes the app each time Docker reports a change of it (or every second) until ``done``."""
    from asynctorchx.specs import is_terminal

    done = done or (lambda r: is_terminal(r.state))
    changed = asyncio.Event()
    unsubscribe = scheduler.subscribe(lambda a: changed.set() if a == app_id else None)
    deadline = time.monotonic() + timeout
    try:
        while True:
            changed.clear()
            resp = await scheduler.describe(app_id)
            assert resp is not None, f"app {app_id} is unknown"
            if done(resp):
                return resp
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"app {app_id} still {resp.state.name} after {timeout}s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, 1.0))
    finally:
        unsubscribe()


async def collect(lines: AsyncIterator[str]) -> list[str]:
    """Every line of ``lines``."""
    return [line async for line in lines]


async def containers_of(app_id: str) -> list[str]:
    """The names of the containers Docker has for ``app_id`` (asked directly, not via the backend)."""
    import aiodocker

    from asynctorchx.schedulers._docker.request import LABEL_APP_ID

    async with aiodocker.Docker() as client:
        label = json.dumps({"label": [f"{LABEL_APP_ID}={app_id}"]})
        return [c["Names"][0] for c in await client.containers.list(all=True, filters=label)]


# -- a fake aiodocker client for unit tests ------------------------------------------------------


class FakeContainer:
    """A container of ``FakeDocker``."""

    def __init__(self, docker: FakeDocker, cid: str, name: str, config: dict[str, Any]) -> None:
        self.docker = docker
        self.id = cid
        self.name = name
        self.config = config
        self.state = "created"
        self.exit_code = 0

    def __getitem__(self, key: str) -> Any:
        return self.summary()[key]

    def summary(self) -> dict[str, Any]:
        status = {"created": "Created", "running": "Up 1 second"}.get(
            self.state, f"Exited ({self.exit_code}) 1 second ago"
        )
        return {
            "Id": self.id,
            "Names": [f"/{self.name}"],
            "Image": self.config.get("Image", ""),
            "Labels": dict(self.config.get("Labels") or {}),
            "State": self.state,
            "Status": status,
            "Created": 1_700_000_000,
        }

    async def start(self) -> None:
        self.docker.calls.append(("start", self.name))
        self.docker.start_asked(self.name).set()
        network = self.config.get("HostConfig", {}).get("NetworkMode", "")
        if network in self.docker.networks_by_id:
            # As Docker does: the container joins its network early in its start.
            self.docker.publish(
                {
                    "Type": "network",
                    "Action": "connect",
                    "Actor": {"ID": network, "Attributes": {"container": self.id}},
                }
            )
        hold = self.docker.hold_start.get(self.name)
        if hold is not None:
            await hold.wait()
        if self.name in self.docker.fail_start:
            raise DockerError(500, f"failed to start {self.name}: exec: not found")
        self.state = "running"

    async def stop(self, **_: Any) -> None:
        self.docker.calls.append(("stop", self.name))
        if self.state == "running":
            self.state, self.exit_code = "exited", 143

    async def delete(self, **_: Any) -> None:
        self.docker.calls.append(("delete", self.name))
        self.docker.containers_by_id.pop(self.id, None)

    async def show(self) -> dict[str, Any]:
        return {
            "Id": self.id,
            "Config": self.config,
            "HostConfig": self.config.get("HostConfig", {}),
            "State": {"Running": self.state == "running", "Restarting": False},
            "RestartCount": 0,
        }


class _FakeContainers:
    def __init__(self, docker: FakeDocker) -> None:
        self.docker = docker

    async def create(self, config: dict[str, Any], *, name: str) -> FakeContainer:
        d = self.docker
        d.calls.append(("create", name))
        if name in d.fail_create:
            raise DockerError(400, d.fail_create[name])
        if any(c.name == name for c in d.containers_by_id.values()):
            raise DockerError(409, f'Conflict. The container name "/{name}" is already in use')
        cid = f"c{next(d.ids):063d}"
        container = FakeContainer(d, cid, name, json.loads(json.dumps(config)))
        d.containers_by_id[cid] = container
        return container

    def container(self, cid: str) -> FakeContainer:
        container = self.docker.containers_by_id.get(cid)
        if container is None:
            raise DockerError(404, f"No such container: {cid}")
        return container

    async def list(self, *, all: bool = False, filters: str = "{}") -> list[FakeContainer]:
        self.docker.calls.append(("list", filters))
        await self.docker.reading()
        wanted = json.loads(filters).get("label", [])
        out = []
        for c in self.docker.containers_by_id.values():
            labels = c.config.get("Labels") or {}
            ok = True
            for w in wanted:
                key, sep, value = w.partition("=")
                ok &= key in labels and (not sep or labels[key] == value)
            if ok and (all or c.state == "running"):
                out.append(c)
        return out


class _FakeImages:
    def __init__(self, docker: FakeDocker) -> None:
        self.docker = docker

    async def inspect(self, name: str) -> dict[str, Any]:
        self.docker.calls.append(("image-inspect", name))
        await self.docker.reading()
        if name not in self.docker.present_images:
            raise DockerError(404, f"No such image: {name}")
        return {"Id": f"sha256:{name}"}

    async def pull(self, name: str, **_: Any) -> list[dict[str, Any]]:
        self.docker.calls.append(("pull", name))
        if name in self.docker.pullable:
            self.docker.present_images.add(name)
            return [{"status": "Downloaded"}]
        raise DockerError(
            500,
            f'Get "https://registry-1.docker.io/v2/": dial tcp: lookup registry-1.docker.io: '
            f"no such host ({name})",
        )


class _FakeNetwork:
    def __init__(self, docker: FakeDocker, nid: str) -> None:
        self.docker = docker
        self.id = nid

    async def show(self) -> dict[str, Any]:
        return self.docker.networks_by_id[self.id]

    async def delete(self) -> bool:
        self.docker.calls.append(("network-delete", self.docker.networks_by_id[self.id]["Name"]))
        self.docker.networks_by_id.pop(self.id, None)
        return True


class _FakeNetworks:
    def __init__(self, docker: FakeDocker) -> None:
        self.docker = docker

    async def create(self, config: dict[str, Any]) -> _FakeNetwork:
        d = self.docker
        d.calls.append(("network-create", config["Name"]))
        # Like Docker 20.10 under concurrent creates: the duplicate check can miss a racing create.
        await asyncio.sleep(0)
        if not d.racy_networks and any(
            n["Name"] == config["Name"] for n in d.networks_by_id.values()
        ):
            raise DockerError(409, f"network with name {config['Name']} already exists")
        nid = f"n{next(d.ids):063d}"
        d.networks_by_id[nid] = {
            "Id": nid,
            "Name": config["Name"],
            "Labels": dict(config.get("Labels") or {}),
            "Created": f"2024-01-01T00:00:00.{next(d.ids):09d}Z",
        }
        return _FakeNetwork(d, nid)

    async def get(self, name_or_id: str) -> _FakeNetwork:
        await self.docker.reading()
        for nid, n in self.docker.networks_by_id.items():
            if name_or_id in (nid, n["Name"]):
                return _FakeNetwork(self.docker, nid)
        raise DockerError(404, f"network {name_or_id} not found")

    async def list(self, *, filters: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
        out = []
        for n in self.docker.networks_by_id.values():
            names = (filters or {}).get("name", [])
            labels = (filters or {}).get("label", [])
            if names and not any(x in n["Name"] for x in names):
                continue
            if labels and not all(
                n["Labels"].get(k) == v for k, _, v in (x.partition("=") for x in labels)
            ):
                continue
            out.append(dict(n))
        return out


class _FakeVolumes:
    def __init__(self, docker: FakeDocker) -> None:
        self.docker = docker

    async def get(self, name: str) -> object:
        await self.docker.reading()
        if name not in self.docker.volumes_present:
            raise DockerError(404, f"get {name}: no such volume")
        return object()

    async def list(self, *, filters: dict[str, list[str]]) -> dict[str, Any]:
        await self.docker.reading()
        self.docker.calls.append(("volume_list", json.dumps(filters)))
        wanted = [x.partition("=") for x in filters.get("label", [])]
        return {
            "Volumes": [
                {"Name": name, "Labels": dict(labels)}
                for name, labels in self.docker.labelled_volumes.items()
                if all(k in labels and (not eq or labels[k] == v) for k, eq, v in wanted)
            ]
        }


class _FakeSystem:
    def __init__(self, docker: FakeDocker) -> None:
        self.docker = docker

    async def info(self) -> dict[str, Any]:
        await self.docker.reading()
        return {"NCPU": 2}


class _FakeEventStream:
    """A response of ``GET /events`` from ``FakeDocker`` (network events only), as aiohttp's."""

    def __init__(self, docker: FakeDocker, filters: dict[str, list[str]]) -> None:
        self.docker = docker
        self.filters = filters
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.content = self

    def offer(self, event: dict[str, Any]) -> None:
        f = self.filters
        if f.get("type", [event["Type"]]) != [event["Type"]]:
            return
        if event["Action"] not in f.get("event", [event["Action"]]):
            return
        if f.get("network") and event["Actor"]["ID"] not in f["network"]:
            return
        self.queue.put_nowait(event)

    async def iter_any(self) -> AsyncIterator[bytes]:
        while True:
            yield json.dumps(await self.queue.get()).encode() + b"\n"

    def close(self) -> None:
        if self in self.docker.event_streams:
            self.docker.event_streams.remove(self)


class FakeDocker:
    """An in-memory stand-in for ``aiodocker.Docker``, enough for the backend's submit path.

    Attributes:
        present_images: images present locally; ``pullable`` ones appear when pulled.
        fail_create: container name -> the error message Docker gives when creating it.
        fail_start: container names whose start fails.
        racy_networks: let concurrent creates of one network name all succeed (Docker 20.10 does).
        calls: every call made, in order, as ``(operation, argument)``.
        most_reads_at_once: the most read requests (listings, inspections) in flight at once.
        hold_start: container name -> an event its start waits for once it has joined its network.
        events_refused: ``GET /events`` fails (as an engine that refuses it would).
    """

    def __init__(self, images: set[str] | None = None) -> None:
        self.ids = itertools.count(1)
        self.present_images: set[str] = set(images or ())
        self.pullable: set[str] = set()
        self.fail_create: dict[str, str] = {}
        self.fail_start: set[str] = set()
        self.volumes_present: set[str] = set()
        #: volumes created through the API (launch claims), with their labels
        self.labelled_volumes: dict[str, dict[str, str]] = {}
        self.racy_networks = False
        self.containers_by_id: dict[str, FakeContainer] = {}
        self.networks_by_id: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.containers = _FakeContainers(self)
        self.images = _FakeImages(self)
        self.networks = _FakeNetworks(self)
        self.volumes = _FakeVolumes(self)
        self.system = _FakeSystem(self)
        self.closed = False
        self._reads_in_flight = 0
        self.most_reads_at_once = 0
        self.hold_start: dict[str, asyncio.Event] = {}
        self.events_refused = False
        self.event_streams: list[_FakeEventStream] = []
        self._start_asked: dict[str, asyncio.Event] = {}

    def start_asked(self, name: str) -> asyncio.Event:
        """The event set once the start of container ``name`` has been asked for."""
        return self._start_asked.setdefault(name, asyncio.Event())

    def publish(self, event: dict[str, Any]) -> None:
        """Sends ``event`` to the open event streams that want it."""
        for stream in list(self.event_streams):
            stream.offer(event)

    async def _query_json(
        self, path: str, method: str = "GET", *, data: bytes = b"", **kwargs: Any
    ) -> dict[str, Any]:
        """``POST /volumes/create`` (an existing volume is answered as it is)."""
        if (path, method) != ("volumes/create", "POST"):
            raise DockerError(500, f"the fake engine does not serve {method} {path}")
        config = json.loads(data)
        self.calls.append(("volume_create", config["Name"]))
        labels = self.labelled_volumes.setdefault(config["Name"], dict(config.get("Labels") or {}))
        self.volumes_present.add(config["Name"])
        return {"Name": config["Name"], "Labels": dict(labels)}

    @contextlib.asynccontextmanager
    async def _query(
        self, path: str, *, params: dict[str, Any], timeout: object = None, method: str = "GET"
    ) -> AsyncIterator[Any]:
        """``GET /events`` (the only streamed request the fake answers), ``DELETE /volumes/``."""
        if method == "DELETE" and path.startswith("volumes/"):
            name = path.removeprefix("volumes/")
            self.calls.append(("volume_remove", name))
            if name not in self.volumes_present:
                raise DockerError(404, f"get {name}: no such volume")
            self.volumes_present.discard(name)
            self.labelled_volumes.pop(name, None)
            yield None
            return
        if path != "events" or self.events_refused:
            raise DockerError(500, f"the fake engine does not serve {path}")
        self.calls.append(("events", params["filters"]))
        stream = _FakeEventStream(self, json.loads(params["filters"]))
        self.event_streams.append(stream)
        try:
            yield stream
        finally:
            stream.close()

    async def reading(self) -> None:
        """Counts a read request in flight while it yields once to the event loop (as a real
        request does), so that reads asked at once are seen overlapping."""
        self._reads_in_flight += 1
        self.most_reads_at_once = max(self.most_reads_at_once, self._reads_in_flight)
        try:
            await asyncio.sleep(0)
        finally:
            self._reads_in_flight -= 1

    async def close(self) -> None:
        self.closed = True

    def by_name(self, name: str) -> FakeContainer | None:
        """The container called ``name``, if any."""
        return next((c for c in self.containers_by_id.values() if c.name == name), None)
