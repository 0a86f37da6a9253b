# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""What a runner's close() ends: the log iterations it handed out (a tail of an app the close does
not stop would go on reading), scheduler closes that hang or fail; and wait(timeout=0) under a call
rate (one look)."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _docker_env import (  # noqa: F401 - pytest fixtures
    busybox_image,
    docker_engine,
    docker_session,
    purge_session,
)
from _fake_scheduler import (
    ClosingFakeScheduler,
    DeafFakeScheduler,
    FakeScheduler,
    TailingFakeScheduler,
)

from asynctorchx import AsyncRunner
from asynctorchx.runner import Limits, PollSettings
from asynctorchx.specs import AppDef, AppState, Role
from asynctorchx.testing import AppScript, ScriptedBackend, VirtualClock
from asynctorchx.testing._script import LogLine

FAST = PollSettings(min_interval=0.01, max_interval=0.05, push_safety_interval=0.2)
CLOSED = "the runner was closed while reading logs"


def app(name: str = "a") -> AppDef:
    return AppDef(name, [Role("worker", image="img", entrypoint="true", num_replicas=2)])


def tailing_runner(**kw: Any) -> tuple[AsyncRunner, list[TailingFakeScheduler]]:
    made: list[TailingFakeScheduler] = []

    def factory(session_name: str, **params: Any) -> TailingFakeScheduler:
        made.append(TailingFakeScheduler(session_name, **params))
        return made[-1]

    runner = AsyncRunner("t", scheduler_factories={"fake": factory}, poll_settings=FAST, **kw)
    return runner, made


async def read_all(lines: AsyncGenerator[Any, None], got: list[Any]) -> None:
    async for line in lines:
        got.append(line)


async def close_after_first_line(
    runner: AsyncRunner, lines: AsyncGenerator[Any, None], timeout: float
) -> list[Any]:
    """Reads ``lines`` in a task until its first item, closes the runner, checks the reader got
    the close's RuntimeError; returns what it read."""
    got: list[Any] = []
    reader = asyncio.create_task(read_all(lines, got))
    with anyio.fail_after(timeout):
        while not got:
            await asyncio.sleep(0.01)  # bounded polling of the reader's progress
        await runner.close()
        with pytest.raises(RuntimeError, match=CLOSED):
            await reader
    return got


# -- fault 1: the log iterations a closed runner handed out ----------------------------------------


async def test_close_ends_a_tail_waiting_for_its_next_line() -> None:
    """A tail waiting for a line of an app the close does not stop raises 'the runner was closed
    while reading logs', and its scheduler iterator has ended by the time close() returns."""
    runner, made = tailing_runner()
    await runner.open()
    handle = await runner.run(app(), "fake")
    got: list[str] = []
    reader = asyncio.create_task(
        read_all(runner.log_lines(handle, "worker", should_tail=True), got)
    )
    with anyio.fail_after(10):
        await made[0].tail_waiting.wait()
        await runner.close()
        assert made[0].tails_opened == made[0].tails_ended == 1  # nothing reads any more
        with pytest.raises(RuntimeError, match=CLOSED):
            await reader
    assert got == ["worker/0 first\n"]


async def test_a_tail_whose_reader_closes_the_runner_ends_at_its_next_line() -> None:
    """Closing the runner from inside a tail's loop body closes the scheduler iterator at once;
    the loop's next step raises 'the runner was closed while reading logs'."""
    runner, made = tailing_runner()
    await runner.open()
    handle = await runner.run(app(), "fake")
    with anyio.fail_after(10), pytest.raises(RuntimeError, match=CLOSED):
        async for _ in runner.log_lines(handle, "worker", should_tail=True):
            await runner.close()
            assert made[0].tails_ended == 1
    assert made[0].tails_opened == made[0].tails_ended == 1


async def test_a_reader_that_resumes_as_the_close_begins_gets_the_error() -> None:
    """A reader in its loop body whose next step is due just as the close begins (before the
    close's clean-up could close its scheduler iterator) raises the close's RuntimeError instead
    of reading on from the iterator."""
    runner, made = tailing_runner()
    await runner.open()
    handle = await runner.run(app(), "fake")
    release = asyncio.Event()
    in_body = asyncio.Event()

    async def reader() -> None:
        async for _ in runner.log_lines(handle, "worker", should_tail=True):
            in_body.set()
            await release.wait()

    task = asyncio.create_task(reader())
    with anyio.fail_after(10):
        await in_body.wait()
        closing = asyncio.create_task(runner.close())
        # the reader is woken after the close's first step has started its clean-up task
        asyncio.get_running_loop().call_soon(release.set)
        await closing
        with pytest.raises(RuntimeError, match=CLOSED):
            await task
    assert made[0].tails_opened == made[0].tails_ended == 1


async def test_the_reader_of_an_ended_tail_is_not_left_cancelled() -> None:
    """The task whose tail the close ended goes on normally after the RuntimeError (the close's
    cancellation of it is taken back): it can await, and nothing cancels it later."""
    runner, made = tailing_runner()
    await runner.open()
    handle = await runner.run(app(), "fake")

    async def reader() -> str:
        try:
            async for _ in runner.log_lines(handle, "worker", should_tail=True):
                pass
        except RuntimeError:
            pass
        await asyncio.sleep(0.01)
        task = asyncio.current_task()
        assert task is not None
        if sys.version_info >= (3, 11):
            assert task.cancelling() == 0
        return "went on"

    task = asyncio.create_task(reader())
    with anyio.fail_after(10):
        await made[0].tail_waiting.wait()
        await runner.close()
        assert await task == "went on"


async def test_a_cancellation_of_the_reader_during_the_close_wins() -> None:
    """A reader cancelled by its owner while the close ends its tail ends cancelled (the
    CancelledError is not turned into the close's RuntimeError)."""
    runner, made = tailing_runner()
    await runner.open()
    handle = await runner.run(app(), "fake")
    reader = asyncio.create_task(read_all(runner.log_lines(handle, "worker", should_tail=True), []))
    with anyio.fail_after(10):
        await made[0].tail_waiting.wait()
        reader.cancel()
        await runner.close()
        with pytest.raises(asyncio.CancelledError):
            await reader
    assert made[0].tails_ended == 1


async def test_close_ends_a_tail_read_one_line_per_task() -> None:
    """A tail read with asyncio.wait_for(anext(...)) (each line in a task of its own, as an SSE
    handler with keep-alives does) ends with the RuntimeError too."""
    runner, made = tailing_runner()
    await runner.open()
    handle = await runner.run(app(), "fake")
    lines = runner.log_lines(handle, "worker", should_tail=True)

    async def reader() -> None:
        while True:
            await asyncio.wait_for(anext(lines), 60)

    task = asyncio.create_task(reader())
    with anyio.fail_after(10):
        await made[0].tail_waiting.wait()
        await runner.close()
        assert made[0].tails_ended == 1
        with pytest.raises(RuntimeError, match=CLOSED):
            await task


async def test_close_ends_many_tails_in_flight_wherever_they_stand() -> None:
    """Fifty tails, half waiting for a line, half held by readers busy in their loop body: the
    close ends every one (all scheduler iterators closed when it returns), each with the error."""
    runner, made = tailing_runner()
    await runner.open()
    handle = await runner.run(app(), "fake")
    busy = asyncio.Event()  # never set: the busy readers stay in their loop body
    first_lines = 0

    async def reader(hold: bool) -> None:
        nonlocal first_lines
        async for _ in runner.log_lines(handle, "worker", k=1, should_tail=True):
            first_lines += 1
            if hold:
                with anyio.move_on_after(60):
                    await busy.wait()

    tasks = [asyncio.create_task(reader(i % 2 == 0)) for i in range(50)]
    with anyio.fail_after(20):
        while first_lines < 50:
            await asyncio.sleep(0.01)  # bounded polling of the readers' progress
        closes = [asyncio.create_task(runner.close()) for _ in range(2)]  # twice, concurrently
        await asyncio.gather(*closes)
        assert made[0].tails_opened == made[0].tails_ended == 50
        for task in tasks[1::2]:
            with pytest.raises(RuntimeError, match=CLOSED):
                await task
        busy.set()
        for task in tasks[::2]:
            with pytest.raises(RuntimeError, match=CLOSED):
                await task


async def test_a_tail_whose_close_hangs_does_not_keep_the_others_reading(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two tails held by readers in their loop body, one whose iterator's close hangs: the close
    ends the other at once, cancels the hung one after close_timeout (with a warning) and
    returns; both readers then get the RuntimeError."""
    runner, made = tailing_runner(close_timeout=0.3)
    await runner.open()
    handle = await runner.run(app(), "fake")
    made[0].hanging_closes.add(0)
    held = asyncio.Event()  # never set: the readers stay in their loop body
    first_lines = 0

    async def reader(k: int) -> None:
        nonlocal first_lines
        async for _ in runner.log_lines(handle, "worker", k=k, should_tail=True):
            first_lines += 1
            with anyio.move_on_after(30):
                await held.wait()

    tasks = [asyncio.create_task(reader(k)) for k in (0, 1)]
    with anyio.fail_after(20):
        while first_lines < 2:
            await asyncio.sleep(0.01)  # bounded polling of the readers' progress
        await runner.close()
        assert made[0].tails_opened == made[0].tails_ended == 2
        held.set()
        for task in tasks:
            with pytest.raises(RuntimeError, match=CLOSED):
                await task
    assert any("did not all end within 0.3 s" in r.getMessage() for r in caplog.records)


async def test_close_looks_for_the_tasks_of_many_tails_in_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ending 200 tails that wait for a line lists the loop's tasks once, not once per tail (a
    close with 1000 tails in flight took 3.5 s, quadratic), and ends them all."""
    listings = 0
    all_tasks = asyncio.all_tasks

    def counting(loop: Any = None) -> Any:
        nonlocal listings
        listings += 1
        return all_tasks(loop)

    runner, made = tailing_runner()
    await runner.open()
    handle = await runner.run(app(), "fake")
    readers = [
        asyncio.create_task(read_all(runner.log_lines(handle, "worker", should_tail=True), []))
        for _ in range(200)
    ]
    with anyio.fail_after(20):
        while made[0].tails_waiting < 200:
            await asyncio.sleep(0.01)  # bounded polling of the readers' progress
        monkeypatch.setattr(asyncio, "all_tasks", counting)
        await runner.close()
        monkeypatch.undo()
        assert made[0].tails_ended == 200
        for reader in readers:
            with pytest.raises(RuntimeError, match=CLOSED):
                await reader
    assert listings == 1


@pytest.mark.parametrize("where", ["opening", "waiting"])
async def test_a_tail_cancelled_at_each_await_ends_and_leaves_the_runner_usable(where: str) -> None:
    """A tail whose reader is cancelled while its log is opened (waiting for the call rate) or
    while it waits for a line ends cancelled with its iterator closed; the runner's close then
    has nothing to end."""
    clock = VirtualClock()  # never advanced: a call beyond the rate waits for good
    limits = {"fake": Limits(max_calls_per_second=1)} if where == "opening" else None
    runner, made = tailing_runner(limits=limits, clock=clock)
    await runner.open()
    handle = await runner.run(app(), "fake")  # (with the rate: its only call)
    lines = runner.log_lines(handle, "worker", should_tail=True)
    reader = asyncio.create_task(read_all(lines, []))
    with anyio.fail_after(10):
        if where == "opening":
            while clock.next_due is None:  # until the reader sleeps for its rate slot
                await asyncio.sleep(0)
        else:
            await made[0].tail_waiting.wait()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert made[0].tails_opened == made[0].tails_ended
        assert len(runner._readings) == 0
        await runner.close()


async def test_close_ends_a_log_entries_tail_of_the_testing_scheduler() -> None:
    """log_entries tailing a scripted app that runs on (no end in its script) raises the close's
    RuntimeError, like log_lines."""
    clock = VirtualClock()
    script = AppScript(
        states=[(0, AppState.RUNNING)],
        logs=[LogLine(0, "worker", "hello"), LogLine(99, "worker", "x")],
    )
    runner = AsyncRunner(
        "t", scheduler_factories={"scripted": ScriptedBackend("scripted", script, clock=clock)}
    )
    await runner.open()
    handle = await runner.run(
        AppDef("a", [Role("worker", image="i", entrypoint="true")]), "scripted"
    )
    lines = runner.log_entries(handle, "worker", should_tail=True)
    got = await close_after_first_line(runner, lines, timeout=10)
    assert [e.line for e in got] == ["hello\n"]


async def test_log_lines_after_close_raise() -> None:
    """A log iteration started after the close (or made before it and started after) raises
    'the runner is closed' at its first step."""
    runner, _ = tailing_runner()
    await runner.open()
    handle = await runner.run(app(), "fake")
    made_before = runner.log_lines(handle, "worker")
    await runner.close()
    for lines in (made_before, runner.log_lines(handle, "worker", should_tail=True)):
        with pytest.raises(RuntimeError, match="the runner is closed"):
            await anext(lines)


@pytest.mark.timeout(60)
async def test_close_ends_a_local_tail_of_the_app_it_stops(tmp_path: Path) -> None:
    """A tail of a local app (a sleep the close stops) raises 'the runner was closed while
    reading logs' and the app ends CANCELLED."""
    name = f"rc-{uuid.uuid4().hex[:8]}"
    runner = AsyncRunner(name=name, local_root=str(tmp_path / "state"))
    await runner.open()
    sleeper = AppDef(
        "s", [Role("main", image=".", entrypoint="sh", args=["-c", "echo up; exec sleep 60"])]
    )
    handle = await runner.run(sleeper, "local_cwd")
    lines = runner.log_lines(handle, "main", should_tail=True)
    assert await close_after_first_line(runner, lines, timeout=30) == ["up\n"]
    async with AsyncRunner(name=name, local_root=str(tmp_path / "state")) as other:
        status = await other.status(handle)
    assert status is not None and status.state == AppState.CANCELLED


@pytest.mark.timeout(90)
async def test_close_ends_a_docker_tail_of_an_app_it_leaves_running(
    docker_engine: None,
    busybox_image: str,
    docker_session: str,
) -> None:
    """A tail of a local_docker app (a sleep: the close leaves containers running) raises 'the
    runner was closed while reading logs' when the runner closes, instead of reading on."""
    try:
        runner = AsyncRunner(name=docker_session)
        await runner.open()
        role = Role(
            "main",
            image=busybox_image,
            entrypoint="sh",
            args=["-c", "trap 'exit 0' TERM; echo up; sleep 120 & wait"],
        )
        handle = await runner.run(AppDef("tail", [role]), "local_docker")
        lines = runner.log_lines(handle, "main", should_tail=True)
        assert await close_after_first_line(runner, lines, timeout=60) == ["up\n"]
        async with AsyncRunner(name=docker_session) as other:  # the app outlived the close
            status = await other.status(handle)
            assert status is not None and status.state == AppState.RUNNING
            await other.cancel(handle)
    finally:
        await purge_session(docker_session)


# -- fault 2: a scheduler's close that hangs or fails --------------------------------------------


def closing_runner(
    modes: dict[str, str], **kw: Any
) -> tuple[AsyncRunner, dict[str, ClosingFakeScheduler]]:
    made: dict[str, ClosingFakeScheduler] = {}

    def factory(backend: str) -> Any:
        def make(session_name: str, **params: Any) -> ClosingFakeScheduler:
            made[backend] = ClosingFakeScheduler(
                session_name, backend=backend, close=modes[backend], **params
            )
            return made[backend]

        return make

    runner = AsyncRunner(
        "t", scheduler_factories={b: factory(b) for b in modes}, poll_settings=FAST, **kw
    )
    return runner, made


async def test_a_hung_scheduler_close_is_bounded_and_the_others_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A scheduler whose close() hangs is cancelled (and has ended) after close_timeout, with a
    warning naming its backend; the runner's close returns and the other schedulers closed."""
    runner, made = closing_runner({"hung": "hang", "good": "ok"}, close_timeout=0.2)
    caplog.set_level(logging.WARNING, logger="asynctorchx.runner.api")
    with anyio.fail_after(10):
        async with runner:
            for backend in ("hung", "good"):
                await runner.run(app(), backend)
    assert made["good"].closed and made["good"].close_ended
    assert made["hung"].close_cancelled and made["hung"].close_ended
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("scheduler hung did not close within 0.2 s" in w for w in warnings), warnings


async def test_a_scheduler_close_that_ignores_its_cancellation_is_kept_and_reported(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler close that goes on after its cancellation does not hold the runner's close
    past the grace: an error names its backend, and its task, kept by the runner, ends later."""
    monkeypatch.setattr("asynctorchx.runner.api._CANCELLED_CLOSE_GRACE", 0.1)
    runner, made = closing_runner({"stubborn": "stubborn", "good": "ok"}, close_timeout=0.1)
    with anyio.fail_after(10):
        async with runner:
            for backend in ("stubborn", "good"):
                await runner.run(app(), backend)
        assert made["good"].closed and made["stubborn"].close_cancelled
        assert not made["stubborn"].close_ended
        made["stubborn"].release.set()
        while not made["stubborn"].close_ended:
            await asyncio.sleep(0.01)  # bounded polling of the kept close
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("scheduler stubborn's close ignores its cancellation" in e for e in errors), errors


async def test_a_failing_scheduler_close_is_logged_and_the_others_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A scheduler whose close() raises is logged naming its backend; the others still close and
    the runner's close returns normally."""
    runner, made = closing_runner({"broken": "raise", "good": "ok"})
    with anyio.fail_after(10):
        async with runner:
            for backend in ("broken", "good"):
                await runner.run(app(), backend)
    assert made["good"].closed and made["broken"].close_ended
    assert any("closing scheduler broken failed" in r.getMessage() for r in caplog.records)


async def test_a_status_round_that_ignores_its_cancellation_does_not_hold_the_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend whose status round ignores its cancellation holds the close at most
    close_timeout per step (with a warning), the waiters get 'closed' at once, and the scheduler
    is closed; the round, kept by the runner, ends once the backend answers."""
    made: list[DeafFakeScheduler] = []

    def factory(session_name: str, **params: Any) -> DeafFakeScheduler:
        made.append(DeafFakeScheduler(session_name, **params))
        return made[-1]

    runner = AsyncRunner(
        "t", scheduler_factories={"fake": factory}, poll_settings=FAST, close_timeout=0.2
    )
    await runner.open()
    handle = await runner.run(app(), "fake")
    waiter = asyncio.create_task(runner.wait(handle))
    hub = runner.hub("fake")
    with anyio.fail_after(10):
        await made[0].in_round.wait()
        await runner.close()
        assert made[0].closed
        with pytest.raises(RuntimeError, match="the runner was closed while waiting"):
            await waiter
        made[0].release.set()
        while hub._loop_task is not None and not hub._loop_task.done():
            await asyncio.sleep(0.01)  # bounded polling of the kept round
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("the status hubs did not stop within 0.2 s" in w for w in warnings), warnings


@pytest.mark.parametrize("value", [0, -1, math.nan, "5", True, None])
def test_a_bad_close_timeout_is_refused_naming_it(value: Any) -> None:
    """close_timeout must be a number of seconds > 0: anything else is a ValueError naming it."""
    with pytest.raises(ValueError, match=r"^close_timeout must be a number of seconds > 0"):
        AsyncRunner("t", close_timeout=value)


# -- fault 3: wait(timeout=0) under a call rate -----------------------------------------------------


@pytest.mark.parametrize("call", ["wait", "wait_all"])
async def test_a_zero_timeout_wait_looks_once_under_a_call_rate(call: str) -> None:
    """wait/wait_all(timeout=0) on an app that ended, when status calls have just taken the rate's
    whole window, wait for its next slot and answer from one status round (no TimeoutError)."""
    made: list[FakeScheduler] = []

    def factory(session_name: str, **params: Any) -> FakeScheduler:
        made.append(FakeScheduler(session_name, **params))
        return made[-1]

    async with AsyncRunner(
        "t",
        scheduler_factories={"fake": factory},
        poll_settings=FAST,
        limits={"fake": Limits(max_calls_per_second=2)},
    ) as runner:
        info = runner.dryrun(app(), "fake")
        app_id = await made[0].schedule(info)  # submitted elsewhere: the hub does not follow it
        made[0].set_state(app_id, AppState.SUCCEEDED)
        handle = f"fake://t/{app_id}"
        for _ in range(2):  # the whole burst of the window
            await runner.status(handle)
        with anyio.fail_after(10):
            if call == "wait":
                status = await runner.wait(handle, timeout=0)
            else:
                status = (await runner.wait_all([handle], timeout=0))[handle]
        assert status is not None and status.state == AppState.SUCCEEDED
        assert made[0].describe_many_calls == [[app_id]]
