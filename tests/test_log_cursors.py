"""Log cursors on every backend: local, Docker and Slurm for real, Kubernetes on the fake API server.

A cursor (``log_entries``) resumes a replica's log exactly after its line: the remainder, nothing
repeated, nothing skipped, also while the app still writes, and across lines that share one engine
timestamp (Docker and Kubernetes stamp a burst of lines alike; the cursor counts them). A cursor
taken elsewhere (another app, role, replica or stream selection) or a damaged one is a one-line
ValueError at the call, naming it. The backends and their fixtures are those of
``test_backend_contract``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import itertools
import json
import pathlib
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import anyio
import pytest
from _docker_env import busybox_image, docker_engine, docker_scheduler, docker_session  # noqa: F401
from _fake_scheduler import FakeScheduler
from k8s_fake import FakeKubeApiServer, PodScript
from k8s_fake.cluster import format_ts
from k8s_fake.testing import fake_k8s, k8s_scheduler, until  # noqa: F401
from test_backend_contract import (  # noqa: F401
    Backend,
    KubernetesBackend,
    LocalBackend,
    docker_backend,
    kubernetes_backend,
    local_backend,
    slurm_backend,
)

from asynctorchx.logs import ALL_STREAMS, LogEntry, LogQuery, Stream, iter_log_entries
from asynctorchx.logs._cursor import LogCursor, Position
from asynctorchx.logs._files import LOG_FILES
from asynctorchx.logs._timestamps import split_timestamp
from asynctorchx.runner import AsyncRunner
from asynctorchx.schedulers._docker.engine import DockerEngine
from asynctorchx.schedulers._docker.frames import format_api_time
from asynctorchx.schedulers._docker.logs import DockerLogSource
from asynctorchx.schedulers._docker.request import (
    KIND_REPLICA,
    LABEL_APP_ID,
    LABEL_ATTEMPT,
    LABEL_KIND,
    LABEL_REPLICA_ID,
    LABEL_ROLE_NAME,
)
from asynctorchx.schedulers._docker.state import ContainerInfo
from asynctorchx.schedulers.kubernetes import KubernetesScheduler
from asynctorchx.specs.api import AppDef, AppState, Role, is_terminal
from asynctorchx.testing import AppScript, ScriptedBackend, lines

#: lines of the big log: written in bursts of BURST lines by one write (Docker and the fake
#: kubelet then stamp a burst's lines alike)
LINES = 10_000
BURST = 5
SECOND = 10**9


def burst_script(first: int, count: int) -> str:
    """A shell loop writing lines ``first..first+count-1`` (``line-N``), BURST per ``printf``."""
    fmt = "\\n".join(f"line-%d-{j}" for j in range(BURST)) + "\\n"
    args = " ".join("$i" for _ in range(BURST))
    return (
        f"i={first // BURST}; while [ $i -lt {(first + count) // BURST} ]; do "
        f"printf '{fmt}' {args}; i=$((i+1)); done"
    )


def burst_lines(first: int, count: int) -> list[str]:
    """What ``burst_script(first, count)`` writes, line by line."""
    return [
        f"line-{i}-{j}\n"
        for i in range(first // BURST, (first + count) // BURST)
        for j in range(BURST)
    ]


@pytest.fixture(params=["local", "docker", "slurm", "kubernetes"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each backend in turn (Docker and Slurm fail rather than skip with
    ASYNCTORCHX_REQUIRE_ENGINES=1 when their engine is missing)."""
    found: Backend = request.getfixturevalue(f"{request.param}_backend")
    return found


async def submit_script(backend: Backend, script: str, pod: PodScript) -> str:
    """Submits a one-replica app running ``sh -c script`` (on Kubernetes: the scripted ``pod``)."""
    role = dataclasses.replace(backend.role(()), args=["-c", script])
    if isinstance(backend, KubernetesBackend):
        backend.server.cluster.script = lambda ctx: pod
    app = AppDef(f"cursor-{uuid.uuid4().hex[:6]}", [role])
    return await backend.scheduler.submit(app, backend.cfg())


async def entries(backend: Backend, app_id: str, **kw: Any) -> list[LogEntry]:
    """Every entry ``log_entries`` gives."""
    with anyio.fail_after(120):
        return [e async for e in backend.scheduler.log_entries(app_id, "main", **kw)]


async def lines_after(
    backend: Backend, app_id: str, cursor: str, limit: int | None = None
) -> list[str]:
    """The lines ``log_iter`` gives after ``cursor`` (the first ``limit`` of them)."""
    out: list[str] = []
    with anyio.fail_after(120):
        it = backend.scheduler.log_iter(app_id, "main", cursor=cursor)
        try:
            async for line in it:
                out.append(line)
                if limit is not None and len(out) >= limit:
                    break
        finally:
            await it.aclose()  # type: ignore[attr-defined]
    return out


@pytest.fixture
async def big_log(backend: Backend) -> tuple[Backend, str, list[LogEntry]]:
    """A finished app that wrote a 10 000-line log in bursts, and its entries."""
    pod = PodScript(lines=burst_lines(0, LINES), line_interval=0, burst=BURST)
    app_id = await submit_script(backend, burst_script(0, LINES), pod)
    await backend.wait_for(app_id, timeout=180)
    got = await entries(backend, app_id)
    return backend, app_id, got


@pytest.mark.timeout(600)
async def test_a_cursor_at_any_line_of_a_10000_line_log_resumes_exactly(
    big_log: tuple[Backend, str, list[LogEntry]],
) -> None:
    """The entries carry the whole log once, each cursor distinct; resuming from a cursor gives
    exactly the lines after it: the next lines for a spread of cursors (every one on local), the
    whole remainder for some, and nothing after the last."""
    backend, app_id, got = big_log
    lines = [e.line for e in got]
    assert sorted(lines) == sorted(burst_lines(0, LINES))
    assert len({e.cursor for e in got}) == LINES
    full = await lines_after(backend, app_id, got[0].cursor)
    assert full == lines[1:]
    # every cursor on local (a resume is a pread); a spread on the engines (a resume is a request)
    step = 1 if isinstance(backend, LocalBackend) else 251
    sample = sorted({*range(0, LINES, step), *range(1, 3 * BURST), LINES - 2})
    for i in sample:
        assert await lines_after(backend, app_id, got[i].cursor, limit=3) == lines[i + 1 : i + 4], i
    for i in (BURST - 1, BURST + 2, LINES // 2 + 1, LINES - BURST - 1):
        assert await lines_after(backend, app_id, got[i].cursor) == lines[i + 1 :], i
    assert await lines_after(backend, app_id, got[-1].cursor) == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["kubernetes"], indirect=True)
async def test_lines_sharing_a_timestamp_resume_by_their_count(
    big_log: tuple[Backend, str, list[LogEntry]],
) -> None:
    """On Kubernetes (the fake kubelet stamps a burst's lines alike) a cursor inside a group of
    lines sharing a timestamp resumes at the group's next line: a cursor resumes from a whole
    second (as the API's sinceTime is) and counts the lines read since then, one more a line."""
    backend, app_id, got = big_log
    assert isinstance(backend, KubernetesBackend)
    (log,) = [log for log in backend.server.cluster.logs.values() if len(log.lines) == LINES]
    stamps = [ts for ts, _ in log.lines]
    shared = [i for i in range(1, LINES) if stamps[i] == stamps[i - 1]]
    assert shared, "the fake kubelet stamped no two lines alike"
    positions = [LogCursor.decode(e.cursor).position for e in got]
    for i in shared:
        (since, count), (before, counted) = positions[i][1:], positions[i - 1][1:]
        assert isinstance(since, int) and since % SECOND == 0
        assert since > before or count == int(counted) + 1, i
    lines = [e.line for e in got]
    for i in shared[:: max(1, len(shared) // 40)]:
        assert await lines_after(backend, app_id, got[i - 1].cursor, limit=2) == lines[i : i + 2], i


def stamps_going_back(count: int) -> dict[int, int]:
    """``PodScript.stamp_offsets`` spreading ``count`` lines 10 ms apart, every third stamped
    300 µs early and every 25th 700 ms early: before lines stored ahead of it, across a second."""
    return {
        i: i * 10_000_000 - (700_000_000 if i % 25 == 0 else 300_000 if i % 3 == 1 else 0)
        for i in range(count)
    }


async def pod_log_of(fake: FakeKubeApiServer, sched: KubernetesScheduler, pod: PodScript) -> str:
    """Submits a one-replica app whose pod runs ``pod``; returns the app's id once it runs."""
    fake.cluster.script = lambda ctx: pod
    role = Role("main", image="registry.example/img:1", entrypoint="sh")
    app_id = await sched.submit(AppDef(f"stamps-{uuid.uuid4().hex[:6]}", [role]), {})
    await until(fake, lambda: len(fake.cluster.logs) == 1)
    return app_id


def went_back_across_a_second(fake: FakeKubeApiServer) -> bool:
    """True when a line of the fake's one pod log is stamped in an earlier second than the line
    stored ahead of it."""
    (log,) = fake.cluster.logs.values()
    stamps = [ts for ts, _ in log.lines]
    return any(b // SECOND < a // SECOND for a, b in itertools.pairwise(stamps))


async def test_kubernetes_stamps_that_go_back_are_read_whole_and_resume_from_any_cursor(
    fake_k8s: FakeKubeApiServer,  # noqa: F811
    k8s_scheduler: KubernetesScheduler,  # noqa: F811
) -> None:
    """A pod log whose stamps go back (containerd stamps stdout and stderr lines before their
    shared writer stores them) is read whole, and a cursor at any line resumes with exactly the
    lines after it (a line stamped before one read ahead of it was dropped)."""
    written = [f"line {i}\n" for i in range(200)]
    pod = PodScript(lines=written, line_interval=0, stamp_offsets=stamps_going_back(200))
    app_id = await pod_log_of(fake_k8s, k8s_scheduler, pod)
    await until(
        fake_k8s,
        lambda: (
            [p["status"].get("phase") for p in fake_k8s.store.list("pods", "default")]
            == ["Succeeded"]
        ),
    )
    assert went_back_across_a_second(fake_k8s)
    with anyio.fail_after(60):
        got = [e async for e in k8s_scheduler.log_entries(app_id, "main")]
        assert [e.line for e in got] == written
        for i, e in enumerate(got):
            rest = [ln async for ln in k8s_scheduler.log_iter(app_id, "main", cursor=e.cursor)]
            assert rest == written[i + 1 :], i


async def test_kubernetes_a_followed_log_cut_while_stamps_go_back_goes_on_exactly(
    fake_k8s: FakeKubeApiServer,  # noqa: F811
    k8s_scheduler: KubernetesScheduler,  # noqa: F811
) -> None:
    """A followed pod log whose stamps go back, cut after its first half was read, goes on with
    exactly the second half (its first line, stamped 700 ms before lines read ahead of it, was
    dropped)."""
    count, gate = 100, asyncio.Event()
    written = [f"line {i}\n" for i in range(count)]
    pod = PodScript(
        lines=written,
        line_interval=0,
        stamp_offsets=stamps_going_back(count),
        gates={count // 2: gate},
    )
    app_id = await pod_log_of(fake_k8s, k8s_scheduler, pod)
    got: list[str] = []
    with anyio.fail_after(30):
        async for line in k8s_scheduler.log_iter(app_id, "main", should_tail=True):
            got.append(line)
            if len(got) == count // 2:
                assert fake_k8s.drop_log_streams() == 1
                gate.set()
    assert got == written
    assert went_back_across_a_second(fake_k8s)


@pytest.mark.timeout(300)
async def test_a_cursor_resumes_a_tail_while_the_app_still_writes(backend: Backend) -> None:
    """A tail read up to a cursor, closed, and resumed from it with the app still running gives
    every line exactly once: the part before the cursor, then the rest as the app writes it."""
    first, second = 300, 300
    gate = asyncio.Event()
    pod = PodScript(
        lines=burst_lines(0, first + second),
        line_interval=0,
        burst=BURST,
        gates={first: gate},
    )
    script = (
        f"second() {{ {burst_script(first, second)}; exit 0; }}; trap second TERM; "
        # (stderr closed: the shell's "Terminated" notice for the killed sleep is not a log line)
        f"{burst_script(0, first)}; exec 2>/dev/null; while :; do sleep 0.05; done"
    )
    app_id = await submit_script(backend, script, pod)
    s = backend.scheduler
    head: list[LogEntry] = []
    with anyio.fail_after(120):
        async with contextlib.aclosing(s.log_entries(app_id, "main", should_tail=True)) as it:  # type: ignore[type-var]
            async for e in it:
                head.append(e)
                if len(head) == first // 2:
                    break
    desc = await s.describe(app_id)
    assert desc is not None and not is_terminal(desc.state)
    rest: list[str] = []
    with anyio.fail_after(180):
        tail = s.log_iter(app_id, "main", should_tail=True, cursor=head[-1].cursor)
        async for line in tail:
            rest.append(line)
            if len(rest) == first - len(head):
                desc = await s.describe(app_id)
                assert desc is not None and desc.state == AppState.RUNNING  # still writing
                if isinstance(backend, KubernetesBackend):
                    gate.set()
                else:
                    await s.cancel(app_id)
    everything = [e.line for e in head] + rest
    assert everything == burst_lines(0, first + second)


async def docker_log_as_stored(cid: str) -> list[tuple[int, str]]:
    """``(engine stamp, line)`` of each line of a container's log, in the order Docker stores it."""
    engine = DockerEngine()
    params = {"stdout": True, "stderr": True, "timestamps": True, "follow": False}
    try:
        out = []
        async for _, payload in engine.container_log_frames(cid, params):
            ts, text = split_timestamp(payload)
            assert ts is not None
            out.append((ts, text.decode()))
        return out
    finally:
        await engine.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["docker"], indirect=True)
async def test_docker_stdout_and_stderr_written_at_once_resume_from_any_cursor(
    backend: Backend,
) -> None:
    """Docker stamps each stdout or stderr line when it reads it from its pipe, before the log's
    writer stores it, so a log of both written at once has stamps that go back: a combined read
    gives every line once, in the stored order, and a cursor at any line (at each one stamped
    before the line ahead of it, and a spread) resumes with exactly the lines after it."""
    pairs = 10_000
    script = f"i=0; while [ $i -lt {pairs} ]; do echo out-$i; echo err-$i >&2; i=$((i+1)); done"
    for _ in range(5):  # (runs of 3000 pairs went back in 13 of 15: a bound, not an assumption)
        app_id = await submit_script(backend, script, PodScript())
        await backend.wait_for(app_id)
        got = await entries(backend, app_id)
        cid = str(LogCursor.decode(got[0].cursor).position[1])
        stored = await docker_log_as_stored(cid)
        back = [i for i in range(1, len(stored)) if stored[i][0] < stored[i - 1][0]]
        if back:
            break
    else:
        pytest.fail("the engine stamped no line before the line stored ahead of it, in 5 runs")
    lines = [e.line for e in got]
    assert lines == [text for _, text in stored]
    for stream in ("out", "err"):
        assert [ln for ln in lines if ln.startswith(stream)] == [
            f"{stream}-{i}\n" for i in range(pairs)
        ]
    near = {j - k for j in back[:20] for k in (2, 1, 0) if j >= k}
    for i in sorted({*near, *range(0, len(lines), 499)}):
        assert await lines_after(backend, app_id, got[i].cursor, limit=3) == lines[i + 1 : i + 4], i
    for i in back[:3]:
        assert await lines_after(backend, app_id, got[i - 1].cursor) == lines[i:], i


@pytest.mark.timeout(300)
async def test_cursors_from_elsewhere_or_damaged_raise_at_the_call(backend: Backend) -> None:
    """A cursor of another app, role, replica or stream selection, a damaged one, or a non-cursor
    raises a one-line ValueError at the call that names it."""
    pod = PodScript(lines=["a\n", "b\n"], line_interval=0)
    app_id = await submit_script(backend, "echo a; echo b", pod)
    other_id = await submit_script(backend, "echo a; echo b", pod)
    await backend.wait_for(app_id)
    await backend.wait_for(other_id)
    s = backend.scheduler
    mine = (await entries(backend, app_id))[0].cursor
    theirs = (await entries(backend, other_id))[0].cursor
    bad = LogCursor.decode(mine)
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({}, theirs, f"was taken on app {other_id!r}, not {app_id!r}"),
        ({"k": 1}, mine, "was taken on replica 0, not 1"),
        ({}, "v1.not-base64!", "malformed log cursor"),
        ({}, "hello", "malformed log cursor 'hello'"),
        ({}, mine[:-6], "malformed log cursor"),
        ({}, dataclasses.replace(bad, position=(-1,) * len(bad.position)).encode(), "malformed"),
        ({}, dataclasses.replace(bad, role="other").encode(), "was taken on role 'other'"),
    ]
    if Stream.STDOUT in s.log_streams:
        cases.append(({"streams": Stream.STDOUT}, mine, "was taken on streams 'combined'"))
    for kw, cursor, message in cases:
        with pytest.raises(ValueError) as info:
            s.log_iter(app_id, "main", cursor=cursor, **kw)
        text = str(info.value)
        assert message in text and "\n" not in text, text
        assert cursor[:40] in text, text
        with pytest.raises(ValueError):
            s.log_entries(app_id, "main", cursor=cursor, **kw)


@pytest.mark.timeout(300)
async def test_a_forged_position_raises_when_read_or_resumes_at_a_known_place(
    backend: Backend,
) -> None:
    """A well-formed cursor whose position cannot be of this log raises ValueError at the first
    iteration (a file offset past the end, an unknown Docker container); a file offset inside a
    line resumes at that line's start (it is how an unfinished line's cursor reads); on
    Kubernetes an unknown pod is a replaced one: the newest pod is read from its start."""
    pod = PodScript(lines=["first\n", "second\n"], line_interval=0)
    app_id = await submit_script(backend, "echo first; echo second", pod)
    await backend.wait_for(app_id)
    got = await entries(backend, app_id)
    assert [e.line for e in got] == ["first\n", "second\n"]
    real = LogCursor.decode(got[0].cursor)
    forged: list[tuple[Position, str | None]]
    if real.kind == "file":
        forged = [
            ((real.position[0], 10_000), r"offset 10000 is past the end of .*combined\.log"),
            ((real.position[0], 3), None),
            (("stderr", real.position[1]), r"^the log cursor's file 'stderr' is not"),
        ]
    elif real.kind == "docker":
        forged = [((real.position[0], "f" * 64, *real.position[2:]), "'ffffffffffff' .* is not a")]
    else:
        forged = [(("no-such-pod", *real.position[1:]), None)]
    for position, error in forged:
        cursor = dataclasses.replace(real, position=position).encode()
        lines = backend.scheduler.log_iter(app_id, "main", cursor=cursor)
        if error is None:
            assert [ln async for ln in lines] == ["first\n", "second\n"]
            continue
        with anyio.fail_after(60), pytest.raises(ValueError, match=error):
            await anext(lines)


class _StreamsEngine:
    """A Docker engine's log endpoint over fixed ``(stream id, timestamp ns, message)`` triples,
    honouring ``stdout``/``stderr`` and an inclusive ``since``. A message without ``\\n`` is a part
    of a line, as Docker sends a line longer than 16 KiB, or the unfinished end of the log."""

    def __init__(self, messages: list[tuple[int, int, str]]) -> None:
        self.messages = messages
        self.requests: list[dict[str, Any]] = []

    async def container_log_frames(
        self, cid: str, params: dict[str, Any]
    ) -> AsyncIterator[tuple[int, bytes]]:
        self.requests.append(dict(params))
        since = params.get("since")
        since_ns = None if since is None else int(since.replace(".", ""))
        wanted = {1: params["stdout"], 2: params["stderr"]}
        for stream, ts, text in list(self.messages):
            if wanted[stream] and (since_ns is None or ts >= since_ns):
                yield stream, f"{format_ts(ts)} {text}".encode()


def _docker_source(engine: Any) -> DockerLogSource:
    """A DockerLogSource over ``engine`` for one exited container of app1/main/0."""
    labels = {
        LABEL_APP_ID: "app1",
        LABEL_ROLE_NAME: "main",
        LABEL_REPLICA_ID: "0",
        LABEL_ATTEMPT: "0",
        LABEL_KIND: KIND_REPLICA,
    }
    container = ContainerInfo("c1", "app1-main-0", "img", labels, "exited", 0, 0)

    async def list_app(app_id: str) -> list[ContainerInfo]:
        return [container]

    async def wait_app(app_id: str, timeout: float) -> None:
        raise AssertionError("a finished app is not waited for")

    return DockerLogSource(engine, list_app, wait_app, lambda a: a)


async def _docker_read(
    source: DockerLogSource,
    cursor: str | None = None,
    stream: Stream = Stream.COMBINED,
    since: datetime | None = None,
) -> list[tuple[str, str]]:
    """``(cursor, line)`` of a non-follow read of ``source`` (after ``cursor``, from ``since``)."""
    query = LogQuery.build(
        "local_docker",
        ALL_STREAMS,
        "app1",
        "main",
        0,
        None,
        since,
        None,
        False,
        stream,
        cursor,
        "docker",
    )
    with anyio.fail_after(30):
        return [
            (LogCursor("app1", "main", 0, stream.value, "docker", p).encode(), line)
            async for p, line in source.entries(query)
        ]


async def test_docker_cursors_tie_break_lines_with_equal_timestamps() -> None:
    """Docker lines sharing a timestamp (a fake engine: the real one stamps lines apart) resume
    exactly from any cursor: the engine is asked from a second before the newest line read (to
    the second) and the cursor's count of lines since then is skipped."""
    base = 1_700_000_000_000_000_000
    stamped = [(base + (i // 4) * 1000, f"l{i}\n") for i in range(40)]
    engine = _StreamsEngine([(1, ts, text) for ts, text in stamped])
    source = _docker_source(engine)
    got = await _docker_read(source, stream=Stream.STDOUT)
    assert [line for _, line in got] == [t for _, t in stamped]
    for i, (cursor, _) in enumerate(got):
        rest = await _docker_read(source, cursor, Stream.STDOUT)
        assert [line for _, line in rest] == [t for _, t in stamped[i + 1 :]], i
    assert engine.requests[-1]["since"] == format_api_time(
        stamped[-1][0] // SECOND * SECOND - SECOND
    )


async def test_the_testing_scheduler_resumes_from_any_cursor_of_each_stream() -> None:
    """The scripted scheduler's cursors (line indexes of the stream selection) resume exactly from
    every line, per stream and combined; an index past the script's log raises when iterated."""
    script = AppScript(
        states=[(0, AppState.SUCCEEDED)],
        logs=[
            *lines("r", [f"out {i}" for i in range(6)]),
            *lines("r", [f"err {i}" for i in range(3)], stream=Stream.STDERR),
        ],
    )
    scheduler = ScriptedBackend("scripted", script)("s")
    app_id = await scheduler.submit(AppDef("a", [Role("r", image="i", entrypoint="true")]), {})
    with anyio.fail_after(30):
        for streams in (None, Stream.STDOUT, Stream.STDERR):
            got = [e async for e in scheduler.log_entries(app_id, "r", streams=streams)]
            assert len(got) == {None: 9, Stream.STDOUT: 6, Stream.STDERR: 3}[streams]
            for i, e in enumerate(got):
                rest = [
                    ln
                    async for ln in scheduler.log_iter(
                        app_id, "r", streams=streams, cursor=e.cursor
                    )
                ]
                assert rest == [x.line for x in got[i + 1 :]]
        forged = dataclasses.replace(LogCursor.decode(got[0].cursor), position=(99,)).encode()
        with pytest.raises(ValueError, match=r"^log cursor index 99 is past the end"):
            await anext(scheduler.log_iter(app_id, "r", streams=Stream.STDERR, cursor=forged))


async def test_a_backend_without_cursors_says_so_rather_than_ignore_one() -> None:
    """A scheduler that cannot resume logs raises NotImplementedError naming it, for log_entries
    and for a log_iter given a cursor (at the call), and through the runner."""
    scheduler = FakeScheduler("s")
    message = r"^the fake scheduler does not support log cursors$"
    with pytest.raises(NotImplementedError, match=message):
        scheduler.log_entries("app", "r")
    with pytest.raises(NotImplementedError, match=message):
        scheduler.log_iter("app", "r", cursor="v1.e30")
    async with AsyncRunner("s", scheduler_factories={"fake": FakeScheduler}) as runner:
        with anyio.fail_after(10), pytest.raises(NotImplementedError, match=message):
            await anext(runner.log_entries("fake://s/app", "r"))


@pytest.mark.parametrize(
    "text",
    [
        None,
        42,
        "",
        "v2.e30",
        "v1.",
        "v1.%%%",
        "v1." + base64.urlsafe_b64encode(b"[" * 5000).decode(),  # nested past the parser's depth
        "v1." + "A" * 9000,
        "v1." + base64.urlsafe_b64encode(b'["a","r",0]').decode(),  # not an object
    ],
)
def test_a_malformed_cursor_is_one_line_value_error_naming_it(text: object) -> None:
    """Whatever is not a v1 cursor (wrong type, prefix, base64, JSON, or too long) is a one-line
    ValueError that names the value (shortened when long)."""
    with pytest.raises(ValueError) as info:
        LogCursor.decode(text)
    message = str(info.value)
    assert "\n" not in message and repr(text)[:40] in message, message


def _raw(doc: dict[str, Any]) -> str:
    return "v1." + base64.urlsafe_b64encode(json.dumps(doc).encode()).decode()


GOOD = {"a": "app", "r": "main", "k": 0, "s": "combined", "x": "file", "p": ["combined", 7]}


@pytest.mark.parametrize(
    "change",
    [
        {"k": -1},
        {"k": True},
        {"k": 1.0},
        {"s": "both"},
        {"x": "ftp"},
        {"p": ["combined", -7]},
        {"p": ["combined", 2**63]},
        {"p": ["combined", 7.5]},
        {"p": ["combined"]},
        {"p": {"combined": 7}},
        {"a": None},
    ],
)
def test_a_cursor_with_fields_out_of_range_is_malformed(change: dict[str, Any]) -> None:
    """A cursor whose fields have the wrong type or range (negative, bool or float counts, an
    unknown stream or kind, a position of the wrong shape) is rejected when decoded."""
    assert LogCursor.decode(_raw(GOOD)).position == ("combined", 7)
    with pytest.raises(ValueError, match=r"^malformed log cursor 'v1\."):
        LogCursor.decode(_raw({**GOOD, **change}))


async def _file_entries(
    directory: pathlib.Path, start: int = 0, **kw: Any
) -> list[tuple[int, str]]:
    """Every ``(offset, line)`` ``iter_log_entries`` gives of ``directory``'s stdout from ``start``."""
    with anyio.fail_after(30):
        return [e async for e in iter_log_entries(directory, Stream.STDOUT, start=start, **kw)]


async def _finished() -> bool:
    return True


async def test_an_unfinished_line_is_given_again_whole_once_it_has_grown(
    tmp_path: pathlib.Path,
) -> None:
    """A file cursor taken at an unterminated last line (a progress bar still being written)
    resumes with that line again, whole, once the app has finished it, then the lines after."""
    log = tmp_path / LOG_FILES[Stream.STDOUT]
    log.write_bytes(b"a\nepoch 1 10%")
    got = await _file_entries(tmp_path)
    assert [line for _, line in got] == ["a\n", "epoch 1 10%"]
    with log.open("ab") as f:
        f.write(b"\r 20%\nb\n")
    for follow in (False, True):
        rest = await _file_entries(tmp_path, got[-1][0], follow=follow, is_finished=_finished)
        assert [line for _, line in rest] == ["epoch 1 10%\r 20%\n", "b\n"], follow
        assert rest[-1][0] == log.stat().st_size


async def test_an_unfinished_line_that_has_not_grown_is_not_given_again(
    tmp_path: pathlib.Path,
) -> None:
    """A file cursor taken at an unterminated last line that is still the file's unchanged end
    (the app ended without a newline) resumes with nothing, read or followed; one that grew by
    more of the same line gives it whole; an offset past the end stays a ValueError."""
    log = tmp_path / LOG_FILES[Stream.STDOUT]
    log.write_bytes(b"a\nno newline")
    end = (await _file_entries(tmp_path))[-1][0]
    assert await _file_entries(tmp_path, end) == []
    assert await _file_entries(tmp_path, end, follow=True, is_finished=_finished) == []
    with log.open("ab") as f:
        f.write(b" yet")
    assert await _file_entries(tmp_path, end) == [(end + 4, "no newline yet")]
    with pytest.raises(ValueError, match="is past the end of"):
        await _file_entries(tmp_path, end + 5)


@pytest.mark.parametrize("backend", ["local"], indirect=True)
async def test_a_local_cursor_taken_while_a_progress_line_is_written_resumes_it_whole(
    backend: Backend, tmp_path: pathlib.Path
) -> None:
    """Local: a non-follow read of a running app that ends with a progress line (no newline yet)
    gives a cursor that, once the replica has finished the line, resumes with it whole."""
    local = backend
    gate = tmp_path / "gate"
    script = (
        f"echo epoch1; printf 'loading 10%%'; while [ ! -e {gate} ]; do sleep 0.05; done; "
        "echo ' 100%'; echo epoch2"
    )
    app_id = await submit_script(local, script, PodScript())
    with anyio.fail_after(60):
        while True:
            got = await entries(local, app_id)
            if [e.line for e in got] == ["epoch1\n", "loading 10%"]:
                break
            await asyncio.sleep(0.05)
    gate.touch()
    await local.wait_for(app_id)
    rest = await lines_after(local, app_id, got[-1].cursor)
    assert rest == ["loading 10% 100%\n", "epoch2\n"]


BASE_NS = 1_700_000_000_000_000_000


async def test_docker_a_combined_read_keeps_lines_whose_timestamps_go_back_across_streams() -> None:
    """Docker stamps stdout and stderr apart: a combined read gives every line even when a stderr
    line is stamped before the stdout line received ahead of it, and each line's cursor resumes
    exactly (from the earlier stream's timestamp, each stream skipping what it gave)."""
    messages = [
        (1, BASE_NS + 10, "out\n"),
        (2, BASE_NS + 5, "err\n"),
        (1, BASE_NS + 20, "out2\n"),
        (2, BASE_NS + 5, "err2\n"),
        (2, BASE_NS + 30, "err3\n"),
    ]
    engine = _StreamsEngine(messages)
    source = _docker_source(engine)
    got = await _docker_read(source)
    assert [line for _, line in got] == [text for _, _, text in messages]
    for i, (cursor, _) in enumerate(got):
        rest = await _docker_read(source, cursor)
        assert [line for _, line in rest] == [text for _, _, text in messages[i + 1 :]], i
    # after "out" stderr has given nothing (read from the start); after "err", from a second
    # before the newest line of either stream
    assert "since" not in engine.requests[1]
    assert engine.requests[2]["since"] == format_api_time(BASE_NS - SECOND)


@pytest.mark.parametrize("stream", [Stream.COMBINED, Stream.STDOUT])
async def test_docker_a_stream_whose_own_stamps_go_back_is_read_whole_and_resumes_exactly(
    stream: Stream,
) -> None:
    """Docker: lines of one stream stamped before lines stored ahead of them (the engine's clock
    set back, or a logger that stamps apart), also across a second, are all read, and each line's
    cursor resumes with exactly the lines after it (they were dropped)."""
    messages = [
        (1, BASE_NS + 10, "o0\n"),
        (2, BASE_NS + 5, "e0\n"),
        (1, BASE_NS + 8, "o1\n"),
        (1, BASE_NS + SECOND + 3, "o2\n"),
        (2, BASE_NS + SECOND + 1, "e1\n"),
        (1, BASE_NS + SECOND - 2, "o3\n"),
        (1, BASE_NS + SECOND - 2, "o4\n"),
        (2, BASE_NS + 2 * SECOND, "e2\n"),
        (1, BASE_NS + 3 * SECOND + 5, "o5\n"),
        (1, BASE_NS + 2 * SECOND + 7, "o6\n"),
    ]
    wanted = [text for s, _, text in messages if stream == Stream.COMBINED or s == 1]
    source = _docker_source(_StreamsEngine(messages))
    got = await _docker_read(source, stream=stream)
    assert [line for _, line in got] == wanted
    for i, (cursor, _) in enumerate(got):
        rest = await _docker_read(source, cursor, stream)
        assert [line for _, line in rest] == wanted[i + 1 :], i


async def test_docker_a_cursor_is_a_place_in_the_log_whatever_since_it_is_resumed_with() -> None:
    """Docker: a cursor taken without ``since`` resumed with one gives the lines after it from
    ``since``, and one taken with ``since`` resumed without gives every line after it, also when
    one stream had given nothing at the cursor (a ``since`` past the cursor's resume time skipped
    lines of the log that the cursor counted)."""
    ms = 1_000_000
    messages = [
        (1, BASE_NS + 100 * ms, "o0\n"),
        (1, BASE_NS + 200 * ms, "o1\n"),
        (1, BASE_NS + 1300 * ms, "o2\n"),
        (1, BASE_NS + 1350 * ms, "o3\n"),
        (2, BASE_NS + 1400 * ms, "e0\n"),
        (1, BASE_NS + 1450 * ms, "o4\n"),
        (2, BASE_NS + 2600 * ms, "e1\n"),
        (1, BASE_NS + 2500 * ms, "o5\n"),
        (1, BASE_NS + 3700 * ms, "o6\n"),
    ]
    since_ns = BASE_NS + 1320 * ms
    since = datetime.fromtimestamp(since_ns / SECOND, tz=timezone.utc)
    source = _docker_source(_StreamsEngine(messages))
    texts = [text for _, _, text in messages]
    from_since = [text for _, ts, text in messages if ts >= since_ns]
    for i, (cursor, _) in enumerate(await _docker_read(source)):
        rest = await _docker_read(source, cursor, since=since)
        assert [line for _, line in rest] == [t for t in texts[i + 1 :] if t in from_since], i
    for cursor, line in await _docker_read(source, since=since):
        rest = await _docker_read(source, cursor)
        assert [line for _, line in rest] == texts[texts.index(line) + 1 :], line


async def test_docker_a_cursor_at_a_partial_line_resumes_with_it_whole_once_grown() -> None:
    """Docker: a read that ends with the first 16 KiB part of a long line still being written
    gives it, and its cursor resumes with the whole line once the rest has come (then the next
    lines); while nothing has come, it resumes with nothing (no repeat)."""
    engine = _StreamsEngine([(1, BASE_NS, "first\n"), (1, BASE_NS + 1000, "A" * 16384)])
    source = _docker_source(engine)
    got = await _docker_read(source)
    assert [line for _, line in got] == ["first\n", "A" * 16384]
    assert await _docker_read(source, got[-1][0]) == []
    engine.messages += [(1, BASE_NS + 2000, "tail\n"), (1, BASE_NS + 3000, "next\n")]
    rest = await _docker_read(source, got[-1][0])
    assert [line for _, line in rest] == ["A" * 16384 + "tail\n", "next\n"]
    assert [line for _, line in await _docker_read(source, got[0][0])] == [
        "A" * 16384 + "tail\n",
        "next\n",
    ]


async def test_docker_the_cursor_of_each_unfinished_last_line_counts_only_up_to_it() -> None:
    """Docker: when a read ends with an unfinished line on both streams, the first one's cursor
    does not count the second: resuming from it gives the second, and from the second nothing."""
    messages = [
        (1, BASE_NS, "out-line\n"),
        (1, BASE_NS + 1000, "out partial"),
        (2, BASE_NS + 2000, "err partial"),
    ]
    source = _docker_source(_StreamsEngine(messages))
    got = await _docker_read(source)
    assert [line for _, line in got] == [text for _, _, text in messages]
    for i, (cursor, _) in enumerate(got):
        rest = await _docker_read(source, cursor)
        assert [line for _, line in rest] == [text for _, _, text in messages[i + 1 :]], i


async def test_docker_cursors_of_the_previous_form_resume_after_their_lines() -> None:
    """A Docker cursor handed out by the previous version (for each stream, the last timestamp
    returned and how many lines carried it) resumes exactly after its line, on both streams."""
    messages = [
        (1, BASE_NS, "o0\n"),
        (2, BASE_NS + 3, "e0\n"),
        (1, BASE_NS, "o1\n"),
        (1, BASE_NS + 7, "o2\n"),
        (2, BASE_NS + 3, "e1\n"),
        (2, BASE_NS + SECOND, "e2\n"),
        (1, BASE_NS + SECOND + 1, "o3\n"),
    ]
    source = _docker_source(_StreamsEngine(messages))
    for i in range(len(messages)):
        position: list[int | str] = [0, "c1"]
        for stream in (1, 2):
            stamps = [ts for s, ts, _ in messages[: i + 1] if s == stream]
            last = stamps[-1] if stamps else 0
            position += (last, stamps.count(last) if stamps else 0, 0)
        old = LogCursor("app1", "main", 0, "combined", "docker", tuple(position)).encode()
        rest = await _docker_read(source, old)
        assert [line for _, line in rest] == [text for _, _, text in messages[i + 1 :]], i


async def test_docker_older_cursors_read_on_one_stream_and_are_refused_combined() -> None:
    """A Docker cursor of the older form (one timestamp and count) still resumes a one-stream
    read; an older combined one, which cannot be placed exactly, is a ValueError saying so."""
    messages = [(1, BASE_NS, "a\n"), (1, BASE_NS, "b\n"), (1, BASE_NS + 1, "c\n")]
    source = _docker_source(_StreamsEngine(messages))
    old = LogCursor("app1", "main", 0, "stdout", "docker", (0, "c1", BASE_NS, 1)).encode()
    assert [line for _, line in await _docker_read(source, old, Stream.STDOUT)] == ["b\n", "c\n"]
    combined = LogCursor("app1", "main", 0, "combined", "docker", (0, "c1", BASE_NS, 1)).encode()
    with pytest.raises(ValueError, match="older combined Docker cursor"):
        await _docker_read(source, combined)
