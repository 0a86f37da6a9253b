"""Faults found by probing the runner's close against everything else: waiters of one backend held
by another's hung status round or by a log iteration slow to close, a log reader whose source's
close hangs or raises a BaseException, launch blocks left or submitting while the runner closes,
calls whose backend answered as it closed; and status rounds that raise a BaseException or answer
malformed, and 20 000 iterations of one app."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import pytest
from _fake_scheduler import DeafFakeScheduler, FakeScheduler

from asynctorchx import AsyncRunner
from asynctorchx.logs import LogQuery
from asynctorchx.runner import Limits, PollSettings
from asynctorchx.schedulers.api import DescribeAppResponse
from asynctorchx.specs import AppDef, AppState, Role
from asynctorchx.testing import ScriptedBackend, VirtualClock

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup
else:  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

CLOSED = "the runner was closed while reading logs"
FAST = PollSettings(min_interval=0.01, max_interval=0.05, push_safety_interval=0.2)


def app(name: str = "a") -> AppDef:
    return AppDef(name, [Role("worker", image="img", entrypoint="true", num_replicas=2)])


class NamedDeafScheduler(DeafFakeScheduler):
    """A DeafFakeScheduler registered under another backend name."""

    def __init__(self, session_name: str, *, backend: str, **kw: Any) -> None:
        super().__init__(session_name, **kw)
        self.backend = backend


async def test_a_hung_status_round_of_one_backend_does_not_hold_the_waiters_of_another() -> None:
    """Closing the runner ends the waits on every backend at once, also while another backend's
    status round ignores its cancellation (the hubs were closed one after the other)."""
    deaf = NamedDeafScheduler("t", backend="deaf")
    good = FakeScheduler("t")
    runner = AsyncRunner(
        "t",
        scheduler_factories={"deaf": lambda *a, **k: deaf, "fake": lambda *a, **k: good},
        poll_settings=FAST,
        close_timeout=30,
    )
    await runner.open()
    deaf_handle = await runner.run(app(), "deaf")
    good_handle = await runner.run(app(), "fake")
    waiters = [asyncio.create_task(runner.wait(h)) for h in (deaf_handle, good_handle)]
    with anyio.fail_after(10):
        await deaf.in_round.wait()
        await good.wait_described(good_handle.rsplit("/", 1)[1])
    closer = asyncio.create_task(runner.close())
    try:
        with anyio.fail_after(5):
            for waiter in waiters:
                with pytest.raises(RuntimeError, match="the runner was closed while waiting"):
                    await waiter
    finally:
        deaf.release.set()
        with anyio.fail_after(10):
            await closer
    assert good.closed and deaf.closed


class SlowClosingTail(FakeScheduler):
    """A FakeScheduler whose tail yields one line, then waits for lines that never come; its
    iterator's close waits until ``release`` is set (a backend slow to stop reading): an async
    generator whose ``finally`` waits, or (``iterator=True``) an iterator whose ``aclose`` does."""

    def __init__(self, session_name: str, *, iterator: bool = False, **kw: Any) -> None:
        super().__init__(session_name, **kw)
        self.first_line = asyncio.Event()
        self.release = asyncio.Event()
        self._iterator = iterator

    def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        return _SlowClosingLines(self) if self._iterator else self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        try:
            yield "first\n"
            self.first_line.set()
            await asyncio.Event().wait()
        finally:
            await self.release.wait()


class _SlowClosingLines:
    """``SlowClosingTail``'s lines as a plain async iterator (no generator)."""

    def __init__(self, tail: SlowClosingTail) -> None:
        self._tail = tail
        self._read = 0

    def __aiter__(self) -> _SlowClosingLines:
        return self

    async def __anext__(self) -> str:
        self._read += 1
        if self._read == 1:
            return "first\n"
        self._tail.first_line.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._tail.release.wait()


async def test_waits_end_at_once_while_a_log_iteration_is_slow_to_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Closing the runner ends a wait() and a status() held by the call rate at once, also while
    the close is still ending a log iteration whose source is slow to close (they waited for it,
    up to close_timeout); the status loop held by the rate ends without an error."""
    clock = VirtualClock()  # never advanced: the call rate's next slot never comes
    sched = SlowClosingTail("t")
    runner = AsyncRunner(
        "t",
        scheduler_factories={"fake": lambda *a, **k: sched},
        poll_settings=FAST,
        close_timeout=30,
        limits={"fake": Limits(max_calls_per_second=3)},
        clock=clock,
    )
    await runner.open()
    closer: asyncio.Task[None] | None = None
    try:
        handle = await runner.run(app(), "fake")  # a call of the window, then two for the log
        lines = runner.log_lines(handle, "worker", should_tail=True)
        assert await anext(lines) == "first\n"
        waiter = asyncio.create_task(runner.wait(handle))
        status = asyncio.create_task(runner.status(handle))
        with anyio.fail_after(10):
            while len(runner._limiters["fake"]._waits) < 2:
                await asyncio.sleep(0)  # bounded polling: the hub's round and status() queued
        closer = asyncio.create_task(runner.close())
        with anyio.fail_after(5):
            with pytest.raises(RuntimeError, match="the runner was closed while waiting"):
                await waiter
            with pytest.raises(RuntimeError, match="closed"):
                await status
    finally:
        sched.release.set()
        with anyio.fail_after(10):
            await (closer or runner.close())
    with pytest.raises(RuntimeError, match="the runner was closed while reading logs"):
        await anext(lines)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("iterator", [False, True], ids=["generator", "iterator"])
async def test_a_reader_waiting_for_a_line_whose_source_close_hangs_gets_the_error(
    iterator: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader waiting for a tail's next line when the runner closes gets 'closed while reading
    logs' within close_timeout even if the source's close hangs (it waited for that close
    forever), with a warning, and its task is not left cancelled."""
    sched = SlowClosingTail("t", iterator=iterator)
    runner = AsyncRunner(
        "t",
        scheduler_factories={"fake": lambda *a, **k: sched},
        poll_settings=FAST,
        close_timeout=0.3,
    )
    await runner.open()
    try:
        handle = await runner.run(app(), "fake")
        lines = runner.log_lines(handle, "worker", should_tail=True)
        assert await anext(lines) == "first\n"
        reader = asyncio.create_task(anext(lines))
        with anyio.fail_after(10):
            await sched.first_line.wait()  # set as the tail waits for its next line
            await runner.close()
        with anyio.fail_after(5), pytest.raises(RuntimeError, match=CLOSED):
            await reader
        assert reader.cancelling() == 0
    finally:
        sched.release.set()
    assert any("within 0.3 s of the runner's close" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("exit_by", ["normal", "error"])
async def test_a_launch_block_left_while_the_runner_closes_says_the_runner_was_closed(
    exit_by: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A launch block left while the runner's close is under way (its first steps still
    running) reports that the runner was closed, as when the close has ended: a RuntimeError on
    a normal exit, a warning otherwise; not a clean-up timeout (TimeoutError) and a logged
    traceback of each refused cancel."""
    sched = SlowClosingTail("t")  # its log iteration holds the close's first step
    runner = AsyncRunner(
        "t", scheduler_factories={"fake": lambda *a, **k: sched}, poll_settings=FAST
    )
    await runner.open()
    closer: asyncio.Task[None] | None = None
    try:
        lines = runner.log_lines(await runner.run(app(), "fake"), "worker", should_tail=True)
        assert await anext(lines) == "first\n"
        expected = RuntimeError if exit_by == "normal" else OSError
        with anyio.fail_after(10), pytest.raises(expected) as caught:
            async with runner.launched(
                app("b"), "fake", cancel_on_normal_exit=True, cleanup_timeout=5
            ) as handle:
                closer = asyncio.create_task(runner.close())
                with pytest.raises(RuntimeError, match="the runner was closed while waiting"):
                    await runner.wait(handle)
                assert not closer.done()
                if exit_by == "error":
                    raise OSError("boom")
    finally:
        sched.release.set()
        with anyio.fail_after(10):
            await (closer or runner.close())
    said = str(caught.value) if exit_by == "normal" else caplog.text
    assert (
        f"the runner was closed inside the launch block, so 1 app(s) it launched were not "
        f"cancelled: {handle}" in said
    )
    assert "not terminal" not in caplog.text
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


class SlowCallsScheduler(FakeScheduler):
    """A FakeScheduler whose cancel and describe wait for ``release`` once it is armed
    (``slow``), telling ``entered`` that one has begun."""

    def __init__(self, session_name: str, **kw: Any) -> None:
        super().__init__(session_name, **kw)
        self.slow = False
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def _hold(self) -> None:
        if self.slow:
            self.entered.set()
            await self.release.wait()

    async def _cancel_existing(self, app_id: str) -> None:
        await self._hold()
        await super()._cancel_existing(app_id)

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        await self._hold()
        return await super().describe(app_id)


@pytest.mark.parametrize("call", ["cancel", "status"])
async def test_a_call_the_backend_answered_as_the_runner_closed_returns_its_answer(
    call: str,
) -> None:
    """A cancel() or status() whose backend call completes while the runner closes returns as
    it would have (the app was cancelled; its status), as run() returns its handle; they raised
    'the runner is closed' after the backend had done what was asked."""
    sched = SlowCallsScheduler("t")
    runner = AsyncRunner(
        "t", scheduler_factories={"fake": lambda *a, **k: sched}, poll_settings=FAST
    )
    await runner.open()
    handle = await runner.run(app(), "fake")
    sched.slow = True
    task = asyncio.create_task(getattr(runner, call)(handle))
    with anyio.fail_after(10):
        await sched.entered.wait()
        closer = asyncio.create_task(runner.close())
        while "closed" not in repr(runner):
            await asyncio.sleep(0)  # bounded polling: the close has begun
        sched.release.set()
        result = await task
        await closer
    app_id = handle.rsplit("/", 1)[1]
    if call == "cancel":
        assert result is None and sched.apps[app_id].state == AppState.CANCELLED
    else:
        assert result is not None and result.state == AppState.RUNNING


class _BackendBaseError(BaseException):
    """A BaseException a backend's code raises (not KeyboardInterrupt or SystemExit)."""


class BadRoundScheduler(FakeScheduler):
    """A FakeScheduler whose next status round, once ``bad`` is set, is ``bad(app_ids)``: what it
    returns is the round's answer, what it raises the round's error."""

    def __init__(self, session_name: str, **kw: Any) -> None:
        super().__init__(session_name, **kw)
        self.bad: Callable[[Sequence[str]], Any] | None = None
        self.misbehaved = asyncio.Event()

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        bad, self.bad = self.bad, None
        if bad is not None:
            self.misbehaved.set()
            return bad(app_ids)  # type: ignore[no-any-return]
        return await super().describe_many(app_ids)


async def _wait_through_a_bad_round(bad: Callable[[Sequence[str]], Any]) -> None:
    """Runs an app on a BadRoundScheduler whose round during a wait is ``bad``, then ends the
    app: the wait must see it end."""
    sched = BadRoundScheduler("t")
    runner = AsyncRunner(
        "t", scheduler_factories={"fake": lambda *a, **k: sched}, poll_settings=FAST
    )
    async with runner:
        handle = await runner.run(app(), "fake")
        app_id = handle.rsplit("/", 1)[1]
        await sched.wait_described(app_id)
        sched.bad = bad
        waiter = asyncio.create_task(runner.wait(handle))
        with anyio.fail_after(10):
            await sched.misbehaved.wait()
        sched.set_state(app_id, AppState.SUCCEEDED)
        with anyio.fail_after(10):
            status = await waiter
        assert status is not None and status.state == AppState.SUCCEEDED


@pytest.mark.parametrize(
    "error",
    [
        _BackendBaseError("odd"),
        GeneratorExit(),
        BaseExceptionGroup("a task group's", [asyncio.CancelledError()]),
    ],
    ids=["base-exception", "generator-exit", "group-of-cancelled"],
)
async def test_a_status_round_raising_a_base_exception_does_not_stop_the_hub(
    error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    """A status round whose backend raises a BaseException other than KeyboardInterrupt or
    SystemExit counts as a failed round (logged): the hub goes on and a wait sees the app end
    (the hub's loop died with it and every wait hung)."""

    def raise_it(app_ids: Sequence[str]) -> Any:
        raise error

    await _wait_through_a_bad_round(raise_it)
    assert any("status round for 1 fake apps failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "answer",
    [lambda ids: None, lambda ids: list(ids), lambda ids: {ids[0]: "RUNNING"}],
    ids=["none", "list", "string-value"],
)
async def test_a_malformed_status_answer_does_not_stop_the_hub(
    answer: Callable[[Sequence[str]], Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A status round whose backend returns no mapping of app ids to DescribeAppResponse or
    None counts as a failed round, logged naming the backend: the hub goes on and a wait sees
    the app end (applying it ended the hub's loop and every wait hung)."""
    await _wait_through_a_bad_round(answer)
    assert any(
        "fake: describe_many must return a mapping" in r.getMessage() for r in caplog.records
    )


async def test_closing_a_runner_with_twenty_thousand_iterations_of_one_app_ends_them_all() -> None:
    """Closing a runner that 20 000 as_completed and watch iterations of one app follow ends
    each with "the runner was closed" and leaves no listener (what it costs: bench_embed.py's
    close_followed_s, 0.4 s; each stopped listening by a list's remove before: 5.5 s)."""
    backend = ScriptedBackend("sb")
    runner = AsyncRunner("t", scheduler_factories={"sb": backend})
    n = 20_000
    await runner.open()
    try:
        handle = await runner.run(app(), "sb")
        hub = runner.hub("sb")

        async def follow(i: int) -> None:
            with pytest.raises(RuntimeError, match="the runner was closed while"):
                if i % 2:
                    async for _ in runner.as_completed([handle]):
                        pass
                else:
                    async for _ in runner.watch([handle]):
                        pass

        tasks = [asyncio.create_task(follow(i)) for i in range(n)]
        with anyio.fail_after(30):
            while hub._listening < n:
                await asyncio.sleep(0.01)  # bounded polling: every iteration listens
        await runner.close()
        with anyio.fail_after(30):
            await asyncio.gather(*tasks)
    finally:
        await runner.close()
    assert hub._listening == 0


class BadlyClosingTail(FakeScheduler):
    """A FakeScheduler whose tail yields one line, then waits; its close raises a BaseException
    of the backend's own (not KeyboardInterrupt or SystemExit)."""

    async def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        try:
            yield "first\n"
            await asyncio.Event().wait()
        finally:
            raise _BackendBaseError("the tail's clean-up failed")


async def test_a_log_source_whose_close_raises_a_base_exception_does_not_abort_the_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A log iteration whose source's close raises a BaseException (not KeyboardInterrupt or
    SystemExit) is logged, and the close goes on to close the schedulers; it aborted the close
    with a BaseExceptionGroup, the schedulers left open (local apps running)."""
    sched = BadlyClosingTail("t")
    runner = AsyncRunner(
        "t", scheduler_factories={"fake": lambda *a, **k: sched}, poll_settings=FAST
    )
    await runner.open()
    lines = runner.log_lines(await runner.run(app(), "fake"), "worker", should_tail=True)
    assert await anext(lines) == "first\n"
    with anyio.fail_after(10):
        await runner.close()
    assert sched.closed
    assert any(
        r.exc_info is not None and isinstance(r.exc_info[1], _BackendBaseError)
        for r in caplog.records
    )
    with pytest.raises(RuntimeError, match=CLOSED):
        await anext(lines)


async def test_a_launch_blocks_submit_in_flight_as_the_runner_closes_returns_its_handle() -> None:
    """The submits of launched() and launch_group() blocks (a gang's too) in flight when the
    runner closes complete and give their blocks the handles, as a run()'s gives its caller;
    the close cancelled them mid-submit ('closed during submit'), so nobody learnt what they
    launched, and a gang's then raised 'the runner is closed' as it began to watch its app."""
    backend = ScriptedBackend("sb", submit_latency=0.3)  # real time: the close does not wait
    runner = AsyncRunner("t", scheduler_factories={"sb": backend})
    await runner.open()

    async def in_launched() -> str:
        async with runner.launched(app("launched"), "sb") as handle:
            return handle

    async def in_group(gang: bool) -> str:
        async with runner.launch_group(gang=gang) as group:
            return await group.launch(app("gang" if gang else "group"), "sb")

    tasks = [
        asyncio.create_task(in_launched()),
        asyncio.create_task(in_group(gang=False)),
        asyncio.create_task(in_group(gang=True)),
        asyncio.create_task(runner.run(app("run"), "sb")),
    ]
    with anyio.fail_after(10):
        await backend.wait_until(lambda: backend.in_flight_submits == 4)
        await runner.close()
        handles = await asyncio.gather(*tasks)
    assert sorted(handles) == [f"sb://t/{a}" for a in sorted(backend.apps)]
    assert len(backend.apps) == 4


def _sleeper(seconds: str) -> AppDef:
    return AppDef("s", [Role("main", image=".", entrypoint="sleep", args=[seconds])])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["wait", "cancel"])
async def test_a_handle_asked_about_before_its_schedule_is_followed_once_scheduled(
    tmp_path: Any, first: str
) -> None:
    """A dry run's handle waited on (timeout 0) or cancelled before the dry run is scheduled is
    unknown then; once scheduled, the runner follows the app: a wait times out while it runs and a
    watch sees it RUNNING (the hub kept its "unknown" verdict for good: wait returned None at once,
    watch yielded a final UNKNOWN event, status said RUNNING)."""
    async with AsyncRunner(name="early", local_root=str(tmp_path)) as r:
        info = r.dryrun(_sleeper("30"), "local_cwd")
        handle = f"local_cwd://early/{info.request.app_id}"
        if first == "wait":
            assert await r.wait(handle, timeout=0) is None
        else:
            await r.cancel(handle)  # nothing of that id exists yet
            hub = r.hub("local_cwd")
            with anyio.fail_after(10):
                while (entry := hub.entry(info.request.app_id)) is None or not entry.final:
                    await anyio.sleep(0.01)
        try:
            assert await r.schedule(info) == handle
            with pytest.raises(TimeoutError):
                await r.wait(handle, timeout=1)
            async for event in r.watch([handle]):
                assert event.state == AppState.RUNNING and not event.final, event
                break
        finally:
            await r.cancel(handle)


class _HiccupClock:
    """Real time; its next ``sleep`` once armed raises."""

    def __init__(self) -> None:
        self.armed = False

    def monotonic(self) -> float:
        import time

        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        if self.armed:
            self.armed = False
            raise OSError("clock source hiccup")
        await anyio.sleep(seconds)


@pytest.mark.timeout(60)
async def test_a_clock_error_in_a_rate_limited_round_is_a_failed_round(tmp_path: Any) -> None:
    """The rate limit's clock (AsyncRunner(clock=...)) raises while a status round waits for its
    slot: a failed round, and the wait sees the app end (the hub's loop ended, every wait hung)."""
    clock = _HiccupClock()
    async with AsyncRunner(
        name="hiccup",
        local_root=str(tmp_path),
        clock=clock,
        limits={"local_cwd": {"max_calls_per_second": 1}},
    ) as runner:
        handle = await runner.run(_sleeper("0.3"), "local_cwd")  # the second's one call
        clock.armed = True  # the hub's first round waits for the next slot: that sleep raises
        with anyio.fail_after(15):
            status = await runner.wait(handle)
        assert status is not None and status.state == AppState.SUCCEEDED


@pytest.mark.timeout(60)
async def test_a_dry_run_of_another_session_is_refused_naming_both(tmp_path: Any) -> None:
    """A dry run made by runner "aaa" scheduled by runner "bbb" is refused before anything is
    launched (it launched an app of session "aaa" under a handle of "bbb", which "bbb"'s list
    named otherwise and its status refused)."""
    async with (
        AsyncRunner(name="aaa", local_root=str(tmp_path)) as a,
        AsyncRunner(name="bbb", local_root=str(tmp_path)) as b,
    ):
        info = a.dryrun(_sleeper("30"), "local_cwd")
        assert info.session == "aaa"
        with pytest.raises(ValueError, match="made for session 'aaa', not this runner's 'bbb'"):
            await b.schedule(info)
        assert await b.list("local_cwd") == []
