"""The same log, cancel and describe cases against every backend: local, Docker and Slurm for real,
Kubernetes on the fake API server (``tests/k8s_fake``).

What every backend must do alike (``Scheduler`` in ``schedulers/api.py``): ``log_iter`` raises
its argument errors at the call, with the same types and messages; an unknown app, role or
replica raises at the first iteration; without ``streams`` it gives everything the replica wrote;
``since``/``until`` split the lines by when they were written; a tail follows the app until it is
terminal, then drains and stops; cancelling an unknown or finished app does nothing, cancelling a
running one ends it CANCELLED; describing an unknown app gives None.

A replica's behaviour is written once as a ``Program`` (lines on stdout or stderr, pauses, running
until stopped) and each backend runs it its way: ``sh -c`` on the local, Docker and Slurm
backends, a scripted pod on the fake Kubernetes cluster (one log per pod, as Kubernetes keeps it).
"""

from __future__ import annotations

import abc
import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from _docker_env import busybox_image, docker_engine, docker_scheduler, docker_session  # noqa: F401
from _slurm_env import CountingRunner, check_cluster, scancel
from k8s_fake import PodScript
from k8s_fake.server import FakeKubeApiServer
from k8s_fake.testing import fake_k8s, k8s_scheduler  # noqa: F401

from asynctorchx.logs import Stream
from asynctorchx.schedulers.api import DescribeAppResponse, Scheduler, UnknownRoleException
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.schedulers.slurm import SlurmScheduler
from asynctorchx.specs.api import (
    AppDef,
    AppState,
    Resource,
    Role,
    UnknownAppException,
    is_terminal,
    make_app_handle,
)

# -- what a replica does ----------------------------------------------------------------------


@dataclass(frozen=True)
class Out:
    """Writes ``text`` and a newline to stdout."""

    text: str


@dataclass(frozen=True)
class Err:
    """Writes ``text`` and a newline to stderr."""

    text: str


@dataclass(frozen=True)
class Pause:
    """Waits ``seconds``."""

    seconds: float


@dataclass(frozen=True)
class Forever:
    """Runs until stopped (exits at once on SIGTERM)."""


Step = Out | Err | Pause | Forever
Program = tuple[Step, ...]


def shell(program: Program) -> str:
    """The program as an ``sh -c`` script."""
    words = []
    for step in program:
        if isinstance(step, Out):
            words.append(f"echo {step.text}")
        elif isinstance(step, Err):
            words.append(f"echo {step.text} >&2")
        elif isinstance(step, Pause):
            words.append(f"sleep {step.seconds}")
        else:
            words.append("trap 'exit 143' TERM; while :; do sleep 0.05; done")
    return "; ".join(words)


def pod_script(program: Program) -> PodScript:
    """The program as a pod of the fake cluster: its lines (both streams in one log), each written
    once the pauses before it have passed, and held open for ``Forever``."""
    loop = asyncio.get_running_loop()
    lines: list[str | bytes] = []
    gates: dict[int, asyncio.Event] = {}
    delay = 0.0
    hold = None
    for step in program:
        if isinstance(step, (Out, Err)):
            if delay:
                gate = gates[len(lines)] = asyncio.Event()
                loop.call_later(delay, gate.set)
            lines.append(step.text + "\n")
        elif isinstance(step, Pause):
            delay += step.seconds
        else:
            hold = asyncio.Event()
    return PodScript(lines=lines, gates=gates, hold=hold)


# -- the backends -----------------------------------------------------------------------------


class Backend(abc.ABC):
    """One backend under test: its scheduler, and how it runs a one-replica ``Program``."""

    #: an app id in this backend's format that it does not know
    unknown_id = "nope-12345678"

    def __init__(self, scheduler: Scheduler[Any]) -> None:
        self.scheduler = scheduler

    @abc.abstractmethod
    def role(self, program: Program) -> Role:
        """The role ``main`` (one replica) that runs ``program``."""

    def cfg(self) -> dict[str, Any]:
        return {}

    async def submit(self, program: Program) -> str:
        app = AppDef(f"contract-{uuid.uuid4().hex[:6]}", [self.role(program)])
        return await self.scheduler.submit(app, self.cfg())

    def handle(self, app_id: str) -> str:
        s = self.scheduler
        return make_app_handle(s.backend, s.session_name, app_id)

    async def wait_for(
        self, app_id: str, done: set[AppState] | None = None, timeout: float = 90.0
    ) -> DescribeAppResponse:
        """Describes the app (bounded polling of the backend) until it is in ``done`` (default:
        terminal)."""
        with anyio.fail_after(timeout):
            while True:
                desc = await self.scheduler.describe(app_id)
                assert desc is not None, f"{self.scheduler.backend} forgot app {app_id}"
                if (done is None and is_terminal(desc.state)) or (done and desc.state in done):
                    return desc
                await asyncio.sleep(0.1)


class LocalBackend(Backend):
    def role(self, program: Program) -> Role:
        return Role("main", image=".", entrypoint="sh", args=["-c", shell(program)])


class DockerBackend(Backend):
    def __init__(self, scheduler: Scheduler[Any], image: str) -> None:
        super().__init__(scheduler)
        self.image = image

    def role(self, program: Program) -> Role:
        return Role("main", image=self.image, entrypoint="sh", args=["-c", shell(program)])


class SlurmBackend(Backend):
    unknown_id = "987654321"

    def __init__(self, scheduler: Scheduler[Any], job_dir: Path) -> None:
        super().__init__(scheduler)
        self.job_dir = job_dir

    def role(self, program: Program) -> Role:
        return Role(
            "main",
            image="/tmp",
            entrypoint="sh",
            args=["-c", shell(program)],
            resource=Resource(cpu=1, gpu=0, memMB=64),
        )

    def cfg(self) -> dict[str, Any]:
        return {"job_dir": str(self.job_dir)}


class KubernetesBackend(Backend):
    unknown_id = "default:nothing-here-1234"

    def __init__(self, scheduler: Scheduler[Any], server: FakeKubeApiServer) -> None:
        super().__init__(scheduler)
        self.server = server

    def role(self, program: Program) -> Role:
        self.server.cluster.script = lambda ctx: pod_script(program)
        return Role("main", image="registry.example/img:1", entrypoint="sh", args=["-c", "..."])


@pytest.fixture
async def local_backend(tmp_path: Path) -> AsyncIterator[Backend]:
    """The local backend, on a state root of the test's own."""
    async with LocalScheduler(f"contract-{uuid.uuid4().hex[:8]}", local_root=tmp_path) as local:
        yield LocalBackend(local)


@pytest.fixture
def docker_backend(busybox_image: str, docker_scheduler: Any) -> Backend:  # noqa: F811
    """The Docker backend on the real engine (busybox replicas)."""
    return DockerBackend(docker_scheduler, busybox_image)


@pytest.fixture
async def slurm_backend(tmp_path: Path) -> AsyncIterator[Backend]:
    """The Slurm backend on the test cluster (its jobs scancelled afterwards)."""
    check_cluster()
    runner = CountingRunner()
    job_dir = tmp_path / "jobs"
    job_dir.mkdir()
    slurm = SlurmScheduler(f"contract-{uuid.uuid4().hex[:8]}", runner=runner)
    try:
        yield SlurmBackend(slurm, job_dir)
    finally:
        await slurm.close()
        scancel(runner.submitted)


@pytest.fixture
def kubernetes_backend(fake_k8s: FakeKubeApiServer, k8s_scheduler: Any) -> Backend:  # noqa: F811
    """The Kubernetes backend on the fake API server."""
    return KubernetesBackend(k8s_scheduler, fake_k8s)


@pytest.fixture(params=["local", "docker", "slurm", "kubernetes"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each backend in turn (Docker and Slurm fail rather than skip with
    ASYNCTORCHX_REQUIRE_ENGINES=1 when their engine is missing)."""
    found: Backend = request.getfixturevalue(f"{request.param}_backend")
    return found


async def read(backend: Backend, app_id: str, role: str = "main", **kw: Any) -> list[str]:
    """Every line ``log_iter`` gives."""
    with anyio.fail_after(60):
        return [ln async for ln in backend.scheduler.log_iter(app_id, role, **kw)]


@pytest.fixture
def now() -> datetime:
    """The time the test started."""
    return datetime.now()


# -- argument errors, at the call -------------------------------------------------------------


def expected_stream_error(backend: Backend, asked: str) -> str:
    s = backend.scheduler
    can = ", ".join(x.value for x in Stream if x in s.log_streams)
    return f"unsupported log stream {asked!r}; the {s.backend} scheduler reads {can}"


@pytest.mark.timeout(120)
async def test_argument_errors_raise_at_the_call_with_the_same_messages(
    backend: Backend, now: datetime
) -> None:
    """A bad stream, regex, time window, replica index or argument type raises at the call (before
    any iteration, whether the app exists or not), with the same type and message everywhere."""
    s, app_id = backend.scheduler, backend.unknown_id
    with pytest.raises(ValueError) as info:
        s.log_iter(app_id, "main", streams="both")  # type: ignore[arg-type]
    assert str(info.value) == expected_stream_error(backend, "both")
    with pytest.raises(ValueError, match=r"^invalid log regex '\(': "):
        s.log_iter(app_id, "main", regex="(")
    before = now - timedelta(seconds=1)
    with pytest.raises(ValueError) as info:
        s.log_iter(app_id, "main", since=now, until=before)
    assert str(info.value) == f"since ({now}) is after until ({before})"
    with pytest.raises(ValueError) as info:
        s.log_iter(app_id, "main", k=-1)
    assert str(info.value) == "the replica index k must be >= 0, got -1"
    with pytest.raises(TypeError) as info:
        s.log_iter(app_id, "main", since="yesterday")  # type: ignore[arg-type]
    assert str(info.value) == "since must be a datetime, got 'yesterday'"
    with pytest.raises(ValueError, match=r"^until \(0001-01-01 00:00:00\) is out of range: "):
        s.log_iter(app_id, "main", until=datetime.min)  # naive: local time, before year 1
    with pytest.raises(TypeError) as info:
        s.log_iter(app_id, "main", k="0")  # type: ignore[arg-type]
    assert str(info.value) == "the replica index k must be an int, got '0'"
    for stream in Stream:
        if stream in s.log_streams:
            s.log_iter(app_id, "main", streams=stream)  # no error before the first iteration
        else:
            with pytest.raises(ValueError) as info:
                s.log_iter(app_id, "main", streams=stream)
            assert str(info.value) == expected_stream_error(backend, stream)


# -- unknown app, role or replica, at the first iteration ---------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("follow", [False, True], ids=["read", "tail"])
async def test_an_unknown_app_raises_at_the_first_iteration(backend: Backend, follow: bool) -> None:
    """log_iter of an unknown app does not raise at the call; its first iteration raises
    UnknownAppException naming the app's handle (read or tailed)."""
    lines = backend.scheduler.log_iter(backend.unknown_id, "main", should_tail=follow)
    with anyio.fail_after(60), pytest.raises(UnknownAppException) as info:
        await lines.__anext__()
    assert info.value.app_handle == backend.handle(backend.unknown_id)


@pytest.mark.timeout(180)
async def test_an_unknown_role_or_replica_raises_at_the_first_iteration(backend: Backend) -> None:
    """For an app that exists, an unknown role or replica raises UnknownRoleException at the first
    iteration, with the same message everywhere."""
    app_id = await backend.submit((Out("hello"),))
    await backend.wait_for(app_id)
    s = backend.scheduler
    role_lines = s.log_iter(app_id, "nope")
    with anyio.fail_after(60), pytest.raises(UnknownRoleException) as info:
        await role_lines.__anext__()
    assert str(info.value) == f"app {app_id!r} has no role 'nope' (roles: main)"
    replica_lines = s.log_iter(app_id, "main", k=1)
    with anyio.fail_after(60), pytest.raises(UnknownRoleException) as info:
        await replica_lines.__anext__()
    assert str(info.value) == (
        f"replica k=1 is out of range for role 'main' of app {app_id!r} (1 replicas)"
    )


# -- what the lines are -----------------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_the_default_stream_is_everything_the_replica_wrote(backend: Backend) -> None:
    """Without streams, log_iter gives the lines of both stdout and stderr; a backend that keeps
    them apart gives each alone on request."""
    app_id = await backend.submit((Out("out"), Err("err")))
    desc = await backend.wait_for(app_id)
    assert desc.state == AppState.SUCCEEDED, desc.msg
    assert sorted(await read(backend, app_id)) == ["err\n", "out\n"]
    assert sorted(await read(backend, app_id, streams=Stream.COMBINED)) == ["err\n", "out\n"]
    if Stream.STDOUT in backend.scheduler.log_streams:
        assert await read(backend, app_id, streams=Stream.STDOUT) == ["out\n"]
    if Stream.STDERR in backend.scheduler.log_streams:
        assert await read(backend, app_id, streams=Stream.STDERR) == ["err\n"]


@pytest.mark.timeout(180)
async def test_since_and_until_split_the_lines_by_when_they_were_written(
    backend: Backend,
) -> None:
    """A moment between two lines written 4 s apart: since keeps the later line, until the
    earlier, read after the app ended."""
    app_id = await backend.submit((Out("early"), Pause(4), Out("late")))
    with anyio.fail_after(90):
        lines = backend.scheduler.log_iter(app_id, "main", should_tail=True)
        try:
            assert await lines.__anext__() == "early\n"
        finally:
            await lines.aclose()  # type: ignore[attr-defined]
    middle = datetime.fromtimestamp(time.time() + 1.0)
    desc = await backend.wait_for(app_id)
    assert desc.state == AppState.SUCCEEDED, desc.msg
    assert await read(backend, app_id) == ["early\n", "late\n"]
    assert await read(backend, app_id, since=middle) == ["late\n"]
    assert await read(backend, app_id, until=middle) == ["early\n"]
    assert await read(backend, app_id, since=middle, until=middle + timedelta(seconds=1)) == []


@pytest.mark.timeout(180)
async def test_an_until_before_the_app_started_gives_nothing(backend: Backend) -> None:
    """until a minute before the submit leaves out even the first line (written as the replica
    started); since then keeps every line."""
    before = datetime.now() - timedelta(minutes=1)
    app_id = await backend.submit((Out("first"), Out("second")))
    desc = await backend.wait_for(app_id)
    assert desc.state == AppState.SUCCEEDED, desc.msg
    assert await read(backend, app_id, until=before) == []
    assert await read(backend, app_id, since=before) == ["first\n", "second\n"]


@pytest.mark.timeout(180)
async def test_a_tail_follows_until_the_app_ends_then_drains(backend: Backend) -> None:
    """should_tail=True started with the app gives every line as it comes and stops once the app is
    terminal, with nothing left unread; a plain read afterwards gives the same lines."""
    program = (Out("one"), Pause(0.5), Out("two"), Pause(0.5), Out("three"))
    app_id = await backend.submit(program)
    with anyio.fail_after(120):
        tailed = [ln async for ln in backend.scheduler.log_iter(app_id, "main", should_tail=True)]
    assert tailed == ["one\n", "two\n", "three\n"]
    desc = await backend.scheduler.describe(app_id)
    assert desc is not None and is_terminal(desc.state)
    assert await read(backend, app_id) == tailed


# -- cancel and describe ----------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_cancel_and_describe_of_an_unknown_app(backend: Backend) -> None:
    """Cancelling an app the backend does not know does nothing; describing it gives None."""
    await backend.scheduler.cancel(backend.unknown_id)
    assert await backend.scheduler.describe(backend.unknown_id) is None
    assert await backend.scheduler.exists(backend.unknown_id) is False


@pytest.mark.timeout(180)
async def test_cancel_of_a_finished_app_does_nothing(backend: Backend) -> None:
    """A finished app stays as it ended when it is cancelled (twice)."""
    app_id = await backend.submit((Out("done"),))
    desc = await backend.wait_for(app_id)
    assert desc.state == AppState.SUCCEEDED, desc.msg
    await backend.scheduler.cancel(app_id)
    await backend.scheduler.cancel(app_id)
    after = await backend.scheduler.describe(app_id)
    assert after is not None and after.state == AppState.SUCCEEDED


@pytest.mark.timeout(180)
async def test_cancel_of_a_running_app_ends_it_cancelled(backend: Backend) -> None:
    """Cancelling a running app returns without waiting; the app ends CANCELLED; cancelling it
    again does nothing."""
    app_id = await backend.submit((Out("started"), Forever()))
    await backend.wait_for(app_id, {AppState.RUNNING})
    with anyio.fail_after(30):
        await backend.scheduler.cancel(app_id)
    desc = await backend.wait_for(app_id)
    assert desc.state == AppState.CANCELLED, desc.msg
    await backend.scheduler.cancel(app_id)
    again = await backend.scheduler.describe(app_id)
    assert again is not None and again.state == AppState.CANCELLED
